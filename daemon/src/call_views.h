// A planned call's geometry and operands as the kernels (CPU references or CUDA launchers)
// take them. Shared by the backends.
#pragma once

#include "absl/status/statusor.h"
#include "transport.h"
#include "ulysses/common/strings.h"
#include "ulysses/common/geometry.h"
#include "ulysses/kernels/exchange.h"

namespace ulysses::daemon {

inline kernels::ExchangeShape ShapeOf(const SessionGeometry& g, const CallPlan& plan) {
  return kernels::ExchangeShape{g.world_size, plan.batch, plan.seq_local, g.num_heads, g.head_dim,
                                g.itemsize()};
}

inline kernels::ConstView InputView(const CallPlan& plan, const CallOperands& ops, int i) {
  const auto& s = plan.inputs[i].strides;
  return kernels::ConstView{ops.inputs[i], {s[0], s[1], s[2], s[3]}};
}

inline kernels::MutView OutView(const CallPlan& plan, const CallOperands& ops) {
  const auto& s = plan.out.strides;
  return kernels::MutView{ops.out, {s[0], s[1], s[2], s[3]}};
}

/// A head-exchange call's operands as the kernels' any-kind block launchers take them.
/// INVALID_ARGUMENT for an op that is not one of the four exchanges.
inline absl::StatusOr<kernels::BlockOperands> BlockOperandsOf(const CallPlan& plan,
                                                              const CallOperands& ops) {
  kernels::BlockKind kind;
  switch (plan.op) {
    case OpKind::kScatterHeads: kind = kernels::BlockKind::kScatterHeads; break;
    case OpKind::kGatherHeads: kind = kernels::BlockKind::kGatherHeads; break;
    case OpKind::kScatterQkvHeadChunk: kind = kernels::BlockKind::kScatterQkvHeadChunk; break;
    case OpKind::kGatherOutputHeadChunk: kind = kernels::BlockKind::kGatherOutputHeadChunk; break;
    default:
      return absl::InvalidArgumentError(StrCat("op: ", OpName(plan.op), " is not an exchange block"));
  }
  kernels::BlockOperands out{kind, {}, plan.head_offset, plan.head_count};
  // Absent inputs (one-input ops) repeat the first, so every view is valid to plan with.
  for (int i = 0; i < 3; ++i) out.inputs[i] = InputView(plan, ops, i < plan.num_inputs ? i : 0);
  return out;
}

}  // namespace ulysses::daemon
