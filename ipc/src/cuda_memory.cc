// CUDA VMM and IPC sharing. The runtime is linked statically; driver functions come from
// cudaGetDriverEntryPointByVersion, resolved once.
#include "ulysses/ipc/cuda_memory.h"
#include "ulysses/ipc/queue_probe.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ulysses/common/logging.h"
#include "ulysses/common/status.h"

namespace ulysses::ipc::cuda {
namespace {

absl::Status RtError(const char* call, cudaError_t err) {
  return absl::InternalError(
      absl::StrCat(call, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

#define ULY_CUDART(call)                                        \
  do {                                                          \
    const cudaError_t uly_err_ = (call);                        \
    if (uly_err_ != cudaSuccess) return RtError(#call, uly_err_); \
  } while (0)

struct Driver {
  decltype(&::cuMemCreate) MemCreate = nullptr;
  decltype(&::cuMemRelease) MemRelease = nullptr;
  decltype(&::cuMemRetainAllocationHandle) MemRetain = nullptr;
  decltype(&::cuMemExportToShareableHandle) MemExport = nullptr;
  decltype(&::cuMemImportFromShareableHandle) MemImport = nullptr;
  decltype(&::cuMemAddressReserve) AddressReserve = nullptr;
  decltype(&::cuMemAddressFree) AddressFree = nullptr;
  decltype(&::cuMemMap) Map = nullptr;
  decltype(&::cuMemUnmap) Unmap = nullptr;
  decltype(&::cuMemSetAccess) SetAccess = nullptr;
  decltype(&::cuMemGetAllocationGranularity) Granularity = nullptr;
  decltype(&::cuPointerGetAttribute) PointerAttribute = nullptr;
  decltype(&::cuPointerGetAttributes) PointerAttributes = nullptr;
  decltype(&::cuGetErrorName) ErrorName = nullptr;
  decltype(&::cuStreamWriteValue64) WriteValue64 = nullptr;
  decltype(&::cuStreamWaitValue64) WaitValue64 = nullptr;
  decltype(&::cuStreamBatchMemOp) BatchMemOp = nullptr;
  absl::Status status;
};

template <typename F>
absl::Status Resolve(const char* name, F* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  const cudaError_t err = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
  if (err != cudaSuccess || q != cudaDriverEntryPointSuccess || p == nullptr)
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA driver entry point ", name, " is not available"));
  *fn = reinterpret_cast<F>(p);
  return absl::OkStatus();
}

const Driver& Drv() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    absl::Status s;
    auto r = [&](const char* n, auto* f) {
      if (s.ok()) s = Resolve(n, f);
    };
    r("cuMemCreate", &d.MemCreate);
    r("cuMemRelease", &d.MemRelease);
    r("cuMemRetainAllocationHandle", &d.MemRetain);
    r("cuMemExportToShareableHandle", &d.MemExport);
    r("cuMemImportFromShareableHandle", &d.MemImport);
    r("cuMemAddressReserve", &d.AddressReserve);
    r("cuMemAddressFree", &d.AddressFree);
    r("cuMemMap", &d.Map);
    r("cuMemUnmap", &d.Unmap);
    r("cuMemSetAccess", &d.SetAccess);
    r("cuMemGetAllocationGranularity", &d.Granularity);
    r("cuPointerGetAttribute", &d.PointerAttribute);
    r("cuPointerGetAttributes", &d.PointerAttributes);
    r("cuGetErrorName", &d.ErrorName);
    r("cuStreamWriteValue64", &d.WriteValue64);
    r("cuStreamWaitValue64", &d.WaitValue64);
    r("cuStreamBatchMemOp", &d.BatchMemOp);
    d.status = s;
  });
  return d;
}

absl::Status DrvError(const char* call, CUresult r) {
  const char* name = "CUDA_ERROR";
  if (Drv().ErrorName) Drv().ErrorName(r, &name);
  return absl::InternalError(absl::StrCat(call, ": ", name, " (", static_cast<int>(r), ")"));
}

#define ULY_CU(call)                                           \
  do {                                                         \
    const CUresult uly_res_ = (call);                          \
    if (uly_res_ != CUDA_SUCCESS) return DrvError(#call, uly_res_); \
  } while (0)

CUmemAllocationProp Prop(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// Reserves an address range, maps `handle` there and grants this process access. Every process
// that maps the allocation must set access itself.
absl::StatusOr<CUdeviceptr> MapHandle(int device, CUmemGenericAllocationHandle handle, size_t size,
                                      bool writable) {
  const Driver& d = Drv();
  CUdeviceptr ptr = 0;
  ULY_CU(d.AddressReserve(&ptr, size, 0, 0, 0));
  CUresult r = d.Map(ptr, size, 0, handle, 0);
  if (r != CUDA_SUCCESS) {
    d.AddressFree(ptr, size);
    return DrvError("cuMemMap", r);
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = writable ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_READ;
  r = d.SetAccess(ptr, size, &access, 1);
  if (r != CUDA_SUCCESS) {
    d.Unmap(ptr, size);
    d.AddressFree(ptr, size);
    return DrvError("cuMemSetAccess", r);
  }
  return ptr;
}

std::atomic<uint64_t> g_created{0}, g_imported{0}, g_ipc_opened{0}, g_live_bytes{0};
std::atomic<uint64_t> g_imported_open{0}, g_ipc_open{0};

}  // namespace

AllocationStats Stats() {
  return AllocationStats{g_created.load(),   g_imported.load(),      g_ipc_opened.load(),
                         g_live_bytes.load(), g_imported_open.load(), g_ipc_open.load()};
}

bool Built() { return true; }

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

absl::StatusOr<int> CurrentDevice() {
  int d = 0;
  ULY_CUDART(cudaGetDevice(&d));
  return d;
}

absl::Status SetDevice(int device) {
  const int n = DeviceCount();
  if (device < 0 || device >= n)
    return absl::InvalidArgumentError(
        absl::StrCat("device: ", device, " is not one of the ", n, " CUDA device(s) here"));
  ULY_CUDART(cudaSetDevice(device));
  ULY_CUDART(cudaFree(nullptr));  // creates the primary context now, not inside a call
  return Drv().status;
}

absl::StatusOr<DeviceInfo> Describe(int device) {
  DeviceInfo info;
  cudaDeviceProp prop{};
  ULY_CUDART(cudaGetDeviceProperties(&prop, device));
  info.name = prop.name;
  const auto* u = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  info.uuid = absl::StrFormat(
      "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2],
      u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  char bus[32] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, device) == cudaSuccess) info.pci_bus_id = bus;
  int numa = -1;
  if (cudaDeviceGetAttribute(&numa, cudaDevAttrNumaId, device) == cudaSuccess) info.numa_node = numa;
  else (void)cudaGetLastError();
  int mps = 0;
  if (cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, device) == cudaSuccess) info.mps = mps != 0;
  else (void)cudaGetLastError();
  info.total_bytes = prop.totalGlobalMem;
  return info;
}

absl::Status MemInfo(uint64_t* free_bytes, uint64_t* total_bytes) {
  size_t f = 0, t = 0;
  ULY_CUDART(cudaMemGetInfo(&f, &t));
  *free_bytes = f;
  *total_bytes = t;
  return absl::OkStatus();
}

absl::StatusOr<bool> CanAccessPeer(int a, int b) {
  if (a == b) return true;
  int ok = 0;
  ULY_CUDART(cudaDeviceCanAccessPeer(&ok, a, b));
  return ok != 0;
}

VmmMapping::~VmmMapping() { Reset(); }

VmmMapping& VmmMapping::operator=(VmmMapping&& o) noexcept {
  if (this != &o) {
    Reset();
    ptr_ = o.ptr_;
    handle_ = o.handle_;
    size_ = o.size_;
    exportable_ = o.exportable_;
    parts_ = std::move(o.parts_);
    o.parts_.clear();
    o.ptr_ = 0;
    o.handle_ = 0;
    o.size_ = 0;
  }
  return *this;
}

void VmmMapping::Reset() noexcept {
  const Driver& d = Drv();
  if (ptr_ != 0) {
    if (parts_.empty()) {
      d.Unmap(ptr_, size_);
    } else {
      uint64_t at = 0;
      for (uint64_t part : parts_) {
        d.Unmap(ptr_ + at, part);
        at += part;
      }
    }
    d.AddressFree(ptr_, size_);
  }
  // Imported allocations mapped here: Import's one (its handle kept), ImportParts' parts.
  if (!exportable_)
    g_imported_open.fetch_sub(parts_.empty() ? (handle_ != 0 ? 1 : 0) : parts_.size());
  parts_.clear();
  if (handle_ != 0) d.MemRelease(handle_);
  if (handle_ != 0 && exportable_) g_live_bytes.fetch_sub(size_);
  ptr_ = 0;
  handle_ = 0;
  size_ = 0;
}

absl::StatusOr<uint64_t> VmmMapping::Granularity(int device) {
  ULY_RETURN_IF_ERROR(Drv().status);
  CUmemAllocationProp prop = Prop(device);
  size_t g = 0;
  ULY_CU(Drv().Granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  return static_cast<uint64_t>(g);
}

absl::StatusOr<VmmMapping> VmmMapping::Create(int device, uint64_t bytes, void* zero_stream) {
  ULY_RETURN_IF_ERROR(Drv().status);
  if (bytes == 0) return absl::InvalidArgumentError("bytes: must be > 0");
  ULY_ASSIGN_OR_RETURN(const uint64_t g, Granularity(device));
  const uint64_t size = (bytes + g - 1) / g * g;
  CUmemAllocationProp prop = Prop(device);
  VmmMapping m;
  CUmemGenericAllocationHandle h = 0;
  const CUresult r = Drv().MemCreate(&h, size, &prop, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY)
    return absl::ResourceExhaustedError(
        absl::StrCat("device memory: cannot allocate ", size, " bytes on device ", device));
  if (r != CUDA_SUCCESS) return DrvError("cuMemCreate", r);
  m.handle_ = h;
  m.size_ = size;
  m.exportable_ = true;
  g_created.fetch_add(1);
  g_live_bytes.fetch_add(size);
  ULY_ASSIGN_OR_RETURN(CUdeviceptr p, MapHandle(device, h, size, true));
  m.ptr_ = p;
  // Zeroed before anyone can see it (a client or a peer writes into it afterwards): the memset
  // is asynchronous to the host, so it is waited for, on its stream alone.
  cudaStream_t on = zero_stream != nullptr ? static_cast<cudaStream_t>(zero_stream) : cudaStreamLegacy;
  ULY_CUDART(cudaMemsetAsync(m.data(), 0, size, on));
  ULY_CUDART(cudaStreamSynchronize(on));
  return m;
}

absl::StatusOr<VmmMapping> VmmMapping::Import(int device, int fd, uint64_t bytes, bool writable) {
  ULY_RETURN_IF_ERROR(Drv().status);
  if (bytes == 0) return absl::InvalidArgumentError("bytes: must be > 0");
  ULY_ASSIGN_OR_RETURN(const uint64_t g, Granularity(device));
  if (bytes % g != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("bytes: ", bytes, " is not a multiple of the granularity ", g));
  VmmMapping m;
  CUmemGenericAllocationHandle h = 0;
  ULY_CU(Drv().MemImport(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  m.handle_ = h;
  m.size_ = bytes;
  g_imported.fetch_add(1);
  g_imported_open.fetch_add(1);
  ULY_ASSIGN_OR_RETURN(CUdeviceptr p, MapHandle(device, h, bytes, writable));
  m.ptr_ = p;
  return m;
}

absl::StatusOr<VmmMapping> VmmMapping::ImportParts(int device, std::span<const Part> parts,
                                                    bool writable, std::string_view what) {
  const std::string name(what);
  const Driver& d = Drv();
  ULY_RETURN_IF_ERROR(d.status);
  if (parts.empty()) return absl::InvalidArgumentError(absl::StrCat(name, ": none given"));
  ULY_ASSIGN_OR_RETURN(const uint64_t g, Granularity(device));
  uint64_t total = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].size == 0 || parts[i].size % g != 0)
      return absl::InvalidArgumentError(absl::StrCat(name, "[", i, "]: ", parts[i].size,
                                                     " bytes, not a positive multiple of the "
                                                     "granularity ", g));
    if (parts[i].size > (uint64_t{1} << 40) - total)
      return absl::InvalidArgumentError(absl::StrCat(name, ": more than 1 TiB in all"));
    total += parts[i].size;
  }
  VmmMapping m;
  CUdeviceptr base = 0;
  ULY_CU(d.AddressReserve(&base, total, 0, 0, 0));
  m.ptr_ = base;
  m.size_ = total;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = writable ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_READ;
  uint64_t at = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    CUmemGenericAllocationHandle h = 0;
    CUresult r = d.MemImport(&h, reinterpret_cast<void*>(static_cast<intptr_t>(parts[i].fd)),
                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS)
      return absl::InvalidArgumentError(absl::StrCat(name, "[", i,
                                                     "]: not a CUDA VMM allocation's descriptor: ",
                                                     DrvError("import", r).message()));
    g_imported.fetch_add(1);
    // The mapping keeps the memory; the handle is not needed once it is made.
    r = d.Map(base + at, parts[i].size, 0, h, 0);
    d.MemRelease(h);
    if (r != CUDA_SUCCESS)
      return absl::InvalidArgumentError(absl::StrCat(name, "[", i, "]: ", parts[i].size,
                                                     " bytes cannot be mapped: ",
                                                     DrvError("cuMemMap", r).message()));
    m.parts_.push_back(parts[i].size);
    g_imported_open.fetch_add(1);
    r = d.SetAccess(base + at, parts[i].size, &access, 1);
    if (r != CUDA_SUCCESS)
      return absl::InvalidArgumentError(absl::StrCat(
          name, "[", i, "]: cannot be made accessible to device ", device,
          " (an allocation of a device this one cannot reach?): ",
          DrvError("cuMemSetAccess", r).message()));
    at += parts[i].size;
  }
  return m;
}

absl::StatusOr<UniqueFd> VmmMapping::Export() const {
  if (!exportable_ || handle_ == 0)
    return absl::FailedPreconditionError("VMM allocation: only a created allocation can be exported");
  int fd = -1;
  ULY_CU(Drv().MemExport(&fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  return UniqueFd(fd);
}

IpcMapping::~IpcMapping() { Close(); }

void IpcMapping::Close() noexcept {
  if (ptr_ == nullptr) return;
  // The thread stays on the mapping's device: restoring the one it reported (device 0 on a
  // thread that never chose one) could make a context there.
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != device_) (void)cudaSetDevice(device_);
  const cudaError_t err = cudaIpcCloseMemHandle(ptr_);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    Logger("ipc")->warn("cudaIpcCloseMemHandle on device {}: {}", device_, cudaGetErrorName(err));
  }
  g_ipc_open.fetch_sub(1);
  ptr_ = nullptr;
}

IpcMapping& IpcMapping::operator=(IpcMapping&& o) noexcept {
  if (this != &o) {
    Close();
    ptr_ = o.ptr_;
    device_ = o.device_;
    o.ptr_ = nullptr;
  }
  return *this;
}

absl::StatusOr<IpcMapping> IpcMapping::Open(const std::string& handle) {
  if (handle.size() != kIpcHandleBytes)
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc_handle: expected ", kIpcHandleBytes,
                                                   " bytes, got ", handle.size()));
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof h);
  IpcMapping m;
  ULY_CUDART(cudaGetDevice(&m.device_));
  const cudaError_t err = cudaIpcOpenMemHandle(&m.ptr_, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    m.ptr_ = nullptr;
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc_handle: cannot be opened: ",
                                                   cudaGetErrorName(err), " (",
                                                   cudaGetErrorString(err), ")"));
  }
  g_ipc_opened.fetch_add(1);
  g_ipc_open.fetch_add(1);
  return m;
}

absl::Status EnsureContext();

// One driver call per operand of every call: all the attributes at once. A pointer the driver
// does not know yields the zero values (memory type 0), not an error.
absl::StatusOr<AllocationInfo> QueryAllocation(const void* ptr) {
  const Driver& d = Drv();
  ULY_RETURN_IF_ERROR(d.status);
  ULY_RETURN_IF_ERROR(EnsureContext());
  unsigned int memory_type = 0;
  int ordinal = -1;
  CUdeviceptr base = 0;
  size_t size = 0;
  unsigned long long id = 0;
  int legacy_ok = 0;
  int managed = 0;
  CUpointer_attribute names[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                 CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                 CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                 CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                 CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                 CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                 CU_POINTER_ATTRIBUTE_IS_MANAGED};
  void* values[] = {&memory_type, &ordinal, &base, &size, &id, &legacy_ok, &managed};
  static_assert(sizeof names / sizeof names[0] == sizeof values / sizeof values[0]);
  ULY_CU(d.PointerAttributes(sizeof names / sizeof names[0], names, values,
                             reinterpret_cast<CUdeviceptr>(ptr)));
  if (memory_type != CU_MEMORYTYPE_DEVICE || managed != 0 || base == 0)
    return absl::InvalidArgumentError(managed != 0 ? "ptr: managed memory, not device memory"
                                                   : "ptr: not device memory");
  AllocationInfo info;
  info.device = ordinal;
  info.base = reinterpret_cast<void*>(base);
  info.size = size;
  info.buffer_id = id;
  info.vmm = legacy_ok == 0;
  return info;
}

absl::StatusOr<std::string> IpcHandle(void* base) {
  cudaIpcMemHandle_t h;
  ULY_CUDART(cudaIpcGetMemHandle(&h, base));
  return std::string(reinterpret_cast<const char*>(&h), sizeof h);
}

absl::StatusOr<std::vector<VmmRegion>> VmmRegions(const void* ptr, uint64_t bytes,
                                                  size_t max_regions) {
  const Driver& d = Drv();
  ULY_RETURN_IF_ERROR(d.status);
  ULY_RETURN_IF_ERROR(EnsureContext());
  std::vector<VmmRegion> regions;
  const CUdeviceptr end = reinterpret_cast<CUdeviceptr>(ptr) + bytes;
  CUdeviceptr at = reinterpret_cast<CUdeviceptr>(ptr);
  while (at < end) {
    if (regions.size() == max_regions)
      return absl::InvalidArgumentError(absl::StrCat(
          "ptr: the ", bytes, " bytes span more than ", max_regions, " CUDA VMM mappings"));
    int mapped = 0;
    int ordinal = -1;
    CUdeviceptr base = 0;
    size_t size = 0;
    unsigned long long id = 0;
    CUpointer_attribute names[] = {CU_POINTER_ATTRIBUTE_MAPPED, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                   CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
                                   CU_POINTER_ATTRIBUTE_MAPPING_SIZE, CU_POINTER_ATTRIBUTE_BUFFER_ID};
    void* values[] = {&mapped, &ordinal, &base, &size, &id};
    static_assert(sizeof names / sizeof names[0] == sizeof values / sizeof values[0]);
    ULY_CU(d.PointerAttributes(sizeof names / sizeof names[0], names, values, at));
    if (mapped == 0 || size == 0 || base > at || at - base >= size)
      return absl::InvalidArgumentError(absl::StrCat(
          "ptr: byte ", at - reinterpret_cast<CUdeviceptr>(ptr), " of the ", bytes,
          " bytes is not in a mapped CUDA VMM allocation"));
    if (!regions.empty() && ordinal != regions.front().device)
      return absl::InvalidArgumentError(absl::StrCat("ptr: the ", bytes,
                                                     " bytes span mappings of devices ",
                                                     regions.front().device, " and ", ordinal));
    regions.push_back(VmmRegion{reinterpret_cast<void*>(base), size, id, ordinal});
    at = base + size;
  }
  return regions;
}

absl::StatusOr<UniqueFd> ExportMapped(const void* base) {
  const Driver& d = Drv();
  ULY_RETURN_IF_ERROR(d.status);
  CUmemGenericAllocationHandle h = 0;
  ULY_CU(d.MemRetain(&h, const_cast<void*>(base)));
  int fd = -1;
  const CUresult r = d.MemExport(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  d.MemRelease(h);
  if (r != CUDA_SUCCESS)
    return absl::InvalidArgumentError(absl::StrCat(
        "ptr: this CUDA VMM allocation cannot be shared as a POSIX file descriptor (make it with "
        "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR among its requested handle types): ",
        DrvError("cuMemExportToShareableHandle", r).message()));
  return UniqueFd(fd);
}

bool IsDevicePointer(const void* ptr) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice;
}

absl::Status Copy(void* dst, const void* src, size_t bytes) {
  ULY_CUDART(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
  return absl::OkStatus();
}

absl::Status Fill(void* dst, int value, size_t bytes) {
  ULY_CUDART(cudaMemset(dst, value, bytes));
  ULY_CUDART(cudaDeviceSynchronize());
  return absl::OkStatus();
}

absl::Status SyncStream(void* stream) {
  ULY_CUDART(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> StreamId(void* stream) {
  unsigned long long id = 0;
  ULY_CUDART(cudaStreamGetId(static_cast<cudaStream_t>(stream), &id));
  return static_cast<uint64_t>(id);
}

absl::Status StreamWaitStream(void* consumer, void* producer) {
  if (consumer == producer) return absl::OkStatus();
  cudaEvent_t ev = nullptr;
  ULY_CUDART(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  cudaError_t err = cudaEventRecord(ev, static_cast<cudaStream_t>(producer));
  if (err == cudaSuccess) err = cudaStreamWaitEvent(static_cast<cudaStream_t>(consumer), ev, 0);
  // An event destroyed with its wait enqueued still orders the wait.
  cudaEventDestroy(ev);
  if (err != cudaSuccess) return RtError("cudaEventRecord / cudaStreamWaitEvent", err);
  return absl::OkStatus();
}

// Driver calls need a current context, which a thread that never called the runtime has not:
// make the runtime's (the current device's primary context) current first.
absl::Status EnsureContext() {
  thread_local bool done = false;
  if (done) return absl::OkStatus();
  int device = 0;
  ULY_CUDART(cudaGetDevice(&device));
  ULY_CUDART(cudaSetDevice(device));
  done = true;
  return absl::OkStatus();
}

absl::Status StreamWrite64(void* stream, uint64_t* word, uint64_t value) {
  const Driver& d = Drv();
  ULY_RETURN_IF_ERROR(d.status);
  ULY_RETURN_IF_ERROR(EnsureContext());
  ULY_CU(d.WriteValue64(static_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(word), value,
                        CU_STREAM_WRITE_VALUE_DEFAULT));
  return absl::OkStatus();
}

absl::Status StreamWait64(void* stream, const uint64_t* word, uint64_t value) {
  const Driver& d = Drv();
  ULY_RETURN_IF_ERROR(d.status);
  ULY_RETURN_IF_ERROR(EnsureContext());
  ULY_CU(d.WaitValue64(static_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(word), value,
                       CU_STREAM_WAIT_VALUE_GEQ));
  return absl::OkStatus();
}

absl::Status WriteFromNewStreams(int device, std::span<uint64_t* const> words, uint64_t value,
                                 int streams, absl::Duration wait) {
  if (streams <= 0)
    return absl::InvalidArgumentError(absl::StrCat("streams: ", streams, " is not positive"));
  int caller_device = 0;
  ULY_CUDART(cudaGetDevice(&caller_device));
  // cudaSetDevice alone: no call here may wait for the device (SetDevice's cudaFree might).
  ULY_CUDART(cudaSetDevice(device));
  absl::Status st;
  int least = 0, greatest = 0;
  cudaError_t e = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (e != cudaSuccess)
    st = absl::InternalError(absl::StrCat("cudaDeviceGetStreamPriorityRange: ", cudaGetErrorString(e)));
  std::vector<cudaStream_t> made;
  for (int i = 0; i < streams && st.ok(); ++i) {
    cudaStream_t s = nullptr;
    e = cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, i % 2 == 0 ? least : greatest);
    if (e != cudaSuccess) {
      st = absl::InternalError(absl::StrCat("cudaStreamCreateWithPriority: ", cudaGetErrorString(e)));
      break;
    }
    made.push_back(s);
    StreamOps ops(s);
    for (uint64_t* word : words)
      if (st.ok()) st = ops.Write(word, value);
    if (st.ok()) st = ops.Flush();
  }
  // Until every stream ran its writes: idle (cudaSuccess), or failed (the first error kept).
  const absl::Time give_up = absl::Now() + wait;
  size_t pending = made.size();
  while (pending > 0) {
    pending = 0;
    for (cudaStream_t s : made) {
      e = cudaStreamQuery(s);
      if (e == cudaErrorNotReady) {
        ++pending;
      } else if (e != cudaSuccess && st.ok()) {
        st = absl::InternalError(absl::StrCat("a stream's writes: ", cudaGetErrorString(e)));
      }
    }
    if (pending == 0 || absl::Now() >= give_up) break;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  for (cudaStream_t s : made) cudaStreamDestroy(s);  // at once; pending work still runs
  (void)cudaSetDevice(caller_device);
  if (!st.ok()) return st;
  if (pending > 0)
    return absl::DeadlineExceededError(absl::StrCat(pending, " of ", made.size(),
                                                    " streams' writes had not run after ",
                                                    absl::FormatDuration(wait)));
  return absl::OkStatus();
}

absl::Status StreamOps::Flush() {
  if (count_ == 0) return absl::OkStatus();
  const Driver& d = Drv();
  ULY_RETURN_IF_ERROR(d.status);
  ULY_RETURN_IF_ERROR(EnsureContext());
  CUstreamBatchMemOpParams params[kCapacity];
  std::memset(params, 0, sizeof params);
  for (int i = 0; i < count_; ++i) {
    const Op& op = ops_[i];
    if (op.wait) {
      params[i].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
      params[i].waitValue.address = reinterpret_cast<CUdeviceptr>(op.word);
      params[i].waitValue.value64 = op.value;
      params[i].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    } else {
      params[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
      params[i].writeValue.address = reinterpret_cast<CUdeviceptr>(op.word);
      params[i].writeValue.value64 = op.value;
      params[i].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    }
  }
  const unsigned count = static_cast<unsigned>(count_);
  count_ = 0;
  // ULYSSES_STREAM_BATCH=0 enqueues them one by one: the fallback for a driver whose batched
  // operations misbehave, and the baseline the benchmark compares with.
  static const bool batch = [] {
    const char* v = std::getenv("ULYSSES_STREAM_BATCH");
    return v == nullptr || std::string_view(v) != "0";
  }();
  if (batch) {
    ULY_CU(d.BatchMemOp(static_cast<CUstream>(stream_), count, params, 0));
    return absl::OkStatus();
  }
  for (unsigned i = 0; i < count; ++i) {
    if (params[i].operation == CU_STREAM_MEM_OP_WAIT_VALUE_64)
      ULY_CU(d.WaitValue64(static_cast<CUstream>(stream_), params[i].waitValue.address,
                           params[i].waitValue.value64, params[i].waitValue.flags));
    else
      ULY_CU(d.WriteValue64(static_cast<CUstream>(stream_), params[i].writeValue.address,
                            params[i].writeValue.value64, params[i].writeValue.flags));
  }
  return absl::OkStatus();
}

absl::Status LaunchHostFunc(void* stream, void (*fn)(void*), void* arg) {
  ULY_CUDART(cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), fn, arg));
  return absl::OkStatus();
}

StreamMark::~StreamMark() {
  if (event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

absl::Status StreamMark::Record(void* stream) {
  if (event_ == nullptr) {
    cudaEvent_t ev = nullptr;
    ULY_CUDART(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    event_ = ev;
  }
  ULY_CUDART(cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::StatusOr<bool> StreamMark::Passed() const {
  if (event_ == nullptr) return true;
  const cudaError_t q = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (q == cudaErrorNotReady) return false;
  ULY_CUDART(q);
  return true;
}

absl::Status StreamMark::OrderBefore(void* consumer) const {
  if (event_ == nullptr) return absl::OkStatus();
  ULY_CUDART(cudaStreamWaitEvent(static_cast<cudaStream_t>(consumer),
                                 static_cast<cudaEvent_t>(event_), 0));
  return absl::OkStatus();
}

}  // namespace ulysses::ipc::cuda

namespace ulysses::ipc::cuda {
namespace {

// The probe's words in mapped host memory: [0] the gate, [1 + j] stream j's word.
class StreamQueueTarget final : public QueueProbeTarget {
 public:
  explicit StreamQueueTarget(std::span<void* const> streams) : streams_(streams) {}
  // Kept when a probe failed: a stream that did not go on may still write here later.
  ~StreamQueueTarget() override {
    if (host_ != nullptr && release_) cudaFreeHost(host_);
  }
  absl::Status Init() {
    const size_t bytes = sizeof(uint64_t) * (1 + streams_.size());
    ULY_CUDART(cudaHostAlloc(reinterpret_cast<void**>(&host_), bytes, cudaHostAllocMapped));
    std::memset(host_, 0, bytes);
    ULY_CUDART(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_), host_, 0));
    return absl::OkStatus();
  }
  void Keep() { release_ = false; }
  int streams() const override { return static_cast<int>(streams_.size()); }
  absl::Status Hold(int i, uint64_t gate) override {
    return StreamWait64(streams_[i], &device_[0], gate);
  }
  absl::Status Write(int j, uint64_t mark) override {
    return StreamWrite64(streams_[j], &device_[1 + j], mark);
  }
  uint64_t Word(int j) const override { return __atomic_load_n(&host_[1 + j], __ATOMIC_ACQUIRE); }
  void Open(uint64_t gate) override { __atomic_store_n(&host_[0], gate, __ATOMIC_RELEASE); }

 private:
  std::span<void* const> streams_;
  uint64_t* host_ = nullptr;
  uint64_t* device_ = nullptr;
  bool release_ = true;
};

}  // namespace

absl::StatusOr<QueueProbeResult> ProbeStreamQueues(std::span<void* const> streams,
                                                   const QueueProbeOptions& options) {
  ULY_RETURN_IF_ERROR(Drv().status);
  ULY_RETURN_IF_ERROR(EnsureContext());
  StreamQueueTarget target(streams);
  ULY_RETURN_IF_ERROR(target.Init());
  absl::StatusOr<QueueProbeResult> result = ProbeQueues(target, options);
  if (!result.ok()) target.Keep();
  return result;
}

}  // namespace ulysses::ipc::cuda
