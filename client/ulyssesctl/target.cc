#include "ulyssesctl/target.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "ulysses/common/strings.h"

namespace ulysses::ctl {
namespace {

bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

std::string OneLine(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return s;
}

}  // namespace

std::string ChooseSocket(std::string_view flag, const char* env) {
  if (!flag.empty()) return std::string(flag);
  if (env != nullptr && env[0] != '\0') return env;
  return std::string(kDefaultSocket);
}

DaemonAddress ResolveSocket(std::string_view socket) {
  DaemonAddress a;
  if (StartsWith(socket, "unix-abstract:")) {
    a.target = a.display = std::string(socket);
    return a;
  }
  if (StartsWith(socket, "unix:")) {
    a.target = a.display = std::string(socket);
    std::string_view rest = socket.substr(5);
    // "unix:///abs" names "/abs"; "unix:path" names path.
    if (StartsWith(rest, "//")) rest.remove_prefix(2);
    a.path = std::string(rest);
    return a;
  }
  std::error_code ec;
  std::filesystem::path p = std::filesystem::absolute(std::filesystem::path(socket), ec);
  if (ec) p = std::filesystem::path(socket);
  a.path = p.lexically_normal().string();
  a.display = a.path;
  a.target = StrCat("unix://", a.path);
  return a;
}

bool IsUnreachable(grpc::StatusCode code, grpc_connectivity_state state_after_call) {
  if (code == grpc::StatusCode::DEADLINE_EXCEEDED) return true;
  return code == grpc::StatusCode::UNAVAILABLE && state_after_call != GRPC_CHANNEL_READY;
}

std::string UnreachableReason(const DaemonAddress& address, const grpc::Status& status,
                              std::int64_t timeout_ms) {
  if (!address.path.empty()) {
    struct stat st {};
    if (::stat(address.path.c_str(), &st) != 0) return std::strerror(errno);
    if (!S_ISSOCK(st.st_mode)) return "not a socket";
  }
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return StrCat("no answer within ", timeout_ms, " ms");
  }
  // The transport's text ends with the cause ("... last error: UNAVAILABLE: unix:/x:
  // Connection refused"); the cause alone reads best.
  std::string message = OneLine(status.error_message());
  static constexpr std::string_view kRefused = "Connection refused";
  if (message.find(kRefused) != std::string::npos) return std::string(kRefused);
  return message.empty() ? "unavailable" : message;
}

}  // namespace ulysses::ctl
