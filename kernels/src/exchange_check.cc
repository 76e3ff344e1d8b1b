#include "exchange_check.h"

#include "absl/strings/str_cat.h"
#include "ulysses/common/status.h"

namespace ulysses::kernels::internal {
namespace {

absl::Status Positive(absl::string_view name, int64_t value) {
  if (value > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(name, " must be positive, got ", value));
}

absl::Status CheckItemsize(int32_t itemsize) {
  if (itemsize == 2 || itemsize == 4) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("itemsize must be 2 (fp16/bf16) or 4 (fp32), got ", itemsize));
}

}  // namespace

absl::Status CheckShape(const ExchangeShape& shape) {
  ULY_RETURN_IF_ERROR(Positive("world", shape.world));
  ULY_RETURN_IF_ERROR(Positive("batch", shape.batch));
  ULY_RETURN_IF_ERROR(Positive("seq_local", shape.seq_local));
  ULY_RETURN_IF_ERROR(Positive("heads", shape.heads));
  ULY_RETURN_IF_ERROR(Positive("head_dim", shape.head_dim));
  ULY_RETURN_IF_ERROR(CheckItemsize(shape.itemsize));
  if (shape.heads % shape.world != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("heads (", shape.heads, ") must be divisible by world (", shape.world, ")"));
  }
  int64_t bytes = shape.batch;
  for (int64_t factor : {int64_t{shape.world}, shape.seq_local, int64_t{shape.heads},
                         int64_t{shape.head_dim}, int64_t{shape.itemsize}}) {
    if (__builtin_mul_overflow(bytes, factor, &bytes)) {
      return absl::InvalidArgumentError(
          "batch * world * seq_local * heads * head_dim * itemsize overflows int64");
    }
  }
  return absl::OkStatus();
}

absl::Status CheckRanks(const ExchangeShape& shape, int src, int dst) {
  if (src < 0 || src >= shape.world) {
    return absl::InvalidArgumentError(
        absl::StrCat("src rank ", src, " is outside [0, ", shape.world, ")"));
  }
  if (dst < 0 || dst >= shape.world) {
    return absl::InvalidArgumentError(
        absl::StrCat("dst rank ", dst, " is outside [0, ", shape.world, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckHeadBand(const ExchangeShape& shape, int32_t head_offset, int32_t head_count) {
  if (head_count < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_count must be positive, got ", head_count));
  }
  if (head_offset < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_offset must be non-negative, got ", head_offset));
  }
  if (int64_t{head_offset} + head_count > LocalHeads(shape)) {
    return absl::InvalidArgumentError(absl::StrCat("head_offset + head_count (", head_offset, " + ",
                                                   head_count, ") exceeds local_heads (",
                                                   LocalHeads(shape), ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckView(absl::string_view name, const void* data, const int64_t stride[4]) {
  if (data == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, " is null"));
  for (int i = 0; i < 4; ++i) {
    if (stride[i] <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".stride[", i, "] must be positive, got ", stride[i]));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckPointer(absl::string_view name, const void* data) {
  if (data == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, " is null"));
  return absl::OkStatus();
}

absl::Status CheckCopyShape(const int64_t shape[4], int32_t itemsize) {
  for (int i = 0; i < 4; ++i) {
    if (shape[i] <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape[", i, "] must be positive, got ", shape[i]));
    }
  }
  return CheckItemsize(itemsize);
}

}  // namespace ulysses::kernels::internal
