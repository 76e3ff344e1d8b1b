// Argument checks shared by the whole-collective references and the CUDA launchers. Each
// failure is INVALID_ARGUMENT naming the argument. These check what the kernels need to run
// safely; the user-facing verdict (capacity, aliasing, ownership) is ulysses::common's.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "ulysses/kernels/exchange.h"

namespace ulysses::kernels::internal {

/// Positive extents, itemsize in {2, 4}, heads divisible by world, and a largest per-rank
/// buffer (B * S_g * H * D * itemsize bytes) that fits in int64.
absl::Status CheckShape(const ExchangeShape& shape);

/// 0 <= src < world and 0 <= dst < world.
absl::Status CheckRanks(const ExchangeShape& shape, int src, int dst);

/// head_count >= 1, head_offset >= 0, head_offset + head_count <= H_l.
absl::Status CheckHeadBand(const ExchangeShape& shape, int32_t head_offset, int32_t head_count);

/// Non-null data and four positive strides.
absl::Status CheckView(absl::string_view name, const void* data, const int64_t stride[4]);

/// Non-null pointer.
absl::Status CheckPointer(absl::string_view name, const void* data);

/// Four positive extents and itemsize in {2, 4}.
absl::Status CheckCopyShape(const int64_t shape[4], int32_t itemsize);

}  // namespace ulysses::kernels::internal
