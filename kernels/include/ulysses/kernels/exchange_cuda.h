// CUDA launchers of the exchange blocks. Usable from host C++ without CUDA headers: the stream
// type is forward-declared exactly as the CUDA runtime declares it. Built only when the
// project has CUDA (ULYSSES_HAVE_CUDA); without it the launchers return FAILED_PRECONDITION
// and CudaDeviceCount() returns 0.
//
// Every launcher has the semantics of the matching *Ref function of exchange.h, checks its
// arguments before launching (INVALID_ARGUMENT naming the argument; nothing is enqueued),
// enqueues asynchronously on `stream` (nullptr: the legacy default stream) and returns
// INTERNAL if the launch fails. Pointers are device pointers valid on the current device,
// output pointers may be a peer GPU's memory (with peer access enabled). Inputs and outputs
// must not overlap. Loads and stores are 16-byte vectors when rows of D elements are a
// multiple of 16 bytes and every row start is 16-byte aligned; element-wise otherwise.
// Launchers are thread-safe; ordering is that of the stream. `cancel`, when given, is a device
// word read by every block before it stores: nonzero, the launch stores nothing (a cancelled
// session's stream drains without writing into slots that were never opened to it).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ulysses/kernels/exchange.h"

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;  // same declaration as the CUDA runtime's

namespace ulysses::kernels {

/// ScatterHeadsBlockRef on the GPU: one (src, dst) block into dst's [B, S_g, H_l, D] buffer.
absl::Status LaunchScatterHeadsBlock(const ExchangeShape& shape, ConstView x_src, int src, int dst,
                                     void* out_dst, cudaStream_t stream,
                    const uint64_t* cancel = nullptr);

/// GatherHeadsBlockRef on the GPU: one (src, dst) block into dst's [B, S_l, H, D] buffer.
absl::Status LaunchGatherHeadsBlock(const ExchangeShape& shape, ConstView y_src, int src, int dst,
                                    void* out_dst, cudaStream_t stream,
                    const uint64_t* cancel = nullptr);

/// ScatterQkvHeadChunkBlockRef on the GPU: one (src, dst) block into dst's [B, S_g, HC, 3D]
/// buffer (three launches on `stream`, one per q/k/v).
absl::Status LaunchScatterQkvHeadChunkBlock(const ExchangeShape& shape, ConstView q, ConstView k,
                                            ConstView v, int32_t head_offset, int32_t head_count,
                                            int src, int dst, void* out_dst, cudaStream_t stream,
                    const uint64_t* cancel = nullptr);

/// GatherOutputHeadChunkBlockRef on the GPU: one (src, dst) block into dst's staging buffer
/// [B, S_l, W, HC, D].
absl::Status LaunchGatherOutputHeadChunkBlock(const ExchangeShape& shape, ConstView x_src,
                                              int32_t head_count, int src, int dst, void* stage_dst,
                                              cudaStream_t stream,
                    const uint64_t* cancel = nullptr);

/// GatherOutputHeadChunkMergeRef on the GPU: staging buffer -> band of the [B, S_l, H, D]
/// view `out`; other heads untouched.
absl::Status LaunchGatherOutputHeadChunkMerge(const ExchangeShape& shape, const void* stage,
                                              int32_t head_offset, int32_t head_count, MutView out,
                                              cudaStream_t stream,
                    const uint64_t* cancel = nullptr);

/// CopyContiguousToViewRef on the GPU.
absl::Status LaunchCopyContiguousToView(const void* src, const int64_t shape[4], int32_t itemsize,
                                        MutView dst, cudaStream_t stream,
                    const uint64_t* cancel = nullptr);

/// CopyViewToContiguousRef on the GPU.
absl::Status LaunchCopyViewToContiguous(ConstView src, const int64_t shape[4], int32_t itemsize,
                                        void* dst, cudaStream_t stream,
                    const uint64_t* cancel = nullptr);

/// Block (src, dst) of any kind (exchange.h BlockKind) into destination `dst`'s buffer
/// `out_dst`: the matching Launch*Block above.
absl::Status LaunchBlock(const ExchangeShape& shape, const BlockOperands& ops, int src, int dst,
                         void* out_dst, cudaStream_t stream);

/// Every block of source `src`: block (src, d) into `out[d]` for each d in [0, shape.world)
/// whose `out[d]` is not null, as LaunchBlock would store it, in one launch (one per distinct
/// vector width of the blocks, which is one unless the views' alignments differ). Plans every
/// block before launching: a bad argument enqueues nothing.
absl::Status LaunchBlocks(const ExchangeShape& shape, const BlockOperands& ops, int src,
                          void* const* out, cudaStream_t stream, const uint64_t* cancel = nullptr);

/// Bytes of one block of `ops` in packed form (equal for every (src, dst) pair): the block's
/// rows back to back, in the order the block launcher visits them (for the head-chunk scatter,
/// every q row, then every k row, then every v row). Host-only; built without CUDA too.
absl::StatusOr<int64_t> PackedBlockBytes(const ExchangeShape& shape, const BlockOperands& ops);

/// Packs block (src, dst) of this rank's `ops` into `packed` (16-byte aligned, at least
/// PackedBlockBytes bytes), for a transport that moves blocks as flat bytes.
absl::Status LaunchPackBlock(const ExchangeShape& shape, const BlockOperands& ops, int src,
                             int dst, void* packed, cudaStream_t stream);

/// Stores a block that rank `src` packed for `dst` (LaunchPackBlock) into `out_dst` exactly
/// where LaunchBlock would have: the receive buffer ends bit-identical. Reads the kind and head
/// band of `ops`, not its inputs (they are the source's).
absl::Status LaunchUnpackBlock(const ExchangeShape& shape, const BlockOperands& ops, int src,
                               int dst, const void* packed, void* out_dst, cudaStream_t stream,
                               const uint64_t* cancel = nullptr);

/// Number of CUDA devices visible to this process. 0, not an error, when there is no device or
/// no driver (so tests can skip); INTERNAL for any other runtime failure.
absl::StatusOr<int> CudaDeviceCount();

}  // namespace ulysses::kernels
