// Counting a process's descriptors for the tests that check nothing leaks.
#pragma once

#include <dirent.h>
#include <sys/types.h>
#include <unistd.h>

#include <string>
#include <string_view>

#include "ulysses/common/strings.h"

namespace ulysses {

/// The descriptors of process `pid`, without pipes (-1 when /proc has none for it). The
/// daemon makes no pipe per client, but a sanitizer runtime starts its symbolizer with pipes
/// the first time a (suppressed) report needs a stack, at a moment no test controls.
inline int CountFdsButPipes(pid_t pid) {
  const std::string dir = StrCat("/proc/", pid, "/fd");
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return -1;
  int n = 0;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    char target[64] = {};
    const ssize_t len = ::readlink((dir + "/" + e->d_name).c_str(), target, sizeof target - 1);
    if (len > 0 && std::string_view(target, len).substr(0, 5) == "pipe:") continue;
    ++n;
  }
  ::closedir(d);
  return n;
}

}  // namespace ulysses
