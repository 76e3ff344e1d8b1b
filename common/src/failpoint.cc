#include "ulysses/common/failpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>

namespace ulysses {
namespace {

// Parsed once, on first use: point name -> file that releases it.
const std::map<std::string, std::string, std::less<>>& Points() {
  static const auto* points = [] {
    auto* m = new std::map<std::string, std::string, std::less<>>();
    const char* env = std::getenv("ULYSSES_FAILPOINTS");
    std::string_view rest = env != nullptr ? env : "";
    while (!rest.empty()) {
      const size_t comma = rest.find(',');
      const std::string_view item = rest.substr(0, comma);
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
      const size_t eq = item.find('=');
      if (eq == std::string_view::npos || eq == 0 || eq + 1 == item.size()) continue;
      m->emplace(std::string(item.substr(0, eq)), std::string(item.substr(eq + 1)));
    }
    return m;
  }();
  return *points;
}

}  // namespace

void Failpoint(std::string_view point) {
  const auto& points = Points();
  if (points.empty()) return;
  const auto it = points.find(point);
  if (it == points.end()) return;
  struct stat st;
  if (::stat(it->second.c_str(), &st) == 0) return;
  // Tells the test that a thread waits here.
  const int reached = ::open((it->second + ".reached").c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
  if (reached >= 0) ::close(reached);
  for (int i = 0; i < 12000 && ::stat(it->second.c_str(), &st) != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

bool FailpointFired(std::string_view point) {
  const auto& points = Points();
  if (points.empty()) return false;
  const auto it = points.find(point);
  struct stat st;
  return it != points.end() && ::stat(it->second.c_str(), &st) == 0;
}

}  // namespace ulysses
