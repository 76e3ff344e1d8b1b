// Validation of the fused session: every rule of the geometry, the weights and the call, each
// error naming its argument.
#include "ulysses/common/fused.h"

#include <cstdint>
#include <map>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "status_matchers.h"
#include "ulysses/common/strings.h"

namespace ulysses {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

// Registered buffers by id and size; anything else is unknown.
class SizedBuffers : public BufferResolver {
 public:
  explicit SizedBuffers(std::map<uint64_t, uint64_t> sizes) : sizes_(std::move(sizes)) {}
  absl::StatusOr<BufferInfo> Resolve(uint64_t buffer_id) const override {
    auto it = sizes_.find(buffer_id);
    if (it == sizes_.end()) return absl::NotFoundError(StrCat("buffer ", buffer_id, " unknown"));
    BufferInfo info;
    info.size_bytes = it->second;
    return info;
  }

 private:
  std::map<uint64_t, uint64_t> sizes_;
};

// W = 4, H = 24, D = 128 (hidden 3072), bshd, 256 tokens, 64 positions.
FusedGeometry Geo() {
  FusedGeometry g;
  g.world_size = 4;
  g.rank = 2;
  g.hidden = 3072;
  g.num_heads = 24;
  g.head_dim = 128;
  g.layout = QkvLayout::kBshd;
  g.max_tokens = 256;
  g.max_pos = 64;
  return g;
}

TEST(FusedGeometryTest, AcceptsTheSessionAndDerivesTheSlot) {
  const FusedGeometry g = Geo();
  EXPECT_THAT(ValidateFusedGeometry(g, FusedImpl::kCuda), IsOk());
  EXPECT_EQ(g.local_heads(), 6);
  EXPECT_EQ(g.qkv_features(), 3 * 3072);
  EXPECT_EQ(g.SlotElems(), 256 * 3 * 3072);
  EXPECT_EQ(g.SlotBytes(), 2 * 256 * 3 * 3072);
}

TEST(FusedGeometryTest, EachRuleNamesItsArgument) {
  struct Bad {
    void (*mutate)(FusedGeometry&);
    const char* arg;
    const char* what;
  };
  const Bad cases[] = {
      {[](FusedGeometry& g) { g.world_size = 0; }, "world_size", "not in [1, 64]"},
      {[](FusedGeometry& g) { g.world_size = 65; }, "world_size", "not in [1, 64]"},
      {[](FusedGeometry& g) { g.rank = 4; }, "rank", "not in [0, world_size=4)"},
      {[](FusedGeometry& g) { g.num_heads = 0; }, "num_heads", "must be > 0"},
      {[](FusedGeometry& g) { g.num_heads = 25, g.head_dim = 128, g.hidden = 3200; }, "num_heads",
       "divisible"},
      {[](FusedGeometry& g) { g.head_dim = 127; }, "head_dim", "even"},
      {[](FusedGeometry& g) { g.head_dim = 64, g.num_heads = 48; }, "head_dim",
       "CUDA kernels take head_dim 128"},
      {[](FusedGeometry& g) { g.hidden = 4096; }, "hidden", "num_heads*head_dim"},
      {[](FusedGeometry& g) { g.dtype = DType::kFloat16; }, "dtype", "bfloat16"},
      {[](FusedGeometry& g) { g.layout = QkvLayout::kUnspecified; }, "layout", "bshd or fused"},
      {[](FusedGeometry& g) { g.max_tokens = 0; }, "max_tokens", "must be > 0"},
      {[](FusedGeometry& g) { g.max_tokens = 1 << 20; }, "max_tokens", "int32 limit"},
      {[](FusedGeometry& g) { g.num_slots = 0; }, "num_slots", "not in [1, 8]"},
      {[](FusedGeometry& g) { g.num_slots = 9; }, "num_slots", "not in [1, 8]"},
      {[](FusedGeometry& g) { g.max_pos = 0; }, "max_pos", "must be > 0"},
  };
  for (const Bad& bad : cases) {
    FusedGeometry g = Geo();
    bad.mutate(g);
    EXPECT_THAT(ValidateFusedGeometry(g, FusedImpl::kCuda),
                StatusIs(kInvalid, AllOf(HasSubstr(StrCat(bad.arg, ":")), HasSubstr(bad.what))))
        << bad.arg;
  }
}

TEST(FusedGeometryTest, HiddenMustBeAMultipleOf64) {
  // The reference takes any even head_dim, but hidden keeps the GEMM's 64-column granularity.
  FusedGeometry g = Geo();
  g.num_heads = 4, g.head_dim = 10, g.hidden = 40, g.world_size = 2, g.rank = 0;
  EXPECT_THAT(ValidateFusedGeometry(g, FusedImpl::kReference),
              StatusIs(kInvalid, AllOf(HasSubstr("hidden:"), HasSubstr("multiple of 64"))));
  g.num_heads = 8, g.head_dim = 8, g.hidden = 64;
  EXPECT_THAT(ValidateFusedGeometry(g, FusedImpl::kReference), IsOk());
  EXPECT_THAT(ValidateFusedGeometry(g, FusedImpl::kCuda),
              StatusIs(kInvalid, HasSubstr("head_dim:")));
}

TEST(FusedGeometryTest, ParsesLayouts) {
  EXPECT_EQ(*ParseQkvLayout("bshd"), QkvLayout::kBshd);
  EXPECT_EQ(*ParseQkvLayout("FUSED"), QkvLayout::kFused);
  EXPECT_THAT(ParseQkvLayout("sbhd"), StatusIs(kInvalid, HasSubstr("layout:")));
  EXPECT_EQ(QkvLayoutName(QkvLayout::kFused), "fused");
}

FusedTensorRef Tensor(uint64_t id, DType dtype, std::vector<int64_t> shape,
                      uint64_t offset_bytes = 0) {
  FusedTensorRef t;
  t.buffer_id = id;
  t.offset_bytes = offset_bytes;
  t.dtype = dtype;
  t.rank = static_cast<int32_t>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) t.shape[i] = shape[i];
  return t;
}

constexpr uint64_t kW = 1, kQ = 2, kK = 3, kCs = 4;

FusedWeightsArgs Weights() {
  FusedWeightsArgs w;
  w.w_qkv = Tensor(kW, DType::kBFloat16, {9216, 3072});
  w.q_norm = Tensor(kQ, DType::kBFloat16, {128});
  w.k_norm = Tensor(kK, DType::kBFloat16, {128}, 64);
  w.cos_sin = Tensor(kCs, DType::kFloat32, {64, 128});
  return w;
}

SizedBuffers WeightBuffers() {
  return SizedBuffers({{kW, 9216 * 3072 * 2}, {kQ, 256}, {kK, 64 + 256}, {kCs, 64 * 128 * 4}});
}

TEST(FusedWeightsTest, AcceptsExactShapesAndRejectsEachDeparture) {
  EXPECT_THAT(ValidateFusedWeights(Geo(), Weights(), WeightBuffers()), IsOk());
  struct Bad {
    void (*mutate)(FusedWeightsArgs&);
    const char* arg;
    const char* what;
  };
  const Bad cases[] = {
      {[](FusedWeightsArgs& w) { w.w_qkv.buffer_id = 0; }, "w_qkv", "required"},
      {[](FusedWeightsArgs& w) { w.w_qkv.dtype = DType::kFloat16; }, "w_qkv", "must be bfloat16"},
      {[](FusedWeightsArgs& w) { w.w_qkv.shape[0] = 3072; }, "w_qkv", "must be [9216,3072]"},
      {[](FusedWeightsArgs& w) { w.q_norm.rank = 2; }, "q_norm", "must be [128]"},
      {[](FusedWeightsArgs& w) { w.k_norm.offset_bytes = 48; }, "k_norm", "32-byte aligned"},
      {[](FusedWeightsArgs& w) { w.k_norm.offset_bytes = 96; }, "k_norm", "exceed buffer 3"},
      {[](FusedWeightsArgs& w) { w.cos_sin.dtype = DType::kBFloat16; }, "cos_sin",
       "must be float32"},
      {[](FusedWeightsArgs& w) { w.cos_sin.shape[0] = 65; }, "cos_sin", "must be [64,128]"},
      {[](FusedWeightsArgs& w) { w.cos_sin.offset_bytes = 16; }, "cos_sin", "32-byte aligned"},
  };
  for (const Bad& bad : cases) {
    FusedWeightsArgs w = Weights();
    bad.mutate(w);
    EXPECT_THAT(ValidateFusedWeights(Geo(), w, WeightBuffers()),
                StatusIs(kInvalid, AllOf(HasSubstr(StrCat(bad.arg, ":")), HasSubstr(bad.what))))
        << bad.arg << " " << bad.what;
  }
  FusedWeightsArgs unknown = Weights();
  unknown.cos_sin.buffer_id = 99;
  EXPECT_THAT(ValidateFusedWeights(Geo(), unknown, WeightBuffers()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("cos_sin: buffer 99")));
}

OperandRef Ref(uint64_t id, uint64_t offset_bytes = 0) {
  OperandRef r;
  r.buffer_id = id;
  r.offset_bytes = offset_bytes;
  return r;
}

constexpr uint64_t kX = 10, kPos = 11;

SizedBuffers CallBuffers() { return SizedBuffers({{kX, 256 * 3072 * 2}, {kPos, 256 * 4}}); }

FusedCallArgs Call(int64_t batch, int64_t seq_local) {
  FusedCallArgs a;
  a.batch = batch;
  a.seq_local = seq_local;
  a.x = Ref(kX);
  a.positions = Ref(kPos);
  return a;
}

TEST(FusedCallTest, PlansTheResultOfBothLayouts) {
  FusedGeometry g = Geo();
  absl::StatusOr<FusedCallPlan> p = PlanFusedCall(g, Call(2, 100), CallBuffers());
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->rows, 200);
  EXPECT_EQ(p->global_seq, 400);
  EXPECT_EQ(p->plane_elems, 2 * 400 * 6 * 128);
  EXPECT_EQ(p->out_elems, 3 * p->plane_elems);
  EXPECT_EQ(p->out_shape, (std::array<int64_t, 4>{2, 400, 6, 128}));
  g.layout = QkvLayout::kFused;
  p = PlanFusedCall(g, Call(2, 100), CallBuffers());
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->out_shape, (std::array<int64_t, 4>{2, 400, 6, 384}));
}

TEST(FusedCallTest, RejectsEachBadCall) {
  const FusedGeometry g = Geo();
  const SizedBuffers buffers = CallBuffers();
  EXPECT_THAT(PlanFusedCall(g, Call(0, 4), buffers), StatusIs(kInvalid, HasSubstr("batch:")));
  EXPECT_THAT(PlanFusedCall(g, Call(1, -1), buffers), StatusIs(kInvalid, HasSubstr("seq_local:")));
  EXPECT_THAT(PlanFusedCall(g, Call(2, 129), buffers),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("capacity:"), HasSubstr("258"), HasSubstr("256"))));
  FusedCallArgs a = Call(1, 256);
  a.x.buffer_id = 0;
  EXPECT_THAT(PlanFusedCall(g, a, buffers),
              StatusIs(kInvalid, HasSubstr("x: operand is required")));
  a = Call(1, 256);
  a.x.strides = {3072, 3072, 1, 1};
  EXPECT_THAT(PlanFusedCall(g, a, buffers), StatusIs(kInvalid, HasSubstr("x: must be contiguous")));
  a = Call(1, 16);
  a.x.offset_bytes = 16;
  EXPECT_THAT(PlanFusedCall(g, a, buffers), StatusIs(kInvalid, HasSubstr("x: offset_bytes 16")));
  a = Call(1, 16);
  a.x.offset_bytes = 32 * 3072;  // in bounds for 16 rows ...
  EXPECT_THAT(PlanFusedCall(g, a, buffers), IsOk());
  a = Call(1, 256);  // ... but not for 256
  a.x.offset_bytes = 32;
  EXPECT_THAT(PlanFusedCall(g, a, buffers), StatusIs(kInvalid, HasSubstr("x: bytes [32, ")));
  a = Call(1, 8);
  a.positions.offset_bytes = 2;
  EXPECT_THAT(PlanFusedCall(g, a, buffers),
              StatusIs(kInvalid, HasSubstr("positions: offset_bytes 2 is not 4-byte aligned")));
  a = Call(1, 256);
  a.positions.offset_bytes = 4;
  EXPECT_THAT(PlanFusedCall(g, a, buffers), StatusIs(kInvalid, HasSubstr("positions: bytes")));
}

TEST(FusedCallTest, PositionsMustLieInTheTable) {
  const FusedGeometry g = Geo();
  const std::vector<int32_t> good = {0, 5, 63};
  EXPECT_THAT(CheckFusedPositions(g, good.data(), 3), IsOk());
  const std::vector<int32_t> past = {0, 64, 1};
  EXPECT_THAT(CheckFusedPositions(g, past.data(), 3),
              StatusIs(kInvalid, HasSubstr("positions[1]: 64 is not in [0, max_pos=64)")));
  const std::vector<int32_t> negative = {3, 2, -1};
  EXPECT_THAT(CheckFusedPositions(g, negative.data(), 3),
              StatusIs(kInvalid, HasSubstr("positions[2]: -1")));
}


// The shared call path's form of a fused call: CallArgs in, a CallPlan whose slot and result
// match the fused plan; the op, band, inputs, out and (host-visible) positions checked.
class HostBuffers : public SizedBuffers {
 public:
  HostBuffers(std::map<uint64_t, uint64_t> sizes, std::map<uint64_t, const void*> data)
      : SizedBuffers(std::move(sizes)), data_(std::move(data)) {}
  absl::StatusOr<BufferInfo> Resolve(uint64_t id) const override {
    absl::StatusOr<BufferInfo> info = SizedBuffers::Resolve(id);
    if (info.ok() && data_.count(id)) info->host_data = data_.at(id);
    return info;
  }

 private:
  std::map<uint64_t, const void*> data_;
};

CallArgs QkvArgs(int64_t batch, int64_t seq_local) {
  CallArgs a;
  a.op = OpKind::kQkvNormRopeExchange;
  a.batch = batch;
  a.seq = seq_local;
  a.inputs[0] = Ref(kX);
  a.inputs[1] = Ref(kPos);
  return a;
}

TEST(QkvCallTest, PlansLikeTheFusedPlanAndSizesSlotsAlike) {
  const FusedGeometry g = Geo();
  EXPECT_EQ(SlotGeometry(g).SlotElems(), g.SlotElems());
  EXPECT_THAT(ValidateSessionGeometry(SlotGeometry(g)), IsOk());
  constexpr uint64_t kOut = 12;
  const int64_t out_bytes = 3 * 2 * 400 * 6 * 128 * 2;
  const SizedBuffers buffers({{kX, 256 * 3072 * 2}, {kPos, 256 * 4}, {kOut, out_bytes}});
  CallArgs a = QkvArgs(2, 100);
  a.out = Ref(kOut);
  absl::StatusOr<CallPlan> p = PlanQkvCall(g, a, buffers, nullptr);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->op, OpKind::kQkvNormRopeExchange);
  EXPECT_EQ(p->num_inputs, 2);
  EXPECT_EQ(p->seq_local, 100);
  EXPECT_EQ(p->out_shape, (std::array<int64_t, 4>{2, 400, 6, 128}));
  EXPECT_EQ(p->slot_elems, 3 * 2 * 400 * 6 * 128);
  EXPECT_TRUE(p->has_out);
  EXPECT_EQ(p->inputs[0].span_bytes, 200u * 3072 * 2);
  EXPECT_EQ(p->inputs[1].span_bytes, 200u * 4);
}

TEST(QkvCallTest, RejectsOtherOpsBandsOutAndPositions) {
  const FusedGeometry g = Geo();
  std::vector<int32_t> pos(256, 1);
  const HostBuffers buffers({{kX, 256 * 3072 * 2}, {kPos, 256 * 4}, {kW, 9216 * 3072 * 2}},
                            {{kPos, pos.data()}});
  CallArgs a = QkvArgs(2, 100);
  a.op = OpKind::kScatterHeads;
  EXPECT_THAT(PlanQkvCall(g, a, buffers),
              StatusIs(kInvalid, HasSubstr("op: scatter_heads is not an op of a qkv_norm_rope")));
  a = QkvArgs(2, 100);
  a.head_count = 1;
  EXPECT_THAT(PlanQkvCall(g, a, buffers), StatusIs(kInvalid, HasSubstr("head_count:")));
  a = QkvArgs(2, 100);
  a.inputs[2] = Ref(kX);
  EXPECT_THAT(PlanQkvCall(g, a, buffers), StatusIs(kInvalid, HasSubstr("inputs:")));
  a = QkvArgs(1, 16);
  a.out = Ref(kX, 2 * 8 * 3072);  // overlaps x's rows [0, 16)
  EXPECT_THAT(PlanQkvCall(g, a, buffers), StatusIs(kInvalid, HasSubstr("out: overlaps input x")));
  a = QkvArgs(1, 16);
  a.out = Ref(kW, 64);
  const FusedWeightsArgs w = Weights();
  EXPECT_THAT(PlanQkvCall(g, a, buffers, &w),
              StatusIs(kInvalid, HasSubstr("out: overlaps the session's weight w_qkv")));
  a.out = Ref(kW, 1);
  EXPECT_THAT(PlanQkvCall(g, a, buffers, &w),
              StatusIs(kInvalid, HasSubstr("out: offset_bytes 1 is not 2-byte aligned")));
  pos[150] = 64;
  EXPECT_THAT(PlanQkvCall(g, QkvArgs(2, 100), buffers),
              StatusIs(kInvalid, HasSubstr("positions[150]: 64 is not in [0, max_pos=64)")));
  EXPECT_THAT(PlanQkvCall(g, QkvArgs(1, 150), buffers), IsOk());  // rows [0, 150) only
  // A head-exchange session refuses the fused op by name.
  SessionGeometry eg = SlotGeometry(g);
  CallArgs e = QkvArgs(1, 4);
  EXPECT_THAT(PlanCall(eg, e, buffers),
              StatusIs(kInvalid, HasSubstr("op: qkv_norm_rope_exchange is the op of a")));
}

TEST(QkvCallTest, PathNamesRoundTrip) {
  for (FusedPath p :
       {FusedPath::kAuto, FusedPath::kPerOperator, FusedPath::kChunked, FusedPath::kEpilogue}) {
    absl::StatusOr<FusedPath> back = ParseFusedPath(FusedPathName(p));
    ASSERT_THAT(back, IsOk());
    EXPECT_EQ(*back, p);
  }
  EXPECT_THAT(ParseFusedPath("fast"), StatusIs(kInvalid, HasSubstr("path:")));
}

}  // namespace
}  // namespace ulysses
