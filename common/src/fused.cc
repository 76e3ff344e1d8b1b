// Validation of the fused session and its calls: one verdict for client and daemon.
#include "ulysses/common/fused.h"

#include <algorithm>
#include <cctype>
#include <string>
#include <utility>

#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"

namespace ulysses {
namespace {

absl::Status Invalid(std::string_view arg, std::string_view what) {
  return absl::InvalidArgumentError(StrCat(arg, ": ", what));
}

std::string ShapeText(const int64_t* shape, int rank) {
  std::string out = "[";
  for (int i = 0; i < rank; ++i) out += (i ? "," : "") + std::to_string(shape[i]);
  return out + "]";
}

// Bounds of `bytes` bytes from `offset_bytes` inside buffer `buffer_id`.
absl::Status CheckInBuffer(std::string_view name, uint64_t buffer_id, uint64_t offset_bytes,
                           uint64_t bytes, const BufferResolver& buffers) {
  absl::StatusOr<BufferInfo> info = buffers.Resolve(buffer_id);
  if (!info.ok())
    return absl::Status(info.status().code(), StrCat(name, ": ", info.status().message()));
  if (offset_bytes > info->size_bytes || bytes > info->size_bytes - offset_bytes)
    return Invalid(name, StrCat("bytes [", offset_bytes, ", ", offset_bytes + bytes,
                                ") exceed buffer ", buffer_id, " of ", info->size_bytes, " bytes"));
  return absl::OkStatus();
}

// A contiguous operand of `elems` elements of `itemsize` bytes, aligned to `align`.
absl::Status CheckContiguousOperand(std::string_view name, const OperandRef& ref, int64_t elems,
                                    int32_t itemsize, uint64_t align,
                                    const BufferResolver& buffers) {
  if (!ref.present()) return Invalid(name, "operand is required (buffer_id 0)");
  if (std::any_of(ref.strides.begin(), ref.strides.end(), [](int64_t s) { return s != 0; }))
    return Invalid(name, "must be contiguous (strides all zero)");
  if (ref.offset_bytes % align != 0)
    return Invalid(name,
                   StrCat("offset_bytes ", ref.offset_bytes, " is not ", align, "-byte aligned"));
  return CheckInBuffer(name, ref.buffer_id, ref.offset_bytes,
                       static_cast<uint64_t>(elems) * static_cast<uint64_t>(itemsize), buffers);
}

absl::Status CheckWeight(std::string_view name, const FusedTensorRef& t, DType dtype,
                         std::initializer_list<int64_t> shape, const BufferResolver& buffers) {
  if (t.buffer_id == 0) return Invalid(name, "weight is required (buffer_id 0)");
  if (t.dtype != dtype)
    return Invalid(name, StrCat("dtype is ", DTypeName(t.dtype), ", must be ", DTypeName(dtype)));
  const int rank = static_cast<int>(shape.size());
  if (t.rank != rank || !std::equal(shape.begin(), shape.end(), t.shape.begin()))
    return Invalid(name, StrCat("shape is ", ShapeText(t.shape.data(), std::clamp(t.rank, 0, 4)),
                                ", must be ", ShapeText(shape.begin(), rank)));
  if (t.offset_bytes % kFusedAlignBytes != 0)
    return Invalid(name, StrCat("offset_bytes ", t.offset_bytes, " is not ", kFusedAlignBytes,
                                "-byte aligned"));
  uint64_t bytes = static_cast<uint64_t>(ItemSize(dtype));
  for (int64_t d : shape) bytes *= static_cast<uint64_t>(d);
  return CheckInBuffer(name, t.buffer_id, t.offset_bytes, bytes, buffers);
}

}  // namespace

std::string_view QkvLayoutName(QkvLayout layout) {
  switch (layout) {
    case QkvLayout::kBshd:
      return "bshd";
    case QkvLayout::kFused:
      return "fused";
    default:
      return "unspecified";
  }
}

absl::StatusOr<QkvLayout> ParseQkvLayout(std::string_view name) {
  std::string n(name);
  for (char& ch : n) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (n == "bshd") return QkvLayout::kBshd;
  if (n == "fused") return QkvLayout::kFused;
  return Invalid("layout", StrCat("'", name, "' is not one of bshd, fused"));
}

std::string_view FusedPathName(FusedPath path) {
  switch (path) {
    case FusedPath::kPerOperator:
      return "per_operator";
    case FusedPath::kChunked:
      return "chunked";
    case FusedPath::kEpilogue:
      return "epilogue";
    default:
      return "auto";
  }
}

absl::StatusOr<FusedPath> ParseFusedPath(std::string_view name) {
  for (FusedPath p :
       {FusedPath::kAuto, FusedPath::kPerOperator, FusedPath::kChunked, FusedPath::kEpilogue})
    if (name == FusedPathName(p)) return p;
  return Invalid("path",
                 StrCat("'", name, "' is not one of auto, per_operator, chunked, epilogue"));
}

SessionGeometry SlotGeometry(const FusedGeometry& g) {
  SessionGeometry s;
  s.world_size = g.world_size;
  s.rank = g.rank;
  s.num_heads = g.num_heads;
  s.head_dim = g.head_dim;
  s.dtype = DType::kBFloat16;
  s.max_tokens = g.max_tokens;
  s.num_slots = g.num_slots;
  return s;
}

absl::Status ValidateFusedGeometry(const FusedGeometry& g, FusedImpl impl) {
  if (g.world_size < 1 || g.world_size > kMaxWorldSize)
    return Invalid("world_size", StrCat(g.world_size, " is not in [1, ", kMaxWorldSize, "]"));
  if (g.rank < 0 || g.rank >= g.world_size)
    return Invalid("rank", StrCat(g.rank, " is not in [0, world_size=", g.world_size, ")"));
  if (g.num_heads <= 0) return Invalid("num_heads", StrCat("must be > 0, got ", g.num_heads));
  if (g.num_heads % g.world_size != 0)
    return Invalid("num_heads",
                   StrCat("H=", g.num_heads, " must be divisible by world_size W=", g.world_size));
  if (g.head_dim <= 0 || g.head_dim % 2 != 0)
    return Invalid("head_dim", StrCat("must be positive and even (RoPE pairs), got ", g.head_dim));
  if (impl == FusedImpl::kCuda && g.head_dim != kFusedGpuHeadDim)
    return Invalid("head_dim", StrCat("the CUDA kernels take head_dim ", kFusedGpuHeadDim, ", got ",
                                      g.head_dim));
  if (int64_t{g.num_heads} * g.head_dim != g.hidden)
    return Invalid("hidden", StrCat(g.hidden, " must equal num_heads*head_dim = ", g.num_heads, "*",
                                    g.head_dim));
  if (g.hidden % kFusedHiddenMultiple != 0)
    return Invalid("hidden", StrCat(g.hidden, " must be a multiple of ", kFusedHiddenMultiple));
  if (g.dtype != DType::kBFloat16)
    return Invalid("dtype", StrCat("the fused op takes bfloat16, got ", DTypeName(g.dtype)));
  if (g.layout != QkvLayout::kBshd && g.layout != QkvLayout::kFused)
    return Invalid("layout", "must be bshd or fused");
  if (g.max_tokens <= 0) return Invalid("max_tokens", StrCat("must be > 0, got ", g.max_tokens));
  if (g.num_slots < 1 || g.num_slots > kMaxSlots)
    return Invalid("num_slots", StrCat(g.num_slots, " is not in [1, ", kMaxSlots, "]"));
  if (g.max_pos <= 0) return Invalid("max_pos", StrCat("must be > 0, got ", g.max_pos));
  // The receive slot (and the projection output) is addressed with int32 element counts.
  if (g.max_tokens > kInt32Max / g.qkv_features())
    return Invalid("max_tokens", StrCat(g.max_tokens, " makes a receive slot of 3*max_tokens*H*D",
                                        " elements, over the int32 limit ", kInt32Max));
  return absl::OkStatus();
}

absl::Status ValidateFusedWeights(const FusedGeometry& g, const FusedWeightsArgs& w,
                                  const BufferResolver& buffers) {
  const int64_t d = g.head_dim;
  ULY_RETURN_IF_ERROR(CheckWeight("w_qkv", w.w_qkv, DType::kBFloat16,
                                  {g.qkv_features(), int64_t{g.hidden}}, buffers));
  ULY_RETURN_IF_ERROR(CheckWeight("q_norm", w.q_norm, DType::kBFloat16, {d}, buffers));
  ULY_RETURN_IF_ERROR(CheckWeight("k_norm", w.k_norm, DType::kBFloat16, {d}, buffers));
  return CheckWeight("cos_sin", w.cos_sin, DType::kFloat32, {int64_t{g.max_pos}, d}, buffers);
}

absl::StatusOr<FusedCallPlan> PlanFusedCall(const FusedGeometry& g, const FusedCallArgs& args,
                                            const BufferResolver& buffers) {
  if (args.batch <= 0) return Invalid("batch", StrCat("must be > 0, got ", args.batch));
  if (args.seq_local <= 0) return Invalid("seq_local", StrCat("must be > 0, got ", args.seq_local));
  int64_t rows = 0;
  if (__builtin_mul_overflow(args.batch, args.seq_local, &rows))
    return Invalid("seq_local", "batch*seq_local overflows 64 bits");
  if (rows > g.max_tokens)
    return absl::ResourceExhaustedError(StrCat("capacity: batch*seq_local = ", rows,
                                               " exceeds the session's max_tokens ", g.max_tokens));
  // With rows <= max_tokens, the geometry's slot limit keeps every count within int32.
  FusedCallPlan p;
  p.batch = args.batch;
  p.seq_local = args.seq_local;
  p.rows = rows;
  p.global_seq = args.seq_local * g.world_size;
  const int64_t hl = g.local_heads(), d = g.head_dim;
  p.plane_elems = p.batch * p.global_seq * hl * d;
  p.out_elems = 3 * p.plane_elems;
  if (g.layout == QkvLayout::kFused) {
    p.out_shape = {p.batch, p.global_seq, hl, 3 * d};
  } else {
    p.out_shape = {p.batch, p.global_seq, hl, d};
  }
  ULY_RETURN_IF_ERROR(CheckContiguousOperand("x", args.x, rows * g.hidden, ItemSize(g.dtype),
                                             kFusedAlignBytes, buffers));
  ULY_RETURN_IF_ERROR(CheckContiguousOperand("positions", args.positions, rows, 4, 4, buffers));
  return p;
}

absl::StatusOr<CallPlan> PlanQkvCall(const FusedGeometry& g, const CallArgs& args,
                                     const BufferResolver& buffers,
                                     const FusedWeightsArgs* weights) {
  if (args.op != OpKind::kQkvNormRopeExchange)
    return Invalid("op", StrCat(OpName(args.op), " is not an op of a qkv_norm_rope_exchange ",
                                "session (its op is qkv_norm_rope_exchange)"));
  if (args.head_offset != 0 || args.head_count != 0)
    return Invalid("head_count", "qkv_norm_rope_exchange takes no head band (head_offset and "
                                 "head_count must be 0)");
  if (args.inputs[2].present())
    return Invalid("inputs", "qkv_norm_rope_exchange takes 2 inputs (x, positions), got an "
                             "operand in position 2");
  ULY_ASSIGN_OR_RETURN(const FusedCallPlan f,
                       PlanFusedCall(g, FusedCallArgs{args.batch, args.seq, args.inputs[0],
                                                      args.inputs[1]},
                                     buffers));
  ULY_ASSIGN_OR_RETURN(const BufferInfo pos_buf, buffers.Resolve(args.inputs[1].buffer_id));
  if (pos_buf.host_data != nullptr) {
    const auto* pos = reinterpret_cast<const int32_t*>(
        static_cast<const uint8_t*>(pos_buf.host_data) + args.inputs[1].offset_bytes);
    ULY_RETURN_IF_ERROR(CheckFusedPositions(g, pos, f.rows));
  }
  const int32_t item = ItemSize(g.dtype);
  auto contiguous = [](uint64_t id, uint64_t offset, int64_t elems, int32_t itemsize) {
    ResolvedOperand r;
    r.buffer_id = id;
    r.offset_bytes = offset;
    r.shape = {1, 1, 1, elems};
    r.strides = {elems, elems, elems, 1};
    r.span_bytes = static_cast<uint64_t>(elems) * static_cast<uint64_t>(itemsize);
    return r;
  };
  CallPlan p;
  p.op = OpKind::kQkvNormRopeExchange;
  p.batch = f.batch;
  p.seq_local = f.seq_local;
  p.num_inputs = 2;
  p.inputs[0] = contiguous(args.inputs[0].buffer_id, args.inputs[0].offset_bytes,
                           f.rows * g.hidden, item);
  p.inputs[0].shape = {f.batch, f.seq_local, g.hidden, 1};
  p.inputs[1] = contiguous(args.inputs[1].buffer_id, args.inputs[1].offset_bytes, f.rows, 4);
  p.inputs[1].shape = {f.batch, f.seq_local, 1, 1};
  p.out_shape = f.out_shape;
  p.slot_elems = f.out_elems;
  if (args.out.present()) {
    ULY_RETURN_IF_ERROR(CheckContiguousOperand("out", args.out, f.out_elems, item,
                                               static_cast<uint64_t>(item), buffers));
    p.has_out = true;
    p.out = contiguous(args.out.buffer_id, args.out.offset_bytes, f.out_elems, item);
    auto overlaps = [&](uint64_t id, uint64_t offset, uint64_t bytes) {
      return id == p.out.buffer_id && offset < p.out.offset_bytes + p.out.span_bytes &&
             p.out.offset_bytes < offset + bytes;
    };
    for (int i = 0; i < 2; ++i)
      if (overlaps(p.inputs[i].buffer_id, p.inputs[i].offset_bytes, p.inputs[i].span_bytes))
        return Invalid("out", StrCat("overlaps input ", i == 0 ? "x" : "positions",
                                     " (same buffer, overlapping bytes)"));
    if (weights != nullptr) {
      const std::pair<const char*, const FusedTensorRef*> named[] = {{"w_qkv", &weights->w_qkv},
                                                                     {"q_norm", &weights->q_norm},
                                                                     {"k_norm", &weights->k_norm},
                                                                     {"cos_sin", &weights->cos_sin}};
      for (const auto& [name, w] : named) {
        uint64_t bytes = static_cast<uint64_t>(ItemSize(w->dtype));
        for (int i = 0; i < std::clamp(w->rank, 0, 4); ++i)
          bytes *= static_cast<uint64_t>(w->shape[i]);
        if (overlaps(w->buffer_id, w->offset_bytes, bytes))
          return Invalid("out", StrCat("overlaps the session's weight ", name,
                                       " (same buffer, overlapping bytes)"));
      }
    }
  }
  return p;
}

absl::Status CheckFusedPositions(const FusedGeometry& g, const int32_t* positions, int64_t count) {
  if (positions == nullptr && count > 0) return Invalid("positions", "is null");
  for (int64_t i = 0; i < count; ++i) {
    if (positions[i] < 0 || positions[i] >= g.max_pos)
      return Invalid(StrCat("positions[", i, "]"),
                     StrCat(positions[i], " is not in [0, max_pos=", g.max_pos, ")"));
  }
  return absl::OkStatus();
}

}  // namespace ulysses
