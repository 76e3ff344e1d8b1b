// PlanCall: every rule of a call's validation, and the exact plan it resolves.
#include <array>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "status_matchers.h"
#include "ulysses/common/geometry.h"
#include "ulysses/common/strings.h"

namespace ulysses {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

// Buffers of the calling client: id -> size. kForeign belongs to another client.
class FakeBuffers : public BufferResolver {
 public:
  static constexpr uint64_t kForeign = 666;

  FakeBuffers& Add(uint64_t id, uint64_t size_bytes) {
    sizes_[id] = size_bytes;
    return *this;
  }

  absl::StatusOr<BufferInfo> Resolve(uint64_t buffer_id) const override {
    if (buffer_id == kForeign)
      return absl::PermissionDeniedError(
          StrCat("buffer ", buffer_id, " is another client's buffer"));
    auto it = sizes_.find(buffer_id);
    if (it == sizes_.end())
      return absl::InvalidArgumentError(StrCat("buffer ", buffer_id, " is not registered"));
    BufferInfo info;
    info.size_bytes = it->second;
    return info;
  }

 private:
  std::map<uint64_t, uint64_t> sizes_;
};

// The call tests' session: W=4, H=8 (H_l=2), D=16, bf16, max_tokens=1024.
constexpr int64_t kW = 4, kH = 8, kD = 16, kItem = 2;  // H_l = kH / kW = 2

SessionGeometry Geo(int32_t rank = 1) {
  SessionGeometry g;
  g.world_size = kW;
  g.rank = rank;
  g.num_heads = kH;
  g.head_dim = kD;
  g.dtype = DType::kBFloat16;
  g.max_tokens = 1024;
  g.schedule = {1, 1};
  return g;
}

OperandRef Ref(uint64_t id, uint64_t offset_bytes = 0, std::array<int64_t, 4> strides = {}) {
  OperandRef r;
  r.buffer_id = id;
  r.offset_bytes = offset_bytes;
  r.strides = strides;
  return r;
}

constexpr uint64_t kBig = uint64_t{1} << 40;

// Buffers 1..9 of 1 TiB each: bounds never get in the way.
FakeBuffers Roomy() {
  FakeBuffers b;
  for (uint64_t id = 1; id < 10; ++id) b.Add(id, kBig);
  return b;
}

// B=2, S_l=3 (S_g=12) calls of each op with contiguous operands in buffers 1..3.
CallArgs Scatter(int64_t batch = 2, int64_t seq_local = 3) {
  CallArgs a;
  a.op = OpKind::kScatterHeads;
  a.batch = batch;
  a.seq = seq_local;
  a.inputs[0] = Ref(1);
  return a;
}
CallArgs Gather(int64_t batch = 2, int64_t seq_global = 12) {
  CallArgs a;
  a.op = OpKind::kGatherHeads;
  a.batch = batch;
  a.seq = seq_global;
  a.inputs[0] = Ref(1);
  return a;
}
CallArgs Qkv(int32_t head_offset = 1, int32_t head_count = 1, int64_t batch = 2,
             int64_t seq_local = 3) {
  CallArgs a;
  a.op = OpKind::kScatterQkvHeadChunk;
  a.batch = batch;
  a.seq = seq_local;
  a.head_offset = head_offset;
  a.head_count = head_count;
  a.inputs = {Ref(1), Ref(2), Ref(3)};
  return a;
}
CallArgs GatherOut(int32_t head_offset = 0, int32_t head_count = 2, int64_t batch = 2,
                   int64_t seq_global = 12) {
  CallArgs a;
  a.op = OpKind::kGatherOutputHeadChunk;
  a.batch = batch;
  a.seq = seq_global;
  a.head_offset = head_offset;
  a.head_count = head_count;
  a.inputs[0] = Ref(1);
  a.out = Ref(4);
  return a;
}

std::vector<CallArgs> AllOps() { return {Scatter(), Gather(), Qkv(), GatherOut()}; }

// ---------------------------------------------------------------------------------------------
// Arguments

TEST(PlanCallTest, UnknownOpRejected) {
  FakeBuffers b = Roomy();
  for (int op : {0, 5, -1, 100}) {
    CallArgs a = Scatter();
    a.op = static_cast<OpKind>(op);
    EXPECT_THAT(PlanCall(Geo(), a, b), StatusIs(kInvalid, HasSubstr("op")))
        << "op=" << op;
  }
}

TEST(PlanCallTest, BatchMustBePositive) {
  FakeBuffers b = Roomy();
  for (CallArgs a : AllOps()) {
    for (int64_t batch : {int64_t{0}, int64_t{-2}}) {
      a.batch = batch;
      EXPECT_THAT(PlanCall(Geo(), a, b), StatusIs(kInvalid, HasSubstr("batch")))
          << OpName(a.op) << " batch=" << batch;
    }
  }
}

TEST(PlanCallTest, SeqMustBePositive) {
  FakeBuffers b = Roomy();
  for (CallArgs a : AllOps()) {
    for (int64_t seq : {int64_t{0}, int64_t{-4}}) {
      a.seq = seq;
      EXPECT_THAT(PlanCall(Geo(), a, b), StatusIs(kInvalid, HasSubstr("seq")))
          << OpName(a.op) << " seq=" << seq;
    }
  }
}

// A seq near 2^63 overflowed S_g = S_l * W before any bound was checked: undefined behaviour,
// which the undefined-behaviour sanitizer build (scripts/sanitize.sh) stopped on; the scatter
// ops take S_l, so theirs reached it.
TEST(PlanCallTest, HugeSeqIsRefusedBeforeAnythingOverflows) {
  FakeBuffers b = Roomy();
  for (CallArgs a : AllOps()) {
    for (int64_t seq : {std::numeric_limits<int64_t>::max(), int64_t{1} << 62,
                        (std::numeric_limits<int64_t>::max() / 4) * 4}) {
      a.seq = seq;
      EXPECT_THAT(PlanCall(Geo(), a, b), StatusIs(kInvalid, HasSubstr("seq")))
          << OpName(a.op) << " seq=" << seq;
    }
  }
}

TEST(PlanCallTest, GatherSeqMustBeDivisibleByWorldSize) {
  FakeBuffers b = Roomy();
  for (CallArgs a : {Gather(2, 13), GatherOut(0, 2, 2, 14)}) {
    EXPECT_THAT(PlanCall(Geo(), a, b),
                StatusIs(kInvalid, AllOf(HasSubstr("seq"), HasSubstr("divisible"))))
        << OpName(a.op);
  }
  // Scatter inputs carry S_l: any positive length is fine.
  EXPECT_THAT(PlanCall(Geo(), Scatter(2, 13), b), IsOk());
  EXPECT_THAT(PlanCall(Geo(), Qkv(0, 1, 2, 13), b), IsOk());
}

TEST(PlanCallTest, HeadCountMustBePositive) {
  FakeBuffers b = Roomy();
  for (int32_t hc : {0, -1}) {
    EXPECT_THAT(PlanCall(Geo(), Qkv(0, hc), b), StatusIs(kInvalid, HasSubstr("head_count")));
    EXPECT_THAT(PlanCall(Geo(), GatherOut(0, hc), b),
                StatusIs(kInvalid, HasSubstr("head_count")));
  }
}

TEST(PlanCallTest, HeadOffsetMustBeNonNegative) {
  FakeBuffers b = Roomy();
  EXPECT_THAT(PlanCall(Geo(), Qkv(-1, 1), b), StatusIs(kInvalid, HasSubstr("head_offset")));
  EXPECT_THAT(PlanCall(Geo(), GatherOut(-1, 1), b),
              StatusIs(kInvalid, HasSubstr("head_offset")));
}

TEST(PlanCallTest, BandMustFitLocalHeads) {
  FakeBuffers b = Roomy();
  // H_l = 2: bands (0,2), (1,1), (0,1) fit; (1,2), (2,1), (0,3) do not.
  for (auto [off, cnt] : {std::pair{0, 2}, std::pair{1, 1}, std::pair{0, 1}}) {
    EXPECT_THAT(PlanCall(Geo(), Qkv(off, cnt), b), IsOk()) << off << "+" << cnt;
    EXPECT_THAT(PlanCall(Geo(), GatherOut(off, cnt), b), IsOk()) << off << "+" << cnt;
  }
  for (auto [off, cnt] : {std::pair{1, 2}, std::pair{2, 1}, std::pair{0, 3}}) {
    EXPECT_THAT(PlanCall(Geo(), Qkv(off, cnt), b),
                StatusIs(kInvalid, HasSubstr("exceeds local_heads")))
        << off << "+" << cnt;
    EXPECT_THAT(PlanCall(Geo(), GatherOut(off, cnt), b),
                StatusIs(kInvalid, HasSubstr("exceeds local_heads")))
        << off << "+" << cnt;
  }
}

// BUG (common/src/validation.cc:116): the message computes head_offset+head_count in int32, which
// overflows (undefined behaviour) for a hostile head_offset near INT32_MAX and reports a negative
// sum. The verdict is right; the message should report the true sum 2147483648 (computed in
// int64, as the check on line 114 does). Left failing on purpose.
TEST(PlanCallTest, BandOverflowMessageReportsTrueSum) {
  FakeBuffers b = Roomy();
  EXPECT_THAT(PlanCall(Geo(), Qkv(std::numeric_limits<int32_t>::max(), 1), b),
              StatusIs(kInvalid, AllOf(HasSubstr("exceeds local_heads"),
                                       HasSubstr("head_offset+head_count=2147483648"))));
}

TEST(PlanCallTest, NonChunkOpsIgnoreBandArguments) {
  FakeBuffers b = Roomy();
  CallArgs a = Scatter();
  a.head_offset = 7;
  a.head_count = -3;
  absl::StatusOr<CallPlan> p = PlanCall(Geo(), a, b);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->head_offset, 0);
  EXPECT_EQ(p->head_count, 0);
}

// ---------------------------------------------------------------------------------------------
// int32 limits and capacity (reference case 4: W=2, H_l=HC=1, D=128, B=1)

SessionGeometry Int32EdgeGeo() {
  SessionGeometry g;
  g.world_size = 2;
  g.rank = 0;
  g.num_heads = 2;
  g.head_dim = 128;
  g.dtype = DType::kBFloat16;
  g.max_tokens = 2796202;
  return g;
}

TEST(PlanCallInt32Test, LargestQkvPayloadAccepted) {
  SessionGeometry g = Int32EdgeGeo();
  ASSERT_THAT(ValidateSessionGeometry(g), IsOk());
  FakeBuffers b = Roomy();
  absl::StatusOr<CallPlan> p = PlanCall(g, Qkv(0, 1, 1, 2796202), b);
  ASSERT_THAT(p, IsOk());
  // B*S_l*W*HC*3D = 2,796,202 * 2 * 1 * 384
  EXPECT_EQ(p->slot_elems, 2147483136);
  EXPECT_THAT(p->out_shape, ElementsAre(1, 5592404, 1, 384));
  EXPECT_EQ(p->seq_local, 2796202);
  EXPECT_EQ(p->inputs[0].span_bytes, uint64_t{2796202} * 2 * 128 * 2);
}

TEST(PlanCallInt32Test, OneMoreTokenRejectedAsInt32) {
  SessionGeometry g = Int32EdgeGeo();
  FakeBuffers b = Roomy();
  // Payload 2,147,483,904 > 2^31-1. Reported as the int32 limit (INVALID_ARGUMENT), before the
  // capacity check would have answered RESOURCE_EXHAUSTED.
  EXPECT_THAT(PlanCall(g, Qkv(0, 1, 1, 2796203), b),
              StatusIs(kInvalid, AllOf(HasSubstr("seq"), HasSubstr("int32"))));
}

TEST(PlanCallInt32Test, InputNumelOverInt32NamesTheInput) {
  SessionGeometry g = Int32EdgeGeo();
  FakeBuffers b = Roomy();
  // x[1, 8388608, 2, 128] has 2^31 elements.
  EXPECT_THAT(PlanCall(g, Scatter(1, 8388608), b),
              StatusIs(kInvalid, AllOf(HasSubstr("x"), HasSubstr("int32"))));
  CallArgs y = Gather(1, 2 * 16777216);  // y[1, 2^25, 1, 128] = 2^32 elements
  EXPECT_THAT(PlanCall(g, y, b), StatusIs(kInvalid, AllOf(HasSubstr("y"), HasSubstr("int32"))));
}

TEST(PlanCallCapacityTest, TokensOverMaxTokensIsResourceExhausted) {
  FakeBuffers b = Roomy();
  // max_tokens = 1024: B*S_l = 2*513 = 1026.
  for (CallArgs a : {Scatter(2, 513), Gather(2, 4 * 513), Qkv(0, 1, 2, 513),
                     GatherOut(0, 2, 2, 4 * 513)}) {
    EXPECT_THAT(PlanCall(Geo(), a, b),
                StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_tokens")))
        << OpName(a.op);
  }
  // Exactly max_tokens fits.
  for (CallArgs a : {Scatter(2, 512), Gather(2, 4 * 512), Qkv(0, 1, 2, 512),
                     GatherOut(0, 2, 2, 4 * 512), Scatter(1024, 1)}) {
    EXPECT_THAT(PlanCall(Geo(), a, b), IsOk()) << OpName(a.op);
  }
}

TEST(PlanCallCapacityTest, BatchTimesSeqOverflowRejected) {
  FakeBuffers b = Roomy();
  CallArgs a = Scatter(int64_t{1} << 32, int64_t{1} << 32);
  EXPECT_THAT(PlanCall(Geo(), a, b), StatusIs(kInvalid, HasSubstr("batch")));
}

// ---------------------------------------------------------------------------------------------
// Operands

TEST(PlanCallOperandTest, MissingInputNamed) {
  FakeBuffers b = Roomy();
  CallArgs a = Scatter();
  a.inputs[0] = OperandRef();
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("x"), HasSubstr("required"))));
  a = Gather();
  a.inputs[0] = OperandRef();
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("y"), HasSubstr("required"))));
  a = GatherOut();
  a.inputs[0] = OperandRef();
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("x"), HasSubstr("required"))));
  for (int i = 0; i < 3; ++i) {
    const char* name[] = {"q: ", "k: ", "v: "};
    a = Qkv();
    a.inputs[i] = OperandRef();
    EXPECT_THAT(PlanCall(Geo(), a, b),
                StatusIs(kInvalid, AllOf(HasSubstr(name[i]), HasSubstr("required"))));
  }
}

TEST(PlanCallOperandTest, ExtraInputRejected) {
  FakeBuffers b = Roomy();
  for (CallArgs a : {Scatter(), Gather(), GatherOut()}) {
    for (int pos : {1, 2}) {
      CallArgs c = a;
      c.inputs[pos] = Ref(5);
      EXPECT_THAT(PlanCall(Geo(), c, b),
                  StatusIs(kInvalid, AllOf(HasSubstr("inputs"),
                                           HasSubstr(StrCat("position ", pos)))))
          << OpName(a.op) << " extra at " << pos;
    }
  }
}

TEST(PlanCallOperandTest, NonPositiveStridesNamed) {
  FakeBuffers b = Roomy();
  CallArgs a = Scatter();
  a.inputs[0] = Ref(1, 0, {384, 0, 16, 1});
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("x"), HasSubstr("strides"))));
  a.inputs[0] = Ref(1, 0, {-384, 128, 16, 1});
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("x"), HasSubstr("strides"))));
  CallArgs q = Qkv();
  q.inputs[2] = Ref(3, 0, {384, 128, 16, -1});
  EXPECT_THAT(PlanCall(Geo(), q, b),
              StatusIs(kInvalid, AllOf(HasSubstr("v: "), HasSubstr("strides"))));
  CallArgs o = GatherOut();
  o.out = Ref(4, 0, {384, 128, 16, 0});
  EXPECT_THAT(PlanCall(Geo(), o, b),
              StatusIs(kInvalid, AllOf(HasSubstr("out"), HasSubstr("strides"))));
}

TEST(PlanCallOperandTest, OffsetMustBeItemsizeMultiple) {
  FakeBuffers b = Roomy();
  CallArgs a = Scatter();
  a.inputs[0] = Ref(1, 1);
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("x"), HasSubstr("itemsize"))));
  a.inputs[0] = Ref(1, 2);  // bf16: 2 is aligned
  EXPECT_THAT(PlanCall(Geo(), a, b), IsOk());
  SessionGeometry f32 = Geo();
  f32.dtype = DType::kFloat32;
  EXPECT_THAT(PlanCall(f32, a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("x"), HasSubstr("itemsize"))));
  CallArgs o = GatherOut();
  o.out = Ref(4, 6, {});
  EXPECT_THAT(PlanCall(f32, o, b),
              StatusIs(kInvalid, AllOf(HasSubstr("out"), HasSubstr("itemsize"))));
}

TEST(PlanCallOperandTest, OutOfBoundsNamed) {
  // x[2,3,8,16] bf16 = 1536 bytes.
  FakeBuffers b;
  b.Add(1, 1536).Add(2, 1534).Add(3, 100);
  CallArgs a = Scatter();
  EXPECT_THAT(PlanCall(Geo(), a, b), IsOk());
  a.inputs[0] = Ref(1, 2);  // one element past the end
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("x"), HasSubstr("exceed"))));
  a.inputs[0] = Ref(2);  // buffer one element short
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("x"), HasSubstr("exceed"))));
  a.inputs[0] = Ref(1, 4096);  // offset past the end
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("x"), HasSubstr("exceed"))));
  a.inputs[0] = Ref(1, uint64_t{1} << 63);  // offset near the top of uint64
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("x"), HasSubstr("exceed"))));
  a.inputs[0] = Ref(1);
  a.out = Ref(3);  // out [2,12,2,16] does not fit in 100 bytes
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("out"), HasSubstr("exceed"))));
}

TEST(PlanCallOperandTest, UnknownBufferInvalidArgument) {
  FakeBuffers b = Roomy();
  CallArgs a = Scatter();
  a.inputs[0] = Ref(999);
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("x: "), HasSubstr("999"))));
  CallArgs o = GatherOut();
  o.out = Ref(998);
  EXPECT_THAT(PlanCall(Geo(), o, b),
              StatusIs(kInvalid, AllOf(HasSubstr("out: "), HasSubstr("998"))));
}

TEST(PlanCallOperandTest, AnotherClientsBufferPermissionDenied) {
  FakeBuffers b = Roomy();
  CallArgs a = Qkv();
  a.inputs[1] = Ref(FakeBuffers::kForeign);
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       AllOf(HasSubstr("k: "), HasSubstr("another client"))));
  CallArgs o = GatherOut();
  o.out = Ref(FakeBuffers::kForeign);
  EXPECT_THAT(PlanCall(Geo(), o, b),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("out: ")));
}

TEST(PlanCallOperandTest, GatherOutputRequiresOut) {
  FakeBuffers b = Roomy();
  CallArgs a = GatherOut();
  a.out = OperandRef();
  EXPECT_THAT(PlanCall(Geo(), a, b), StatusIs(kInvalid, HasSubstr("out")));
}

TEST(PlanCallOperandTest, OutOptionalForOtherOps) {
  FakeBuffers b = Roomy();
  for (CallArgs a : {Scatter(), Gather(), Qkv()}) {
    absl::StatusOr<CallPlan> p = PlanCall(Geo(), a, b);
    ASSERT_THAT(p, IsOk()) << OpName(a.op);
    EXPECT_FALSE(p->has_out);
    a.out = Ref(7);
    p = PlanCall(Geo(), a, b);
    ASSERT_THAT(p, IsOk()) << OpName(a.op);
    EXPECT_TRUE(p->has_out);
    EXPECT_EQ(p->out.buffer_id, 7u);
    EXPECT_EQ(p->out.shape, p->out_shape);
  }
}

// ---------------------------------------------------------------------------------------------
// Aliasing of out with the inputs

// q, k, v [2,3,8,16] bf16 (1536 bytes each) back to back in buffer 10.
constexpr uint64_t kQkvBytes = 1536;

CallArgs QkvInOneBuffer() {
  CallArgs a = Qkv();
  a.inputs = {Ref(10, 0), Ref(10, kQkvBytes), Ref(10, 2 * kQkvBytes)};
  return a;
}

TEST(PlanCallAliasTest, OutPartiallyOverlappingInputRejected) {
  FakeBuffers b;
  b.Add(10, 1 << 20);
  // out [2,12,1,48] = 2304 bytes.
  CallArgs a = QkvInOneBuffer();
  a.out = Ref(10, kQkvBytes - 2);  // last element of q, then into k
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("out"), HasSubstr("input q"))));
  a.out = Ref(10, 3 * kQkvBytes - 2);  // last element of v
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("out"), HasSubstr("input v"))));
  a = QkvInOneBuffer();
  a.inputs[0] = Ref(11);  // q elsewhere; out starts inside k
  b.Add(11, kQkvBytes);
  a.out = Ref(10, kQkvBytes + 100);
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("out"), HasSubstr("input k"))));
  // out exactly equal to x for gather_output_head_chunk.
  CallArgs g = GatherOut();
  g.inputs[0] = Ref(10);
  g.out = Ref(10);
  EXPECT_THAT(PlanCall(Geo(), g, b),
              StatusIs(kInvalid, AllOf(HasSubstr("out"), HasSubstr("input x"))));
}

TEST(PlanCallAliasTest, OutDisjointInSameBufferAccepted) {
  FakeBuffers b;
  b.Add(10, 1 << 20);
  CallArgs a = QkvInOneBuffer();
  a.out = Ref(10, 3 * kQkvBytes);  // right after v
  absl::StatusOr<CallPlan> p = PlanCall(Geo(), a, b);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->out.offset_bytes, 3 * kQkvBytes);
  EXPECT_EQ(p->out.span_bytes, 2u * 12 * 1 * 48 * 2);
  // Ending right where q starts.
  a.inputs = {Ref(10, 4096), Ref(10, 4096 + kQkvBytes), Ref(10, 4096 + 2 * kQkvBytes)};
  a.out = Ref(10, 4096 - 2304);
  EXPECT_THAT(PlanCall(Geo(), a, b), IsOk());
  // gather_output_head_chunk: x [2,12,2,16] = 1536 bytes, out [2,3,8,16] after it.
  CallArgs g = GatherOut();
  g.inputs[0] = Ref(10);
  g.out = Ref(10, 1536);
  EXPECT_THAT(PlanCall(Geo(), g, b), IsOk());
}

TEST(PlanCallAliasTest, SelfOverlappingOutRejected) {
  FakeBuffers b = Roomy();
  CallArgs a = Gather();  // out [2,3,8,16]
  a.out = Ref(4, 0, {384, 128, 8, 1});  // heads 8 apart but 16 wide
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("out"), HasSubstr("overlap"))));
  a.out = Ref(4, 0, {1, 1, 1, 1});
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("out"), HasSubstr("overlap"))));
  CallArgs o = GatherOut();
  o.out = Ref(4, 0, {128, 128, 16, 1});  // batch and sequence steps collide
  EXPECT_THAT(PlanCall(Geo(), o, b),
              StatusIs(kInvalid, AllOf(HasSubstr("out"), HasSubstr("overlap"))));
}

TEST(PlanCallAliasTest, PaddedOrPermutedOutAccepted) {
  FakeBuffers b = Roomy();
  CallArgs a = Gather();  // out [2,3,8,16]
  a.out = Ref(4, 0, {3 * 8 * 32, 8 * 32, 32, 1});  // D padded to 32
  absl::StatusOr<CallPlan> p = PlanCall(Geo(), a, b);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->out.span_bytes, uint64_t(1 * 768 + 2 * 256 + 7 * 32 + 15 + 1) * kItem);
  a.out = Ref(4, 0, {16, 2 * 8 * 16, 2 * 16, 1});  // [S,H,B,D] memory order
  EXPECT_THAT(PlanCall(Geo(), a, b), IsOk());
}

TEST(PlanCallAliasTest, SelfOverlappingInputAccepted) {
  // Inputs are only read: a broadcast-like view is allowed.
  FakeBuffers b = Roomy();
  CallArgs a = Scatter();
  a.inputs[0] = Ref(1, 0, {1, 1, 1, 1});
  absl::StatusOr<CallPlan> p = PlanCall(Geo(), a, b);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->inputs[0].span_bytes, uint64_t(1 + 2 + 7 + 15 + 1) * kItem);
}

// ---------------------------------------------------------------------------------------------
// Resolved plans

TEST(PlanCallPlanTest, ScatterHeadsContiguous) {
  FakeBuffers b = Roomy();
  CallArgs a = Scatter();
  a.inputs[0] = Ref(1, 64);
  absl::StatusOr<CallPlan> p = PlanCall(Geo(), a, b);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->op, OpKind::kScatterHeads);
  EXPECT_EQ(p->batch, 2);
  EXPECT_EQ(p->seq_local, 3);
  EXPECT_EQ(p->num_inputs, 1);
  EXPECT_EQ(p->inputs[0].buffer_id, 1u);
  EXPECT_EQ(p->inputs[0].offset_bytes, 64u);
  EXPECT_THAT(p->inputs[0].shape, ElementsAre(2, 3, 8, 16));
  EXPECT_THAT(p->inputs[0].strides, ElementsAre(384, 128, 16, 1));
  EXPECT_EQ(p->inputs[0].span_bytes, 2u * 3 * 8 * 16 * 2);
  EXPECT_THAT(p->out_shape, ElementsAre(2, 12, 2, 16));
  EXPECT_EQ(p->slot_elems, 2 * 12 * 2 * 16);
  EXPECT_FALSE(p->has_out);
}

TEST(PlanCallPlanTest, GatherHeadsContiguous) {
  FakeBuffers b = Roomy();
  absl::StatusOr<CallPlan> p = PlanCall(Geo(), Gather(2, 12), b);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->seq_local, 3);
  EXPECT_THAT(p->inputs[0].shape, ElementsAre(2, 12, 2, 16));
  EXPECT_THAT(p->inputs[0].strides, ElementsAre(384, 32, 16, 1));
  EXPECT_EQ(p->inputs[0].span_bytes, 2u * 12 * 2 * 16 * 2);
  EXPECT_THAT(p->out_shape, ElementsAre(2, 3, 8, 16));
  EXPECT_EQ(p->slot_elems, 2 * 3 * 8 * 16);
}

TEST(PlanCallPlanTest, ScatterQkvFromUnbindViews) {
  // One [B,S_l,H,3,D] = [2,3,8,3,16] tensor in buffer 20; q, k, v are its unbind(3) views.
  const uint64_t whole = 2 * 3 * 8 * 3 * 16 * kItem;  // 4608 bytes
  FakeBuffers b;
  b.Add(20, whole).Add(21, 1 << 20);
  const std::array<int64_t, 4> st = {3 * 8 * 48, 8 * 48, 48, 1};
  CallArgs a = Qkv(1, 1);
  a.inputs = {Ref(20, 0, st), Ref(20, 16 * kItem, st), Ref(20, 32 * kItem, st)};
  a.out = Ref(21, 0);
  absl::StatusOr<CallPlan> p = PlanCall(Geo(), a, b);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->num_inputs, 3);
  EXPECT_EQ(p->head_offset, 1);
  EXPECT_EQ(p->head_count, 1);
  EXPECT_EQ(p->seq_local, 3);
  // Largest offset: 1*1152 + 2*384 + 7*48 + 15 = 2271.
  const uint64_t span = 2272 * kItem;
  for (int i = 0; i < 3; ++i) {
    EXPECT_THAT(p->inputs[i].shape, ElementsAre(2, 3, 8, 16)) << i;
    EXPECT_THAT(p->inputs[i].strides, ElementsAre(1152, 384, 48, 1)) << i;
    EXPECT_EQ(p->inputs[i].span_bytes, span) << i;
    EXPECT_EQ(p->inputs[i].offset_bytes, uint64_t(i) * 16 * kItem) << i;
  }
  // v ends exactly at the end of the buffer.
  EXPECT_EQ(p->inputs[2].offset_bytes + p->inputs[2].span_bytes, whole);
  EXPECT_THAT(p->out_shape, ElementsAre(2, 12, 1, 48));
  EXPECT_EQ(p->slot_elems, 2 * 12 * 1 * 48);
  EXPECT_TRUE(p->has_out);
  EXPECT_THAT(p->out.strides, ElementsAre(576, 48, 48, 1));
  EXPECT_EQ(p->out.span_bytes, 2u * 12 * 48 * 2);

  // One byte less and v no longer fits.
  FakeBuffers small;
  small.Add(20, whole - 2).Add(21, 1 << 20);
  EXPECT_THAT(PlanCall(Geo(), a, small),
              StatusIs(kInvalid, AllOf(HasSubstr("v: "), HasSubstr("exceed"))));
}

TEST(PlanCallPlanTest, GatherOutputHeadChunkStrided) {
  FakeBuffers b = Roomy();
  // x [2,12,1,16] as a view of a [2,12,2,16] tensor (band of one head); out contiguous.
  CallArgs a = GatherOut(1, 1);
  a.inputs[0] = Ref(1, 16 * kItem, {12 * 32, 32, 16, 1});
  absl::StatusOr<CallPlan> p = PlanCall(Geo(), a, b);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->seq_local, 3);
  EXPECT_EQ(p->head_offset, 1);
  EXPECT_EQ(p->head_count, 1);
  EXPECT_THAT(p->inputs[0].shape, ElementsAre(2, 12, 1, 16));
  EXPECT_THAT(p->inputs[0].strides, ElementsAre(384, 32, 16, 1));
  EXPECT_EQ(p->inputs[0].span_bytes, uint64_t(384 + 11 * 32 + 0 + 15 + 1) * kItem);
  EXPECT_THAT(p->out_shape, ElementsAre(2, 3, 8, 16));
  // The slot holds what arrives: B*S_l*W*HC*D.
  EXPECT_EQ(p->slot_elems, 2 * 3 * 4 * 1 * 16);
  EXPECT_TRUE(p->has_out);
  EXPECT_EQ(p->out.buffer_id, 4u);
  EXPECT_THAT(p->out.shape, ElementsAre(2, 3, 8, 16));
  EXPECT_THAT(p->out.strides, ElementsAre(384, 128, 16, 1));
  EXPECT_EQ(p->out.span_bytes, 2u * 3 * 8 * 16 * 2);

  // The whole band.
  p = PlanCall(Geo(), GatherOut(0, 2), b);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->slot_elems, 2 * 3 * 4 * 2 * 16);
  EXPECT_THAT(p->inputs[0].strides, ElementsAre(384, 32, 16, 1));
}

TEST(PlanCallPlanTest, Float32SpansUseItemsize) {
  SessionGeometry g = Geo();
  g.dtype = DType::kFloat32;
  FakeBuffers b = Roomy();
  absl::StatusOr<CallPlan> p = PlanCall(g, Scatter(), b);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->inputs[0].span_bytes, 2u * 3 * 8 * 16 * 4);
}

TEST(PlanCallPlanTest, SameVerdictOnEveryRank) {
  FakeBuffers b = Roomy();
  for (const CallArgs& a : AllOps()) {
    absl::StatusOr<CallPlan> p0 = PlanCall(Geo(0), a, b);
    ASSERT_THAT(p0, IsOk());
    for (int32_t r = 1; r < kW; ++r) {
      absl::StatusOr<CallPlan> p = PlanCall(Geo(r), a, b);
      ASSERT_THAT(p, IsOk());
      EXPECT_EQ(p->out_shape, p0->out_shape);
      EXPECT_EQ(p->slot_elems, p0->slot_elems);
      EXPECT_EQ(p->inputs[0].span_bytes, p0->inputs[0].span_bytes);
    }
  }
}

TEST(PlanCallPlanTest, MiniMaxH3Bands) {
  // [1, 37888, 56, 128] at W=2 with (7,14,7) and W=4 with (2,10,2).
  for (auto [w, schedule] : {std::pair{2, std::vector<int32_t>{7, 14, 7}},
                             std::pair{4, std::vector<int32_t>{2, 10, 2}}}) {
    SessionGeometry g;
    g.world_size = w;
    g.num_heads = 56;
    g.head_dim = 128;
    g.dtype = DType::kBFloat16;
    g.max_tokens = 37888 / w;
    g.schedule = schedule;
    ASSERT_THAT(ValidateSessionGeometry(g), IsOk());
    FakeBuffers b = Roomy();
    std::vector<int32_t> offsets = g.ScheduleOffsets();
    for (size_t i = 0; i < schedule.size(); ++i) {
      CallArgs a = Qkv(offsets[i], schedule[i], 1, 37888 / w);
      absl::StatusOr<CallPlan> p = PlanCall(g, a, b);
      ASSERT_THAT(p, IsOk()) << "W=" << w << " band " << i;
      EXPECT_THAT(p->out_shape, ElementsAre(1, 37888, schedule[i], 384));
      EXPECT_EQ(p->slot_elems, int64_t{37888} * schedule[i] * 384);
      EXPECT_LE(p->slot_elems, g.SlotElems());
      CallArgs o = GatherOut(offsets[i], schedule[i], 1, 37888);
      p = PlanCall(g, o, b);
      ASSERT_THAT(p, IsOk()) << "W=" << w << " band " << i;
      EXPECT_EQ(p->slot_elems, int64_t{37888} * schedule[i] * 128);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 64-bit offsets

TEST(PlanCallLargeOffsetTest, OffsetBeyondInt32AcceptedWhenBufferIsLargeEnough) {
  // x [2,3,8,16] whose batch stride is 2^31 + 384 elements: the largest offset is
  // 2^31 + 384 + 2*128 + 7*16 + 15 = 2,147,484,415 elements.
  const int64_t s0 = (int64_t{1} << 31) + 384;
  const uint64_t span = uint64_t(s0 + 256 + 112 + 15 + 1) * kItem;  // 4,294,968,832 bytes
  ASSERT_EQ(span, 4294968832u);
  CallArgs a = Scatter();
  a.inputs[0] = Ref(1, 1024, {s0, 128, 16, 1});
  FakeBuffers exact;
  exact.Add(1, 1024 + span);
  absl::StatusOr<CallPlan> p = PlanCall(Geo(), a, exact);
  ASSERT_THAT(p, IsOk());
  EXPECT_THAT(p->inputs[0].strides, ElementsAre(s0, 128, 16, 1));
  EXPECT_EQ(p->inputs[0].span_bytes, span);
  EXPECT_EQ(p->inputs[0].offset_bytes, 1024u);

  FakeBuffers short_by_one;
  short_by_one.Add(1, 1024 + span - kItem);
  EXPECT_THAT(PlanCall(Geo(), a, short_by_one),
              StatusIs(kInvalid, AllOf(HasSubstr("x"), HasSubstr("exceed"))));
}

TEST(PlanCallLargeOffsetTest, OffsetsOverflowingInt64Rejected) {
  FakeBuffers b = Roomy();
  CallArgs a = Scatter();
  a.inputs[0] = Ref(1, 0, {std::numeric_limits<int64_t>::max(), 128, 16, 1});
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("x"), HasSubstr("overflow"))));
  // Largest offset fits in int64 but its byte span does not.
  a.inputs[0] = Ref(1, 0, {std::numeric_limits<int64_t>::max() / 2, 128, 16, 1});
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("x"), HasSubstr("overflow"))));
  // Largest offset exactly INT64_MAX: 1*s0 + 2*1 + 7*1 + 15*1 with s0 = INT64_MAX - 24.
  // BUG (common/src/validation.cc:49): `max_off + 1` overflows int64 here (undefined behaviour,
  // reported by -fsanitize=undefined); the rejection below only happens because the sum wraps to
  // INT64_MIN and the multiply then overflows. The check should test max_off + 1 for overflow
  // (e.g. __builtin_add_overflow) before multiplying by the itemsize.
  a.inputs[0] = Ref(1, 0, {std::numeric_limits<int64_t>::max() - 24, 1, 1, 1});
  EXPECT_THAT(PlanCall(Geo(), a, b),
              StatusIs(kInvalid, AllOf(HasSubstr("x"), HasSubstr("overflow"))));
}

}  // namespace
}  // namespace ulysses
