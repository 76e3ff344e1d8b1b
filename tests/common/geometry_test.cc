// Session geometry rules (ValidateSessionGeometry), dtypes and the derived quantities.
#include "ulysses/common/geometry.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "status_matchers.h"

namespace ulysses {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// A valid geometry every test starts from: W=4, H=8 (H_l=2), D=16, bf16.
SessionGeometry Base() {
  SessionGeometry g;
  g.world_size = 4;
  g.rank = 1;
  g.num_heads = 8;
  g.head_dim = 16;
  g.dtype = DType::kBFloat16;
  g.max_tokens = 1024;
  g.num_slots = 2;
  return g;
}

// MiniMax-H3: H=56, D=128, bf16, S=37888 global tokens.
SessionGeometry MiniMax(int32_t world_size, std::vector<int32_t> schedule) {
  SessionGeometry g;
  g.world_size = world_size;
  g.rank = 0;
  g.num_heads = 56;
  g.head_dim = 128;
  g.dtype = DType::kBFloat16;
  g.max_tokens = 37888;
  g.schedule = std::move(schedule);
  return g;
}

// ---------------------------------------------------------------------------------------------
// ValidateSessionGeometry

TEST(SessionGeometryTest, BaseIsValid) { EXPECT_THAT(ValidateSessionGeometry(Base()), IsOk()); }

TEST(SessionGeometryTest, WorldSizeOutOfRange) {
  for (int32_t w : {0, -1, kMaxWorldSize + 1}) {
    SessionGeometry g = Base();
    g.world_size = w;
    g.rank = 0;
    EXPECT_THAT(ValidateSessionGeometry(g),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("world_size")))
        << "W=" << w;
  }
}

TEST(SessionGeometryTest, WorldSizeEdgesAccepted) {
  SessionGeometry g = Base();
  g.world_size = 1;
  g.rank = 0;
  EXPECT_THAT(ValidateSessionGeometry(g), IsOk());
  g.world_size = kMaxWorldSize;
  g.num_heads = 2 * kMaxWorldSize;
  g.rank = kMaxWorldSize - 1;
  EXPECT_THAT(ValidateSessionGeometry(g), IsOk());
}

TEST(SessionGeometryTest, RankOutOfRange) {
  for (int32_t r : {-1, 4, 5}) {
    SessionGeometry g = Base();
    g.rank = r;
    EXPECT_THAT(ValidateSessionGeometry(g),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank")))
        << "rank=" << r;
  }
  SessionGeometry g = Base();
  g.rank = 0;
  EXPECT_THAT(ValidateSessionGeometry(g), IsOk());
  g.rank = 3;
  EXPECT_THAT(ValidateSessionGeometry(g), IsOk());
}

TEST(SessionGeometryTest, NumHeadsMustBePositive) {
  for (int32_t h : {0, -8}) {
    SessionGeometry g = Base();
    g.num_heads = h;
    EXPECT_THAT(ValidateSessionGeometry(g),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_heads")))
        << "H=" << h;
  }
}

TEST(SessionGeometryTest, NumHeadsMustBeDivisibleByWorldSize) {
  SessionGeometry g = Base();
  g.num_heads = 10;  // 10 % 4 != 0
  EXPECT_THAT(ValidateSessionGeometry(g),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("num_heads"), HasSubstr("divisible"))));
}

TEST(SessionGeometryTest, HeadDimMustBePositive) {
  for (int32_t d : {0, -128}) {
    SessionGeometry g = Base();
    g.head_dim = d;
    EXPECT_THAT(ValidateSessionGeometry(g),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("head_dim")))
        << "D=" << d;
  }
}

TEST(SessionGeometryTest, DTypeMustBeSet) {
  SessionGeometry g = Base();
  g.dtype = DType::kUnspecified;
  EXPECT_THAT(ValidateSessionGeometry(g),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtype")));
  g.dtype = static_cast<DType>(17);
  EXPECT_THAT(ValidateSessionGeometry(g),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtype")));
  for (DType d : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    g.dtype = d;
    EXPECT_THAT(ValidateSessionGeometry(g), IsOk()) << DTypeName(d);
  }
}

TEST(SessionGeometryTest, MaxTokensMustBePositive) {
  for (int64_t t : {int64_t{0}, int64_t{-1}}) {
    SessionGeometry g = Base();
    g.max_tokens = t;
    EXPECT_THAT(ValidateSessionGeometry(g),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_tokens")))
        << "max_tokens=" << t;
  }
}

TEST(SessionGeometryTest, NumSlotsOutOfRange) {
  for (int32_t n : {0, 9, -1}) {
    SessionGeometry g = Base();
    g.num_slots = n;
    EXPECT_THAT(ValidateSessionGeometry(g),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_slots")))
        << "num_slots=" << n;
  }
  for (int32_t n : {1, kMaxSlots}) {
    SessionGeometry g = Base();
    g.num_slots = n;
    EXPECT_THAT(ValidateSessionGeometry(g), IsOk()) << "num_slots=" << n;
  }
}

TEST(SessionGeometryTest, ScheduleCountsMustBePositive) {
  SessionGeometry g = MiniMax(2, {7, 0, 21});
  EXPECT_THAT(ValidateSessionGeometry(g),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("schedule"), HasSubstr("positive"))));
  g.schedule = {30, -2};  // sums to 28 but has a negative count
  EXPECT_THAT(ValidateSessionGeometry(g),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("schedule"), HasSubstr("positive"))));
}

TEST(SessionGeometryTest, ScheduleMustSumToLocalHeads) {
  SessionGeometry g = MiniMax(2, {7, 14, 6});  // H_l = 28, sum 27
  EXPECT_THAT(ValidateSessionGeometry(g),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("schedule"), HasSubstr("27"), HasSubstr("28"))));
  g.schedule = {7, 14, 8};  // sum 29
  EXPECT_THAT(ValidateSessionGeometry(g),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("schedule")));
}

TEST(SessionGeometryTest, MiniMaxH3Schedules) {
  EXPECT_THAT(ValidateSessionGeometry(MiniMax(2, {7, 14, 7})), IsOk());
  EXPECT_THAT(ValidateSessionGeometry(MiniMax(4, {2, 10, 2})), IsOk());
  EXPECT_THAT(ValidateSessionGeometry(MiniMax(8, {})), IsOk());
  EXPECT_THAT(ValidateSessionGeometry(MiniMax(4, {14})), IsOk());
  EXPECT_THAT(ValidateSessionGeometry(MiniMax(4, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1})),
              IsOk());
  // The W=2 schedule is wrong for W=4 (H_l = 14).
  EXPECT_THAT(ValidateSessionGeometry(MiniMax(4, {7, 14, 7})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("schedule")));
}

TEST(SessionGeometryTest, MiniMaxH3RejectedAtWorldSizeSix) {
  EXPECT_THAT(ValidateSessionGeometry(MiniMax(6, {})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("num_heads"), HasSubstr("divisible"))));
}

TEST(SessionGeometryTest, SlotOverInt32Limit) {
  // H*D = 256: the slot is 3*max_tokens*256 elements; 2,796,202 is the largest that fits.
  SessionGeometry g;
  g.world_size = 2;
  g.num_heads = 2;
  g.head_dim = 128;
  g.dtype = DType::kBFloat16;
  g.max_tokens = 2796202;
  EXPECT_THAT(ValidateSessionGeometry(g), IsOk());
  EXPECT_EQ(g.SlotElems(), 2147483136);
  g.max_tokens = 2796203;  // 2,147,483,904 elements
  EXPECT_THAT(ValidateSessionGeometry(g),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("max_tokens"), HasSubstr("int32"))));
  g.max_tokens = int64_t{1} << 40;
  EXPECT_THAT(ValidateSessionGeometry(g),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("int32")));
}

TEST(SessionGeometryTest, LocalHeadsAndItemSize) {
  SessionGeometry g = MiniMax(4, {2, 10, 2});
  EXPECT_EQ(g.local_heads(), 14);
  EXPECT_EQ(g.itemsize(), 2);
  g.dtype = DType::kFloat32;
  EXPECT_EQ(g.itemsize(), 4);
  g.world_size = 0;
  EXPECT_EQ(g.local_heads(), 0);
}

// ---------------------------------------------------------------------------------------------
// Derived quantities

TEST(ScheduleOffsetsTest, PrefixSums) {
  EXPECT_THAT(MiniMax(2, {7, 14, 7}).ScheduleOffsets(), ElementsAre(0, 7, 21));
  EXPECT_THAT(MiniMax(4, {2, 10, 2}).ScheduleOffsets(), ElementsAre(0, 2, 12));
  EXPECT_THAT(MiniMax(4, {14}).ScheduleOffsets(), ElementsAre(0));
  EXPECT_THAT(MiniMax(8, {1, 2, 3, 1}).ScheduleOffsets(), ElementsAre(0, 1, 3, 6));
  EXPECT_THAT(MiniMax(8, {}).ScheduleOffsets(), IsEmpty());
}

TEST(SlotElemsTest, ThreeTimesMaxTokensTimesHeadsTimesDim) {
  SessionGeometry g = MiniMax(2, {7, 14, 7});
  EXPECT_EQ(g.SlotElems(), int64_t{3} * 37888 * 56 * 128);
  EXPECT_EQ(g.SlotBytes(), int64_t{3} * 37888 * 56 * 128 * 2);
  SessionGeometry b = Base();
  EXPECT_EQ(b.SlotElems(), 3 * 1024 * 8 * 16);
  b.dtype = DType::kFloat32;
  EXPECT_EQ(b.SlotBytes(), 3 * 1024 * 8 * 16 * 4);
}

// ---------------------------------------------------------------------------------------------
// DTypes and names

TEST(DTypeTest, ItemSize) {
  EXPECT_EQ(ItemSize(DType::kFloat16), 2);
  EXPECT_EQ(ItemSize(DType::kBFloat16), 2);
  EXPECT_EQ(ItemSize(DType::kFloat32), 4);
  EXPECT_EQ(ItemSize(DType::kUnspecified), 0);
  EXPECT_EQ(ItemSize(static_cast<DType>(42)), 0);
}

TEST(DTypeTest, NameRoundTrip) {
  for (DType d : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    absl::StatusOr<DType> parsed = ParseDType(DTypeName(d));
    ASSERT_THAT(parsed, IsOk()) << DTypeName(d);
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_EQ(DTypeName(DType::kFloat16), "float16");
  EXPECT_EQ(DTypeName(DType::kBFloat16), "bfloat16");
  EXPECT_EQ(DTypeName(DType::kFloat32), "float32");
  EXPECT_EQ(DTypeName(DType::kUnspecified), "unspecified");
}

TEST(DTypeTest, Aliases) {
  const std::vector<std::pair<std::string, DType>> cases = {
      {"fp16", DType::kFloat16},  {"half", DType::kFloat16},      {"FP16", DType::kFloat16},
      {"bf16", DType::kBFloat16}, {"BFloat16", DType::kBFloat16}, {"fp32", DType::kFloat32},
      {"float", DType::kFloat32}, {"Float32", DType::kFloat32},
  };
  for (const auto& [name, want] : cases) {
    absl::StatusOr<DType> parsed = ParseDType(name);
    ASSERT_THAT(parsed, IsOk()) << name;
    EXPECT_EQ(*parsed, want) << name;
  }
}

TEST(DTypeTest, BadNameRejected) {
  for (const char* name : {"int8", "", "unspecified", "float64", "bf 16"}) {
    EXPECT_THAT(ParseDType(name),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtype")))
        << "'" << name << "'";
  }
  EXPECT_THAT(ParseDType("int8"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("int8")));
}

TEST(OpNamesTest, NamesAndInputs) {
  EXPECT_EQ(OpName(OpKind::kScatterHeads), "scatter_heads");
  EXPECT_EQ(OpName(OpKind::kGatherHeads), "gather_heads");
  EXPECT_EQ(OpName(OpKind::kScatterQkvHeadChunk), "scatter_qkv_head_chunk");
  EXPECT_EQ(OpName(OpKind::kGatherOutputHeadChunk), "gather_output_head_chunk");
  EXPECT_EQ(OpName(OpKind::kUnspecified), "unspecified");
  EXPECT_THAT(InputNames(OpKind::kScatterHeads), ElementsAre("x"));
  EXPECT_THAT(InputNames(OpKind::kGatherHeads), ElementsAre("y"));
  EXPECT_THAT(InputNames(OpKind::kScatterQkvHeadChunk), ElementsAre("q", "k", "v"));
  EXPECT_THAT(InputNames(OpKind::kGatherOutputHeadChunk), ElementsAre("x"));
  EXPECT_THAT(InputNames(OpKind::kUnspecified), IsEmpty());
}

TEST(OpTraitsTest, OneEntryPerOpAndNoneForAValueOutsideTheSet) {
  for (int32_t v = 0; v < kNumOpKinds; ++v) {
    const OpTraits& t = Traits(static_cast<OpKind>(v));
    EXPECT_EQ(static_cast<int32_t>(t.op), v) << "the table is indexed by OpKind value";
    EXPECT_EQ(IsHeadExchangeOp(t.op), v >= 1 && v <= 4) << t.name;
  }
  for (int32_t v : {-1, kNumOpKinds, 1 << 30}) {
    EXPECT_EQ(Traits(static_cast<OpKind>(v)).op, OpKind::kUnspecified) << v;
    EXPECT_FALSE(IsHeadExchangeOp(static_cast<OpKind>(v))) << v;
  }
  EXPECT_TRUE(Traits(OpKind::kQkvNormRopeExchange).fused);
  EXPECT_THAT(InputNames(OpKind::kQkvNormRopeExchange), ElementsAre("x", "positions"));
  // Only the merge writes into a caller's out, and only the head-chunk ops take a band.
  for (int32_t v = 1; v < kNumOpKinds; ++v) {
    const OpTraits& t = Traits(static_cast<OpKind>(v));
    EXPECT_EQ(t.merges_into_out, t.op == OpKind::kGatherOutputHeadChunk) << t.name;
    EXPECT_EQ(t.head_chunk, t.op == OpKind::kScatterQkvHeadChunk ||
                                t.op == OpKind::kGatherOutputHeadChunk)
        << t.name;
  }
}

}  // namespace
}  // namespace ulysses
