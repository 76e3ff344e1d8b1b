#include "ulysses/ipc/frames.h"

#include <exception>

#include "nlohmann/json.hpp"
#include "ulysses/common/strings.h"

namespace ulysses::ipc {
namespace {

using json = nlohmann::json;

// Parses `payload` as one JSON object without exceptions (the parser reports malformed text
// as a discarded value). `what` names the frame in messages.
absl::StatusOr<json> ParseObject(std::string_view payload, const char* what) {
  if (payload.size() > kMaxClientFrameBytes)
    return absl::InvalidArgumentError(StrCat(what, ": ", payload.size(), " bytes exceed ",
                                             kMaxClientFrameBytes));
  json j = json::parse(payload.begin(), payload.end(), /*cb=*/nullptr,
                       /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(StrCat(what, ": not valid JSON"));
  if (!j.is_object()) return absl::InvalidArgumentError(StrCat(what, ": expected a JSON object"));
  return j;
}

// The unsigned integer under `key`; JSON keeps non-negative integers as number_unsigned, so a
// negative, fractional, string or null value is refused here by its type alone.
absl::StatusOr<uint64_t> Unsigned(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::InvalidArgumentError(StrCat(key, ": missing"));
  if (!it->is_number_unsigned())
    return absl::InvalidArgumentError(
        StrCat(key, ": expected a non-negative integer, got ", it->type_name()));
  return it->get<uint64_t>();
}

absl::StatusOr<HelloFrame> DecodeHelloImpl(std::string_view payload) {
  absl::StatusOr<json> j = ParseObject(payload, "hello");
  if (!j.ok()) return j.status();
  HelloFrame hello;
  absl::StatusOr<uint64_t> id = Unsigned(*j, "client_id");
  if (!id.ok()) return id.status();
  if (*id == 0) return absl::InvalidArgumentError("client_id: must be > 0");
  hello.client_id = *id;
  auto token = j->find("token");
  if (token == j->end()) return absl::InvalidArgumentError("token: missing");
  if (!token->is_string())
    return absl::InvalidArgumentError(StrCat("token: expected a string, got ", token->type_name()));
  const std::string& text = token->get_ref<const std::string&>();
  if (text.empty() || text.size() > kMaxTokenBytes)
    return absl::InvalidArgumentError(
        StrCat("token: ", text.size(), " bytes, expected 1..", kMaxTokenBytes));
  hello.token = text;
  return hello;
}

absl::StatusOr<FdFrame> DecodeFdFrameImpl(std::string_view payload) {
  absl::StatusOr<json> j = ParseObject(payload, "fd frame");
  if (!j.ok()) return j.status();
  absl::StatusOr<uint64_t> tag = Unsigned(*j, "tag");
  if (!tag.ok()) return tag.status();
  return FdFrame{*tag};
}

}  // namespace

// The typed checks above leave the JSON library nothing to throw on; the handlers only turn
// an allocation failure into a status, so that nothing unwinds into the caller's thread.
absl::StatusOr<HelloFrame> DecodeHello(std::string_view payload) {
  try {
    return DecodeHelloImpl(payload);
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(StrCat("hello: ", e.what()));
  }
}

absl::StatusOr<FdFrame> DecodeFdFrame(std::string_view payload) {
  try {
    return DecodeFdFrameImpl(payload);
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(StrCat("fd frame: ", e.what()));
  }
}

std::string EncodeHello(const HelloFrame& hello) {
  return json{{"client_id", hello.client_id}, {"token", hello.token}}.dump(
      -1, ' ', false, json::error_handler_t::replace);
}

std::string EncodeFdFrame(const FdFrame& frame) { return json{{"tag", frame.tag}}.dump(); }

}  // namespace ulysses::ipc
