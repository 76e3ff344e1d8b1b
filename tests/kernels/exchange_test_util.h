// Test helpers for the exchange kernels: dtypes, random bytes, and strided views over owned
// host buffers. Used by tests/kernels and tests/gpu.
#pragma once

#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "ulysses/kernels/exchange.h"

namespace ulysses::kernels::testing {

enum class Dtype { kFp16, kBf16, kFp32 };

inline int32_t ItemSize(Dtype dtype) { return dtype == Dtype::kFp32 ? 4 : 2; }

inline std::string DtypeName(Dtype dtype) {
  switch (dtype) {
    case Dtype::kFp16:
      return "fp16";
    case Dtype::kBf16:
      return "bf16";
    case Dtype::kFp32:
      return "fp32";
  }
  return "unknown";
}

inline void PrintTo(Dtype dtype, std::ostream* os) { *os << DtypeName(dtype); }

// A NaN bit pattern in every dtype of the given itemsize (0x7FC1 is NaN as bf16 and as fp16).
inline uint32_t NanBits(int32_t itemsize) { return itemsize == 4 ? 0x7FC0DEADu : 0x7FC1u; }

inline std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t r = rng();
    std::memcpy(out.data() + i, &r, 8);
  }
  for (; i < n; ++i) out[i] = static_cast<uint8_t>(rng());
  return out;
}

inline std::vector<uint8_t> FilledBytes(size_t elems, int32_t itemsize, uint32_t bits) {
  std::vector<uint8_t> out(elems * itemsize);
  for (size_t i = 0; i < elems; ++i) std::memcpy(out.data() + i * itemsize, &bits, itemsize);
  return out;
}

// How a logical [n0, n1, n2, n3] tensor sits in its backing buffer.
enum class Layout {
  kContiguous,   // row-major, offset 0
  kPaddedHeads,  // slot 1 of [n0, n1, n2, 2, n3] (like one of q/k/v unbound from a pack)
  kTransposed,   // slot 1 of [n1, n0, n2, n3, 2]: dims 0/1 swapped, element stride 2
};

inline std::string LayoutName(Layout layout) {
  switch (layout) {
    case Layout::kContiguous:
      return "contiguous";
    case Layout::kPaddedHeads:
      return "padded_heads";
    case Layout::kTransposed:
      return "transposed";
  }
  return "unknown";
}

// A view of a random-filled backing buffer; the padding is random too, so reading it shows.
struct HostView {
  std::vector<uint8_t> buffer;
  int64_t base = 0;  // elements
  int64_t stride[4] = {0, 0, 0, 0};
  int64_t shape[4] = {0, 0, 0, 0};
  int32_t itemsize = 0;

  ConstView view() const {
    return ConstView{buffer.data() + base * itemsize, {stride[0], stride[1], stride[2], stride[3]}};
  }
  MutView mut_view() {
    return MutView{buffer.data() + base * itemsize, {stride[0], stride[1], stride[2], stride[3]}};
  }
  // Byte offset of element [i0, i1, i2, i3] in `buffer`, computed here independently.
  int64_t ByteAt(int64_t i0, int64_t i1, int64_t i2, int64_t i3) const {
    return (base + i0 * stride[0] + i1 * stride[1] + i2 * stride[2] + i3 * stride[3]) * itemsize;
  }
  const uint8_t* At(int64_t i0, int64_t i1, int64_t i2, int64_t i3) const {
    return buffer.data() + ByteAt(i0, i1, i2, i3);
  }
  // The logical tensor, contiguous.
  std::vector<uint8_t> Dense() const {
    std::vector<uint8_t> out(shape[0] * shape[1] * shape[2] * shape[3] * itemsize);
    size_t pos = 0;
    for (int64_t a = 0; a < shape[0]; ++a)
      for (int64_t b = 0; b < shape[1]; ++b)
        for (int64_t c = 0; c < shape[2]; ++c)
          for (int64_t d = 0; d < shape[3]; ++d, pos += itemsize)
            std::memcpy(out.data() + pos, At(a, b, c, d), itemsize);
    return out;
  }
};

inline HostView MakeHostView(Layout layout, int64_t n0, int64_t n1, int64_t n2, int64_t n3,
                             int32_t itemsize, uint64_t seed) {
  HostView v;
  v.itemsize = itemsize;
  v.shape[0] = n0;
  v.shape[1] = n1;
  v.shape[2] = n2;
  v.shape[3] = n3;
  int64_t elems = n0 * n1 * n2 * n3;
  switch (layout) {
    case Layout::kContiguous:
      v.stride[0] = n1 * n2 * n3, v.stride[1] = n2 * n3, v.stride[2] = n3, v.stride[3] = 1;
      break;
    case Layout::kPaddedHeads:
      elems *= 2;
      v.base = n3;
      v.stride[0] = n1 * n2 * 2 * n3, v.stride[1] = n2 * 2 * n3, v.stride[2] = 2 * n3;
      v.stride[3] = 1;
      break;
    case Layout::kTransposed:
      elems *= 2;
      v.base = 1;
      v.stride[0] = n2 * n3 * 2, v.stride[1] = n0 * n2 * n3 * 2, v.stride[2] = n3 * 2;
      v.stride[3] = 2;
      break;
  }
  v.buffer = RandomBytes(static_cast<size_t>(elems * itemsize), seed);
  return v;
}

inline const Layout kAllLayouts[] = {Layout::kContiguous, Layout::kPaddedHeads,
                                     Layout::kTransposed};

}  // namespace ulysses::kernels::testing
