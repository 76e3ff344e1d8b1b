// Without CUDA: every device-memory function reports that this build has none.
#include "ulysses/ipc/cuda_memory.h"
#include "ulysses/ipc/queue_probe.h"

namespace ulysses::ipc::cuda {
namespace {
absl::Status NoCuda() {
  return absl::FailedPreconditionError("CUDA: this build of ulyssesd has no CUDA support");
}
}  // namespace

bool Built() { return false; }
int DeviceCount() { return 0; }
absl::StatusOr<int> CurrentDevice() { return NoCuda(); }
absl::Status SetDevice(int) { return NoCuda(); }
absl::StatusOr<DeviceInfo> Describe(int) { return NoCuda(); }
absl::Status MemInfo(uint64_t*, uint64_t*) { return NoCuda(); }
absl::StatusOr<bool> CanAccessPeer(int, int) { return NoCuda(); }
VmmMapping::~VmmMapping() = default;
VmmMapping& VmmMapping::operator=(VmmMapping&&) noexcept { return *this; }
void VmmMapping::Reset() noexcept {}
absl::StatusOr<uint64_t> VmmMapping::Granularity(int) { return NoCuda(); }
absl::StatusOr<VmmMapping> VmmMapping::Create(int, uint64_t, void*) { return NoCuda(); }
absl::StatusOr<VmmMapping> VmmMapping::Import(int, int, uint64_t, bool) { return NoCuda(); }
absl::StatusOr<VmmMapping> VmmMapping::ImportParts(int, std::span<const Part>, bool,
                                                    std::string_view) {
  return NoCuda();
}
absl::StatusOr<UniqueFd> VmmMapping::Export() const { return NoCuda(); }
IpcMapping::~IpcMapping() = default;
IpcMapping& IpcMapping::operator=(IpcMapping&&) noexcept { return *this; }
absl::StatusOr<IpcMapping> IpcMapping::Open(const std::string&) { return NoCuda(); }
absl::StatusOr<AllocationInfo> QueryAllocation(const void*) { return NoCuda(); }
absl::StatusOr<std::string> IpcHandle(void*) { return NoCuda(); }
absl::StatusOr<std::vector<VmmRegion>> VmmRegions(const void*, uint64_t, size_t) {
  return NoCuda();
}
absl::StatusOr<UniqueFd> ExportMapped(const void*) { return NoCuda(); }
bool IsDevicePointer(const void*) { return false; }
AllocationStats Stats() { return {}; }
absl::Status Copy(void*, const void*, size_t) { return NoCuda(); }
absl::Status Fill(void*, int, size_t) { return NoCuda(); }
absl::Status SyncStream(void*) { return NoCuda(); }
absl::StatusOr<uint64_t> StreamId(void*) { return NoCuda(); }
absl::Status StreamWaitStream(void*, void*) { return NoCuda(); }
absl::Status StreamWrite64(void*, uint64_t*, uint64_t) { return NoCuda(); }
absl::Status StreamWait64(void*, const uint64_t*, uint64_t) { return NoCuda(); }
absl::Status WriteFromNewStreams(int, std::span<uint64_t* const>, uint64_t, int, absl::Duration) {
  return NoCuda();
}
absl::Status StreamOps::Flush() {
  if (count_ == 0) return absl::OkStatus();
  count_ = 0;
  return NoCuda();
}
absl::Status LaunchHostFunc(void*, void (*)(void*), void*) { return NoCuda(); }
StreamMark::~StreamMark() = default;
absl::Status StreamMark::Record(void*) { return NoCuda(); }
absl::StatusOr<bool> StreamMark::Passed() const { return true; }
absl::Status StreamMark::OrderBefore(void*) const { return NoCuda(); }

}  // namespace ulysses::ipc::cuda

namespace ulysses::ipc::cuda {
absl::StatusOr<QueueProbeResult> ProbeStreamQueues(std::span<void* const>,
                                                   const QueueProbeOptions&) {
  return absl::FailedPreconditionError("CUDA: this build of ulyssesd has no CUDA support");
}
}  // namespace ulysses::ipc::cuda
