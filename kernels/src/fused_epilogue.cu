// The epilogue-fused GEMM of the fused QKV op (fused_epilogue.h): CUTLASS's sm_90a TMA
// warp-specialized mainloop, ping-pong (a 128-row tile of one head per consumer warpgroup) or
// cooperative (a 128-row tile of two heads for both), with a persistent swizzled tile scheduler
// on single CTAs or clusters of 2, and an epilogue of our own in the operator form that
// CUTLASS's Sm90TmaWarpSpecializedAdapter runs in place of its TMA epilogues; and the
// cooperative mainloop in a kernel of our own whose epilogue runs on warps of its own beside
// the next tile's mainloop (EpilogueWarpsKernel).
//
// Per output tile (128 token rows of one or two heads):
//   1. the consumer threads round their accumulators to bf16: into a padded shared-memory
//      tile (NormRopeStoreEpilogue, ping-pong; EpilogueWarpsKernel, for its epilogue warps),
//      or they keep them in registers (NormRopeRegisterEpilogue, cooperative);
//   2. whole rows of 16-byte vectors (a half-warp's from the shared tile, or a quad's after
//      a transpose in registers) get RMSNorm + RoPE (Q and K) through the norm_rope.cu
//      kernels' device functions, so the step is bit for bit that of the other paths on the
//      same projection;
//   3. each row goes straight to its destination's slot (at QkvDestOffset);
//   4. the tile counts itself on its rows' chunk's counter; the chunk's last
//      arrival publishes the chunk's readiness word in every destination (release order
//      after every store).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "cuda_check.h"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cluster_launch.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/gemm.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/util/packed_stride.hpp"
#include "fused_epilogue.h"
#include "norm_rope.cuh"
#include "qkv_checks.h"
#include "ulysses/common/status.h"
#include "ulysses/kernels/fused_qkv.h"

namespace ulysses::kernels::internal {
namespace {

constexpr int kTileK = 64;
constexpr int kPitch = kHeadDim + 8;  // bf16 elements per shared row: 16 bytes of padding

// What the epilogue needs on the device; trivially copyable, passed in the kernel's params.
struct EpilogueParams {
  QkvNormRopeShape shape;
  QkvLayout layout;
  int32_t src;
  int32_t rows;
  int32_t chunk_units;  // 128-row units per readiness chunk
  int32_t n_tiles;      // tiles across the features
  const int32_t* positions;
  const uint16_t* q_norm;
  const uint16_t* k_norm;
  const float* cos_sin;
  uint16_t* out[kMaxWorldSize];
  uint64_t* ready[kMaxWorldSize];  // chunk i's word of dst at ready[dst] + i; null: none
  uint64_t epoch;
  const uint64_t* cancel;
  unsigned int* counters;  // per chunk; null: no readiness words
  uint16_t* projection;    // null: the raw projection is not kept
  int32_t gemm_alone;      // nonzero: the epilogue returns at once
  int32_t projection_only; // nonzero: the raw projection is stored, nothing else
};

using Element = cutlass::bfloat16_t;
using StrideCD = cute::Stride<int64_t, cute::Int<1>, int64_t>;

// What CUTLASS's Sm90TmaWarpSpecializedAdapter and kernel ask of an epilogue in the operator
// form, for both epilogues below.
struct EpilogueOperatorBase {
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  // Names only: the adapter and the kernel ask for these types; nothing here runs them.
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<Element, 1, float, float>;
  using ElementOutput = Element;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using ElementC = Element;
  using StrideC = StrideCD;
  using ElementD = Element;
  using StrideD = StrideCD;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  using Arguments = EpilogueParams;
  using Params = EpilogueParams;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }
};

// Where a tile's head goes in its destination's slot: the head `h` of the destination's
// `hl` (= H / W), of plane `plane`; and the call's constants of the rows' offsets.
struct TileDest {
  uint16_t* out;
  uint32_t plane, h, hl, world, src_base, plane_elems;
};
__device__ __forceinline__ TileDest DestOf(const EpilogueParams& p, int plane, int32_t head) {
  const uint32_t hl = static_cast<uint32_t>(p.shape.heads / p.shape.world);
  const uint32_t dst = static_cast<uint32_t>(head) / hl;
  return {p.out[dst],
          static_cast<uint32_t>(plane),
          static_cast<uint32_t>(head) % hl,
          hl,
          static_cast<uint32_t>(p.shape.world),
          static_cast<uint32_t>(p.src * p.shape.seq_local),
          static_cast<uint32_t>(QkvPlaneElems(p.shape))};
}

// Element offset of row `row`'s head (its first element) in the destination's slot:
// QkvDestOffset in 32-bit arithmetic (every offset of a slot is below 2^31: Run checks
// B*S_l*3*H*D), since a 64-bit division costs a long software sequence per row.
__device__ __forceinline__ uint32_t DestRowOffset(const EpilogueParams& p, const TileDest& d,
                                                  int64_t row) {
  const uint32_t r32 = static_cast<uint32_t>(row), sl = static_cast<uint32_t>(p.shape.seq_local);
  const uint32_t b = r32 / sl, token = b * sl * d.world + d.src_base + (r32 - b * sl);
  return p.layout == QkvLayout::kFused
             ? (token * d.hl + d.h) * 3 * kHeadDim + d.plane * kHeadDim
             : d.plane * d.plane_elems + (token * d.hl + d.h) * kHeadDim;
}

// A tile of the call: its place, and whether it is in the problem at all. The swizzled
// scheduler rounds the tile grid up to whole swizzle groups: a tile outside the problem (seen
// with 12 tiles across) has nothing to store and is no chunk's tile; every thread of the
// group finds this alike, before any of its barriers.
struct TileOf {
  int m_tile, n_tile;
  bool in_problem;
  int64_t n;         // first feature column
  int64_t features;  // 3 * H * D, the projection's row pitch
  int plane;      // 0 Q, 1 K, 2 V: of the tile's first head
  int32_t head;   // in the plane
};
// The place of a tile of kTileM rows and kTileN columns (whole heads).
template <int kTileM, int kTileN, class BlockCoordMNKL>
__device__ __forceinline__ TileOf TileAt(const EpilogueParams& p, const BlockCoordMNKL& blk) {
  TileOf t{};
  t.m_tile = static_cast<int>(cute::get<0>(blk));
  t.n_tile = static_cast<int>(cute::get<1>(blk));
  t.in_problem = t.n_tile < p.n_tiles && int64_t{t.m_tile} * kTileM < p.rows;
  const int64_t hd = int64_t{p.shape.heads} * kHeadDim;
  t.features = 3 * hd;
  t.n = int64_t{t.n_tile} * kTileN;
  t.plane = static_cast<int>(t.n / hd);
  t.head = static_cast<int32_t>((t.n % hd) / kHeadDim);
  return t;
}

// Head `hh` of a tile of several heads: its plane and head in the plane, and whether it is a
// head of the problem at all (3H odd leaves the last tile's second head outside). Alike for
// every thread of the tile.
struct HeadOf {
  bool in_problem;
  int plane;
  int32_t head;
  int64_t n;  // first feature column
};
__device__ __forceinline__ HeadOf HeadAt(const EpilogueParams& p, const TileOf& t, int hh) {
  const int64_t global = t.n / kHeadDim + hh;  // 0 .. 3H - 1 across the planes
  const int64_t heads = p.shape.heads;
  return {global < 3 * heads, static_cast<int>(global / heads),
          static_cast<int32_t>(global % heads), global * kHeadDim};
}

// The user named barrier of a tile's epilogue threads: one per consumer warpgroup of the
// ping-pong kernel (warpgroup 0 is the producer), one for both of the cooperative kernel's;
// CUTLASS offsets user ids past the ones it reserves.
template <int kThreads>
__device__ __forceinline__ uint32_t EpilogueBarrier() {
  static_assert(kThreads == 128 || kThreads == 256);
  return kThreads == 128 ? threadIdx.x / kThreads : 1;
}

// Whether the call is cancelled, as its cancel word reads once for the warp (every lane of the
// warp calls this together).
__device__ __forceinline__ bool WarpCancelled(const EpilogueParams& p) {
  if (p.cancel == nullptr) return false;
  const int word =
      threadIdx.x % 32 == 0 ? (*static_cast<const volatile uint64_t*>(p.cancel) != 0) : 0;
  return __shfl_sync(0xffffffffu, word, 0) != 0;
}

// Step 4, readiness, by the tile's thread 0 once a barrier has ordered every thread's stores
// before it (as a grid barrier does: one system-scope fence per tile, not one per thread).
// Every tile is one 128-row unit (kEpilogueTileRows) of one chunk, on whose counter it
// arrives. A chunk's last arrival has seen every other (fence after the atomic) and publishes
// the words with release stores.
__device__ __forceinline__ void ArriveTile(const EpilogueParams& p, int m_tile) {
  __threadfence_system();
  const auto units = static_cast<int32_t>((p.rows + kEpilogueTileRows - 1) / kEpilogueTileRows);
  const UnitArrival a = ArrivalOf(m_tile, units, p.chunk_units, p.n_tiles);
  const unsigned int arrived = atomicAdd(p.counters + a.chunk, 1u);
  if (arrived == a.arrivals - 1) {
    __threadfence_system();
    for (int d = 0; d < p.shape.world; ++d) {
      if (p.ready[d] != nullptr) StoreRelease(p.ready[d] + a.chunk, p.epoch);
    }
    atomicExch(p.counters + a.chunk, 0u);
  }
}

// The epilogue of one 128-row tile of the ping-pong kernel, run by the consumer warpgroup
// that owns it (its epilogue beside the other warpgroup's mainloop; the kernel orders the two
// epilogues, so they share one staging tile): the tile goes through shared memory, from which
// each half-warp takes whole rows.
class NormRopeStoreEpilogue : public EpilogueOperatorBase {
 public:
  static constexpr int kTileM = 128;
  static constexpr int kTileN = kHeadDim;  // one head of one plane
  static constexpr int kThreads = 128;
  static constexpr int kHalfWarps = kThreads / kHeadLanes;
  static constexpr int kRowsPerThread = kTileM / kHalfWarps;
  static constexpr const char* kForm = "";

  struct SharedStorage {
    alignas(128) uint16_t tile[kTileM * kPitch];
    int cancelled;
  };
  using TensorStorage = SharedStorage;

  // `params` is the kernel's (a __grid_constant__ parameter): kept by address, not copied. A
  // copy is a per-thread struct of 1 KiB (the W destinations' pointers) that the dynamic
  // index by destination puts on the stack, in local memory.
  CUTLASS_HOST_DEVICE explicit NormRopeStoreEpilogue(Params const& params) : params_(&params) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL, BlockShapeMNK, BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char* smem) {
    using namespace cute;
    const Params& p = *params_;
    if (p.gemm_alone != 0) return;
    SharedStorage& storage = *reinterpret_cast<SharedStorage*>(smem);
    const uint32_t barrier = EpilogueBarrier<kThreads>();
    const TileOf tile = TileAt<kTileM, kTileN>(p, blk_coord_mnkl);
    if (!tile.in_problem) return;
    const int m_tile = tile.m_tile, plane = tile.plane;
    const int64_t n = tile.n, features = tile.features;
    const bool only = p.projection_only != 0;  // alike for every thread of the kernel
    const bool norm = plane < 2 && !only;      // alike for every thread of the tile
    const int lane = thread_idx % kHeadLanes, half_warp = thread_idx / kHeadLanes;
    if (thread_idx == 0) {
      storage.cancelled =
          p.cancel != nullptr && *static_cast<const volatile uint64_t*>(p.cancel) != 0 ? 1 : 0;
    }
    // This thread's rows: the two halves of a warp take rows 2w and 2w+1 (+kHalfWarps j), so
    // both run the same steps (the norm's shuffles need all 32 lanes). Their positions are
    // loaded first, and their cos/sin while the tile is written, so that the rows' steps
    // below wait on no global load.
    const int64_t first_row = int64_t{m_tile} * kTileM;
    int32_t pos[kRowsPerThread];
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kRowsPerThread; ++j) {
      const int64_t row = first_row + half_warp + j * kHalfWarps;
      pos[j] = norm && row < p.rows ? p.positions[row] : 0;
    }
    // 1. Accumulators -> bf16 (round to nearest even, as cuBLASLt's bf16 output) -> shared.
    Tensor s_tile = make_tensor(make_smem_ptr(storage.tile),
                                Layout<Shape<Int<kTileM>, Int<kTileN>>, Stride<Int<kPitch>, _1>>{});
    Tensor t_s = tiled_mma.get_thread_slice(thread_idx).partition_C(s_tile);
    CUTE_STATIC_ASSERT_V(size(t_s) == size(accumulators));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accumulators); ++i) {
      t_s(i) = __bfloat16_as_ushort(__float2bfloat16_rn(accumulators(i)));
    }
    float w[kHeadVec] = {};
    CosSin cs[kRowsPerThread] = {};
    if (norm) {
      LoadNormWeights(plane == 0 ? p.q_norm : p.k_norm, lane, w);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kRowsPerThread; ++j) {
        cs[j] = LoadCosSin(CosSinRow(p.cos_sin, pos[j], p.shape.max_pos), lane);
      }
    }
    const TileDest dest = DestOf(p, plane, tile.head);
    cutlass::arch::NamedBarrier::sync(kThreads, barrier);

    // 2 and 3. Norm + RoPE and the stores, row by row.
    const bool cancelled = storage.cancelled != 0;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kRowsPerThread; ++j) {
      const int r = half_warp + j * kHalfWarps;
      const int64_t row = first_row + r;
      const bool valid = row < p.rows;
      uint4 raw = *reinterpret_cast<const uint4*>(storage.tile + r * kPitch + lane * kHeadVec);
      if (valid && p.projection != nullptr) {
        *reinterpret_cast<uint4*>(p.projection + row * features + n + lane * kHeadVec) = raw;
      }
      if (only) continue;
      if (norm) NormRopeHead(raw, valid, w, cs[j]);  // the same for every lane of the tile
      if (valid && !cancelled) {
        *reinterpret_cast<uint4*>(dest.out + DestRowOffset(p, dest, row) + lane * kHeadVec) = raw;
      }
    }

    // 4. Readiness (ArriveTile). The barrier also keeps the shared tile until every half-warp
    // has read it.
    cutlass::arch::NamedBarrier::sync(kThreads, barrier);
    if (p.counters != nullptr && thread_idx == 0) ArriveTile(p, m_tile);
  }

 private:
  Params const* params_;
};

// The epilogue of one tile of the cooperative kernel straight from the accumulators, without
// shared memory, run by both consumer warpgroups together: 128 rows of two heads side by side,
// so that a row's cos/sin serves both heads (on 256 x 128 tiles of one head each output read
// twice the cos/sin, and the kernel was 0.5-7% slower: docs/benchmarks.md). A warpgroup's
// 64 x 256 MMA leaves each quad of lanes (4k .. 4k + 3) 2 rows (the two warpgroups' 64-row
// bands, so the rows are read off the MMA's own partition of the tile's coordinates), lane q
// with columns 2q, 2q + 1 of each 8-column block. Per row and head, the quad transposes its
// blocks in groups of 4 (QuadSend / QuadReceive), so that lane q holds blocks q, 4 + q, 8 + q
// and 12 + q of the head whole: 16-byte vectors to store, and 4 of the 16 partials of the
// head's sum of squares, which the quad then adds in the reference's order (QuadPartialSum
// and two exchanges). Norm + RoPE per
// vector is NormRopeVec, as in the other paths, so the bits are theirs.
class NormRopeRegisterEpilogue : public EpilogueOperatorBase {
 public:
  static constexpr int kHeads = 2;
  static constexpr int kTileM = 128;
  static constexpr int kTileN = kHeads * kHeadDim;
  static constexpr int kThreads = 256;
  static constexpr int kRows = 2;             // rows of each lane
  static constexpr int kBlocks = kTileN / 8;  // 8-column blocks of a row
  static constexpr const char* kForm = " from registers, two heads a tile";

  struct SharedStorage {
    int unused;  // no staging: the adapter asks for a type
  };
  using TensorStorage = SharedStorage;

  // `params` is kept by address, as NormRopeStoreEpilogue's.
  CUTLASS_HOST_DEVICE explicit NormRopeRegisterEpilogue(Params const& params)
      : params_(&params) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL, BlockShapeMNK, BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    // A warpgroup's 64 x 256 MMA (values: 2 columns x 2 row halves x 32 blocks), once along M.
    CUTE_STATIC_ASSERT_V(size<0>(accumulators) == Int<4 * kBlocks>{});
    CUTE_STATIC_ASSERT_V(size<1>(accumulators) == Int<1>{});
    CUTE_STATIC_ASSERT_V(size<2>(accumulators) == Int<1>{});
    const Params& p = *params_;
    if (p.gemm_alone != 0) return;
    const uint32_t barrier = EpilogueBarrier<kThreads>();
    const TileOf tile = TileAt<kTileM, kTileN>(p, blk_coord_mnkl);
    if (!tile.in_problem) return;
    const int m_tile = tile.m_tile;
    const int64_t features = tile.features;
    const bool only = p.projection_only != 0;
    const int lane = thread_idx % 32, q = lane % 4;
    // The tile's coordinates as the MMA partitions its accumulators: value 2v is this lane's
    // first column of block 0 in row half v.
    const Tensor coords = tiled_mma.get_thread_slice(thread_idx)
                              .partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<kTileN>>{}));
    HeadOf head[kHeads];
    bool norm[kHeads];  // alike for every thread of the tile
    bool any_norm = false;
    CUTLASS_PRAGMA_UNROLL
    for (int hh = 0; hh < kHeads; ++hh) {
      head[hh] = HeadAt(p, tile, hh);
      norm[hh] = head[hh].in_problem && head[hh].plane < 2 && !only;
      any_norm = any_norm || norm[hh];
    }
    // The cancel word, read once per warp (without a shared tile there is no place to share
    // one read by the whole tile): a cancel that lands during the tile may leave some of its
    // rows stored and others not, as it may between the tiles of a call.
    const bool cancelled = !only && WarpCancelled(p);
    int64_t row[kRows];
    int32_t pos[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kRows; ++k) {
      row[k] = int64_t{m_tile} * kTileM + get<0>(coords(2 * k, 0, 0));
      pos[k] = any_norm && row[k] < p.rows ? p.positions[row[k]] : 0;
    }
    // 1. Accumulators -> bf16 pairs (round to nearest even): u[k][b] is columns 8b + 2q and
    // 8b + 2q + 1 of row k.
    uint32_t u[kRows][kBlocks];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kRows; ++k) {
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kBlocks; ++b) {
        const int v = 4 * b + 2 * k;
        const __nv_bfloat162 pair =
            __floats2bfloat162_rn(accumulators(v, 0, 0), accumulators(v + 1, 0, 0));
        u[k][b] = *reinterpret_cast<const uint32_t*>(&pair);
      }
    }
    // The norm weights of one plane at a time: the heads of a tile share theirs unless the
    // tile straddles Q and K (an odd H), where each head loads its own when its turn comes.
    uint4 w[4] = {};
    int w_plane = -1;
    const auto load_weights = [&](int plane) {
      if (plane == w_plane) return;
      CUTLASS_PRAGMA_UNROLL
      for (int g = 0; g < 4; ++g) {
        w[g] = LoadNormWeightPairs(plane == 0 ? p.q_norm : p.k_norm, 4 * g + q);
      }
      w_plane = plane;
    };
    if (any_norm) load_weights(norm[0] ? head[0].plane : head[1].plane);
    TileDest dest[kHeads];
    CUTLASS_PRAGMA_UNROLL
    for (int hh = 0; hh < kHeads; ++hh) dest[hh] = DestOf(p, head[hh].plane, head[hh].head);

    // 2 and 3, row by row: the quad's transpose, norm + RoPE, the stores. Each row's cos/sin
    // is loaded during the row before it (ahead of that row's stores, which the compiler may
    // not move loads across), so that no row waits for its own.
    CosSin next[4] = {};
    const auto load_cos_sin = [&](int k) {
      if (!any_norm) return;
      const float* cs_row = CosSinRow(p.cos_sin, pos[k], p.shape.max_pos);
      CUTLASS_PRAGMA_UNROLL
      for (int g = 0; g < 4; ++g) next[g] = LoadCosSin(cs_row, 4 * g + q);
    };
    load_cos_sin(0);
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kRows; ++k) {
      CosSin cs[4];
      CUTLASS_PRAGMA_UNROLL
      for (int g = 0; g < 4; ++g) cs[g] = next[g];
      if (k + 1 < kRows) load_cos_sin(k + 1);
      const bool valid = row[k] < p.rows;
      CUTLASS_PRAGMA_UNROLL
      for (int hh = 0; hh < kHeads; ++hh) {
        if (!head[hh].in_problem) continue;
        uint4 vec[4];
        CUTLASS_PRAGMA_UNROLL
        for (int g = 0; g < 4; ++g) {
          const int b0 = 16 * hh + 4 * g;
          uint32_t a[4] = {u[k][b0], u[k][b0 + 1], u[k][b0 + 2], u[k][b0 + 3]};
          CUTLASS_PRAGMA_UNROLL
          for (int step = 1; step <= 2; ++step) {
            uint32_t send[2], got[2];
            QuadSend(a, q, step, send);
            got[0] = __shfl_xor_sync(0xffffffffu, send[0], step);
            got[1] = __shfl_xor_sync(0xffffffffu, send[1], step);
            QuadReceive(a, q, step, got);
          }
          vec[g] = make_uint4(a[0], a[1], a[2], a[3]);
        }
        if (valid && p.projection != nullptr) {
          uint16_t* at = p.projection + row[k] * features + head[hh].n;
          CUTLASS_PRAGMA_UNROLL
          for (int g = 0; g < 4; ++g) {
            *reinterpret_cast<uint4*>(at + (4 * g + q) * kHeadVec) = vec[g];
          }
        }
        if (only) continue;
        if (norm[hh]) {
          float y[4][kHeadVec], part[4];
          CUTLASS_PRAGMA_UNROLL
          for (int g = 0; g < 4; ++g) {
            Unpack(vec[g], y[g]);
            part[g] = SumSquares(y[g]);
          }
          float sum_sq = QuadPartialSum(part);
          sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, 2);
          sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, 1);
          if (valid) {
            const float inv_rms = InvRms(sum_sq);
            load_weights(head[hh].plane);
            CUTLASS_PRAGMA_UNROLL
            for (int g = 0; g < 4; ++g) NormRopeVec(vec[g], y[g], inv_rms, w[g], cs[g]);
          }
        }
        if (valid && !cancelled) {
          uint16_t* at = dest[hh].out + DestRowOffset(p, dest[hh], row[k]);
          CUTLASS_PRAGMA_UNROLL
          for (int g = 0; g < 4; ++g) {
            *reinterpret_cast<uint4*>(at + (4 * g + q) * kHeadVec) = vec[g];
          }
        }
      }
    }

    // 4. Readiness (ArriveTile), after every thread's stores.
    cutlass::arch::NamedBarrier::sync(kThreads, barrier);
    if (p.counters != nullptr && thread_idx == 0) ArriveTile(p, m_tile);
  }

 private:
  Params const* params_;
};

// The cooperative kernel with warps of its own for the epilogue (EpilogueWarpsKernel):
// CUTLASS's mainloop collective (the cooperative schedule's two consumer warpgroups on one
// 128 x 256 tile of two heads, fed by a TMA producer warp) and persistent tile scheduler, in a
// kernel of our own whose producer warpgroup's other three warps (idle in CUTLASS's kernel) run
// the epilogue. After its mainloop, a tile's consumers round their accumulators to bf16 into a
// shared staging tile and go on to the next tile's mainloop at once; the epilogue warps take
// the tile's rows from the staging tile through steps 2 to 4 beside that mainloop. So the
// epilogue's time (11% of the cooperative kernel's at 4096 rows, where its consumers ran it
// between mainloops: docs/benchmarks.md) is hidden but for the staging stores and the last
// tile's. The staging tile (66 KiB) leaves room for 3 mainloop stages, not 4. (A fourth
// warpgroup cannot be had: at 512 threads a thread has 128 registers, and a consumer's
// 64 x 256 MMA needs about 154.)
//
// The hand-off is two named barriers of the 352 consumer and epilogue threads: kStagedBarrier
// (consumers arrive once the tile is staged; the epilogue warps wait) and kFreeBarrier (the
// epilogue warps arrive once they have read the tile; consumers wait before staging the next).
// The epilogue warps arrive on kFreeBarrier once before their first tile and the consumers
// wait on it once after their last, so each side's count of the two is the same. Both sides
// stage the same tiles (Staged): every tile of the scheduler's sequence that is in the problem
// but the CTA's last, none when the epilogue is skipped (gemm_alone). The last tile's epilogue
// the consumers run themselves from their registers (NormRopeRegisterEpilogue), beside the
// epilogue warps' work on the tile before: on 3 warps a tile's epilogue takes longer than on
// the consumers' 8, and after the last mainloop there is nothing to hide it behind.
struct EpilogueWarpsForm {
  static constexpr int kHeads = 2;
  static constexpr int kTileM = 128;
  static constexpr int kTileN = kHeads * kHeadDim;
  static constexpr int kPitch = kTileN + 8;  // bf16 elements per staged row: no bank conflicts
  static constexpr const char* kForm =
      " from a shared tile by warps of its own, two heads a tile";
  struct Staging {
    alignas(128) uint16_t tile[kTileM * kPitch];
  };
};

template <int kClusterM>
struct EpilogueWarpsKernel {
  using Form = EpilogueWarpsForm;
  using TileShape =
      cute::Shape<cute::Int<Form::kTileM>, cute::Int<Form::kTileN>, cute::Int<kTileK>>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::_1, cute::_1>;
  using ProblemShape = cute::Shape<int, int, int, int>;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8,
      Element, cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(Form::Staging) + 128)>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using TiledMma = typename CollectiveMainloop::TiledMma;
  using StrideA = typename CollectiveMainloop::StrideA;
  using StrideB = typename CollectiveMainloop::StrideB;
  using MainloopPipeline = typename CollectiveMainloop::MainloopPipeline;
  using PipelineState = typename CollectiveMainloop::PipelineState;
  using TileScheduler = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

  static constexpr uint32_t kMmaThreads = cute::size(TiledMma{});
  static_assert(kMmaThreads == 256, "two consumer warpgroups on each tile");
  static constexpr uint32_t MaxThreadsPerBlock = kMmaThreads + cutlass::NumThreadsPerWarpGroup;
  static constexpr uint32_t MinBlocksPerMultiprocessor = 1;
  // Registers per thread after the start (168 each: the block's pool is 168 x 384, and an
  // increase waits until the pool has the registers): the producer warpgroup (the TMA warp and
  // the epilogue warps) gives up 80 of them, and the consumers take them for their last tile's
  // epilogue from registers.
  static constexpr uint32_t kStartRegisters = 65536 / MaxThreadsPerBlock / 8 * 8;
  static constexpr uint32_t kProducerRegisters = 88;
  static constexpr uint32_t kConsumerRegisters = 208;
  static_assert(kProducerRegisters * cutlass::NumThreadsPerWarpGroup +
                    kConsumerRegisters * kMmaThreads <=
                kStartRegisters * MaxThreadsPerBlock);
  static constexpr int kEpilogueThreads = cutlass::NumThreadsPerWarpGroup - 32;  // warps 1 to 3
  static constexpr uint32_t kHandOffThreads = kMmaThreads + kEpilogueThreads;
  // User named barriers (CUTLASS offsets them past the ones it reserves), past the one of
  // NormRopeRegisterEpilogue (EpilogueBarrier), which the consumers run on their last tile.
  static constexpr uint32_t kStagedBarrier = 2, kFreeBarrier = 3, kEpilogueTileBarrier = 4;

  struct SharedStorage {
    typename CollectiveMainloop::TensorStorage mainloop;  // first: the most aligned place
    Form::Staging staging;
    alignas(16) typename CollectiveMainloop::PipelineStorage pipeline;
  };
  static constexpr int SharedStorageSize = sizeof(SharedStorage);
  static_assert(SharedStorageSize <= cutlass::gemm::collective::detail::sm90_smem_capacity_bytes);

  struct Arguments {
    cutlass::gemm::GemmUniversalMode mode{};
    ProblemShape problem_shape{};
    typename CollectiveMainloop::Arguments mainloop{};
    EpilogueParams epilogue{};
    cutlass::KernelHardwareInfo hw_info{};
    typename TileScheduler::Arguments scheduler{};
  };
  struct Params {
    ProblemShape problem_shape{};
    typename CollectiveMainloop::Params mainloop{};
    EpilogueParams epilogue{};
    cutlass::KernelHardwareInfo hw_info{};
    typename TileScheduler::Params scheduler{};
  };

  static Params to_underlying_arguments(const Arguments& args, void*) {
    const cutlass::KernelHardwareInfo hw{args.hw_info.device_id, args.hw_info.sm_count, 0};
    return {args.problem_shape,
            CollectiveMainloop::to_underlying_arguments(args.problem_shape, args.mainloop, nullptr),
            args.epilogue, hw,
            TileScheduler::to_underlying_arguments(args.problem_shape, TileShape{}, ClusterShape{},
                                                   hw, args.scheduler, nullptr)};
  }
  static bool can_implement(const Arguments& args) {
    return args.mode == cutlass::gemm::GemmUniversalMode::kGemm &&
           CollectiveMainloop::can_implement(args.problem_shape, args.mainloop) &&
           TileScheduler::can_implement(args.scheduler);
  }
  static size_t get_workspace_size(const Arguments&) { return 0; }
  static dim3 get_grid_shape(const Params& params) {
    typename TileScheduler::Arguments args{};
    args.max_swizzle_size = 1 << params.scheduler.log_swizzle_size_;
    args.raster_order = params.scheduler.raster_order_ == TileScheduler::RasterOrder::AlongN
                            ? TileScheduler::RasterOrderOptions::AlongN
                            : TileScheduler::RasterOrderOptions::AlongM;
    return TileScheduler::get_grid_shape(params.scheduler, params.problem_shape, TileShape{},
                                         ClusterShape{}, params.hw_info, args);
  }
  static dim3 get_block_shape() { return dim3(MaxThreadsPerBlock, 1, 1); }

  // Whether a tile is staged for the epilogue warps: alike on both sides of the hand-off. The
  // CTA's last tile is not: its consumers, with nothing left to multiply, run its epilogue
  // themselves from their registers (NormRopeRegisterEpilogue, on 8 warps, not 3), beside the
  // epilogue warps' work on the tile before.
  template <class WorkTile>
  CUTLASS_DEVICE static bool Staged(const EpilogueParams& p, const TileScheduler& scheduler,
                                    WorkTile& work) {
    return p.gemm_alone == 0 && work.N_idx < p.n_tiles &&
           int64_t{work.M_idx} * Form::kTileM < p.rows && !scheduler.is_last_tile(work);
  }

  CUTLASS_DEVICE void operator()(const Params& params, char* smem) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace cute;
    SharedStorage& storage = *reinterpret_cast<SharedStorage*>(smem);
    const int warp_group = cutlass::canonical_warp_group_idx();
    const int warp = cutlass::canonical_warp_idx_sync();
    const int lane_predicate = cute::elect_one_sync();
    if (warp == 0 && lane_predicate) CollectiveMainloop::prefetch_tma_descriptors(params.mainloop);

    typename MainloopPipeline::Params pipeline_params;
    if (warp == 0) pipeline_params.role = MainloopPipeline::ThreadCategory::Producer;
    if (warp_group == 1 || warp_group == 2)
      pipeline_params.role = MainloopPipeline::ThreadCategory::Consumer;
    pipeline_params.is_leader = threadIdx.x % cutlass::NumThreadsPerWarpGroup == 0;
    pipeline_params.num_consumers = kMmaThreads;
    pipeline_params.num_producers = CollectiveMainloop::NumProducerThreadEvents;
    pipeline_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
    MainloopPipeline pipeline(storage.pipeline, pipeline_params, ClusterShape{});
    // Every CTA of the cluster sees the pipeline's barriers made before any uses them.
    if constexpr (kClusterM > 1) {
      cute::cluster_arrive_relaxed();
      cute::cluster_wait();
    } else {
      __syncthreads();
    }

    const auto problem = params.problem_shape;
    CollectiveMainloop mainloop;
    TileScheduler scheduler{params.scheduler};
    auto work = scheduler.initial_work_tile_info(ClusterShape{});
    const EpilogueParams& p = params.epilogue;

    if (warp_group == 0) cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (warp == 0) {  // the producer: loads every tile's operands
      const auto inputs = mainloop.load_init(problem, params.mainloop);
      const auto gA = get<0>(inputs);
      PipelineState write = cutlass::make_producer_start_state<MainloopPipeline>();
      for (; work.is_valid(); work = get<0>(scheduler.fetch_next_work(work))) {
        const auto blk = make_coord(work.M_idx, work.N_idx, _, work.L_idx);
        const int k_tiles = TileScheduler::get_work_k_tile_count(work, problem, TileShape{});
        const auto k_iter = make_coord_iterator(idx2crd(0, shape<3>(gA)), shape<3>(gA));
        mainloop.load(params.mainloop, pipeline, write, inputs, blk, k_iter, k_tiles,
                      cutlass::canonical_lane_idx(), cute::block_rank_in_cluster(),
                      storage.mainloop);
        write.advance(k_tiles);
      }
      mainloop.load_tail(pipeline, write);
    } else if (warp_group > 0) {  // the consumers: mainloop, then the staging stores
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
      const int mma_thread = static_cast<int>(threadIdx.x) - cutlass::NumThreadsPerWarpGroup;
      TiledMma tiled_mma;
      PipelineState read;
      bool staged_any = false;
      auto accumulators = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));
      for (; work.is_valid(); work = get<0>(scheduler.fetch_next_work(work))) {
        const int k_tiles = TileScheduler::get_work_k_tile_count(work, problem, TileShape{});
        mainloop.mma(pipeline, read, accumulators, k_tiles, mma_thread, storage.mainloop,
                     params.mainloop);
        mainloop.mma_tail(pipeline, read, k_tiles);
        read.advance(k_tiles);
        if (scheduler.is_last_tile(work)) break;
        if (!Staged(p, scheduler, work)) continue;
        cutlass::arch::NamedBarrier::sync(kHandOffThreads, kFreeBarrier);
        StageTile(accumulators, tiled_mma, mma_thread, storage.staging.tile);
        cutlass::arch::NamedBarrier::arrive(kHandOffThreads, kStagedBarrier);
        staged_any = true;
      }
      if (work.is_valid()) {  // the last tile: its epilogue here, from the registers
        NormRopeRegisterEpilogue last(p);
        last(problem, TileShape{}, make_coord(work.M_idx, work.N_idx, _, work.L_idx),
             accumulators, tiled_mma, TileShape{}, mma_thread, nullptr);
      }
      if (staged_any) cutlass::arch::NamedBarrier::sync(kHandOffThreads, kFreeBarrier);
    } else {  // the epilogue warps
      if (p.gemm_alone != 0) return;
      const int t = static_cast<int>(threadIdx.x) - 32;
      bool first = true;
      for (; work.is_valid(); work = get<0>(scheduler.fetch_next_work(work))) {
        if (!Staged(p, scheduler, work)) continue;
        if (first) cutlass::arch::NamedBarrier::arrive(kHandOffThreads, kFreeBarrier);
        first = false;
        EpilogueTile(p, work, storage.staging.tile, t);  // arrives on kFreeBarrier once read
      }
    }
#endif
  }

 private:
  // Step 1 (consumer threads): the accumulators, rounded to bf16 pairs (round to nearest even,
  // as cuBLASLt's bf16 output), into the staging tile at their place in the tile (values v and
  // v + 1 of the MMA's partition are adjacent columns of a row).
  template <class Accumulators>
  CUTLASS_DEVICE static void StageTile(const Accumulators& accumulators, TiledMma tiled_mma,
                                       int mma_thread, uint16_t* staging) {
    using namespace cute;
    const Tensor coords =
        tiled_mma.get_thread_slice(mma_thread)
            .partition_C(make_identity_tensor(Shape<Int<Form::kTileM>, Int<Form::kTileN>>{}));
    CUTE_STATIC_ASSERT_V(size(coords) == size(accumulators));
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < size(accumulators); v += 2) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(accumulators(v), accumulators(v + 1));
      *reinterpret_cast<__nv_bfloat162*>(staging + get<0>(coords(v)) * Form::kPitch +
                                         get<1>(coords(v))) = pair;
    }
  }

  // Steps 2 to 4 of a staged tile (epilogue thread t): each half-warp takes rows half_warp + 6j,
  // both heads of each, as NormRopeStoreEpilogue takes a row of one head. The weights and the
  // first row's position and cos/sin are loaded before the tile is staged; each row's cos/sin
  // during the row before it, and its position during the row before that.
  template <class WorkTile>
  CUTLASS_DEVICE static void EpilogueTile(const EpilogueParams& p, const WorkTile& work,
                                          const uint16_t* staging, int t) {
    constexpr int kHalfWarps = kEpilogueThreads / kHeadLanes;
    const TileOf tile = TileAt<Form::kTileM, Form::kTileN>(
        p, cute::make_coord(work.M_idx, work.N_idx, cute::_, work.L_idx));
    const bool only = p.projection_only != 0;
    const int lane = t % kHeadLanes, half_warp = t / kHeadLanes;
    HeadOf head[Form::kHeads];
    bool norm[Form::kHeads];
    bool any_norm = false;
    uint4 w[Form::kHeads] = {};
    TileDest dest[Form::kHeads];
    CUTLASS_PRAGMA_UNROLL
    for (int hh = 0; hh < Form::kHeads; ++hh) {
      head[hh] = HeadAt(p, tile, hh);
      norm[hh] = head[hh].in_problem && head[hh].plane < 2 && !only;
      any_norm = any_norm || norm[hh];
      if (norm[hh]) w[hh] = LoadNormWeightPairs(head[hh].plane == 0 ? p.q_norm : p.k_norm, lane);
      dest[hh] = DestOf(p, head[hh].plane, head[hh].head);
    }
    const int64_t first_row = int64_t{tile.m_tile} * Form::kTileM;
    const auto position = [&](int r) {
      const int64_t row = first_row + r;
      return any_norm && r < Form::kTileM && row < p.rows ? p.positions[row] : 0;
    };
    const auto cos_sin = [&](int32_t pos) {
      return any_norm ? LoadCosSin(CosSinRow(p.cos_sin, pos, p.shape.max_pos), lane) : CosSin{};
    };
    const bool cancelled = !only && WarpCancelled(p);
    CosSin next = cos_sin(position(half_warp));
    int32_t pos_after = position(half_warp + kHalfWarps);
    cutlass::arch::NamedBarrier::sync(kHandOffThreads, kStagedBarrier);
    for (int r = half_warp; r < Form::kTileM; r += kHalfWarps) {  // alike for the warp's halves
      const CosSin cs = next;
      next = cos_sin(pos_after);
      pos_after = position(r + 2 * kHalfWarps);
      const int64_t row = first_row + r;
      const bool valid = row < p.rows;
      CUTLASS_PRAGMA_UNROLL
      for (int hh = 0; hh < Form::kHeads; ++hh) {
        if (!head[hh].in_problem) continue;
        uint4 raw = *reinterpret_cast<const uint4*>(staging + r * Form::kPitch + hh * kHeadDim +
                                                    lane * kHeadVec);
        if (valid && p.projection != nullptr) {
          *reinterpret_cast<uint4*>(p.projection + row * tile.features + head[hh].n +
                                    lane * kHeadVec) = raw;
        }
        if (only) continue;
        if (norm[hh]) NormRopeHead(raw, valid, w[hh], cs);  // alike for every lane of the tile
        if (valid && !cancelled) {
          *reinterpret_cast<uint4*>(dest[hh].out + DestRowOffset(p, dest[hh], row) +
                                    lane * kHeadVec) = raw;
        }
      }
    }
    // The staging tile is read: the consumers may stage the next (the caller arrives once more,
    // before its first tile). Then readiness (ArriveTile), after every thread's stores.
    cutlass::arch::NamedBarrier::arrive(kHandOffThreads, kFreeBarrier);
    if (p.counters != nullptr) {
      cutlass::arch::NamedBarrier::sync(kEpilogueThreads, kEpilogueTileBarrier);
      if (t == 0) ArriveTile(p, tile.m_tile);
    }
  }
};

// EpilogueWarpsKernel as CutlassEpilogueGemm takes a kernel (EpilogueKernel's members).
template <int kClusterM>
struct EpilogueWarpsGemm {
  static constexpr int kCluster = kClusterM;
  static constexpr const char* kName = "cooperative";
  using Epilogue = EpilogueWarpsForm;
  using Kernel = EpilogueWarpsKernel<kClusterM>;
  using CollectiveMainloop = typename Kernel::CollectiveMainloop;
};

// The GEMM kernel with this epilogue: CUTLASS's ping-pong schedule on 128 x 128 tiles (one
// per consumer warpgroup) or its cooperative schedule on 128 x 256 tiles (both warpgroups on
// one tile, 64 rows each, then on its epilogue together); single CTAs (kClusterM 1) or
// clusters of 2 along M.
// x [rows, hidden] row-major is A (M x K, K-major); w_qkv [features, hidden] row-major is B as
// K x N column-major (also K-major): the TN GEMM that Hopper's TMA + wgmma path wants.
template <int kClusterM, class Schedule, class EpilogueOp>
struct EpilogueKernel {
  static constexpr bool kPingpong =
      std::is_same_v<Schedule, cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  static constexpr int kCluster = kClusterM;
  static constexpr const char* kName = kPingpong ? "ping-pong" : "cooperative";
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::_1, cute::_1>;
  using Epilogue = EpilogueOp;
  // Every tile is one readiness unit (ArriveTile): 128 rows of one head (ping-pong) or two.
  static_assert(Epilogue::kTileM == kEpilogueTileRows);
  static_assert(Epilogue::kTileN == (kPingpong ? 1 : 2) * kHeadDim);
  using TileShape =
      cute::Shape<cute::Int<Epilogue::kTileM>, cute::Int<Epilogue::kTileN>, cute::Int<kTileK>>;
  using CollectiveEpilogue =
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Epilogue>;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8,
      Element, cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                           CollectiveEpilogue, cutlass::gemm::PersistentScheduler>;
};
template <int kClusterM>
using PingpongKernel = EpilogueKernel<kClusterM, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                      NormRopeStoreEpilogue>;
template <int kClusterM>
using CooperativeRegisterKernel =
    EpilogueKernel<kClusterM, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                   NormRopeRegisterEpilogue>;

template <class K>
class CutlassEpilogueGemm final : public EpilogueGemm {
 public:
  using GemmKernel = typename K::Kernel;
  static constexpr int kTileM = K::Epilogue::kTileM;
  static constexpr int kTileN = K::Epilogue::kTileN;
  static constexpr int kTileDepth = cute::size<2>(typename GemmKernel::TileShape{});
  CutlassEpilogueGemm(int64_t features, int64_t hidden, int device, int sms)
      : features_(features), hidden_(hidden), device_(device), sms_(sms) {}

  static absl::Status Setup() {
    ULY_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(cutlass::device_kernel<GemmKernel>,
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  GemmKernel::SharedStorageSize));
    return absl::OkStatus();
  }

  absl::Status Run(const EpilogueCall& c, cudaStream_t stream) override {
    const ScopedDevice on_device(device_);
    ULY_CUDA_RETURN_IF_ERROR(on_device.status());
    const QkvNormRopeShape& s = c.shape;
    ULY_RETURN_IF_ERROR(CheckShapeAndRows(s, 0, QkvRows(s)));
    if (QkvFeatures(s) != features_ || QkvHidden(s) != hidden_)
      return absl::InvalidArgumentError(absl::StrCat(
          "shape: 3*H*D = ", QkvFeatures(s), " and hidden = ", QkvHidden(s),
          " differ from the GEMM's ", features_, " and ", hidden_));
    ULY_RETURN_IF_ERROR(CheckAligned("x", c.x));
    ULY_RETURN_IF_ERROR(CheckAligned("weights.w_qkv", c.weights.w_qkv));
    const int64_t rows = QkvRows(s);
    EpilogueParams e{};
    if (c.gemm_alone && c.projection_only)
      return absl::InvalidArgumentError("gemm_alone and projection_only exclude each other");
    if (c.gemm_alone) {
      e.gemm_alone = 1;
    } else if (c.projection_only) {
      ULY_RETURN_IF_ERROR(CheckAligned("projection", c.projection));
      e.projection_only = 1;
      e.shape = s;  // the projection's row pitch (3*H*D) and the tiles' planes and heads
      e.rows = static_cast<int32_t>(rows);
      e.n_tiles = NTiles();
      e.projection = static_cast<uint16_t*>(c.projection);
    } else {
      ULY_RETURN_IF_ERROR(CheckEpilogueArguments(c, rows));
      FillEpilogueParams(c, rows, e);
    }
    return Launch(c, rows, e, stream);
  }

  std::string Description() const override {
    return absl::StrCat("cutlass sm90a tma warp-specialized ", K::kName, ", persistent, tile ",
                        kTileM, "x", kTileN, "x", kTileDepth, ", cluster ", K::kCluster,
                        "x1, swizzle up to 8, ", K::CollectiveMainloop::DispatchPolicy::Stages,
                        " stages, epilogue norm_rope_store", K::Epilogue::kForm);
  }

 private:
  // Tiles across the features (the last one half outside where a tile of two heads meets an
  // odd 3H).
  int32_t NTiles() const { return static_cast<int32_t>((features_ + kTileN - 1) / kTileN); }

  static absl::Status CheckEpilogueArguments(const EpilogueCall& c, int64_t rows) {
    const QkvNormRopeShape& s = c.shape;
    ULY_RETURN_IF_ERROR(CheckWeights(c.weights, c.positions));
    ULY_RETURN_IF_ERROR(CheckDestinations(s, c.layout, c.src, c.dests, c.chunk_counters));
    if (c.chunk_rows <= 0 || c.chunk_rows % kEpilogueTileRows != 0)
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk_rows ", c.chunk_rows, " is not a positive multiple of ", kEpilogueTileRows));
    if ((rows + c.chunk_rows - 1) / c.chunk_rows > kMaxFusedChunks)
      return absl::InvalidArgumentError(
          absl::StrCat("chunk_rows ", c.chunk_rows, " makes more than ", kMaxFusedChunks,
                       " chunks of ", rows, " rows"));
    if (c.projection != nullptr) ULY_RETURN_IF_ERROR(CheckAligned("projection", c.projection));
    return absl::OkStatus();
  }

  void FillEpilogueParams(const EpilogueCall& c, int64_t rows, EpilogueParams& e) const {
    const QkvNormRopeShape& s = c.shape;
    e.shape = s;
    e.layout = c.layout;
    e.src = c.src;
    e.rows = static_cast<int32_t>(rows);
    e.chunk_units = static_cast<int32_t>(c.chunk_rows / kEpilogueTileRows);
    e.n_tiles = NTiles();
    e.positions = c.positions;
    e.q_norm = static_cast<const uint16_t*>(c.weights.q_norm);
    e.k_norm = static_cast<const uint16_t*>(c.weights.k_norm);
    e.cos_sin = c.weights.cos_sin;
    for (int d = 0; d < s.world; ++d) {
      e.out[d] = static_cast<uint16_t*>(c.dests.out[d]);
      e.ready[d] = c.dests.ready != nullptr ? c.dests.ready[d] : nullptr;
    }
    e.epoch = c.dests.epoch;
    e.cancel = c.dests.cancel;
    e.counters = c.dests.ready != nullptr ? c.chunk_counters : nullptr;
    e.projection = static_cast<uint16_t*>(c.projection);
  }

  absl::Status Launch(const EpilogueCall& c, int64_t rows, const EpilogueParams& e,
                      cudaStream_t stream) const {
    const int m = static_cast<int>(rows), nf = static_cast<int>(features_),
              k = static_cast<int>(hidden_);
    cutlass::KernelHardwareInfo hw;
    hw.device_id = device_;
    hw.sm_count = sms_;
    typename GemmKernel::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, nf, k, 1},
        {static_cast<const Element*>(c.x),
         cutlass::make_cute_packed_stride(typename GemmKernel::StrideA{}, cute::make_shape(m, k, 1)),
         static_cast<const Element*>(c.weights.w_qkv),
         cutlass::make_cute_packed_stride(typename GemmKernel::StrideB{},
                                          cute::make_shape(nf, k, 1))},
        e,
        hw};
    // Groups of up to 8 tiles along the raster's minor side: a wave of tiles shares its rows
    // of x and its columns of w_qkv in L2 (without it, each wave streams a whole operand).
    // Fewer where 8 would pad the tile grid (EpilogueSwizzle).
    args.scheduler.max_swizzle_size =
        EpilogueSwizzle((rows + kTileM - 1) / kTileM, NTiles(), K::kCluster);
    if (GemmKernel::get_workspace_size(args) != 0)
      return absl::InternalError("the epilogue GEMM asks for a workspace it was not given");
    if (GemmKernel::can_implement(args) == false)
      return absl::InvalidArgumentError(
          absl::StrCat("the epilogue GEMM cannot run ", m, " x ", nf, " x ", k));
    const typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, nullptr);
    const dim3 grid = GemmKernel::get_grid_shape(params);
    const dim3 block = GemmKernel::get_block_shape();
    if constexpr (K::kCluster == 1) {
      cutlass::device_kernel<GemmKernel>
          <<<grid, block, GemmKernel::SharedStorageSize, stream>>>(params);
      ULY_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    } else {
      const cutlass::Status st = cutlass::launch_kernel_on_cluster(
          {grid, block, dim3(K::kCluster, 1, 1), GemmKernel::SharedStorageSize, stream},
          reinterpret_cast<const void*>(&cutlass::device_kernel<GemmKernel>), params);
      if (st != cutlass::Status::kSuccess)
        return absl::InternalError(
            absl::StrCat("cluster launch failed: ", cutlass::cutlassGetStatusString(st)));
    }
    return absl::OkStatus();
  }

 private:
  int64_t features_, hidden_;
  int device_, sms_;
};

template <class K>
absl::StatusOr<std::unique_ptr<EpilogueGemm>> Make(int64_t features, int64_t hidden, int device,
                                                   int sms) {
  ULY_RETURN_IF_ERROR(CutlassEpilogueGemm<K>::Setup());
  return std::unique_ptr<EpilogueGemm>(new CutlassEpilogueGemm<K>(features, hidden, device, sms));
}

}  // namespace

std::string EpilogueGemm::Unavailable() { return {}; }

absl::StatusOr<std::unique_ptr<EpilogueGemm>> EpilogueGemm::Create(int64_t features,
                                                                   int64_t hidden,
                                                                   EpilogueSchedule schedule) {
  if (features <= 0 || features % kHeadDim != 0 || hidden <= 0 || hidden % kHeadDim != 0)
    return absl::InvalidArgumentError(absl::StrCat("features (", features, ") and hidden (",
                                                   hidden, ") must be positive multiples of ",
                                                   kHeadDim));
  int device = 0, major = 0, minor = 0, sms = 0;
  ULY_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  ULY_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  ULY_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  ULY_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (major != 9 || minor != 0)
    return absl::FailedPreconditionError(absl::StrCat(
        "the epilogue-fused GEMM needs an sm_90 GPU; device ", device, " is sm_", major, minor));
  if (schedule == EpilogueSchedule::kPingpongCluster2)
    return Make<PingpongKernel<2>>(features, hidden, device, sms);
  if (schedule == EpilogueSchedule::kCooperativeCluster2TwoHeads)
    return Make<CooperativeRegisterKernel<2>>(features, hidden, device, sms);
  if (schedule == EpilogueSchedule::kCooperativeEpilogueWarps)
    return Make<EpilogueWarpsGemm<2>>(features, hidden, device, sms);
  return Make<PingpongKernel<1>>(features, hidden, device, sms);
}

}  // namespace ulysses::kernels::internal
