// Without CUDA or NCCL there is no nccl backend; `--backend nccl` refuses to start.
#include <cstdio>

#include "transport.h"

namespace ulysses::daemon {

absl::StatusOr<std::unique_ptr<Backend>> MakeNcclBackend(int, absl::Duration,
                                                         std::unique_ptr<Backend>) {
  return absl::FailedPreconditionError("this build has no NCCL");
}

int RunNcclRootHelper() {
  std::printf("error this build has no NCCL\n");
  return 1;
}

}  // namespace ulysses::daemon
