// CUDA exchange launchers. Every block is one RowCopyPlan (exchange_plan.cc) run by
// RowCopyKernel; the plan, not the kernel, knows which exchange it is.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cancel.cuh"
#include "cuda_check.h"
#include "exchange_plan.h"
#include "ulysses/common/geometry.h"
#include "ulysses/common/status.h"
#include "ulysses/kernels/exchange_cuda.h"

namespace ulysses::kernels {
namespace {

using internal::RowCopyPlan;

constexpr int kThreads = 256;

// blockDim = (plan.lanes, kThreads / plan.lanes): threadIdx.y picks a row (grid-stride over
// all rows), threadIdx.x strides over the row's units, so consecutive lanes touch consecutive
// units of one row and the row decomposition (64-bit div/mod) is paid once per row.
template <typename Unit>
__device__ __forceinline__ void CopyRows(const RowCopyPlan& p) {
  const auto* src = static_cast<const char*>(p.src);
  auto* dst = static_cast<char*>(p.dst);
  const int64_t row_step = int64_t{gridDim.x} * blockDim.y;
  for (int64_t row = int64_t{blockIdx.x} * blockDim.y + threadIdx.y; row < p.rows;
       row += row_step) {
    const internal::RowOffsets o = internal::RowAt(p, row);
    for (int64_t u = threadIdx.x; u < p.units_per_row; u += blockDim.x) {
      const Unit value = *reinterpret_cast<const Unit*>(src + o.src + u * p.src_unit_step);
      *reinterpret_cast<Unit*>(dst + o.dst + u * p.dst_unit_step) = value;
    }
  }
}

template <typename Unit>
__global__ void __launch_bounds__(kThreads) RowCopyKernel(const RowCopyPlan p,
                                                          const uint64_t* cancel) {
  if (internal::BlockCancelled(cancel)) return;
  CopyRows<Unit>(p);
}

// Several plans of one unit width and lane count in one launch: blockIdx.y picks the plan, and
// each plan's rows are strided over gridDim.x blocks. A call's blocks for all its destinations
// (and the q, k, v parts of a head chunk) go out as one launch instead of one each.
constexpr int kPlansPerLaunch = 24;  // 8 destinations x 3 parts
struct PlanBatch {
  RowCopyPlan plans[kPlansPerLaunch];
};
static_assert(sizeof(PlanBatch) <= 4000, "a kernel's parameters stay within 4 KiB");

template <typename Unit>
__global__ void __launch_bounds__(kThreads) RowCopyBatchKernel(const PlanBatch b,
                                                               const uint64_t* cancel) {
  if (internal::BlockCancelled(cancel)) return;
  CopyRows<Unit>(b.plans[blockIdx.y]);
}

// Blocks the current device holds resident at once (one wave): the kernel strides over the rest
// of the rows, so block starts (and the cancel read) are paid once per resident block.
absl::StatusOr<int64_t> ResidentBlocks() {
  int device = 0, sms = 0, threads_per_sm = 0;
  ULY_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  ULY_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  ULY_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device));
  return std::max<int64_t>(1, int64_t{sms} * std::max(1, threads_per_sm / kThreads));
}

absl::Status LaunchPlan(const RowCopyPlan& p, cudaStream_t stream,
                        const uint64_t* cancel = nullptr) {
  const dim3 block(static_cast<unsigned>(p.lanes), static_cast<unsigned>(kThreads / p.lanes));
  ULY_ASSIGN_OR_RETURN(const int64_t resident, ResidentBlocks());
  const int64_t blocks = std::min<int64_t>((p.rows + block.y - 1) / block.y, resident);
  const dim3 grid(static_cast<unsigned>(blocks));
  switch (p.unit_bytes) {
    case 16:
      RowCopyKernel<uint4><<<grid, block, 0, stream>>>(p, cancel);
      break;
    case 4:
      RowCopyKernel<uint32_t><<<grid, block, 0, stream>>>(p, cancel);
      break;
    case 2:
      RowCopyKernel<uint16_t><<<grid, block, 0, stream>>>(p, cancel);
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("no copy kernel for ", p.unit_bytes, "-byte units"));
  }
  ULY_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

// `count` plans of the same unit width and lane count, in one launch.
absl::Status LaunchBatch(const RowCopyPlan* plans, int count, cudaStream_t stream,
                         const uint64_t* cancel) {
  if (count == 1) return LaunchPlan(plans[0], stream, cancel);
  PlanBatch batch;
  int64_t rows = 0;
  for (int i = 0; i < count; ++i) {
    batch.plans[i] = plans[i];
    rows = std::max(rows, plans[i].rows);
  }
  const dim3 block(static_cast<unsigned>(plans[0].lanes),
                   static_cast<unsigned>(kThreads / plans[0].lanes));
  ULY_ASSIGN_OR_RETURN(const int64_t resident, ResidentBlocks());
  const int64_t per_plan = std::max<int64_t>(1, resident / count);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((rows + block.y - 1) / block.y, per_plan));
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(count));
  switch (plans[0].unit_bytes) {
    case 16:
      RowCopyBatchKernel<uint4><<<grid, block, 0, stream>>>(batch, cancel);
      break;
    case 4:
      RowCopyBatchKernel<uint32_t><<<grid, block, 0, stream>>>(batch, cancel);
      break;
    case 2:
      RowCopyBatchKernel<uint16_t><<<grid, block, 0, stream>>>(batch, cancel);
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("no copy kernel for ", plans[0].unit_bytes, "-byte units"));
  }
  ULY_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

// Every plan, in as few launches as their unit widths and lane counts allow (plans with no
// rows are skipped). All of them are planned before this runs, so a bad argument enqueued
// nothing.
absl::Status LaunchPlans(const RowCopyPlan* plans, int count, cudaStream_t stream,
                         const uint64_t* cancel) {
  bool done[kMaxWorldSize * 3] = {};
  if (count > static_cast<int>(sizeof done)) return absl::InternalError("too many plans");
  for (int i = 0; i < count; ++i) {
    if (done[i]) continue;
    RowCopyPlan group[kPlansPerLaunch];
    int n = 0;
    for (int j = i; j < count && n < kPlansPerLaunch; ++j) {
      if (done[j] || plans[j].unit_bytes != plans[i].unit_bytes || plans[j].lanes != plans[i].lanes)
        continue;
      done[j] = true;
      if (plans[j].rows > 0) group[n++] = plans[j];
    }
    // More plans of this kind than one launch takes: the rest start a group of their own.
    if (n > 0) ULY_RETURN_IF_ERROR(LaunchBatch(group, n, stream, cancel));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchScatterHeadsBlock(const ExchangeShape& shape, ConstView x_src, int src, int dst,
                                     void* out_dst, cudaStream_t stream, const uint64_t* cancel) {
  ULY_ASSIGN_OR_RETURN(const RowCopyPlan plan,
                       internal::PlanScatterHeadsBlock(shape, x_src, src, dst, out_dst));
  return LaunchPlan(plan, stream, cancel);
}

absl::Status LaunchGatherHeadsBlock(const ExchangeShape& shape, ConstView y_src, int src, int dst,
                                    void* out_dst, cudaStream_t stream, const uint64_t* cancel) {
  ULY_ASSIGN_OR_RETURN(const RowCopyPlan plan,
                       internal::PlanGatherHeadsBlock(shape, y_src, src, dst, out_dst));
  return LaunchPlan(plan, stream, cancel);
}

absl::Status LaunchScatterQkvHeadChunkBlock(const ExchangeShape& shape, ConstView q, ConstView k,
                                            ConstView v, int32_t head_offset, int32_t head_count,
                                            int src, int dst, void* out_dst, cudaStream_t stream, const uint64_t* cancel) {
  // Plan all three parts before launching any, so a bad argument enqueues nothing.
  const ConstView parts[3] = {q, k, v};
  RowCopyPlan plans[3];
  for (int part = 0; part < 3; ++part) {
    ULY_ASSIGN_OR_RETURN(
        plans[part], internal::PlanScatterQkvHeadChunkPart(shape, parts[part], part, head_offset,
                                                           head_count, src, dst, out_dst));
  }
  return LaunchPlans(plans, 3, stream, cancel);
}

absl::Status LaunchGatherOutputHeadChunkBlock(const ExchangeShape& shape, ConstView x_src,
                                              int32_t head_count, int src, int dst, void* stage_dst,
                                              cudaStream_t stream, const uint64_t* cancel) {
  ULY_ASSIGN_OR_RETURN(const RowCopyPlan plan, internal::PlanGatherOutputHeadChunkBlock(
                                                   shape, x_src, head_count, src, dst, stage_dst));
  return LaunchPlan(plan, stream, cancel);
}

absl::Status LaunchGatherOutputHeadChunkMerge(const ExchangeShape& shape, const void* stage,
                                              int32_t head_offset, int32_t head_count, MutView out,
                                              cudaStream_t stream, const uint64_t* cancel) {
  ULY_ASSIGN_OR_RETURN(const RowCopyPlan plan, internal::PlanGatherOutputHeadChunkMerge(
                                                   shape, stage, head_offset, head_count, out));
  return LaunchPlan(plan, stream, cancel);
}

absl::Status LaunchCopyContiguousToView(const void* src, const int64_t shape[4], int32_t itemsize,
                                        MutView dst, cudaStream_t stream, const uint64_t* cancel) {
  ULY_ASSIGN_OR_RETURN(const RowCopyPlan plan,
                       internal::PlanCopyContiguousToView(src, shape, itemsize, dst));
  return LaunchPlan(plan, stream, cancel);
}

absl::Status LaunchCopyViewToContiguous(ConstView src, const int64_t shape[4], int32_t itemsize,
                                        void* dst, cudaStream_t stream, const uint64_t* cancel) {
  ULY_ASSIGN_OR_RETURN(const RowCopyPlan plan,
                       internal::PlanCopyViewToContiguous(src, shape, itemsize, dst));
  return LaunchPlan(plan, stream, cancel);
}

absl::Status LaunchBlock(const ExchangeShape& shape, const BlockOperands& ops, int src, int dst,
                         void* out_dst, cudaStream_t stream) {
  ULY_ASSIGN_OR_RETURN(const internal::BlockPlans b,
                       internal::PlanBlock(shape, ops, src, dst, out_dst));
  for (int i = 0; i < b.count; ++i) ULY_RETURN_IF_ERROR(LaunchPlan(b.plans[i], stream));
  return absl::OkStatus();
}

absl::Status LaunchBlocks(const ExchangeShape& shape, const BlockOperands& ops, int src,
                          void* const* out, cudaStream_t stream, const uint64_t* cancel) {
  if (shape.world < 1 || shape.world > kMaxWorldSize)
    return absl::InvalidArgumentError(absl::StrCat("shape.world: ", shape.world, " not in [1, ",
                                                   kMaxWorldSize, "]"));
  if (out == nullptr) return absl::InvalidArgumentError("out: null");
  internal::RowCopyPlan plans[kMaxWorldSize * 3];
  int count = 0;
  for (int dst = 0; dst < shape.world; ++dst) {
    if (out[dst] == nullptr) continue;
    ULY_ASSIGN_OR_RETURN(const internal::BlockPlans b,
                         internal::PlanBlock(shape, ops, src, dst, out[dst]));
    for (int i = 0; i < b.count; ++i) plans[count++] = b.plans[i];
  }
  return LaunchPlans(plans, count, stream, cancel);
}

absl::Status LaunchPackBlock(const ExchangeShape& shape, const BlockOperands& ops, int src,
                             int dst, void* packed, cudaStream_t stream) {
  ULY_ASSIGN_OR_RETURN(const internal::BlockPlans b,
                       internal::PlanPackBlock(shape, ops, src, dst, packed));
  for (int i = 0; i < b.count; ++i) ULY_RETURN_IF_ERROR(LaunchPlan(b.plans[i], stream));
  return absl::OkStatus();
}

absl::Status LaunchUnpackBlock(const ExchangeShape& shape, const BlockOperands& ops, int src,
                               int dst, const void* packed, void* out_dst, cudaStream_t stream,
                               const uint64_t* cancel) {
  ULY_ASSIGN_OR_RETURN(const internal::BlockPlans b,
                       internal::PlanUnpackBlock(shape, ops, src, dst, packed, out_dst));
  for (int i = 0; i < b.count; ++i) ULY_RETURN_IF_ERROR(LaunchPlan(b.plans[i], stream, cancel));
  return absl::OkStatus();
}

absl::StatusOr<int> CudaDeviceCount() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
    (void)cudaGetLastError();  // clear it, so the next launch check does not see it
    return 0;
  }
  ULY_CUDA_RETURN_IF_ERROR(err);
  return count;
}

}  // namespace ulysses::kernels
