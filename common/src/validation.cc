// PlanCall: the one verdict on a call, computed identically by the client (before it submits)
// and by the daemon (which never trusts the client).
#include <algorithm>

#include "ulysses/common/strings.h"
#include "ulysses/common/geometry.h"
#include "ulysses/common/status.h"

namespace ulysses {
namespace {

absl::Status Invalid(std::string_view arg, std::string_view what) {
  return absl::InvalidArgumentError(StrCat(arg, ": ", what));
}

bool MulOverflow(int64_t a, int64_t b, int64_t* out) { return __builtin_mul_overflow(a, b, out); }

// Checks strides, alignment and bounds of one operand and fills in the resolved view.
absl::StatusOr<ResolvedOperand> ResolveOperand(std::string_view name, const OperandRef& ref,
                                               const std::array<int64_t, 4>& shape,
                                               int32_t itemsize, const BufferResolver& buffers,
                                               bool must_not_self_overlap) {
  if (!ref.present()) return Invalid(name, "operand is required (buffer_id 0)");
  ResolvedOperand r;
  r.buffer_id = ref.buffer_id;
  r.offset_bytes = ref.offset_bytes;
  r.shape = shape;
  const bool contiguous = std::all_of(ref.strides.begin(), ref.strides.end(),
                                      [](int64_t s) { return s == 0; });
  if (contiguous) {
    r.strides[3] = 1;
    for (int i = 2; i >= 0; --i) r.strides[i] = r.strides[i + 1] * shape[i + 1];
  } else {
    for (int i = 0; i < 4; ++i) {
      if (ref.strides[i] <= 0)
        return Invalid(name, StrCat("strides must be positive, strides[", i,
                                          "] = ", ref.strides[i]));
    }
    r.strides = ref.strides;
  }
  int64_t max_off = 0;
  for (int i = 0; i < 4; ++i) {
    int64_t term = 0;
    if (MulOverflow(shape[i] - 1, r.strides[i], &term) ||
        __builtin_add_overflow(max_off, term, &max_off))
      return Invalid(name, "element offsets overflow 64 bits");
  }
  int64_t span = 0, count = 0;
  if (__builtin_add_overflow(max_off, int64_t{1}, &count) || MulOverflow(count, itemsize, &span))
    return Invalid(name, "byte span overflows 64 bits");
  r.span_bytes = static_cast<uint64_t>(span);
  if (ref.offset_bytes % static_cast<uint64_t>(itemsize) != 0)
    return Invalid(name, StrCat("offset_bytes ", ref.offset_bytes,
                                      " is not a multiple of the itemsize ", itemsize));
  if (must_not_self_overlap && !contiguous) {
    // Sorted by stride, each dimension must step past everything the inner ones cover, or two
    // indices would write the same element.
    std::array<int, 4> order{0, 1, 2, 3};
    std::sort(order.begin(), order.end(),
              [&](int a, int b) { return r.strides[a] < r.strides[b]; });
    int64_t covered = 1;
    for (int i : order) {
      if (shape[i] == 1) continue;
      if (r.strides[i] < covered)
        return Invalid(name, "strides make elements overlap; an output view must not overlap "
                             "itself");
      covered = r.strides[i] * shape[i];
    }
  }
  absl::StatusOr<BufferInfo> info = buffers.Resolve(ref.buffer_id);
  if (!info.ok())
    return absl::Status(info.status().code(), StrCat(name, ": ", info.status().message()));
  if (ref.offset_bytes > info->size_bytes || r.span_bytes > info->size_bytes - ref.offset_bytes)
    return Invalid(name, StrCat("bytes [", ref.offset_bytes, ", ",
                                      ref.offset_bytes + r.span_bytes, ") exceed buffer ",
                                      ref.buffer_id, " of ", info->size_bytes, " bytes"));
  return r;
}

bool Overlaps(const ResolvedOperand& a, const ResolvedOperand& b) {
  if (a.buffer_id != b.buffer_id) return false;
  return a.offset_bytes < b.offset_bytes + b.span_bytes &&
         b.offset_bytes < a.offset_bytes + a.span_bytes;
}

}  // namespace

absl::StatusOr<CallPlan> PlanCall(const SessionGeometry& g, const CallArgs& args,
                                  const BufferResolver& buffers) {
  const int64_t W = g.world_size;
  const int64_t H = g.num_heads;
  const int64_t HL = g.local_heads();
  const int64_t D = g.head_dim;
  CallPlan p;
  p.op = args.op;
  if (args.op == OpKind::kQkvNormRopeExchange)
    return Invalid("op", "qkv_norm_rope_exchange is the op of a qkv_norm_rope_exchange session, "
                         "not of a head_exchange session");
  if (!IsHeadExchangeOp(args.op))
    return Invalid("op", StrCat("unknown operation ", static_cast<int>(args.op)));
  const OpTraits& op = Traits(args.op);
  if (args.batch <= 0) return Invalid("batch", StrCat("must be > 0, got ", args.batch));
  if (args.seq <= 0) return Invalid("seq", StrCat("must be > 0, got ", args.seq));
  const bool gather = op.input_global;
  if (gather && args.seq % W != 0)
    return Invalid("seq", StrCat("S_g=", args.seq, " must be divisible by world_size W=", W));
  p.batch = args.batch;
  p.seq_local = gather ? args.seq / W : args.seq;
  const int64_t B = p.batch, SL = p.seq_local;
  int64_t SG = 0;  // S_g = S_l * W, which a huge seq overflows
  if (MulOverflow(SL, W, &SG))
    return Invalid("seq", StrCat("S_l=", SL, " times world_size W=", W, " overflows 64 bits"));
  int64_t HC = HL;
  if (op.head_chunk) {
    if (args.head_count <= 0)
      return Invalid("head_count", StrCat("must be > 0, got ", args.head_count));
    if (args.head_offset < 0)
      return Invalid("head_offset", StrCat("must be >= 0, got ", args.head_offset));
    const int64_t band_end = static_cast<int64_t>(args.head_offset) + args.head_count;
    if (band_end > HL)
      return Invalid("head_count", StrCat("head_offset+head_count=", band_end,
                                          " exceeds local_heads H/W=", HL));
    p.head_offset = args.head_offset;
    p.head_count = args.head_count;
    HC = args.head_count;
  }
  // int32 limits of the kernels: every operand's element count and the exchanged payload.
  int64_t tokens = 0, payload = 0;
  if (MulOverflow(B, SL, &tokens)) return Invalid("batch", "batch*seq overflows");
  std::array<int64_t, 4> in_shape{}, out_shape{};
  int64_t slot_elems = 0;
  // HC is H_l unless the op takes a band (OpTraits).
  if (op.input_global) {
    in_shape = {B, SG, HC, D};
    out_shape = {B, SL, H, D};
  } else {
    in_shape = {B, SL, H, D};
    out_shape = {B, SG, HC, op.width * D};
  }
  for (int64_t d : {in_shape[0], in_shape[1], in_shape[2], in_shape[3]}) {
    if (__builtin_mul_overflow(payload == 0 ? 1 : payload, d, &payload))
      return Invalid("seq", "operand size overflows 64 bits");
  }
  if (payload > kInt32Max)
    return Invalid(InputNames(args.op)[0], StrCat("numel ", payload,
                                                        " exceeds the int32 limit ", kInt32Max));
  // Exchanged payload: what this rank sends, W blocks of its share.
  const int64_t width = op.width * D;
  const int64_t send_heads = HC;
  int64_t send = 0;
  if (MulOverflow(tokens, W * send_heads * width, &send) || send > kInt32Max)
    return Invalid("seq", StrCat("exchanged payload B*S_l*W*", send_heads, "*", width,
                                       " exceeds the int32 limit ", kInt32Max));
  if (tokens > g.max_tokens)
    return absl::ResourceExhaustedError(StrCat(
        "capacity: batch*seq_local = ", tokens, " exceeds the session's max_tokens ",
        g.max_tokens));
  // The slot holds the result, or the received blocks that a merge writes into out.
  const std::array<int64_t, 4>& held = op.merges_into_out ? in_shape : out_shape;
  slot_elems = held[0] * held[1] * held[2] * held[3];
  p.out_shape = out_shape;
  p.slot_elems = slot_elems;

  const int32_t itemsize = g.itemsize();
  // The traits' own names: planning a call allocates nothing.
  const std::array<std::string_view, 3>& names = Traits(args.op).inputs;
  p.num_inputs = Traits(args.op).num_inputs;
  for (int i = 0; i < p.num_inputs; ++i) {
    ULY_ASSIGN_OR_RETURN(p.inputs[i], ResolveOperand(names[i], args.inputs[i], in_shape, itemsize,
                                                     buffers, /*must_not_self_overlap=*/false));
  }
  for (int i = p.num_inputs; i < 3; ++i) {
    if (args.inputs[i].present())
      return Invalid("inputs", StrCat(OpName(args.op), " takes ", p.num_inputs,
                                            " input(s), got an operand in position ", i));
  }
  const bool out_required = op.merges_into_out;
  if (out_required && !args.out.present())
    return Invalid("out", "gather_output_head_chunk requires an out tensor [B,S_l,H,D]");
  if (args.out.present()) {
    ULY_ASSIGN_OR_RETURN(p.out, ResolveOperand("out", args.out, out_shape, itemsize, buffers,
                                               /*must_not_self_overlap=*/true));
    p.has_out = true;
    for (int i = 0; i < p.num_inputs; ++i) {
      if (Overlaps(p.out, p.inputs[i]))
        return Invalid("out", StrCat("overlaps input ", names[i],
                                           " (same buffer, overlapping bytes)"));
    }
  }
  return p;
}

}  // namespace ulysses
