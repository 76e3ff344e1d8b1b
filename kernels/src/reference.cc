#include "ulysses/kernels/reference.h"

#include "absl/strings/str_cat.h"
#include "exchange_check.h"
#include "ulysses/common/status.h"

namespace ulysses::kernels {
namespace {

template <typename View>
absl::Status CheckViews(const ExchangeShape& shape, absl::string_view name,
                        const std::vector<View>& views) {
  if (views.size() != static_cast<size_t>(shape.world)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " has ", views.size(), " views, expected world = ", shape.world));
  }
  for (size_t i = 0; i < views.size(); ++i) {
    ULY_RETURN_IF_ERROR(
        internal::CheckView(absl::StrCat(name, "[", i, "]"), views[i].data, views[i].stride));
  }
  return absl::OkStatus();
}

std::vector<HostBuffer> MakeBuffers(int32_t world, int64_t elems, int32_t itemsize) {
  return std::vector<HostBuffer>(static_cast<size_t>(world),
                                 HostBuffer(static_cast<size_t>(elems * itemsize)));
}

}  // namespace

absl::StatusOr<std::vector<HostBuffer>> ScatterHeadsRef(const ExchangeShape& shape,
                                                        const std::vector<ConstView>& x) {
  ULY_RETURN_IF_ERROR(internal::CheckShape(shape));
  ULY_RETURN_IF_ERROR(CheckViews(shape, "x", x));
  auto out =
      MakeBuffers(shape.world, shape.batch * GlobalSeq(shape) * LocalHeads(shape) * shape.head_dim,
                  shape.itemsize);
  for (int dst = 0; dst < shape.world; ++dst) {
    for (int src = 0; src < shape.world; ++src) {
      ScatterHeadsBlockRef(shape, x[src], src, dst, out[dst].data());
    }
  }
  return out;
}

absl::StatusOr<std::vector<HostBuffer>> GatherHeadsRef(const ExchangeShape& shape,
                                                       const std::vector<ConstView>& y) {
  ULY_RETURN_IF_ERROR(internal::CheckShape(shape));
  ULY_RETURN_IF_ERROR(CheckViews(shape, "y", y));
  auto out = MakeBuffers(shape.world, shape.batch * shape.seq_local * shape.heads * shape.head_dim,
                         shape.itemsize);
  for (int dst = 0; dst < shape.world; ++dst) {
    for (int src = 0; src < shape.world; ++src) {
      GatherHeadsBlockRef(shape, y[src], src, dst, out[dst].data());
    }
  }
  return out;
}

absl::StatusOr<std::vector<HostBuffer>> ScatterQkvHeadChunkRef(
    const ExchangeShape& shape, const std::vector<ConstView>& q, const std::vector<ConstView>& k,
    const std::vector<ConstView>& v, int32_t head_offset, int32_t head_count) {
  ULY_RETURN_IF_ERROR(internal::CheckShape(shape));
  ULY_RETURN_IF_ERROR(internal::CheckHeadBand(shape, head_offset, head_count));
  ULY_RETURN_IF_ERROR(CheckViews(shape, "q", q));
  ULY_RETURN_IF_ERROR(CheckViews(shape, "k", k));
  ULY_RETURN_IF_ERROR(CheckViews(shape, "v", v));
  auto out =
      MakeBuffers(shape.world, shape.batch * GlobalSeq(shape) * head_count * 3 * shape.head_dim,
                  shape.itemsize);
  for (int dst = 0; dst < shape.world; ++dst) {
    for (int src = 0; src < shape.world; ++src) {
      ScatterQkvHeadChunkBlockRef(shape, q[src], k[src], v[src], head_offset, head_count, src, dst,
                                  out[dst].data());
    }
  }
  return out;
}

absl::Status GatherOutputHeadChunkRef(const ExchangeShape& shape, const std::vector<ConstView>& x,
                                      int32_t head_offset, int32_t head_count,
                                      const std::vector<MutView>& out) {
  ULY_RETURN_IF_ERROR(internal::CheckShape(shape));
  ULY_RETURN_IF_ERROR(internal::CheckHeadBand(shape, head_offset, head_count));
  ULY_RETURN_IF_ERROR(CheckViews(shape, "x", x));
  ULY_RETURN_IF_ERROR(CheckViews(shape, "out", out));
  // stage[b, s, src, hc, d]: rank dst's receive slot, one block per source rank.
  HostBuffer stage(static_cast<size_t>(shape.batch * shape.seq_local * shape.world * head_count *
                                       shape.head_dim * shape.itemsize));
  for (int dst = 0; dst < shape.world; ++dst) {
    for (int src = 0; src < shape.world; ++src) {
      GatherOutputHeadChunkBlockRef(shape, x[src], head_count, src, dst, stage.data());
    }
    GatherOutputHeadChunkMergeRef(shape, stage.data(), head_offset, head_count, out[dst]);
  }
  return absl::OkStatus();
}

}  // namespace ulysses::kernels
