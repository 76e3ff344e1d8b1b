// String building for messages. The distribution's absl keeps its own string_view type, so
// absl::StrCat does not take std::string_view; ulysses::StrCat takes anything streamable,
// std::string_view and absl::string_view alike.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>

#include "absl/strings/string_view.h"

namespace ulysses {
namespace strings_internal {

inline void Append(std::ostringstream& os, absl::string_view v) { os.write(v.data(), v.size()); }
template <typename T>
void Append(std::ostringstream& os, const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    os << (v ? "true" : "false");
  } else if constexpr (std::is_integral_v<T>) {
    // sizeof only where T is an integer: a manipulator (std::hex) is a function type, for
    // which sizeof is ill-formed (clang refuses it, gcc warns).
    if constexpr (sizeof(T) == 1) os << static_cast<int>(v);
    else os << v;
  } else {
    os << v;
  }
}

}  // namespace strings_internal

/// Concatenates the text of every argument (numbers in decimal).
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::ostringstream os;
  (strings_internal::Append(os, args), ...);
  return os.str();
}

/// absl::string_view of a std::string_view (the distribution's absl has its own type).
inline absl::string_view AbslView(std::string_view v) { return absl::string_view(v.data(), v.size()); }
/// std::string_view of an absl::string_view.
inline std::string_view StdView(absl::string_view v) { return std::string_view(v.data(), v.size()); }

/// Whether `a` equals `b`, in a time that depends on their lengths only (a client's token
/// against the one it sent: timing the answers tells nothing of the token).
inline bool EqualInConstantTime(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i)
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]);
  return diff == 0;
}

/// A client's pid for people: the one the daemon knows from the socket's credentials, else the
/// one the client reported ("1234 (reported)": from another PID namespace), else "unknown".
inline std::string PidText(int64_t pid, int64_t reported_pid) {
  if (pid > 0) return StrCat(pid);
  if (reported_pid > 0) return StrCat(reported_pid, " (reported)");
  return "unknown";
}

}  // namespace ulysses
