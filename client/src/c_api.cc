// The C ABI (ulysses/c_api.h) over the C++ client. Handles share the state they need through
// shared_ptr, so that a handle freed before the ones made from it leaves those usable to free:
// a result keeps its session's segment mapped, a buffer keeps its own mapping, and every handle
// keeps the client it came from. No C++ exception crosses this boundary.
#include "ulysses/c_api.h"

#include <dlpack/dlpack.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "ulysses/client/client.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/cuda_memory.h"
#include "ulysses/ipc/shm.h"

namespace {

namespace uc = ulysses::client;
using ulysses::StrCat;

thread_local std::string g_last_error;

uly_status Fail(const absl::Status& s) {
  g_last_error = std::string(s.message());
  const int code = static_cast<int>(s.code());
  return code >= ULY_CANCELLED && code <= ULY_UNAUTHENTICATED ? static_cast<uly_status>(code)
                                                              : ULY_UNKNOWN;
}

uly_status Done(const absl::Status& s) { return s.ok() ? ULY_OK : Fail(s); }

// Runs `f` (returning absl::Status) with every C++ exception turned into a status.
template <typename F>
uly_status Guard(F&& f) {
  try {
    return Done(f());
  } catch (const std::bad_alloc&) {
    return Fail(absl::ResourceExhaustedError("out of memory"));
  } catch (const std::exception& e) {
    return Fail(absl::InternalError(StrCat("unexpected exception: ", e.what())));
  } catch (...) {
    return Fail(absl::InternalError("unexpected exception"));
  }
}

absl::Status NotNull(const void* p, const char* name) {
  if (p == nullptr) return absl::InvalidArgumentError(StrCat(name, ": must not be NULL"));
  return absl::OkStatus();
}

// A caller's struct is at least as large as this library's version 1 of it; fields appended
// later are ignored by a library that predates them.
absl::Status CheckStructSize(uint32_t struct_size, size_t v1_size, const char* name) {
  if (struct_size < v1_size)
    return absl::InvalidArgumentError(StrCat(name, ": struct_size ", struct_size,
                                             " is smaller than this ABI's ", v1_size));
  return absl::OkStatus();
}

std::string Dims(const int64_t* v, int n) {
  std::string s = "[";
  for (int i = 0; i < n; ++i) s += StrCat(i ? ", " : "", v[i]);
  return s + "]";
}

// A buffer's own read-write mapping of the memfd it shares with the daemon.
struct BufferEntry {
  uint64_t id = 0;
  uint64_t size = 0;
};

// A device allocation registered through RegisterDeviceBuffer: its registration and extent.
struct DeviceEntry {
  uint64_t id = 0;
  uint64_t size = 0;
};

struct ClientState : ulysses::BufferResolver {
  std::unique_ptr<uc::Client> client;
  std::string backend;
  std::string socket;
  mutable std::mutex mu;
  std::map<uintptr_t, BufferEntry> by_address;  // buffer start -> entry
  std::map<uint64_t, uint64_t> sizes;           // buffer id -> size
  std::map<uintptr_t, DeviceEntry> devices;     // device allocation base -> registration

  absl::StatusOr<ulysses::BufferInfo> Resolve(uint64_t id) const override {
    std::lock_guard<std::mutex> lock(mu);
    auto it = sizes.find(id);
    if (it == sizes.end())
      return absl::InvalidArgumentError(StrCat("buffer ", id, " is not a buffer of this client"));
    return ulysses::BufferInfo{it->second};
  }

  // The buffer holding `p`, and p's offset in it.
  absl::StatusOr<std::pair<uint64_t, uint64_t>> Locate(const void* p, const char* name) const {
    const auto a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu);
    auto it = by_address.upper_bound(a);
    if (it != by_address.begin()) {
      --it;
      if (a - it->first < it->second.size) return std::make_pair(it->second.id, a - it->first);
    }
    return absl::InvalidArgumentError(
        StrCat(name, ": data does not point into a shared buffer of this client"));
  }

  // Records the registration `id` of the device memory [base, base+size). The client
  // re-registers memory that was freed and re-made at the same address under a new id and
  // frees the old registration; overlapping ones it freed are forgotten here too (CUDA VMM
  // registrations of neighbouring tensors may overlap and stay).
  void NoteDevice(const void* base, uint64_t size, uint64_t id) {
    const auto lo = reinterpret_cast<uintptr_t>(base);
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = devices.begin(); it != devices.end();) {
      const bool overlaps = it->first < lo + size && lo < it->first + it->second.size;
      if (overlaps && it->second.id != id && !client->HoldsBuffer(it->second.id)) {
        sizes.erase(it->second.id);
        it = devices.erase(it);
      } else {
        ++it;
      }
    }
    devices[lo] = {id, size};
    sizes[id] = size;
  }
};

struct SessionState {
  std::shared_ptr<ClientState> client;
  std::unique_ptr<uc::Session> session;
  std::string described;  // the text of the last uly_session_describe
  // The CUDA device the session's slots are mapped on, found by the first DLPack export of
  // one of its device results (-1 until then): every later export needs no driver query.
  std::atomic<int> slot_device{-1};
};

}  // namespace

struct uly_client {
  std::shared_ptr<ClientState> state;
};

struct uly_buffer {
  std::shared_ptr<ClientState> client;
  ulysses::ipc::Mapping mapping;
  uint64_t id = 0;
};

struct uly_group {
  std::shared_ptr<ClientState> client;
  uc::Group group;
};

struct uly_session {
  std::shared_ptr<SessionState> state;
};

struct uly_result {
  std::shared_ptr<SessionState> session;  // keeps the segment holding `result.data` mapped
  mutable std::mutex mu;
  uc::Result result;
  // The results of one fused call share one slot hold: set once any of them released it. Null
  // for a head-exchange result (which holds its slot alone).
  std::shared_ptr<std::atomic<bool>> siblings_released;
  // The handle's own reference and one per live DLPack export: the last to go releases.
  std::atomic<int> refs{1};
  bool held() const {
    return result.held() && !(siblings_released && siblings_released->load());
  }
};

namespace {

// A result exported as DLPack: the managed tensor (first, so that its address is this one's)
// and the extents it points at.
struct DlpackTensor {
  DLManagedTensor managed{};
  int64_t shape[4] = {};
  int64_t strides[4] = {};
};
static_assert(offsetof(DlpackTensor, managed) == 0);

// A result's shape and the element strides of its contiguous layout.
void ContiguousExtents(const std::array<int64_t, 4>& in, int64_t shape[4], int64_t strides[4]) {
  int64_t stride = 1;
  for (int i = 3; i >= 0; --i) {
    shape[i] = in[i];
    strides[i] = stride;
    stride *= in[i];
  }
}

absl::StatusOr<DLDataType> DlpackDType(ulysses::DType dtype) {
  switch (dtype) {
    case ulysses::DType::kBFloat16: return DLDataType{kDLBfloat, 16, 1};
    case ulysses::DType::kFloat16: return DLDataType{kDLFloat, 16, 1};
    case ulysses::DType::kFloat32: return DLDataType{kDLFloat, 32, 1};
    case ulysses::DType::kUnspecified: break;
  }
  return absl::InternalError("result: a dtype DLPack cannot name");
}

// Why a CUDA tensor or a stream (`what`) cannot be used with a session of `backend`, or OK.
absl::Status CheckDeviceUse(const std::string& backend, const std::string& what) {
  if (!ulysses::ipc::cuda::Built())
    return absl::FailedPreconditionError(StrCat(
        what, ": this libulysses_client was built without CUDA, so it takes shared host "
              "buffers (ULY_DEVICE_HOST) only"));
  if (backend == "host")
    return absl::InvalidArgumentError(StrCat(
        what, ": the session runs on the host backend, which takes shared host buffers "
              "(ULY_DEVICE_HOST) and no stream; start the daemons with a GPU backend "
              "(--backend nvlink) for CUDA tensors"));
  return absl::OkStatus();
}

// Bytes per element of a uly_dtype (ULY_DTYPE_INT32 included); 0 for an unknown one.
size_t CItemSize(int32_t dtype) {
  return dtype == ULY_DTYPE_INT32 ? 4 : ulysses::ItemSize(static_cast<ulysses::DType>(dtype));
}

// Whether the first `n` strides are all zero (the contiguous convention).
bool ZeroStrides(const uly_tensor* t, int n) {
  for (int i = 0; i < n; ++i)
    if (t->strides[i] != 0) return false;
  return true;
}

// Bytes from element [0,...,0] to one past the last element of a strided tensor of t->ndim
// dimensions.
absl::StatusOr<uint64_t> Extent(const uly_tensor* t, const char* name) {
  const size_t item = CItemSize(t->dtype);
  const int n = t->ndim;
  const bool contiguous = ZeroStrides(t, n);
  uint64_t last = 0, stride = 1;
  for (int i = n - 1; i >= 0; --i) {
    if (t->shape[i] <= 0)
      return absl::InvalidArgumentError(
          StrCat(name, ": shape ", Dims(t->shape, n), " has an extent <= 0"));
    const int64_t s = contiguous ? static_cast<int64_t>(stride) : t->strides[i];
    if (s <= 0)
      return absl::InvalidArgumentError(
          StrCat(name, ": strides ", Dims(t->strides, n), " must be positive"));
    last += static_cast<uint64_t>(t->shape[i] - 1) * static_cast<uint64_t>(s);
    stride *= static_cast<uint64_t>(t->shape[i]);
  }
  return (last + 1) * item;
}

// A CUDA tensor as an operand: its allocation is registered with the daemon (once; the client
// caches it by the allocation's CUDA buffer id) and the operand addresses the tensor in it.
// `backend` is the session's (or the group's, for weights).
absl::Status ToDeviceOperand(ClientState& c, const std::string& backend, const uly_tensor* t,
                             const char* name, ulysses::OperandRef* ref) {
  ULY_RETURN_IF_ERROR(CheckDeviceUse(backend, name));
  if (t->buffer_id != 0)
    return absl::InvalidArgumentError(
        StrCat(name, ": a CUDA tensor gives its device pointer in data; buffer_id must be 0"));
  if (t->data == nullptr)
    return absl::InvalidArgumentError(StrCat(name, ": data (the device pointer) is NULL"));
  if (t->device_index < 0)
    return absl::InvalidArgumentError(
        StrCat(name, ": device_index ", t->device_index, " is not a CUDA device ordinal"));
  void* ptr = static_cast<uint8_t*>(t->data) + t->byte_offset;
  ULY_ASSIGN_OR_RETURN(uint64_t bytes, Extent(t, name));
  absl::StatusOr<uc::Buffer> b = c.client->RegisterDeviceBuffer(ptr, bytes, name, t->device_index);
  if (!b.ok())
    return absl::Status(b.status().code(), StrCat(name, ": ", b.status().message()));
  c.NoteDevice(static_cast<const uint8_t*>(ptr) - b->base_offset, b->registration_size, b->id);
  *ref = b->Ref(0);
  return absl::OkStatus();
}

// Where tensor `t` (named `name`) lies: a host buffer of this client or a registered CUDA
// allocation. Sets ref's buffer and offset and copies the first ndim (<= 4) strides.
absl::Status LocateTensor(ClientState& c, const std::string& backend, const uly_tensor* t,
                          const char* name, ulysses::OperandRef* ref) {
  if (t->device_kind != ULY_DEVICE_HOST && t->device_kind != ULY_DEVICE_CUDA)
    return absl::InvalidArgumentError(StrCat(name, ": unknown device_kind ", t->device_kind));
  if (t->reserved != 0) return absl::InvalidArgumentError(StrCat(name, ": reserved must be 0"));
  if (t->device_kind == ULY_DEVICE_CUDA) {
    ULY_RETURN_IF_ERROR(ToDeviceOperand(c, backend, t, name, ref));
  } else if (t->buffer_id != 0) {
    if (t->data != nullptr)
      return absl::InvalidArgumentError(StrCat(name, ": give buffer_id or data, not both"));
    ref->buffer_id = t->buffer_id;
    ref->offset_bytes = t->byte_offset;
  } else {
    if (t->data == nullptr)
      return absl::InvalidArgumentError(StrCat(name, ": neither buffer_id nor data is set"));
    ULY_ASSIGN_OR_RETURN(auto where,
                         c.Locate(static_cast<const uint8_t*>(t->data) + t->byte_offset, name));
    ref->buffer_id = where.first;
    ref->offset_bytes = where.second;
  }
  for (int i = 0; i < 4; ++i) ref->strides[i] = i < t->ndim ? t->strides[i] : 0;
  return absl::OkStatus();
}

// Converts the tensor `t` named `name` into an operand of this client's buffers; `shape`
// receives its shape.
absl::Status ToOperand(const SessionState& s, const uly_tensor* t, const char* name,
                       ulysses::OperandRef* ref, std::array<int64_t, 4>* shape) {
  ULY_RETURN_IF_ERROR(NotNull(t, name));
  ULY_RETURN_IF_ERROR(CheckStructSize(t->struct_size, sizeof(uly_tensor), name));
  const ulysses::SessionGeometry& g = s.session->geometry();
  if (t->dtype != static_cast<int32_t>(g.dtype))
    return absl::InvalidArgumentError(
        StrCat(name, ": dtype ", t->dtype, " is not the session's ", static_cast<int>(g.dtype),
               " (", ulysses::DTypeName(g.dtype), ")"));
  if (t->ndim != 4)
    return absl::InvalidArgumentError(StrCat(name, ": ndim ", t->ndim, ", this op takes 4-D tensors"));
  ULY_RETURN_IF_ERROR(LocateTensor(*s.client, s.session->backend(), t, name, ref));
  for (int i = 0; i < 4; ++i) (*shape)[i] = t->shape[i];
  return absl::OkStatus();
}

// A dense tensor of the fused session or call: `dtype`, exactly the extents `want`, strides
// all zero or row-major. On success `ref` addresses it (zero strides: contiguous) and, for
// weights, `tensor` is the same as the C++ spec takes it.
absl::Status ToDenseRef(ClientState& c, const std::string& backend, const uly_tensor* t,
                        const char* name, int32_t dtype, const std::vector<int64_t>& want,
                        ulysses::OperandRef* ref, ulysses::FusedTensorRef* tensor = nullptr) {
  ULY_RETURN_IF_ERROR(NotNull(t, name));
  ULY_RETURN_IF_ERROR(CheckStructSize(t->struct_size, sizeof(uly_tensor), name));
  const int n = static_cast<int>(want.size());
  if (t->dtype != dtype)
    return absl::InvalidArgumentError(StrCat(
        name, ": dtype ", t->dtype, ", want ", dtype,
        dtype == ULY_DTYPE_INT32 ? " (ULY_DTYPE_INT32)"
                                 : StrCat(" (", ulysses::DTypeName(static_cast<ulysses::DType>(dtype)), ")")));
  if (t->ndim != n)
    return absl::InvalidArgumentError(
        StrCat(name, ": ndim ", t->ndim, ", want ", n, " (shape ", Dims(want.data(), n), ")"));
  if (!std::equal(want.begin(), want.end(), t->shape))
    return absl::InvalidArgumentError(StrCat(name, ": shape ", Dims(t->shape, n),
                                             ", want ", Dims(want.data(), n)));
  if (!ZeroStrides(t, n)) {
    int64_t stride = 1;
    for (int i = n - 1; i >= 0; --i) {
      if (t->shape[i] != 1 && t->strides[i] != stride)
        return absl::InvalidArgumentError(StrCat(name, ": strides ", Dims(t->strides, n),
                                                 " are not contiguous (row-major)"));
      stride *= t->shape[i];
    }
  }
  // Located as the 1-D run of its elements (the operand's strides are then all zero).
  uly_tensor flat = *t;
  flat.ndim = 1;
  flat.shape[0] = 1;
  for (int i = 0; i < n; ++i) flat.shape[0] *= want[i];
  for (int i = 0; i < ULY_MAX_DIMS; ++i) {
    flat.strides[i] = 0;
    if (i > 0) flat.shape[i] = 0;
  }
  ULY_RETURN_IF_ERROR(LocateTensor(c, backend, &flat, name, ref));
  if (tensor != nullptr) {
    if (n > 4) return absl::InvalidArgumentError(StrCat(name, ": at most 4 dimensions"));
    tensor->buffer_id = ref->buffer_id;
    tensor->offset_bytes = ref->offset_bytes;
    tensor->dtype = static_cast<ulysses::DType>(dtype);
    tensor->rank = n;
    for (int i = 0; i < n; ++i) tensor->shape[i] = want[i];
  }
  return absl::OkStatus();
}

absl::Status CheckShape(const std::array<int64_t, 4>& got, const std::array<int64_t, 4>& want,
                        const char* name) {
  if (got != want)
    return absl::InvalidArgumentError(StrCat(name, ": shape ", Dims(got.data(), 4),
                                             " does not match the op's ", Dims(want.data(), 4)));
  return absl::OkStatus();
}

// Builds the C++ call from the C one: batch and sequence extent from inputs[0], then every
// tensor's shape checked against the plan that the shared validator makes of the call.
absl::StatusOr<ulysses::CallArgs> ToCallArgs(const SessionState& s, const uly_call_args* a) {
  ULY_RETURN_IF_ERROR(NotNull(a, "args"));
  ULY_RETURN_IF_ERROR(CheckStructSize(a->struct_size, sizeof(uly_call_args), "args"));
  if (a->stream != nullptr) ULY_RETURN_IF_ERROR(CheckDeviceUse(s.session->backend(), "stream"));
  if (a->op < ULY_OP_SCATTER_HEADS || a->op > ULY_OP_GATHER_OUTPUT_HEAD_CHUNK)
    return absl::InvalidArgumentError(StrCat("op: unknown op ", a->op));
  const auto op = static_cast<ulysses::OpKind>(a->op);
  const std::vector<std::string_view> names = ulysses::InputNames(op);
  const ulysses::SessionGeometry& g = s.session->geometry();
  ulysses::CallArgs args;
  args.op = op;
  args.head_offset = a->head_offset;
  args.head_count = a->head_count;
  std::array<std::array<int64_t, 4>, 3> in_shapes{};
  for (size_t i = 0; i < 3; ++i) {
    if (i >= names.size()) {
      if (a->inputs[i] != nullptr)
        return absl::InvalidArgumentError(
            StrCat("inputs[", i, "]: ", ulysses::OpName(op), " takes ", names.size(), " input(s)"));
      continue;
    }
    const std::string name(names[i]);
    ULY_RETURN_IF_ERROR(ToOperand(s, a->inputs[i], name.c_str(), &args.inputs[i], &in_shapes[i]));
  }
  std::array<int64_t, 4> out_shape{};
  if (a->out != nullptr)
    ULY_RETURN_IF_ERROR(ToOperand(s, a->out, "out", &args.out, &out_shape));
  args.batch = in_shapes[0][0];
  args.seq = in_shapes[0][1];
  ULY_ASSIGN_OR_RETURN(ulysses::CallPlan plan, ulysses::PlanCall(g, args, *s.client));
  for (size_t i = 0; i < names.size(); ++i)
    ULY_RETURN_IF_ERROR(CheckShape(in_shapes[i], plan.inputs[i].shape, std::string(names[i]).c_str()));
  if (plan.has_out) ULY_RETURN_IF_ERROR(CheckShape(out_shape, plan.out.shape, "out"));
  return args;
}

// A weight of the fused session: a dense tensor of at most 4 dimensions, of its own shape
// and dtype (both checked against the geometry by the shared validator).
absl::Status ToWeight(ClientState& c, const std::string& backend, const uly_tensor* t,
                      const char* name, ulysses::FusedTensorRef* tensor) {
  ULY_RETURN_IF_ERROR(NotNull(t, name));
  ULY_RETURN_IF_ERROR(CheckStructSize(t->struct_size, sizeof(uly_tensor), name));
  if (t->ndim < 1 || t->ndim > 4)
    return absl::InvalidArgumentError(StrCat(name, ": ndim ", t->ndim, ", want 1 to 4"));
  if (t->dtype != ULY_DTYPE_BFLOAT16 && t->dtype != ULY_DTYPE_FLOAT32)
    return absl::InvalidArgumentError(StrCat(name, ": dtype ", t->dtype,
                                             ", want ULY_DTYPE_BFLOAT16 or ULY_DTYPE_FLOAT32"));
  ulysses::OperandRef ref;
  return ToDenseRef(c, backend, t, name, t->dtype, std::vector<int64_t>(t->shape, t->shape + t->ndim),
                    &ref, tensor);
}

uly_result* NewResult(const std::shared_ptr<SessionState>& s, uc::Result r,
                      std::shared_ptr<std::atomic<bool>> siblings_released = nullptr) {
  auto* h = new uly_result;
  h->session = s;
  h->result = std::move(r);
  h->siblings_released = std::move(siblings_released);
  return h;
}

uly_session* NewSession(const std::shared_ptr<ClientState>& c, std::unique_ptr<uc::Session> s) {
  auto state = std::make_shared<SessionState>();
  state->client = c;
  state->session = std::move(s);
  return new uly_session{std::move(state)};
}

// The fused call's operands from the C ones: x [B,S_l,hidden] gives B and S_l; positions and
// out must have the shapes they imply.
// A wait's timeout_ms: 0 is 5 minutes.
absl::StatusOr<absl::Duration> WaitTimeout(int64_t timeout_ms) {
  if (timeout_ms < 0) return absl::InvalidArgumentError("timeout_ms: must be >= 0");
  return timeout_ms == 0 ? absl::Minutes(5) : absl::Milliseconds(timeout_ms);
}

struct FusedOperands {
  ulysses::OperandRef x, positions, out;
  int64_t batch = 0, seq_local = 0;
};

absl::StatusOr<FusedOperands> ToFusedOperands(const SessionState& s, const uly_fused_call_args* a) {
  ULY_RETURN_IF_ERROR(NotNull(a, "args"));
  ULY_RETURN_IF_ERROR(CheckStructSize(a->struct_size, sizeof(uly_fused_call_args), "args"));
  if (a->reserved != 0) return absl::InvalidArgumentError("args: reserved must be 0");
  const ulysses::FusedGeometry* g = s.session->fused_geometry();
  if (g == nullptr)
    return absl::InvalidArgumentError(StrCat(
        "session: ", s.session->id(), " is a head_exchange session; qkv_norm_rope_exchange needs "
        "a session of uly_session_create_fused"));
  const std::string& backend = s.session->backend();
  if (a->stream != nullptr) ULY_RETURN_IF_ERROR(CheckDeviceUse(backend, "stream"));
  ULY_RETURN_IF_ERROR(NotNull(a->x, "x"));
  ULY_RETURN_IF_ERROR(CheckStructSize(a->x->struct_size, sizeof(uly_tensor), "x"));
  if (a->x->ndim != 3)
    return absl::InvalidArgumentError(
        StrCat("x: ndim ", a->x->ndim, ", want 3 ([B, S_l, hidden])"));
  FusedOperands o;
  o.batch = a->x->shape[0];
  o.seq_local = a->x->shape[1];
  if (o.batch <= 0 || o.seq_local <= 0)
    return absl::InvalidArgumentError(
        StrCat("x: shape ", Dims(a->x->shape, 3), " has an extent <= 0"));
  ClientState& c = *s.client;
  ULY_RETURN_IF_ERROR(ToDenseRef(c, backend, a->x, "x", ULY_DTYPE_BFLOAT16,
                                 {o.batch, o.seq_local, g->hidden}, &o.x));
  ULY_RETURN_IF_ERROR(ToDenseRef(c, backend, a->positions, "positions", ULY_DTYPE_INT32,
                                 {o.batch, o.seq_local}, &o.positions));
  if (a->out != nullptr) {
    const int64_t sg = o.seq_local * g->world_size, hl = g->local_heads(), d = g->head_dim;
    const std::vector<int64_t> want = g->layout == ulysses::QkvLayout::kFused
                                          ? std::vector<int64_t>{o.batch, sg, hl, 3 * d}
                                          : std::vector<int64_t>{3, o.batch, sg, hl, d};
    ULY_RETURN_IF_ERROR(ToDenseRef(c, backend, a->out, "out", ULY_DTYPE_BFLOAT16, want, &o.out));
  }
  return o;
}

}  // namespace

extern "C" {

uint32_t uly_abi_version(void) { return ULY_ABI_VERSION; }

int32_t uly_cuda_built(void) { return ulysses::ipc::cuda::Built() ? 1 : 0; }

const char* uly_version(void) { return ULYSSES_VERSION; }

const char* uly_last_error(void) { return g_last_error.c_str(); }

const char* uly_status_name(int32_t status) {
  static const char* const kNames[] = {
      "OK",      "CANCELLED",         "UNKNOWN",   "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS",  "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
      "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
      "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  return status >= 0 && status <= ULY_UNAUTHENTICATED ? kNames[status] : "UNKNOWN";
}

uly_status uly_connect(const uly_connect_options* options, uly_client** out) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(options, "options"));
    ULY_RETURN_IF_ERROR(NotNull(out, "out"));
    *out = nullptr;
    ULY_RETURN_IF_ERROR(
        CheckStructSize(options->struct_size, sizeof(uly_connect_options), "options"));
    const uint32_t v = options->abi_version;
    if ((v >> 16) != ULY_ABI_VERSION_MAJOR || (v & 0xffff) > ULY_ABI_VERSION_MINOR)
      return absl::FailedPreconditionError(
          StrCat("abi_version: the caller was built for ABI ", v >> 16, ".", v & 0xffff,
                 ", this library implements ", ULY_ABI_VERSION_MAJOR, ".", ULY_ABI_VERSION_MINOR));
    uc::ConnectOptions o;
    if (options->socket != nullptr && options->socket[0] != '\0') {
      o.socket = options->socket;
    } else if (const char* env = std::getenv("ULYSSES_SOCKET"); env != nullptr && env[0] != '\0') {
      o.socket = env;
    } else {
      o.socket = StrCat("/run/ulysses/gpu", options->device < 0 ? 0 : options->device, ".sock");
    }
    if (options->name != nullptr) o.name = options->name;
    if (options->connect_timeout_ms < 0)
      return absl::InvalidArgumentError("connect_timeout_ms: must be >= 0");
    if (options->connect_timeout_ms > 0) o.connect_timeout = absl::Milliseconds(options->connect_timeout_ms);
    o.use_rings = options->disable_rings == 0;
    ULY_ASSIGN_OR_RETURN(std::unique_ptr<uc::Client> c, uc::Client::Connect(o));
    auto state = std::make_shared<ClientState>();
    state->backend = c->daemon_backend();
    state->socket = o.socket;
    state->client = std::move(c);
    *out = new uly_client{std::move(state)};
    return absl::OkStatus();
  });
}

uly_status uly_client_close(uly_client* client) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(client, "client"));
    return client->state->client->Close();
  });
}

void uly_client_free(uly_client* client) {
  if (client == nullptr) return;
  (void)uly_client_close(client);
  delete client;
}

uint64_t uly_client_id(const uly_client* client) {
  return client != nullptr ? client->state->client->client_id() : 0;
}

const char* uly_client_backend(const uly_client* client) {
  return client != nullptr ? client->state->backend.c_str() : "";
}

const char* uly_client_socket(const uly_client* client) {
  return client != nullptr ? client->state->socket.c_str() : "";
}

int32_t uly_client_uses_rings(const uly_client* client) {
  return client != nullptr && client->state->client->uses_rings() ? 1 : 0;
}

uly_status uly_buffer_alloc(uly_client* client, uint64_t size_bytes, const char* name,
                            uly_buffer** out) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(client, "client"));
    ULY_RETURN_IF_ERROR(NotNull(out, "out"));
    *out = nullptr;
    if (size_bytes == 0) return absl::InvalidArgumentError("size_bytes: must be > 0");
    const std::string label = name != nullptr ? name : "";
    // This library makes the memfd and keeps its own mapping, so that the memory stays valid
    // for as long as the handle, whatever happens to the client.
    ULY_ASSIGN_OR_RETURN(ulysses::ipc::UniqueFd fd,
                         ulysses::ipc::CreateMemfd("ulysses-buffer", size_bytes));
    ULY_RETURN_IF_ERROR(ulysses::ipc::SealSize(fd.get()));
    ULY_ASSIGN_OR_RETURN(ulysses::ipc::Mapping m, ulysses::ipc::Mapping::Map(fd.get(), size_bytes, true));
    ClientState& st = *client->state;
    ULY_ASSIGN_OR_RETURN(uc::Buffer b, st.client->RegisterBuffer(fd.get(), label));
    auto h = std::make_unique<uly_buffer>();
    h->client = client->state;
    h->id = b.id;
    h->mapping = std::move(m);
    {
      std::lock_guard<std::mutex> lock(st.mu);
      st.by_address[reinterpret_cast<uintptr_t>(h->mapping.data())] = {b.id, size_bytes};
      st.sizes[b.id] = size_bytes;
    }
    *out = h.release();
    return absl::OkStatus();
  });
}

uly_status uly_buffer_free(uly_buffer* buffer) {
  if (buffer == nullptr) return ULY_OK;
  std::unique_ptr<uly_buffer> h(buffer);
  return Guard([&]() -> absl::Status {
    ClientState& st = *h->client;
    {
      std::lock_guard<std::mutex> lock(st.mu);
      st.by_address.erase(reinterpret_cast<uintptr_t>(h->mapping.data()));
      st.sizes.erase(h->id);
    }
    absl::Status s = st.client->FreeBuffer(h->id);
    // After Close the daemon has released every buffer already.
    if (s.code() == absl::StatusCode::kUnauthenticated) return absl::OkStatus();
    return s;
  });
}

uint64_t uly_buffer_id(const uly_buffer* buffer) { return buffer != nullptr ? buffer->id : 0; }
void* uly_buffer_data(const uly_buffer* buffer) {
  return buffer != nullptr ? buffer->mapping.data() : nullptr;
}
uint64_t uly_buffer_size(const uly_buffer* buffer) {
  return buffer != nullptr ? buffer->mapping.size() : 0;
}

uly_status uly_join_group(uly_client* client, const uly_group_spec* spec, uly_group** out) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(client, "client"));
    ULY_RETURN_IF_ERROR(NotNull(spec, "spec"));
    ULY_RETURN_IF_ERROR(NotNull(out, "out"));
    *out = nullptr;
    ULY_RETURN_IF_ERROR(CheckStructSize(spec->struct_size, sizeof(uly_group_spec), "spec"));
    if (spec->name == nullptr || spec->name[0] == '\0')
      return absl::InvalidArgumentError("name: must not be empty");
    if (spec->num_members < 0) return absl::InvalidArgumentError("num_members: must be >= 0");
    if (spec->num_members > 0 && spec->members == nullptr)
      return absl::InvalidArgumentError("members: NULL with num_members > 0");
    uc::GroupSpec g;
    g.name = spec->name;
    g.world_size = spec->world_size;
    g.rank = spec->rank;
    for (int32_t i = 0; i < spec->num_members; ++i) {
      if (spec->members[i] == nullptr)
        return absl::InvalidArgumentError(StrCat("members[", i, "]: NULL"));
      g.members.emplace_back(spec->members[i]);
    }
    if (spec->backend != nullptr && spec->backend[0] != '\0') g.backend = spec->backend;
    g.timeout_ms = spec->timeout_ms;
    ULY_ASSIGN_OR_RETURN(uc::Group group, client->state->client->JoinGroup(g));
    *out = new uly_group{client->state, std::move(group)};
    return absl::OkStatus();
  });
}

void uly_group_free(uly_group* group) { delete group; }
uint64_t uly_group_id(const uly_group* group) { return group != nullptr ? group->group.id : 0; }
int32_t uly_group_rank(const uly_group* group) { return group != nullptr ? group->group.rank : 0; }
int32_t uly_group_world_size(const uly_group* group) {
  return group != nullptr ? group->group.world_size : 0;
}
const char* uly_group_backend(const uly_group* group) {
  return group != nullptr ? group->group.backend.c_str() : "";
}
const char* uly_group_backend_reason(const uly_group* group) {
  return group != nullptr ? group->group.backend_reason.c_str() : "";
}

uly_status uly_group_leave(uly_group* group) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(group, "group"));
    return group->client->client->LeaveGroup(group->group);
  });
}

uly_status uly_session_create(uly_client* client, const uly_group* group,
                              const uly_session_spec* spec, uly_session** out) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(client, "client"));
    ULY_RETURN_IF_ERROR(NotNull(group, "group"));
    ULY_RETURN_IF_ERROR(NotNull(spec, "spec"));
    ULY_RETURN_IF_ERROR(NotNull(out, "out"));
    *out = nullptr;
    ULY_RETURN_IF_ERROR(CheckStructSize(spec->struct_size, sizeof(uly_session_spec), "spec"));
    if (group->client != client->state)
      return absl::InvalidArgumentError("group: joined by another client");
    if (spec->schedule_length < 0) return absl::InvalidArgumentError("schedule_length: must be >= 0");
    if (spec->schedule_length > 0 && spec->schedule == nullptr)
      return absl::InvalidArgumentError("schedule: NULL with schedule_length > 0");
    uc::SessionSpec s;
    s.num_heads = spec->num_heads;
    s.head_dim = spec->head_dim;
    s.dtype = static_cast<ulysses::DType>(spec->dtype);
    s.max_tokens = spec->max_tokens;
    s.num_slots = spec->num_slots == 0 ? 2 : spec->num_slots;
    s.schedule.assign(spec->schedule, spec->schedule + spec->schedule_length);
    s.timeout_ms = spec->timeout_ms;
    ULY_ASSIGN_OR_RETURN(std::unique_ptr<uc::Session> session,
                         client->state->client->CreateSession(group->group, s));
    *out = NewSession(client->state, std::move(session));
    return absl::OkStatus();
  });
}

uly_status uly_session_create_fused(uly_client* client, const uly_group* group,
                                    const uly_fused_session_spec* spec, uly_session** out) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(client, "client"));
    ULY_RETURN_IF_ERROR(NotNull(group, "group"));
    ULY_RETURN_IF_ERROR(NotNull(spec, "spec"));
    ULY_RETURN_IF_ERROR(NotNull(out, "out"));
    *out = nullptr;
    ULY_RETURN_IF_ERROR(CheckStructSize(spec->struct_size, sizeof(uly_fused_session_spec), "spec"));
    if (group->client != client->state)
      return absl::InvalidArgumentError("group: joined by another client");
    if (spec->layout != ULY_QKV_LAYOUT_BSHD && spec->layout != ULY_QKV_LAYOUT_FUSED)
      return absl::InvalidArgumentError(
          StrCat("layout: ", spec->layout, " is not ULY_QKV_LAYOUT_BSHD (1) or ULY_QKV_LAYOUT_FUSED (2)"));
    if (spec->path < ULY_FUSED_PATH_AUTO || spec->path > ULY_FUSED_PATH_EPILOGUE)
      return absl::InvalidArgumentError(StrCat(
          "path: ", spec->path,
          " is not ULY_FUSED_PATH_AUTO, _PER_OPERATOR, _CHUNKED or _EPILOGUE (0..3)"));
    if (spec->num_slots < 0) return absl::InvalidArgumentError("num_slots: must be >= 0");
    uc::FusedSessionSpec f;
    f.hidden = spec->hidden;
    f.num_heads = spec->num_heads;
    f.head_dim = spec->head_dim;
    f.layout = static_cast<ulysses::QkvLayout>(spec->layout);
    f.path = static_cast<ulysses::FusedPath>(spec->path);
    f.max_tokens = spec->max_tokens;
    f.num_slots = spec->num_slots == 0 ? 2 : spec->num_slots;
    f.max_pos = spec->max_pos;
    f.timeout_ms = spec->timeout_ms;
    ClientState& c = *client->state;
    const std::string& backend = group->group.backend;
    // The weights as the C++ spec takes them; their shapes and dtypes are checked against
    // the geometry by CreateFusedSession (after the geometry itself), with the daemon's words.
    ULY_RETURN_IF_ERROR(ToWeight(c, backend, spec->w_qkv, "w_qkv", &f.weights.w_qkv));
    ULY_RETURN_IF_ERROR(ToWeight(c, backend, spec->q_norm, "q_norm", &f.weights.q_norm));
    ULY_RETURN_IF_ERROR(ToWeight(c, backend, spec->k_norm, "k_norm", &f.weights.k_norm));
    ULY_RETURN_IF_ERROR(ToWeight(c, backend, spec->cos_sin, "cos_sin", &f.weights.cos_sin));
    ULY_ASSIGN_OR_RETURN(std::unique_ptr<uc::Session> session,
                         c.client->CreateFusedSession(group->group, f));
    *out = NewSession(client->state, std::move(session));
    return absl::OkStatus();
  });
}

uly_status uly_session_close(uly_session* session) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(session, "session"));
    return session->state->session->Close();
  });
}

void uly_session_free(uly_session* session) {
  if (session == nullptr) return;
  (void)uly_session_close(session);
  delete session;
}

uint64_t uly_session_id(const uly_session* session) {
  return session != nullptr ? session->state->session->id() : 0;
}

const char* uly_session_backend(const uly_session* session) {
  return session != nullptr ? session->state->session->backend().c_str() : "";
}

uly_status uly_session_poison_slots(uly_session* session, int32_t* poisoned) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(session, "session"));
    ULY_ASSIGN_OR_RETURN(int n, session->state->session->PoisonSlots());
    if (poisoned != nullptr) *poisoned = n;
    return absl::OkStatus();
  });
}

uly_status uly_session_call(uly_session* session, const uly_call_args* args, uly_result** result) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(session, "session"));
    if (result != nullptr) *result = nullptr;
    ULY_ASSIGN_OR_RETURN(ulysses::CallArgs a, ToCallArgs(*session->state, args));
    if (result == nullptr && !a.out.present())
      return absl::InvalidArgumentError("result: NULL, but the call has no out");
    session->state->session->set_stream(args->stream);
    ULY_ASSIGN_OR_RETURN(uc::Result r, session->state->session->Call(a));
    if (result != nullptr) *result = NewResult(session->state, std::move(r));
    return absl::OkStatus();
  });
}

uly_status uly_session_submit(uly_session* session, const uly_call_args* args, uint64_t* epoch) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(session, "session"));
    ULY_RETURN_IF_ERROR(NotNull(epoch, "epoch"));
    ULY_ASSIGN_OR_RETURN(ulysses::CallArgs a, ToCallArgs(*session->state, args));
    session->state->session->set_stream(args->stream);
    ULY_ASSIGN_OR_RETURN(*epoch, session->state->session->Submit(a));
    return absl::OkStatus();
  });
}

uly_status uly_session_wait(uly_session* session, uint64_t epoch, int64_t timeout_ms,
                            uly_result** result) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(session, "session"));
    ULY_RETURN_IF_ERROR(NotNull(result, "result"));
    *result = nullptr;
    ULY_ASSIGN_OR_RETURN(const absl::Duration timeout, WaitTimeout(timeout_ms));
    ULY_ASSIGN_OR_RETURN(uc::Result r, session->state->session->Wait(epoch, timeout));
    *result = NewResult(session->state, std::move(r));
    return absl::OkStatus();
  });
}

namespace {

// Hands a fused call's views to the caller as result handles sharing one release.
absl::Status FusedResults(const std::shared_ptr<SessionState>& state,
                          std::vector<uc::Result> views, uly_result** results,
                          int32_t* num_results) {
  if (views.size() > ULY_MAX_FUSED_RESULTS)
    return absl::InternalError(StrCat(views.size(), " results from one fused call"));
  if (num_results != nullptr) *num_results = static_cast<int32_t>(views.size());
  if (results == nullptr) return absl::OkStatus();  // out given: the views hold nothing
  auto released = std::make_shared<std::atomic<bool>>(false);
  for (size_t i = 0; i < views.size(); ++i)
    results[i] = NewResult(state, std::move(views[i]), released);
  return absl::OkStatus();
}

void ClearFusedResults(uly_result** results, int32_t* num_results) {
  if (results != nullptr)
    for (int i = 0; i < ULY_MAX_FUSED_RESULTS; ++i) results[i] = nullptr;
  if (num_results != nullptr) *num_results = 0;
}

}  // namespace

uly_status uly_session_qkv_norm_rope_exchange(uly_session* session, const uly_fused_call_args* args,
                                              uly_result** results, int32_t* num_results) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(session, "session"));
    ClearFusedResults(results, num_results);
    ULY_ASSIGN_OR_RETURN(FusedOperands o, ToFusedOperands(*session->state, args));
    if (results == nullptr && !o.out.present())
      return absl::InvalidArgumentError("results: NULL, but the call has no out");
    uc::Session& s = *session->state->session;
    s.set_stream(args->stream);
    ULY_ASSIGN_OR_RETURN(std::vector<uc::Result> views,
                         s.QkvNormRopeExchange(o.x, o.positions, o.batch, o.seq_local, o.out));
    return FusedResults(session->state, std::move(views), results, num_results);
  });
}

uly_status uly_session_qkv_norm_rope_submit(uly_session* session, const uly_fused_call_args* args,
                                            uint64_t* epoch) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(session, "session"));
    ULY_RETURN_IF_ERROR(NotNull(epoch, "epoch"));
    ULY_ASSIGN_OR_RETURN(FusedOperands o, ToFusedOperands(*session->state, args));
    uc::Session& s = *session->state->session;
    s.set_stream(args->stream);
    ULY_ASSIGN_OR_RETURN(*epoch, s.SubmitQkvNormRopeExchange(o.x, o.positions, o.batch,
                                                             o.seq_local, o.out));
    return absl::OkStatus();
  });
}

uly_status uly_session_qkv_norm_rope_wait(uly_session* session, uint64_t epoch,
                                          int64_t timeout_ms, uly_result** results,
                                          int32_t* num_results) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(session, "session"));
    ClearFusedResults(results, num_results);
    ULY_ASSIGN_OR_RETURN(const absl::Duration timeout, WaitTimeout(timeout_ms));
    ULY_ASSIGN_OR_RETURN(std::vector<uc::Result> views,
                         session->state->session->WaitQkvNormRopeExchange(epoch, timeout));
    return FusedResults(session->state, std::move(views), results, num_results);
  });
}

uly_status uly_session_describe(uly_session* session, const char** text) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(session, "session"));
    ULY_RETURN_IF_ERROR(NotNull(text, "text"));
    *text = "";
    ULY_ASSIGN_OR_RETURN(session->state->described, session->state->session->Describe());
    *text = session->state->described.c_str();
    return absl::OkStatus();
  });
}

uly_status uly_result_get_info(const uly_result* result, uly_result_info* info) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(result, "result"));
    ULY_RETURN_IF_ERROR(NotNull(info, "info"));
    ULY_RETURN_IF_ERROR(CheckStructSize(info->struct_size, sizeof(uly_result_info), "info"));
    const uint32_t size = info->struct_size;
    std::memset(info, 0, sizeof(uly_result_info));
    info->struct_size = size;
    std::lock_guard<std::mutex> lock(result->mu);
    const uc::Result& res = result->result;
    info->slot = res.slot;
    info->epoch = res.epoch;
    info->device_kind = res.device ? ULY_DEVICE_CUDA : ULY_DEVICE_HOST;
    info->dtype = static_cast<int32_t>(result->session->session->geometry().dtype);
    info->ndim = 4;
    const bool held = result->held();
    info->held = held ? 1 : 0;
    ContiguousExtents(res.shape, info->shape, info->strides);
    // A result copied to `out` (or released) describes no readable data.
    info->data = held ? res.data : nullptr;
    info->bytes = held ? res.bytes : 0;
    info->daemon_us = res.daemon_us;
    return absl::OkStatus();
  });
}

uly_status uly_result_release(uly_result* result) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(result, "result"));
    std::lock_guard<std::mutex> lock(result->mu);
    // One release gives a fused call's slot back for all its results.
    if (result->siblings_released) result->siblings_released->store(true);
    return result->result.Release();
  });
}

void uly_result_free(uly_result* result) {
  if (result == nullptr) return;
  if (result->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;  // a DLPack tensor lives
  // A fused call's result shares its slot with the others of the call: dropping this handle
  // keeps the slot held for them (the last one's drop releases it).
  if (!result->siblings_released) (void)uly_result_release(result);
  delete result;
}

uly_status uly_result_to_dlpack(uly_result* result, void** managed) {
  return Guard([&]() -> absl::Status {
    ULY_RETURN_IF_ERROR(NotNull(result, "result"));
    ULY_RETURN_IF_ERROR(NotNull(managed, "managed"));
    *managed = nullptr;
    auto t = std::make_unique<DlpackTensor>();
    {
      std::lock_guard<std::mutex> lock(result->mu);
      if (!result->held())
        return absl::FailedPreconditionError(
            "result: holds no slot (released, or copied to out): nothing to view");
      const uc::Result& res = result->result;
      ULY_ASSIGN_OR_RETURN(t->managed.dl_tensor.dtype,
                           DlpackDType(result->session->session->geometry().dtype));
      DLDevice device{kDLCPU, 0};
      if (res.device) {
        std::atomic<int>& known = result->session->slot_device;
        int ordinal = known.load(std::memory_order_relaxed);
        if (ordinal < 0) {
          ULY_ASSIGN_OR_RETURN(ulysses::ipc::cuda::AllocationInfo a,
                               ulysses::ipc::cuda::QueryAllocation(res.data));
          ordinal = a.device;
          known.store(ordinal, std::memory_order_relaxed);
        }
        device = DLDevice{kDLCUDA, ordinal};
      }
      ContiguousExtents(res.shape, t->shape, t->strides);
      DLTensor& dl = t->managed.dl_tensor;
      dl.data = const_cast<void*>(res.data);
      dl.device = device;
      dl.ndim = 4;
      dl.shape = t->shape;
      dl.strides = t->strides;
      dl.byte_offset = 0;
    }
    t->managed.manager_ctx = result;
    t->managed.deleter = [](DLManagedTensor* self) {
      auto* owner = reinterpret_cast<DlpackTensor*>(self);  // managed is its first member
      uly_result_free(static_cast<uly_result*>(self->manager_ctx));
      delete owner;
    };
    result->refs.fetch_add(1, std::memory_order_acq_rel);
    *managed = &t.release()->managed;
    return absl::OkStatus();
  });
}

void uly_dlpack_free(void* managed) {
  if (managed == nullptr) return;
  auto* m = static_cast<DLManagedTensor*>(managed);
  if (m->deleter != nullptr) m->deleter(m);
}

uly_status uly_stream_wait(void* consumer, void* producer) {
  return Guard([&]() -> absl::Status {
    if (!ulysses::ipc::cuda::Built())
      return absl::UnimplementedError("uly_stream_wait: the library was built without CUDA");
    return ulysses::ipc::cuda::StreamWaitStream(consumer, producer);
  });
}

}  // extern "C"
