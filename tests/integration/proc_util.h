// What /proc says of a process: its listening TCP sockets, its children.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "ulysses/common/strings.h"

namespace ulysses::testing_util {

/// Listening TCP sockets (IPv4 and IPv6) among the descriptors of process `pid`. The daemons
/// talk over unix sockets; NCCL's bootstrap (its root, each rank's own) listens on TCP.
inline int ListeningTcpSockets(pid_t pid) {
  std::set<std::string> inodes;  // "socket:[N]" of the process's descriptors
  std::error_code ec;
  for (const auto& fd : std::filesystem::directory_iterator(StrCat("/proc/", pid, "/fd"), ec)) {
    std::error_code link_ec;
    const std::string target = std::filesystem::read_symlink(fd.path(), link_ec).string();
    if (!link_ec && target.rfind("socket:[", 0) == 0)
      inodes.insert(target.substr(8, target.size() - 9));
  }
  int n = 0;
  for (const char* table : {"tcp", "tcp6"}) {
    std::ifstream in(StrCat("/proc/", pid, "/net/", table));
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
          timeout >> inode;
      if (state == "0A" && inodes.count(inode) > 0) ++n;  // 0A: LISTEN
    }
  }
  return n;
}

/// The processes whose parent is `pid` (zombies included: a child not yet reaped is listed).
inline std::vector<pid_t> ChildrenOf(pid_t pid) {
  std::vector<pid_t> children;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(entry.path() / "stat");
    std::string stat;
    std::getline(in, stat);
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses; the last ')' ends it.
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 1));
    std::string state;
    pid_t parent = 0;
    rest >> state >> parent;
    if (parent == pid) children.push_back(static_cast<pid_t>(std::stol(name)));
  }
  return children;
}

}  // namespace ulysses::testing_util
