// CPU reference of the exchange blocks. The host backend runs these on shared host memory, so
// they move whole contiguous runs with memcpy where the layout allows it: a run of H_l*D (or
// HC*D) elements when a view's head band is contiguous, else one run of D per head, else one
// element at a time.
#include <cstddef>
#include <cstring>

#include "ulysses/kernels/exchange.h"

namespace ulysses::kernels {
namespace {

using Byte = std::byte;

template <int kItem>
void CopyStridedElems(Byte* dst, int64_t dst_step, const Byte* src, int64_t src_step, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(dst + i * dst_step * kItem, src + i * src_step * kItem, kItem);
  }
}

// Copies n elements; steps are in elements.
void CopyElems(Byte* dst, int64_t dst_step, const Byte* src, int64_t src_step, int64_t n,
               int64_t itemsize) {
  if ((dst_step == 1 && src_step == 1) || n == 1) {
    std::memcpy(dst, src, static_cast<size_t>(n * itemsize));
  } else if (itemsize == 2) {
    CopyStridedElems<2>(dst, dst_step, src, src_step, n);
  } else {
    CopyStridedElems<4>(dst, dst_step, src, src_step, n);
  }
}

// True when `count` consecutive heads of D elements each form one contiguous run.
bool HeadsContiguous(const int64_t stride[4], int64_t count, int64_t d) {
  const bool rows = d == 1 || stride[3] == 1;
  return rows && (count == 1 || stride[2] == d);
}

// Copies `count` heads (rows of D elements) from a view row (head stride src_head, element
// stride src_elem) to a destination (head stride dst_head, element stride dst_elem).
void CopyHeads(Byte* dst, int64_t dst_head, int64_t dst_elem, const Byte* src, int64_t src_head,
               int64_t src_elem, int64_t count, int64_t d, int64_t itemsize, bool one_run) {
  if (one_run) {
    std::memcpy(dst, src, static_cast<size_t>(count * d * itemsize));
    return;
  }
  for (int64_t h = 0; h < count; ++h) {
    CopyElems(dst + h * dst_head * itemsize, dst_elem, src + h * src_head * itemsize, src_elem, d,
              itemsize);
  }
}

}  // namespace

void ScatterHeadsBlockRef(const ExchangeShape& shape, ConstView x_src, int src, int dst,
                          void* out_dst) {
  const int64_t hl = LocalHeads(shape), d = shape.head_dim, sl = shape.seq_local;
  const int64_t sg = GlobalSeq(shape), item = shape.itemsize;
  const auto* in = static_cast<const Byte*>(x_src.data);
  auto* out = static_cast<Byte*>(out_dst);
  const bool one_run = HeadsContiguous(x_src.stride, hl, d);
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t s = 0; s < sl; ++s) {
      const Byte* from = in + ViewOffset(x_src.stride, b, s, int64_t{dst} * hl, 0) * item;
      Byte* to = out + ((b * sg + src * sl + s) * hl) * d * item;
      CopyHeads(to, d, 1, from, x_src.stride[2], x_src.stride[3], hl, d, item, one_run);
    }
  }
}

void GatherHeadsBlockRef(const ExchangeShape& shape, ConstView y_src, int src, int dst,
                         void* out_dst) {
  const int64_t hl = LocalHeads(shape), d = shape.head_dim, sl = shape.seq_local;
  const int64_t h = shape.heads, item = shape.itemsize;
  const auto* in = static_cast<const Byte*>(y_src.data);
  auto* out = static_cast<Byte*>(out_dst);
  const bool one_run = HeadsContiguous(y_src.stride, hl, d);
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t s = 0; s < sl; ++s) {
      const Byte* from = in + ViewOffset(y_src.stride, b, dst * sl + s, 0, 0) * item;
      Byte* to = out + ((b * sl + s) * h + src * hl) * d * item;
      CopyHeads(to, d, 1, from, y_src.stride[2], y_src.stride[3], hl, d, item, one_run);
    }
  }
}

void ScatterQkvHeadChunkBlockRef(const ExchangeShape& shape, ConstView q, ConstView k, ConstView v,
                                 int32_t head_offset, int32_t head_count, int src, int dst,
                                 void* out_dst) {
  const int64_t hl = LocalHeads(shape), d = shape.head_dim, sl = shape.seq_local;
  const int64_t sg = GlobalSeq(shape), item = shape.itemsize, hc_n = head_count;
  const int64_t head0 = int64_t{dst} * hl + head_offset;
  const ConstView parts[3] = {q, k, v};
  auto* out = static_cast<Byte*>(out_dst);
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t s = 0; s < sl; ++s) {
      // Record (b, src*S_l+s, hc) holds [q | k | v] of one head: 3D elements.
      Byte* rec = out + ((b * sg + src * sl + s) * hc_n) * 3 * d * item;
      for (int p = 0; p < 3; ++p) {
        const Byte* from = static_cast<const Byte*>(parts[p].data) +
                           ViewOffset(parts[p].stride, b, s, head0, 0) * item;
        CopyHeads(rec + p * d * item, 3 * d, 1, from, parts[p].stride[2], parts[p].stride[3], hc_n,
                  d, item, /*one_run=*/false);
      }
    }
  }
}

void GatherOutputHeadChunkBlockRef(const ExchangeShape& shape, ConstView x_src, int32_t head_count,
                                   int src, int dst, void* stage_dst) {
  const int64_t d = shape.head_dim, sl = shape.seq_local, w = shape.world;
  const int64_t item = shape.itemsize, hc_n = head_count;
  const auto* in = static_cast<const Byte*>(x_src.data);
  auto* out = static_cast<Byte*>(stage_dst);
  const bool one_run = HeadsContiguous(x_src.stride, hc_n, d);
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t s = 0; s < sl; ++s) {
      const Byte* from = in + ViewOffset(x_src.stride, b, dst * sl + s, 0, 0) * item;
      Byte* to = out + (((b * sl + s) * w + src) * hc_n) * d * item;
      CopyHeads(to, d, 1, from, x_src.stride[2], x_src.stride[3], hc_n, d, item, one_run);
    }
  }
}

void GatherOutputHeadChunkMergeRef(const ExchangeShape& shape, const void* stage,
                                   int32_t head_offset, int32_t head_count, MutView out) {
  const int64_t hl = LocalHeads(shape), d = shape.head_dim, sl = shape.seq_local;
  const int64_t w = shape.world, item = shape.itemsize, hc_n = head_count;
  const auto* in = static_cast<const Byte*>(stage);
  auto* to_base = static_cast<Byte*>(out.data);
  const bool one_run = HeadsContiguous(out.stride, hc_n, d);
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t s = 0; s < sl; ++s) {
      for (int64_t r = 0; r < w; ++r) {
        const Byte* from = in + (((b * sl + s) * w + r) * hc_n) * d * item;
        Byte* to = to_base + ViewOffset(out.stride, b, s, r * hl + head_offset, 0) * item;
        CopyHeads(to, out.stride[2], out.stride[3], from, d, 1, hc_n, d, item, one_run);
      }
    }
  }
}

void CopyContiguousToViewRef(const void* src, const int64_t shape[4], int32_t itemsize,
                             MutView dst) {
  const int64_t item = itemsize, n3 = shape[3];
  const auto* in = static_cast<const Byte*>(src);
  auto* out = static_cast<Byte*>(dst.data);
  int64_t row = 0;
  for (int64_t i0 = 0; i0 < shape[0]; ++i0) {
    for (int64_t i1 = 0; i1 < shape[1]; ++i1) {
      for (int64_t i2 = 0; i2 < shape[2]; ++i2, ++row) {
        CopyElems(out + ViewOffset(dst.stride, i0, i1, i2, 0) * item, dst.stride[3],
                  in + row * n3 * item, 1, n3, item);
      }
    }
  }
}

void CopyViewToContiguousRef(ConstView src, const int64_t shape[4], int32_t itemsize, void* dst) {
  const int64_t item = itemsize, n3 = shape[3];
  const auto* in = static_cast<const Byte*>(src.data);
  auto* out = static_cast<Byte*>(dst);
  int64_t row = 0;
  for (int64_t i0 = 0; i0 < shape[0]; ++i0) {
    for (int64_t i1 = 0; i1 < shape[1]; ++i1) {
      for (int64_t i2 = 0; i2 < shape[2]; ++i2, ++row) {
        CopyElems(out + row * n3 * item, 1, in + ViewOffset(src.stride, i0, i1, i2, 0) * item,
                  src.stride[3], n3, item);
      }
    }
  }
}

}  // namespace ulysses::kernels
