// Whole-collective CPU references: given every rank's inputs, produce every rank's outputs by
// running the block references for all (src, dst) pairs. For tests and the demo; the daemon's
// host backend calls the block functions of exchange.h directly, one pair at a time.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ulysses/kernels/exchange.h"

namespace ulysses::kernels {

/// One rank's contiguous buffer, as raw bytes.
using HostBuffer = std::vector<uint8_t>;

/// scatter_heads over all ranks: `x[j]` is rank j's [B, S_l, H, D] view (size W). Returns W
/// new buffers, element r being rank r's contiguous [B, S_g, H_l, D] output. INVALID_ARGUMENT
/// for a bad shape, a wrong number of views, or a null / non-positive-stride view.
absl::StatusOr<std::vector<HostBuffer>> ScatterHeadsRef(const ExchangeShape& shape,
                                                        const std::vector<ConstView>& x);

/// gather_heads over all ranks: `y[p]` is rank p's [B, S_g, H_l, D] view. Returns W buffers,
/// element r being rank r's contiguous [B, S_l, H, D] output. Errors as ScatterHeadsRef.
absl::StatusOr<std::vector<HostBuffer>> GatherHeadsRef(const ExchangeShape& shape,
                                                       const std::vector<ConstView>& y);

/// scatter_qkv_head_chunk over all ranks for the band [head_offset, head_offset + head_count):
/// `q[j]`, `k[j]`, `v[j]` are rank j's [B, S_l, H, D] views. Returns W buffers, element r
/// being rank r's contiguous [B, S_g, HC, 3D] output. Errors as ScatterHeadsRef, plus a band
/// outside [0, H_l).
absl::StatusOr<std::vector<HostBuffer>> ScatterQkvHeadChunkRef(
    const ExchangeShape& shape, const std::vector<ConstView>& q, const std::vector<ConstView>& k,
    const std::vector<ConstView>& v, int32_t head_offset, int32_t head_count);

/// gather_output_head_chunk over all ranks: `x[p]` is rank p's [B, S_g, HC, D] attention
/// output for the band; `out[r]` is rank r's [B, S_l, H, D] output view, updated in place:
/// only heads w*H_l + head_offset + [0, HC) for every w are written, the rest is untouched.
/// Goes through a staging buffer per rank, as the daemon does. Errors as
/// ScatterQkvHeadChunkRef; on error nothing is written.
absl::Status GatherOutputHeadChunkRef(const ExchangeShape& shape, const std::vector<ConstView>& x,
                                      int32_t head_offset, int32_t head_count,
                                      const std::vector<MutView>& out);

}  // namespace ulysses::kernels
