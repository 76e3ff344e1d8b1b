// How the GPU benches end on an error they cannot go on from: a line on stderr, prefixed with
// the program's name, and exit status 1.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"

namespace ulysses::bench {

/// The name the messages start with; main sets it first.
inline const char*& ProgramName() {
  static const char* name = "bench";
  return name;
}

[[noreturn]] inline void Die(const std::string& what) {
  std::fprintf(stderr, "%s: %s\n", ProgramName(), what.c_str());
  std::exit(1);
}
inline void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) Die(std::string(what) + ": " + cudaGetErrorString(err));
}
inline void Check(const absl::Status& st) {
  if (!st.ok()) Die(std::string(st.message()));
}

}  // namespace ulysses::bench
