// The fd socket's malformed frames: hellos the daemon must refuse, and frames of a bound client
// that it must drop. The tests send them from their own process and, through
// second_uid_client, from a process of another uid.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ulysses::security {

/// Hellos that name `client_id` and `token` wrongly typed, signed, fractional, missing or
/// wrong, and frames that are no hello at all.
inline std::vector<std::string> MalformedHellos(uint64_t client_id, const std::string& token) {
  const std::string id = std::to_string(client_id);
  const std::string tok = "\"" + token + "\"";
  return {
      "{\"client_id\": \"" + id + "\", \"token\": " + tok + "}",
      "{\"client_id\": null, \"token\": " + tok + "}",
      "{\"client_id\": " + id + ", \"token\": 7}",
      "{\"client_id\": " + id + ", \"token\": null}",
      "{\"client_id\": -" + id + ", \"token\": " + tok + "}",
      "{\"client_id\": " + id + ".5, \"token\": " + tok + "}",
      "{\"client_id\": " + id + ", \"token\": \"wrong\"}",
      "{\"client_id\": " + id + "}",
      "[" + id + ", " + tok + "]",
      "not json",
      "",
      std::string(2000, '[') + std::string(2000, ']'),
  };
}

/// A bound client's frame and how many copies of one descriptor ride with it.
struct HostileFrame {
  std::string payload;
  int fds = 1;
};

/// Tags of the wrong type, sign or kind, no tag, no JSON, and frames without or with two
/// descriptors.
inline std::vector<HostileFrame> MalformedFdFrames() {
  return {
      {R"({"tag":"7"})"}, {R"({"tag":-1})"}, {R"({"tag":null})"},  {R"({"tag":1.5})"},
      {R"({})"},          {"not json"},      {R"([7])"},           {R"({"tag":5})", 0},
      {R"({"tag":6})", 2},
  };
}

}  // namespace ulysses::security
