// The command line of the SIGKILL tests' phase clients (phase_client, gpu_phase_client):
//   --socket S --members S0,S1 --rank R --phase P --ready FILE [--tag T]
// and what each does once it reached its phase: write its pid to the ready file and wait to be
// killed.
#pragma once

#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace ulysses::testing_util {

/// The session's max_tokens of the GPU phase client and its peer: receive slots of about
/// 200 MB (8 heads of 64 bf16 values), so that memory they leak shows in cudaMemGetInfo.
inline constexpr int kGpuPhaseMaxTokens = 65536;

struct PhaseArgs {
  std::string socket, phase, ready;
  std::string tag;  ///< names the groups of the pair-cycle phase
  std::vector<std::string> members;
  int rank = 0;
};

inline PhaseArgs ParsePhaseArgs(int argc, char** argv) {
  PhaseArgs a;
  std::string members;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--socket") a.socket = v;
    else if (k == "--members") members = v;
    else if (k == "--rank") a.rank = std::stoi(v);
    else if (k == "--phase") a.phase = v;
    else if (k == "--ready") a.ready = v;
    else if (k == "--tag") a.tag = v;
  }
  std::stringstream ss(members);
  for (std::string m; std::getline(ss, m, ',');) a.members.push_back(m);
  return a;
}

/// Writes this process's pid to `ready`.
inline void Announce(const std::string& ready) { std::ofstream(ready) << getpid() << "\n"; }

/// Writes this process's pid to `ready` and waits to be killed.
[[noreturn]] inline void StopAtPhase(const std::string& ready) {
  Announce(ready);
  for (;;) pause();
}

}  // namespace ulysses::testing_util
