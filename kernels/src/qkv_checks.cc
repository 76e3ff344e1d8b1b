#include "qkv_checks.h"

#include "absl/strings/str_cat.h"
#include "ulysses/common/status.h"

namespace ulysses::kernels::internal {

absl::Status CheckAligned(absl::string_view name, const void* p) {
  if (p == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, " is null"));
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
    return absl::InvalidArgumentError(absl::StrCat(name, " is not 16-byte aligned"));
  return absl::OkStatus();
}

absl::Status CheckShapeAndRows(const QkvNormRopeShape& s, int64_t row_begin, int64_t row_end) {
  if (s.world < 1 || s.world > kMaxWorldSize)
    return absl::InvalidArgumentError(
        absl::StrCat("world ", s.world, " is not in [1, ", kMaxWorldSize, "]"));
  if (s.heads <= 0 || s.heads % s.world != 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "heads (", s.heads, ") must be positive and divisible by world (", s.world, ")"));
  if (s.head_dim != kFusedGpuHeadDim)
    return absl::InvalidArgumentError(absl::StrCat(
        "head_dim must be ", kFusedGpuHeadDim, " for the CUDA kernels, got ", s.head_dim));
  if (s.batch <= 0 || s.seq_local <= 0 || s.max_pos <= 0)
    return absl::InvalidArgumentError("batch, seq_local and max_pos must be positive");
  const int64_t rows = QkvRows(s);
  if (rows * QkvFeatures(s) > kInt32Max)
    return absl::InvalidArgumentError("B*S_l*3*H*D exceeds the int32 limit");
  if (row_begin < 0 || row_end > rows || row_begin >= row_end)
    return absl::InvalidArgumentError(absl::StrCat(
        "rows [", row_begin, ", ", row_end, ") are not a non-empty range in [0, ", rows, ")"));
  return absl::OkStatus();
}

absl::Status CheckWeights(const QkvWeights& w, const int32_t* positions) {
  ULY_RETURN_IF_ERROR(CheckAligned("q_norm", w.q_norm));
  ULY_RETURN_IF_ERROR(CheckAligned("k_norm", w.k_norm));
  ULY_RETURN_IF_ERROR(CheckAligned("cos_sin", w.cos_sin));
  if (positions == nullptr) return absl::InvalidArgumentError("positions is null");
  return absl::OkStatus();
}

absl::Status CheckDestinations(const QkvNormRopeShape& s, QkvLayout layout, int src,
                               const QkvDestinations& dests, const void* counter) {
  if (layout != QkvLayout::kBshd && layout != QkvLayout::kFused)
    return absl::InvalidArgumentError("layout must be bshd or fused");
  if (src < 0 || src >= s.world)
    return absl::InvalidArgumentError(
        absl::StrCat("src rank ", src, " is outside [0, ", s.world, ")"));
  if (dests.out == nullptr) return absl::InvalidArgumentError("dests.out is null");
  if (dests.ready != nullptr && counter == nullptr)
    return absl::InvalidArgumentError("counter is null but dests.ready is set");
  for (int d = 0; d < s.world; ++d)
    ULY_RETURN_IF_ERROR(CheckAligned(absl::StrCat("dests.out[", d, "]"), dests.out[d]));
  return absl::OkStatus();
}

}  // namespace ulysses::kernels::internal
