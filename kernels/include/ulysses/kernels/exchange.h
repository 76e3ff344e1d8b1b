// Geometry and views of the head exchange, and the CPU reference of every exchange block.
//
// Host-visible; compiles as C++17 so that .cu files can include it. Nothing here allocates,
// synchronizes or returns an error: callers validate first (ulysses::common validation, or
// the checks of the CUDA launchers), and the block functions assume valid arguments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

/// Marks the small index helpers below callable from host and device code under nvcc; empty
/// for host compilers. (Keys on __CUDACC__, never __CUDA_ARCH__: host and device see the same
/// code.)
#if defined(__CUDACC__)
#define ULY_HOST_DEVICE __host__ __device__
#else
#define ULY_HOST_DEVICE
#endif

namespace ulysses::kernels {

/// Geometry of one exchange call, seen from the calling rank. Trivially copyable; shared by
/// host and device code. Index space (DESIGN.md section 4): W = world, H_l = heads / world,
/// S_g = world * seq_local. Valid when every field is positive, heads % world == 0 and
/// itemsize is 2 (fp16, bf16) or 4 (fp32). Values move as raw bytes: dtype only matters
/// through itemsize.
struct ExchangeShape {
  int32_t world;      ///< W: ranks in the group.
  int64_t batch;      ///< B.
  int64_t seq_local;  ///< S_l: tokens per rank; S_g = W * S_l.
  int32_t heads;      ///< H: global head count; each rank owns H / W of them.
  int32_t head_dim;   ///< D: elements per head.
  int32_t itemsize;   ///< Bytes per element: 2 or 4.
};

/// A read-only 4-D view: `data` points at element [0,0,0,0]; element [i0,i1,i2,i3] lives at
/// `data + itemsize * ViewOffset(stride, i0, i1, i2, i3)`. Strides are in elements and must be
/// positive; they need not describe a contiguous layout. Does not own `data`.
struct ConstView {
  const void* data;
  int64_t stride[4];
};

/// A writable 4-D view; same conventions as ConstView. Does not own `data`.
struct MutView {
  void* data;
  int64_t stride[4];
};

static_assert(std::is_trivially_copyable_v<ExchangeShape>);
static_assert(sizeof(ExchangeShape) == 40);
static_assert(offsetof(ExchangeShape, batch) == 8 && offsetof(ExchangeShape, seq_local) == 16 &&
              offsetof(ExchangeShape, heads) == 24 && offsetof(ExchangeShape, itemsize) == 32);
static_assert(std::is_trivially_copyable_v<ConstView>);
static_assert(std::is_trivially_copyable_v<MutView>);
static_assert(sizeof(ConstView) == 40 && sizeof(MutView) == 40);

/// Element offset (not bytes) of [i0,i1,i2,i3] in a view with element strides `stride`.
/// All math is 64-bit, so offsets beyond 2^31 elements are exact.
ULY_HOST_DEVICE constexpr int64_t ViewOffset(const int64_t stride[4], int64_t i0, int64_t i1,
                                             int64_t i2, int64_t i3) {
  return i0 * stride[0] + i1 * stride[1] + i2 * stride[2] + i3 * stride[3];
}

/// H_l = heads / world: the number of heads each rank owns.
ULY_HOST_DEVICE constexpr int64_t LocalHeads(const ExchangeShape& shape) {
  return shape.heads / shape.world;
}

/// S_g = world * seq_local: the sequence length after a scatter.
ULY_HOST_DEVICE constexpr int64_t GlobalSeq(const ExchangeShape& shape) {
  return int64_t{shape.world} * shape.seq_local;
}

/// A view of a contiguous (row-major) tensor [n0, n1, n2, n3] at `data`; n0 does not enter
/// the strides, so it is not asked for.
constexpr ConstView ContiguousConstView(const void* data, int64_t n1, int64_t n2, int64_t n3) {
  return ConstView{data, {n1 * n2 * n3, n2 * n3, n3, 1}};
}

/// Writable counterpart of ContiguousConstView.
constexpr MutView ContiguousMutView(void* data, int64_t n1, int64_t n2, int64_t n3) {
  return MutView{data, {n1 * n2 * n3, n2 * n3, n3, 1}};
}

/// Which exchange a block belongs to (the four exchanges of the block references below).
enum class BlockKind : int32_t {
  kScatterHeads = 0,
  kGatherHeads = 1,
  kScatterQkvHeadChunk = 2,
  kGatherOutputHeadChunk = 3,
};

/// One rank's operands of an exchange, for the launchers that take any kind of block
/// (exchange_cuda.h). `inputs[0]` is x (scatter_heads), y (gather_heads) or x_src
/// (gather_output_head_chunk); the head-chunk scatter reads q, k and v from inputs[0..2]. The
/// head band is read by the head-chunk kinds only.
struct BlockOperands {
  BlockKind kind;
  ConstView inputs[3];
  int32_t head_offset;
  int32_t head_count;
};
static_assert(std::is_trivially_copyable_v<BlockOperands>);

// ---------------------------------------------------------------------------------------
// Block references. A "block" is the piece that source rank `src` contributes to
// destination rank `dst`. Each function writes ONLY that block of its output buffer, so the
// blocks of all (src, dst) pairs can be written into one receive buffer in any order (or
// concurrently, from different threads, into disjoint blocks). Inputs and outputs must not
// overlap. Requires a valid shape and 0 <= src, dst < world.
// ---------------------------------------------------------------------------------------

/// scatter_heads block: `out_dst` is destination rank `dst`'s contiguous [B, S_g, H_l, D]
/// buffer; writes out_dst[b, src*S_l + s, h, d] = x_src[b, s, dst*H_l + h, d] for all b, s,
/// h, d, where `x_src` is source rank `src`'s [B, S_l, H, D] input view.
void ScatterHeadsBlockRef(const ExchangeShape& shape, ConstView x_src, int src, int dst,
                          void* out_dst);

/// gather_heads block: `out_dst` is destination rank `dst`'s contiguous [B, S_l, H, D]
/// buffer; writes out_dst[b, s, src*H_l + h, d] = y_src[b, dst*S_l + s, h, d], where `y_src`
/// is source rank `src`'s [B, S_g, H_l, D] view.
void GatherHeadsBlockRef(const ExchangeShape& shape, ConstView y_src, int src, int dst,
                         void* out_dst);

/// scatter_qkv_head_chunk block for the head band [head_offset, head_offset + head_count) of
/// every destination (HC = head_count, 0 <= head_offset, head_offset + HC <= H_l).
/// `q`, `k`, `v` are source rank `src`'s [B, S_l, H, D] views; `out_dst` is destination rank
/// `dst`'s contiguous [B, S_g, HC, 3D] buffer. Writes, for hc in [0, HC):
///   out_dst[b, src*S_l + s, hc, 0:D]   = q[b, s, dst*H_l + head_offset + hc, :]
///   out_dst[b, src*S_l + s, hc, D:2D]  = k[...same index...]
///   out_dst[b, src*S_l + s, hc, 2D:3D] = v[...same index...]
void ScatterQkvHeadChunkBlockRef(const ExchangeShape& shape, ConstView q, ConstView k, ConstView v,
                                 int32_t head_offset, int32_t head_count, int src, int dst,
                                 void* out_dst);

/// gather_output_head_chunk, exchange half: `x_src` is source rank `src`'s [B, S_g, HC, D]
/// attention output for one head band; `stage_dst` is destination rank `dst`'s contiguous
/// staging buffer [B, S_l, W, HC, D]. Writes stage_dst[b, s, src, hc, d] =
/// x_src[b, dst*S_l + s, hc, d].
void GatherOutputHeadChunkBlockRef(const ExchangeShape& shape, ConstView x_src, int32_t head_count,
                                   int src, int dst, void* stage_dst);

/// gather_output_head_chunk, merge half (on the destination rank, once every source's block
/// has landed in `stage`): out[b, s, w*H_l + head_offset + hc, d] = stage[b, s, w, hc, d]
/// for every w in [0, W). `stage` is contiguous [B, S_l, W, HC, D]; `out` is a
/// [B, S_l, H, D] view. Heads outside the band of every w are left untouched.
void GatherOutputHeadChunkMergeRef(const ExchangeShape& shape, const void* stage,
                                   int32_t head_offset, int32_t head_count, MutView out);

/// Copies a contiguous tensor of `shape` (4 positive extents) into the view `dst`, element
/// by element (`itemsize` bytes each). For `out=` copies.
void CopyContiguousToViewRef(const void* src, const int64_t shape[4], int32_t itemsize,
                             MutView dst);

/// Copies the view `src` of `shape` into the contiguous buffer `dst`. For `out=` copies.
void CopyViewToContiguousRef(ConstView src, const int64_t shape[4], int32_t itemsize, void* dst);

}  // namespace ulysses::kernels
