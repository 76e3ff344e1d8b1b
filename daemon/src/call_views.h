// A planned call's geometry and operands as the kernels (CPU references or CUDA launchers)
// take them. Shared by the backends.
#pragma once

#include "transport.h"
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

}  // namespace ulysses::daemon
