#include "exchange_plan.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "exchange_check.h"
#include "ulysses/common/status.h"

namespace ulysses::kernels::internal {
namespace {

constexpr int64_t kVectorBytes = 16;

// A plan in element units, before the unit width is chosen.
struct ElemPlan {
  const void* src;
  void* dst;
  int64_t src_base;  // elements added to src
  int64_t dst_base;
  int64_t extent[4];
  int64_t src_coef[4];
  int64_t dst_coef[4];
  int64_t row_elems;
  int64_t src_elem_step;
  int64_t dst_elem_step;
  int64_t itemsize;
};

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kVectorBytes == 0; }

// Picks 16-byte units when every row start on both sides is 16-byte aligned and rows are
// contiguous multiples of 16 bytes; the scalar path (one element per unit) otherwise. A level
// of extent 1 never moves the address, so its coefficient does not matter.
RowCopyPlan Finish(const ElemPlan& e) {
  RowCopyPlan p{};
  p.src = static_cast<const char*>(e.src) + e.src_base * e.itemsize;
  p.dst = static_cast<char*>(e.dst) + e.dst_base * e.itemsize;
  p.rows = 1;
  for (int k = 0; k < 4; ++k) {
    p.extent[k] = e.extent[k];
    p.src_coef[k] = e.src_coef[k] * e.itemsize;
    p.dst_coef[k] = e.dst_coef[k] * e.itemsize;
    p.rows *= e.extent[k];
  }
  const int64_t row_bytes = e.row_elems * e.itemsize;
  bool vector = row_bytes % kVectorBytes == 0 && e.src_elem_step == 1 && e.dst_elem_step == 1 &&
                Aligned(p.src) && Aligned(p.dst);
  for (int k = 0; k < 4 && vector; ++k) {
    if (p.extent[k] > 1 &&
        (p.src_coef[k] % kVectorBytes != 0 || p.dst_coef[k] % kVectorBytes != 0)) {
      vector = false;
    }
  }
  if (vector) {
    p.unit_bytes = static_cast<int32_t>(kVectorBytes);
    p.units_per_row = row_bytes / kVectorBytes;
    p.src_unit_step = kVectorBytes;
    p.dst_unit_step = kVectorBytes;
  } else {
    p.unit_bytes = static_cast<int32_t>(e.itemsize);
    p.units_per_row = e.row_elems;
    p.src_unit_step = e.src_elem_step * e.itemsize;
    p.dst_unit_step = e.dst_elem_step * e.itemsize;
  }
  p.lanes = 1;
  while (p.lanes < 32 && p.lanes < p.units_per_row) p.lanes *= 2;
  return p;
}

absl::Status CheckBlock(const ExchangeShape& shape, int src, int dst, absl::string_view in_name,
                        ConstView in, absl::string_view out_name, const void* out) {
  ULY_RETURN_IF_ERROR(CheckShape(shape));
  ULY_RETURN_IF_ERROR(CheckRanks(shape, src, dst));
  ULY_RETURN_IF_ERROR(CheckView(in_name, in.data, in.stride));
  return CheckPointer(out_name, out);
}

}  // namespace

absl::StatusOr<RowCopyPlan> PlanScatterHeadsBlock(const ExchangeShape& shape, ConstView x_src,
                                                  int src, int dst, void* out_dst) {
  ULY_RETURN_IF_ERROR(CheckBlock(shape, src, dst, "x_src", x_src, "out_dst", out_dst));
  const int64_t hl = LocalHeads(shape), d = shape.head_dim, sl = shape.seq_local;
  const int64_t sg = GlobalSeq(shape);
  const int64_t* st = x_src.stride;
  // Rows (b, s, 1, h): x_src[b, s, dst*H_l + h, :] -> out_dst[b, src*S_l + s, h, :].
  return Finish(ElemPlan{x_src.data,
                         out_dst,
                         dst * hl * st[2],
                         src * sl * hl * d,
                         {shape.batch, sl, 1, hl},
                         {st[0], st[1], 0, st[2]},
                         {sg * hl * d, hl * d, 0, d},
                         d,
                         st[3],
                         1,
                         shape.itemsize});
}

absl::StatusOr<RowCopyPlan> PlanGatherHeadsBlock(const ExchangeShape& shape, ConstView y_src,
                                                 int src, int dst, void* out_dst) {
  ULY_RETURN_IF_ERROR(CheckBlock(shape, src, dst, "y_src", y_src, "out_dst", out_dst));
  const int64_t hl = LocalHeads(shape), d = shape.head_dim, sl = shape.seq_local;
  const int64_t h = shape.heads;
  const int64_t* st = y_src.stride;
  // Rows (b, s, 1, h): y_src[b, dst*S_l + s, h, :] -> out_dst[b, s, src*H_l + h, :].
  return Finish(ElemPlan{y_src.data,
                         out_dst,
                         dst * sl * st[1],
                         src * hl * d,
                         {shape.batch, sl, 1, hl},
                         {st[0], st[1], 0, st[2]},
                         {sl * h * d, h * d, 0, d},
                         d,
                         st[3],
                         1,
                         shape.itemsize});
}

absl::StatusOr<RowCopyPlan> PlanScatterQkvHeadChunkPart(const ExchangeShape& shape,
                                                        ConstView part_view, int part,
                                                        int32_t head_offset, int32_t head_count,
                                                        int src, int dst, void* out_dst) {
  static constexpr const char* kNames[3] = {"q", "k", "v"};
  if (part < 0 || part > 2) {
    return absl::InvalidArgumentError(absl::StrCat("part must be 0, 1 or 2, got ", part));
  }
  ULY_RETURN_IF_ERROR(CheckBlock(shape, src, dst, kNames[part], part_view, "out_dst", out_dst));
  ULY_RETURN_IF_ERROR(CheckHeadBand(shape, head_offset, head_count));
  const int64_t hl = LocalHeads(shape), d = shape.head_dim, sl = shape.seq_local;
  const int64_t sg = GlobalSeq(shape), hc = head_count;
  const int64_t* st = part_view.stride;
  // Rows (b, s, 1, hc): part[b, s, dst*H_l + head_offset + hc, :] ->
  // out_dst[b, src*S_l + s, hc, part*D : (part+1)*D].
  return Finish(ElemPlan{part_view.data,
                         out_dst,
                         (dst * hl + head_offset) * st[2],
                         src * sl * hc * 3 * d + part * d,
                         {shape.batch, sl, 1, hc},
                         {st[0], st[1], 0, st[2]},
                         {sg * hc * 3 * d, hc * 3 * d, 0, 3 * d},
                         d,
                         st[3],
                         1,
                         shape.itemsize});
}

absl::StatusOr<RowCopyPlan> PlanGatherOutputHeadChunkBlock(const ExchangeShape& shape,
                                                           ConstView x_src, int32_t head_count,
                                                           int src, int dst, void* stage_dst) {
  ULY_RETURN_IF_ERROR(CheckBlock(shape, src, dst, "x_src", x_src, "stage_dst", stage_dst));
  ULY_RETURN_IF_ERROR(CheckHeadBand(shape, 0, head_count));
  const int64_t d = shape.head_dim, sl = shape.seq_local, w = shape.world, hc = head_count;
  const int64_t* st = x_src.stride;
  // Rows (b, s, 1, hc): x_src[b, dst*S_l + s, hc, :] -> stage_dst[b, s, src, hc, :].
  return Finish(ElemPlan{x_src.data,
                         stage_dst,
                         dst * sl * st[1],
                         src * hc * d,
                         {shape.batch, sl, 1, hc},
                         {st[0], st[1], 0, st[2]},
                         {sl * w * hc * d, w * hc * d, 0, d},
                         d,
                         st[3],
                         1,
                         shape.itemsize});
}

absl::StatusOr<RowCopyPlan> PlanGatherOutputHeadChunkMerge(const ExchangeShape& shape,
                                                           const void* stage, int32_t head_offset,
                                                           int32_t head_count, MutView out) {
  ULY_RETURN_IF_ERROR(CheckShape(shape));
  ULY_RETURN_IF_ERROR(CheckHeadBand(shape, head_offset, head_count));
  ULY_RETURN_IF_ERROR(CheckPointer("stage", stage));
  ULY_RETURN_IF_ERROR(CheckView("out", out.data, out.stride));
  const int64_t hl = LocalHeads(shape), d = shape.head_dim, sl = shape.seq_local;
  const int64_t w = shape.world, hc = head_count;
  const int64_t* st = out.stride;
  // Rows (b, s, w, hc): stage[b, s, w, hc, :] -> out[b, s, w*H_l + head_offset + hc, :].
  return Finish(ElemPlan{stage,
                         out.data,
                         0,
                         head_offset * st[2],
                         {shape.batch, sl, w, hc},
                         {sl * w * hc * d, w * hc * d, hc * d, d},
                         {st[0], st[1], hl * st[2], st[2]},
                         d,
                         1,
                         st[3],
                         shape.itemsize});
}

absl::StatusOr<RowCopyPlan> PlanCopyContiguousToView(const void* src, const int64_t shape[4],
                                                     int32_t itemsize, MutView dst) {
  ULY_RETURN_IF_ERROR(CheckCopyShape(shape, itemsize));
  ULY_RETURN_IF_ERROR(CheckPointer("src", src));
  ULY_RETURN_IF_ERROR(CheckView("dst", dst.data, dst.stride));
  const int64_t n1 = shape[1], n2 = shape[2], n3 = shape[3];
  const int64_t* st = dst.stride;
  return Finish(ElemPlan{src,
                         dst.data,
                         0,
                         0,
                         {shape[0], n1, n2, 1},
                         {n1 * n2 * n3, n2 * n3, n3, 0},
                         {st[0], st[1], st[2], 0},
                         n3,
                         1,
                         st[3],
                         itemsize});
}

absl::StatusOr<RowCopyPlan> PlanCopyViewToContiguous(ConstView src, const int64_t shape[4],
                                                     int32_t itemsize, void* dst) {
  ULY_RETURN_IF_ERROR(CheckCopyShape(shape, itemsize));
  ULY_RETURN_IF_ERROR(CheckView("src", src.data, src.stride));
  ULY_RETURN_IF_ERROR(CheckPointer("dst", dst));
  const int64_t n1 = shape[1], n2 = shape[2], n3 = shape[3];
  const int64_t* st = src.stride;
  return Finish(ElemPlan{src.data,
                         dst,
                         0,
                         0,
                         {shape[0], n1, n2, 1},
                         {st[0], st[1], st[2], 0},
                         {n1 * n2 * n3, n2 * n3, n3, 0},
                         n3,
                         st[3],
                         1,
                         itemsize});
}

namespace {

// A packed block's rows back to back in row-major order of the plan's grid; the head-chunk
// scatter's parts follow each other. Byte coefficients of `p`'s rows in that form.
void PackedCoefs(const RowCopyPlan& p, int64_t coef[4]) {
  coef[3] = p.units_per_row * p.unit_bytes;
  coef[2] = p.extent[3] * coef[3];
  coef[1] = p.extent[2] * coef[2];
  coef[0] = p.extent[1] * coef[1];
}

int64_t PackedPlanBytes(const RowCopyPlan& p) { return p.rows * p.units_per_row * p.unit_bytes; }

absl::Status CheckPacked(const void* packed) {
  ULY_RETURN_IF_ERROR(CheckPointer("packed", packed));
  if (!Aligned(packed)) return absl::InvalidArgumentError("packed: must be 16-byte aligned");
  return absl::OkStatus();
}

// The unpack plans replace the source side, so the source views only need to be valid: the
// contiguous layout of what each kind reads stands in for the remote rank's view.
BlockOperands StandInSources(const ExchangeShape& shape, const BlockOperands& ops,
                             const void* data) {
  const int64_t d = shape.head_dim;
  int64_t n1 = shape.seq_local, n2 = shape.heads;  // x, q, k, v: [B, S_l, H, D]
  if (ops.kind == BlockKind::kGatherHeads) {
    n1 = GlobalSeq(shape);
    n2 = LocalHeads(shape);
  } else if (ops.kind == BlockKind::kGatherOutputHeadChunk) {
    n1 = GlobalSeq(shape);
    n2 = ops.head_count;
  }
  BlockOperands out = ops;
  for (ConstView& v : out.inputs) v = ContiguousConstView(data, n1, n2, d);
  return out;
}

}  // namespace

absl::StatusOr<BlockPlans> PlanBlock(const ExchangeShape& shape, const BlockOperands& ops,
                                     int src, int dst, void* out_dst) {
  BlockPlans out;
  switch (ops.kind) {
    case BlockKind::kScatterHeads: {
      ULY_ASSIGN_OR_RETURN(out.plans[0],
                           PlanScatterHeadsBlock(shape, ops.inputs[0], src, dst, out_dst));
      out.count = 1;
      return out;
    }
    case BlockKind::kGatherHeads: {
      ULY_ASSIGN_OR_RETURN(out.plans[0],
                           PlanGatherHeadsBlock(shape, ops.inputs[0], src, dst, out_dst));
      out.count = 1;
      return out;
    }
    case BlockKind::kScatterQkvHeadChunk: {
      for (int part = 0; part < 3; ++part) {
        ULY_ASSIGN_OR_RETURN(out.plans[part], PlanScatterQkvHeadChunkPart(
                                                  shape, ops.inputs[part], part, ops.head_offset,
                                                  ops.head_count, src, dst, out_dst));
      }
      out.count = 3;
      return out;
    }
    case BlockKind::kGatherOutputHeadChunk: {
      ULY_ASSIGN_OR_RETURN(out.plans[0], PlanGatherOutputHeadChunkBlock(
                                             shape, ops.inputs[0], ops.head_count, src, dst, out_dst));
      out.count = 1;
      return out;
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("kind: unknown block kind ", static_cast<int32_t>(ops.kind)));
}

absl::StatusOr<int64_t> PackedBlockBytes(const ExchangeShape& shape, const BlockOperands& ops) {
  ULY_RETURN_IF_ERROR(CheckShape(shape));
  const int64_t rows = shape.batch * shape.seq_local;
  const int64_t row = int64_t{shape.head_dim} * shape.itemsize;
  switch (ops.kind) {
    case BlockKind::kScatterHeads:
    case BlockKind::kGatherHeads:
      return rows * LocalHeads(shape) * row;
    case BlockKind::kScatterQkvHeadChunk:
      ULY_RETURN_IF_ERROR(CheckHeadBand(shape, ops.head_offset, ops.head_count));
      return 3 * rows * ops.head_count * row;
    case BlockKind::kGatherOutputHeadChunk:
      ULY_RETURN_IF_ERROR(CheckHeadBand(shape, 0, ops.head_count));
      return rows * ops.head_count * row;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("kind: unknown block kind ", static_cast<int32_t>(ops.kind)));
}

absl::StatusOr<BlockPlans> PlanPackBlock(const ExchangeShape& shape, const BlockOperands& ops,
                                         int src, int dst, void* packed) {
  ULY_RETURN_IF_ERROR(CheckPacked(packed));
  // Planned into `packed` as if it were the destination's buffer, then the destination side
  // is replaced by the packed rows. A vector plan stays valid: packed rows are multiples of
  // its row bytes, which are multiples of 16.
  ULY_ASSIGN_OR_RETURN(BlockPlans out, PlanBlock(shape, ops, src, dst, packed));
  int64_t at = 0;
  for (int i = 0; i < out.count; ++i) {
    RowCopyPlan& p = out.plans[i];
    p.dst = static_cast<char*>(packed) + at;
    PackedCoefs(p, p.dst_coef);
    p.dst_unit_step = p.unit_bytes;
    at += PackedPlanBytes(p);
  }
  return out;
}

absl::StatusOr<BlockPlans> PlanUnpackBlock(const ExchangeShape& shape, const BlockOperands& ops,
                                           int src, int dst, const void* packed, void* out_dst) {
  ULY_RETURN_IF_ERROR(CheckPacked(packed));
  ULY_ASSIGN_OR_RETURN(BlockPlans out,
                       PlanBlock(shape, StandInSources(shape, ops, packed), src, dst, out_dst));
  int64_t at = 0;
  for (int i = 0; i < out.count; ++i) {
    RowCopyPlan& p = out.plans[i];
    p.src = static_cast<const char*>(packed) + at;
    PackedCoefs(p, p.src_coef);
    p.src_unit_step = p.unit_bytes;
    at += PackedPlanBytes(p);
  }
  return out;
}

void RunPlanOnHost(const RowCopyPlan& plan) {
  const auto* src = static_cast<const char*>(plan.src);
  auto* dst = static_cast<char*>(plan.dst);
  for (int64_t row = 0; row < plan.rows; ++row) {
    const RowOffsets o = RowAt(plan, row);
    for (int64_t u = 0; u < plan.units_per_row; ++u) {
      std::memcpy(dst + o.dst + u * plan.dst_unit_step, src + o.src + u * plan.src_unit_step,
                  static_cast<size_t>(plan.unit_bytes));
    }
  }
}

}  // namespace ulysses::kernels::internal

namespace ulysses::kernels {

absl::StatusOr<int64_t> PackedBlockBytes(const ExchangeShape& shape, const BlockOperands& ops) {
  return internal::PackedBlockBytes(shape, ops);
}

}  // namespace ulysses::kernels
