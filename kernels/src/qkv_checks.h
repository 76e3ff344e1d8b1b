// Argument checks shared by the fused QKV op's CUDA launchers (norm_rope.cu, the epilogue-fused
// GEMM): each returns INVALID_ARGUMENT naming the argument, before anything is enqueued.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "ulysses/kernels/qkv_norm_rope.h"
#include "ulysses/kernels/qkv_norm_rope_cuda.h"

namespace ulysses::kernels::internal {

/// `p` is non-null and 16-byte aligned.
absl::Status CheckAligned(absl::string_view name, const void* p);

/// A shape the kernels take (head_dim 128, B*S_l*3*H*D within int32) and a non-empty row
/// range [row_begin, row_end) of it.
absl::Status CheckShapeAndRows(const QkvNormRopeShape& s, int64_t row_begin, int64_t row_end);

/// The norm weights and the cos/sin table aligned, positions non-null.
absl::Status CheckWeights(const QkvWeights& w, const int32_t* positions);

/// The layout, the source rank, every destination buffer of `s.world` aligned, and a counter
/// whenever readiness words are asked for.
absl::Status CheckDestinations(const QkvNormRopeShape& s, QkvLayout layout, int src,
                               const QkvDestinations& dests, const void* counter);

}  // namespace ulysses::kernels::internal
