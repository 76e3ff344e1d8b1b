// What the fuzz targets share: buffers and geometries drawn from the input, and the checks
// that turn a wrong verdict into a crash the fuzzer reports.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "ulysses/common/fused.h"
#include "ulysses/common/geometry.h"

namespace ulysses::fuzz {

/// Stops the run with a message: the fuzzer records the input as a crash.
[[noreturn]] inline void Fail(const char* what) {
  std::fprintf(stderr, "fuzz invariant violated: %s\n", what);
  std::abort();
}

/// Registered buffers as the validators see them: ids 1..8 with sizes from the input. Small
/// buffers get real bytes (from the input too) behind host_data, so that a validator reading
/// past a buffer's end is caught by the address sanitizer; large ones are device-like (no
/// host bytes). Id 9 belongs to "another client" (PERMISSION_DENIED).
class FuzzBuffers : public BufferResolver {
 public:
  static constexpr uint64_t kForeignId = 9;

  explicit FuzzBuffers(FuzzedDataProvider& in) {
    const int n = in.ConsumeIntegralInRange<int>(0, 8);
    for (uint64_t id = 1; id <= static_cast<uint64_t>(n); ++id) {
      Entry e;
      switch (in.ConsumeIntegralInRange<int>(0, 3)) {
        case 0: e.size = in.ConsumeIntegralInRange<uint64_t>(1, 4096); break;
        case 1: e.size = in.ConsumeIntegralInRange<uint64_t>(1, 1u << 16); break;
        case 2: e.size = in.ConsumeIntegralInRange<uint64_t>(1, 1ull << 40); break;
        default: e.size = in.ConsumeIntegral<uint64_t>(); break;
      }
      if (e.size == 0) e.size = 1;
      if (e.size <= (1u << 16)) {
        e.bytes = in.ConsumeBytes<uint8_t>(e.size);
        e.bytes.resize(e.size);
      }
      buffers_[id] = std::move(e);
    }
  }

  absl::StatusOr<BufferInfo> Resolve(uint64_t id) const override {
    if (id == kForeignId) return absl::PermissionDeniedError("buffer belongs to another client");
    auto it = buffers_.find(id);
    if (it == buffers_.end()) return absl::InvalidArgumentError("buffer is not registered");
    return BufferInfo{it->second.size,
                      it->second.bytes.empty() ? nullptr : it->second.bytes.data()};
  }

  /// The size of buffer `id`; 0 when there is none.
  uint64_t SizeOf(uint64_t id) const {
    auto it = buffers_.find(id);
    return it == buffers_.end() ? 0 : it->second.size;
  }

 private:
  struct Entry {
    uint64_t size = 0;
    std::vector<uint8_t> bytes;
  };
  std::map<uint64_t, Entry> buffers_;
};

/// A session geometry from the input; often invalid, which ValidateSessionGeometry refuses.
inline SessionGeometry DrawGeometry(FuzzedDataProvider& in) {
  SessionGeometry g;
  g.world_size = in.ConsumeIntegralInRange<int32_t>(0, 9);
  g.rank = in.ConsumeIntegralInRange<int32_t>(0, 8);
  g.num_heads = in.ConsumeIntegralInRange<int32_t>(0, 130);
  g.head_dim = in.ConsumeIntegralInRange<int32_t>(0, 300);
  g.dtype = static_cast<DType>(in.ConsumeIntegralInRange<int32_t>(0, 4));
  g.max_tokens = in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(0, 1 << 12)
                                  : in.ConsumeIntegral<int64_t>();
  g.num_slots = in.ConsumeIntegralInRange<int32_t>(0, 5);
  const int bands = in.ConsumeIntegralInRange<int>(0, 4);
  for (int i = 0; i < bands; ++i) g.schedule.push_back(in.ConsumeIntegralInRange<int32_t>(-1, 40));
  return g;
}

/// A fused geometry from the input; often invalid, which ValidateFusedGeometry refuses.
inline FusedGeometry DrawFusedGeometry(FuzzedDataProvider& in) {
  FusedGeometry g;
  g.world_size = in.ConsumeIntegralInRange<int32_t>(0, 9);
  g.rank = in.ConsumeIntegralInRange<int32_t>(0, 8);
  g.num_heads = in.ConsumeIntegralInRange<int32_t>(0, 33);
  g.head_dim = 2 * in.ConsumeIntegralInRange<int32_t>(0, 66);
  g.hidden = in.ConsumeBool() ? g.num_heads * g.head_dim : in.ConsumeIntegral<int32_t>();
  g.dtype = static_cast<DType>(in.ConsumeIntegralInRange<int32_t>(0, 4));
  g.layout = static_cast<QkvLayout>(in.ConsumeIntegralInRange<int32_t>(0, 3));
  g.max_tokens = in.ConsumeIntegralInRange<int64_t>(0, 1 << 12);
  g.num_slots = in.ConsumeIntegralInRange<int32_t>(0, 5);
  g.max_pos = in.ConsumeIntegralInRange<int32_t>(0, 1 << 12);
  return g;
}

/// A resolved operand must lie inside its buffer: the daemon reads or writes exactly
/// [offset_bytes, offset_bytes + span_bytes) of it.
inline void CheckOperandInBuffer(const ResolvedOperand& op, const FuzzBuffers& buffers) {
  const uint64_t size = buffers.SizeOf(op.buffer_id);
  if (size == 0) Fail("a planned operand names a buffer that is not registered");
  if (op.offset_bytes > size || op.span_bytes > size - op.offset_bytes)
    Fail("a planned operand reaches past the end of its buffer");
}

/// What a plan PlanCall or PlanQkvCall admitted must be safe to run: every operand inside its
/// buffer and the result inside one receive slot of `slot_geometry`.
inline void CheckPlan(const CallPlan& plan, const SessionGeometry& slot_geometry,
                      const FuzzBuffers& buffers) {
  if (plan.num_inputs < 0 || plan.num_inputs > 3) Fail("a plan with more than 3 inputs");
  for (int i = 0; i < plan.num_inputs; ++i) CheckOperandInBuffer(plan.inputs[i], buffers);
  if (plan.has_out) CheckOperandInBuffer(plan.out, buffers);
  if (plan.slot_elems < 0 || plan.slot_elems > slot_geometry.SlotElems())
    Fail("a planned call writes more than one receive slot holds");
}

}  // namespace ulysses::fuzz
