// Device memory shared between processes: CUDA VMM allocations with POSIX-fd handles (the
// daemons' receive slots, daemon-allocated client buffers) and legacy CUDA IPC handles (client
// tensors from a caching allocator). Usable from host C++ without CUDA headers. Built for real
// only when the project has CUDA (ULYSSES_HAVE_CUDA); otherwise every function returns
// FAILED_PRECONDITION and DeviceCount() returns 0. Driver functions are resolved at run time
// through cudaGetDriverEntryPointByVersion, so programs start on machines without a driver.
#pragma once

#include <cstddef>
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ulysses/ipc/fd.h"

namespace ulysses::ipc::cuda {

/// Whether this build has CUDA support at all.
bool Built();
/// Devices visible to this process; 0 without a driver or a device (never an error for that).
int DeviceCount();
/// The calling thread's current device.
absl::StatusOr<int> CurrentDevice();
/// Makes `device` current for the calling thread (and creates its primary context).
absl::Status SetDevice(int device);

/// What the daemon reports about its GPU.
struct DeviceInfo {
  std::string name;
  std::string uuid;        ///< "GPU-xxxxxxxx-xxxx-..."
  std::string pci_bus_id;  ///< "0000:1b:00.0"
  int numa_node = -1;      ///< -1 when unknown
  bool mps = false;        ///< contexts on this device are MPS clients
  uint64_t total_bytes = 0;
};
absl::StatusOr<DeviceInfo> Describe(int device);
/// Free and total device memory of the current device, in bytes.
absl::Status MemInfo(uint64_t* free_bytes, uint64_t* total_bytes);

/// Whether processes can map each other's memory between `a` and `b` (same device, or P2P).
absl::StatusOr<bool> CanAccessPeer(int a, int b);

/// A CUDA VMM allocation (cuMemCreate with a POSIX-fd handle) mapped into this process on one
/// device, read-write or read-only. Created here (exportable) or imported from a peer's fd. The
/// size is rounded up to the allocation granularity. Unmapped and released on destruction.
class VmmMapping {
 public:
  VmmMapping() = default;
  ~VmmMapping();
  VmmMapping(VmmMapping&& o) noexcept { *this = std::move(o); }
  VmmMapping& operator=(VmmMapping&& o) noexcept;
  VmmMapping(const VmmMapping&) = delete;
  VmmMapping& operator=(const VmmMapping&) = delete;

  /// A new zero-filled allocation of at least `bytes` on `device`, mapped read-write here. The
  /// zeroing runs on `zero_stream` (a cudaStream_t; null: the legacy stream) and is waited for
  /// there alone: pass an idle stream of the caller's so no other stream's work is waited for.
  static absl::StatusOr<VmmMapping> Create(int device, uint64_t bytes,
                                           void* zero_stream = nullptr);
  /// Maps an allocation exported by another process (`fd` from Export; the fd is not kept).
  /// `bytes` must equal the exporter's size(). `writable` false maps it read-only.
  static absl::StatusOr<VmmMapping> Import(int device, int fd, uint64_t bytes, bool writable);
  /// One allocation of several mapped back to back, as ImportParts takes them.
  struct Part {
    int fd = -1;        ///< the allocation's POSIX fd (not kept)
    uint64_t size = 0;  ///< bytes mapped from its start: a multiple of the granularity
  };
  /// Maps several allocations exported by another process back to back, in order, as that
  /// process maps them (a tensor over the pieces of an expandable segment). The parts are
  /// unmapped one by one on destruction. Errors name the parts as `name`[i].
  static absl::StatusOr<VmmMapping> ImportParts(int device, std::span<const Part> parts,
                                                bool writable, std::string_view name = "parts");
  /// A POSIX fd for the allocation, to pass over SCM_RIGHTS. Only for allocations created
  /// here (an imported handle cannot be exported again).
  absl::StatusOr<UniqueFd> Export() const;

  void* data() const { return reinterpret_cast<void*>(ptr_); }
  uint64_t size() const { return size_; }
  bool valid() const { return ptr_ != 0; }
  /// Allocation granularity (bytes) of `device`.
  static absl::StatusOr<uint64_t> Granularity(int device);

 private:
  void Reset() noexcept;
  uint64_t ptr_ = 0;     // CUdeviceptr
  [[maybe_unused]] uint64_t handle_ = 0;  // CUmemGenericAllocationHandle (unread without CUDA)
  uint64_t size_ = 0;
  [[maybe_unused]] bool exportable_ = false;
  std::vector<uint64_t> parts_;  // sizes of the parts mapped one by one (empty: one mapping)
};

/// Size of a legacy CUDA IPC memory handle (cudaIpcMemHandle_t).
inline constexpr size_t kIpcHandleBytes = 64;

/// A peer process's allocation opened through its cudaIpcMemHandle_t bytes. Closed on
/// destruction.
class IpcMapping {
 public:
  IpcMapping() = default;
  ~IpcMapping();
  IpcMapping(IpcMapping&& o) noexcept : ptr_(o.ptr_), device_(o.device_) { o.ptr_ = nullptr; }
  IpcMapping& operator=(IpcMapping&& o) noexcept;
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;
  /// Opens `handle` (kIpcHandleBytes bytes) on the current device. It is closed on that
  /// device, whichever thread lets it go (one with no device of its own would otherwise
  /// close it in a context of device 0, made for it).
  static absl::StatusOr<IpcMapping> Open(const std::string& handle);
  void* data() const { return ptr_; }

 private:
  void Close() noexcept;
  void* ptr_ = nullptr;
  int device_ = 0;
};

/// The allocation a device pointer lies in, as the driver knows it.
struct AllocationInfo {
  void* base = nullptr;       ///< CU_POINTER_ATTRIBUTE_RANGE_START_ADDR
  uint64_t size = 0;          ///< CU_POINTER_ATTRIBUTE_RANGE_SIZE
  uint64_t buffer_id = 0;     ///< CU_POINTER_ATTRIBUTE_BUFFER_ID: unique per allocation
  int device = -1;
  bool vmm = false;           ///< made by cuMemCreate (no legacy IPC handle)
};
/// INVALID_ARGUMENT when `ptr` is not device memory.
absl::StatusOr<AllocationInfo> QueryAllocation(const void* ptr);
/// The cudaIpcMemHandle_t bytes of the allocation starting at `base`.
absl::StatusOr<std::string> IpcHandle(void* base);

/// Most CUDA VMM mappings one registered device range may span (each one's fd is a descriptor
/// the daemon holds unclaimed until RegisterBuffer takes it).
inline constexpr size_t kMaxVmmMappings = 64;

/// One mapping (cuMemMap) of a CUDA VMM allocation in this process, as the driver reports it.
struct VmmRegion {
  void* base = nullptr;    ///< CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR
  uint64_t size = 0;       ///< CU_POINTER_ATTRIBUTE_MAPPING_SIZE
  uint64_t buffer_id = 0;  ///< CU_POINTER_ATTRIBUTE_BUFFER_ID: new for every mapping made
  int device = -1;
};
/// The mappings that cover [ptr, ptr + bytes), in address order (at most `max_regions`).
/// INVALID_ARGUMENT when part of the range is not mapped device memory, when it spans more
/// than `max_regions` mappings, or when its mappings are of different devices.
absl::StatusOr<std::vector<VmmRegion>> VmmRegions(const void* ptr, uint64_t bytes,
                                                  size_t max_regions);
/// A POSIX fd of the VMM allocation mapped at `base` (retained, exported, released again).
/// INVALID_ARGUMENT when the allocation was not made exportable as a POSIX fd.
absl::StatusOr<UniqueFd> ExportMapped(const void* base);

/// Process-wide counts of this module's device allocations, for the daemon's accounting.
struct AllocationStats {
  uint64_t created = 0;     ///< VMM allocations created
  uint64_t imported = 0;    ///< VMM allocations imported from another process
  uint64_t ipc_opened = 0;  ///< legacy IPC handles opened
  uint64_t live_bytes = 0;  ///< bytes of VMM allocations created here and not yet released
  /// Other processes' memory mapped here now: VMM allocations imported and not released, and
  /// legacy IPC handles opened and not closed.
  uint64_t imported_open = 0;
  uint64_t ipc_open = 0;
};
AllocationStats Stats();

/// Whether `ptr` is device memory (false for host pointers, also without CUDA).
bool IsDevicePointer(const void* ptr);
/// cudaMemcpy with cudaMemcpyDefault (any of host/device on either side), synchronous.
absl::Status Copy(void* dst, const void* src, size_t bytes);
/// cudaMemset on device memory, synchronous.
absl::Status Fill(void* dst, int value, size_t bytes);
/// cudaStreamSynchronize (`stream` a cudaStream_t; nullptr: the legacy default stream).
absl::Status SyncStream(void* stream);
/// The CUDA runtime's id of `stream` (cudaStreamGetId): one stream, one id, for the life of its
/// context. Unlike the handle it tells apart a stream made after another was destroyed at the
/// same address, and the per-thread default stream of two threads.
absl::StatusOr<uint64_t> StreamId(void* stream);
/// Enqueues on `consumer` a wait for the work enqueued on `producer` so far (an event recorded
/// on one, waited on by the other); no host thread waits. Nothing when they are the same.
absl::Status StreamWaitStream(void* consumer, void* producer);


/// 64-bit stream memory operations on device words, enqueued on `stream` (a cudaStream_t;
/// nullptr: the legacy default stream). StreamWrite64 stores `value` into `word` once the
/// stream's earlier work is complete, with a memory barrier first (the earlier work's stores
/// are visible before the word). StreamWait64 holds the stream's later work until the cyclic
/// comparison (int64_t)(*word - value) >= 0 holds.
absl::Status StreamWrite64(void* stream, uint64_t* word, uint64_t value);
absl::Status StreamWait64(void* stream, const uint64_t* word, uint64_t value);
/// Stores `value` into every one of `words` (device words of `device`) from each of `streams`
/// new non-blocking streams, half of them at the greatest priority, waits up to `wait` for all
/// of those writes to run, and destroys the streams (a stream's pending work still runs). For
/// words that this process's streams wait on after the writer that should have let them go
/// died. A stream's wait holds back its whole hardware queue, so a write on a stream of that
/// queue waits too; the new streams spread over the queues, and the first write that runs lets
/// every wait on the words pass, and with it the writes queued behind those waits. OK once
/// every write ran; DEADLINE_EXCEEDED when some had not within `wait` (the words must then stay
/// mapped: those writes may still run); INVALID_ARGUMENT naming `streams` when it is not
/// positive.
absl::Status WriteFromNewStreams(int device, std::span<uint64_t* const> words, uint64_t value,
                                 int streams, absl::Duration wait);
/// StreamWrite64 and StreamWait64 gathered and enqueued on `stream` with one driver call
/// (cuStreamBatchMemOp) each Flush, in the order they were added, with the same semantics as
/// one by one. No allocation: at most kCapacity operations are held, and adding one more
/// flushes first. Operations not flushed are dropped with the object.
class StreamOps {
 public:
  static constexpr int kCapacity = 32;
  explicit StreamOps(void* stream) : stream_(stream) {}
  absl::Status Write(uint64_t* word, uint64_t value) { return Add(false, word, value); }
  absl::Status Wait(const uint64_t* word, uint64_t value) { return Add(true, word, value); }
  /// Enqueues what was gathered (nothing when empty).
  absl::Status Flush();

 private:
  struct Op {
    bool wait = false;
    const uint64_t* word = nullptr;
    uint64_t value = 0;
  };
  absl::Status Add(bool wait, const uint64_t* word, uint64_t value) {
    if (count_ == kCapacity) {
      absl::Status st = Flush();
      if (!st.ok()) return st;
    }
    ops_[count_++] = Op{wait, word, value};
    return absl::OkStatus();
  }
  [[maybe_unused]] void* stream_;  // unread in builds without CUDA
  std::array<Op, kCapacity> ops_{};
  int count_ = 0;
};

/// Runs fn(arg) on a driver thread once the stream's earlier work is complete. `fn` must not
/// call CUDA.
absl::Status LaunchHostFunc(void* stream, void (*fn)(void*), void* arg);

/// A CUDA event (timing disabled) marking a point of a stream, to learn without blocking
/// whether the stream has passed it. Destroyed with the object.
class StreamMark {
 public:
  StreamMark() = default;
  ~StreamMark();
  StreamMark(const StreamMark&) = delete;
  StreamMark& operator=(const StreamMark&) = delete;
  /// Marks the current end of `stream` (creating the event the first time).
  absl::Status Record(void* stream);
  /// Whether the stream has passed the last Record (true when never recorded).
  absl::StatusOr<bool> Passed() const;
  /// Enqueues on `consumer` a wait for the work before the last Record (nothing when never
  /// recorded); no host thread waits. Valid after the recorded stream was destroyed.
  absl::Status OrderBefore(void* consumer) const;

 private:
  [[maybe_unused]] void* event_ = nullptr;  // unread in builds without CUDA
};

}  // namespace ulysses::ipc::cuda
