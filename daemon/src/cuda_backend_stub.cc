// Without CUDA there is no GPU backend; `auto` falls back to the host backend.
#include "transport.h"

namespace ulysses::daemon {

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int, FdExports*,
                                                         const CudaBackendOptions&) {
  return absl::FailedPreconditionError("this build has no CUDA support");
}

}  // namespace ulysses::daemon
