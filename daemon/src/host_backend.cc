// The host backend: every rank's receive slots live in its session segment (shared memory that
// the group's daemons map), and the CPU block references of kernels/ write into them.
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "call_views.h"
#include "transport.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/shm.h"
#include "ulysses/kernels/exchange.h"
#include "ulysses/kernels/qkv_norm_rope.h"

namespace ulysses::daemon {
namespace {

class HostTransport final : public Transport {
 public:
  explicit HostTransport(const TransportSetup& s) : s_(s) {
    // A fused call reads its positions from this copy: the client's buffer is shared memory it
    // may still write, and the reference indexes the cos/sin table with them. Sized once.
    if (s_.fused) positions_.resize(static_cast<size_t>(s_.fused->geometry.max_tokens));
  }

  std::string LocalHandle() const override { return "host"; }

  absl::Status CheckPeers(const std::vector<std::string>& handles) override {
    return CheckPeersRunThisBackend(handles, s_.geometry.rank,
                                    [](int, const std::string& h) { return h == "host"; });
  }

  absl::Status Connect(const std::vector<std::string>&, const std::vector<std::string>&,
                       const std::vector<uint8_t*>& peer_segments, absl::Duration) override {
    segments_ = peer_segments;
    return absl::OkStatus();
  }

  absl::Status Push(const CallPlan& plan, const CallOperands& ops, int dst, int slot) override {
    const kernels::ExchangeShape shape = ShapeOf(s_.geometry, plan);
    const int me = s_.geometry.rank;
    uint8_t* out = Slot(dst, slot);
    switch (plan.op) {
      case OpKind::kScatterHeads:
        kernels::ScatterHeadsBlockRef(shape, InputView(plan, ops, 0), me, dst, out);
        return absl::OkStatus();
      case OpKind::kGatherHeads:
        kernels::GatherHeadsBlockRef(shape, InputView(plan, ops, 0), me, dst, out);
        return absl::OkStatus();
      case OpKind::kScatterQkvHeadChunk:
        kernels::ScatterQkvHeadChunkBlockRef(shape, InputView(plan, ops, 0),
                                             InputView(plan, ops, 1), InputView(plan, ops, 2),
                                             plan.head_offset, plan.head_count, me, dst, out);
        return absl::OkStatus();
      case OpKind::kGatherOutputHeadChunk:
        kernels::GatherOutputHeadChunkBlockRef(shape, InputView(plan, ops, 0), plan.head_count, me,
                                               dst, out);
        return absl::OkStatus();
      default:
        return absl::InvalidArgumentError("op: unknown operation");
    }
  }

  bool PushesAtOnce(const CallPlan& plan) const override {
    return Traits(plan.op).fused;
  }

  absl::Status PushAll(const CallPlan& plan, const CallOperands& ops, int slot, uint64_t) override {
    if (!Traits(plan.op).fused || !s_.fused)
      return absl::InvalidArgumentError(StrCat("op: ", OpName(plan.op), " is pushed per destination"));
    const FusedGeometry& g = s_.fused->geometry;
    const int64_t rows = plan.batch * plan.seq_local;
    // Validation checked the range; a value the client changed since is clamped, as the GPU
    // kernels clamp.
    const auto* pos = static_cast<const int32_t*>(ops.inputs[1]);
    for (int64_t t = 0; t < rows; ++t) positions_[t] = std::clamp(pos[t], 0, g.max_pos - 1);
    const kernels::QkvNormRopeShape shape{g.world_size, g.num_heads,  g.head_dim,
                                          g.max_pos,    plan.batch,   plan.seq_local};
    const int me = g.rank;
    for (int k = 1; k <= g.world_size; ++k) {
      const int dst = (me + k) % g.world_size;
      kernels::QkvNormRopeBlockRef(shape, g.layout, s_.fused->weights, ops.inputs[0],
                                   positions_.data(), me, dst, Slot(dst, slot));
    }
    return absl::OkStatus();
  }

  absl::Status Flush() override { return absl::OkStatus(); }  // stores are already visible

  absl::Status Finish(const CallPlan& plan, const CallOperands& ops, int slot) override {
    const uint8_t* data = Slot(s_.geometry.rank, slot);
    if (Traits(plan.op).fused) {
      if (plan.has_out)
        std::memcpy(ops.out, data, static_cast<size_t>(plan.slot_elems) * s_.geometry.itemsize());
    } else if (Traits(plan.op).merges_into_out) {
      kernels::GatherOutputHeadChunkMergeRef(ShapeOf(s_.geometry, plan), data, plan.head_offset,
                                             plan.head_count, OutView(plan, ops));
    } else if (plan.has_out) {
      kernels::CopyContiguousToViewRef(data, plan.out_shape.data(), s_.geometry.itemsize(),
                                       OutView(plan, ops));
    }
    return absl::OkStatus();
  }

  absl::Status Poison(int slot) override {
    std::memset(Slot(s_.geometry.rank, slot), 0xff, s_.slot_bytes);
    return absl::OkStatus();
  }

  uint64_t SlotOffset(int slot) const override {
    return s_.slots_offset_bytes + s_.slot_stride_bytes * static_cast<uint64_t>(slot);
  }
  ClientSlotMapping ClientMapping() const override {
    return ClientSlotMapping{s_.segment_fd, s_.segment_bytes, false};
  }
  uint64_t DeviceBytes() const override { return 0; }

  std::string Describe() const override {
    if (!s_.fused) return "host: CPU block references, one block per destination";
    return StrCat("host: fp32 step-by-step CPU reference (QkvNormRopeBlockRef): per destination, ",
                  "its band of the projection, RMSNorm + RoPE of its Q and K heads, stored in ",
                  QkvLayoutName(s_.fused->geometry.layout),
                  " layout into its slot; the GPU paths need the nvlink backend");
  }

 private:
  uint8_t* Slot(int rank, int slot) const {
    uint8_t* base = rank == s_.geometry.rank ? s_.own_segment : segments_[rank];
    return base + SlotOffset(slot);
  }

  TransportSetup s_;
  std::vector<uint8_t*> segments_;
  std::vector<int32_t> positions_;  // fused sessions: [max_tokens], this call's positions
};

class HostBackend final : public Backend {
 public:
  std::string_view name() const override { return "host"; }
  bool slots_in_segment() const override { return true; }
  absl::StatusOr<std::unique_ptr<Transport>> MakeTransport(const TransportSetup& setup) override {
    return std::unique_ptr<Transport>(new HostTransport(setup));
  }
  absl::StatusOr<std::shared_ptr<Buffer>> AllocBuffer(uint64_t bytes) override {
    auto b = std::make_shared<Buffer>();
    b->size = bytes;
    ULY_ASSIGN_OR_RETURN(b->fd, ipc::CreateMemfd("ulysses-buf", bytes));
    ULY_RETURN_IF_ERROR(ipc::SealSize(b->fd.get()));
    ULY_ASSIGN_OR_RETURN(ipc::Mapping m, ipc::Mapping::Map(b->fd.get(), bytes, /*writable=*/true));
    auto mapping = std::make_shared<ipc::Mapping>(std::move(m));
    b->data = mapping->data();
    b->keep = mapping;
    return b;
  }
  absl::StatusOr<std::shared_ptr<Buffer>> ImportIpcBuffer(const std::string&, uint64_t) override {
    return absl::FailedPreconditionError(
        "cuda_ipc_handle: this daemon runs the host backend; register host memory (a memfd)");
  }
  absl::StatusOr<std::shared_ptr<Buffer>> ImportVmmBuffer(
      std::span<const ipc::cuda::VmmMapping::Part>) override {
    return absl::FailedPreconditionError(
        "vmm_mappings: this daemon runs the host backend; register host memory (a memfd)");
  }
  absl::StatusOr<bool> CanReach(int) const override { return true; }
  std::string_view mps_mode() const override { return "none"; }
};

}  // namespace

std::unique_ptr<Backend> MakeHostBackend() { return std::make_unique<HostBackend>(); }

}  // namespace ulysses::daemon
