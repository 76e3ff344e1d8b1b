// The CUDA launchers run RowCopyPlans; RunPlanOnHost runs the same plans (same RowAt index
// math, same unit widths) on host memory. Here every plan is checked against its reference
// block, so the kernels' addressing is verified on machines without a GPU.
#include "exchange_plan.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "exchange_test_util.h"
#include "ulysses/kernels/exchange.h"

namespace ulysses::kernels {
namespace {

using internal::RowCopyPlan;
using testing::Dtype;
using testing::HostView;
using testing::Layout;

struct Dims {
  int64_t batch, seq_local;
  int32_t heads, head_dim;
};
void PrintTo(const Dims& d, std::ostream* os) {
  *os << "B" << d.batch << " S_l" << d.seq_local << " H" << d.heads << " D" << d.head_dim;
}
using Param = std::tuple<int, Dims, Dtype>;

// Layouts plus one whose data pointer is one element off 16-byte alignment (scalar path).
struct Variant {
  Layout layout;
  bool misaligned;
};
const Variant kVariants[] = {{Layout::kContiguous, false},
                             {Layout::kPaddedHeads, false},
                             {Layout::kTransposed, false},
                             {Layout::kContiguous, true}};

std::string VariantName(const Variant& v) {
  return testing::LayoutName(v.layout) + (v.misaligned ? "_misaligned" : "");
}

HostView MakeView(const Variant& v, int64_t n0, int64_t n1, int64_t n2, int64_t n3,
                  int32_t itemsize, uint64_t seed) {
  HostView view = testing::MakeHostView(v.layout, n0, n1, n2, n3, itemsize, seed);
  if (v.misaligned) {
    // Shift the view by one element inside a buffer one element longer.
    view.buffer.resize(view.buffer.size() + itemsize);
    view.base += 1;
  }
  return view;
}

class ExchangePlanTest : public ::testing::TestWithParam<Param> {
 protected:
  ExchangeShape Shape() const {
    const auto& [world, dims, dtype] = GetParam();
    return ExchangeShape{world,      dims.batch,    dims.seq_local,
                         dims.heads, dims.head_dim, testing::ItemSize(dtype)};
  }
  // Runs `plan_fn` and `ref_fn` for every (src, dst) into copies of the same random buffer
  // and requires identical bytes.
  template <typename PlanFn, typename RefFn>
  void ExpectSameForAllPairs(int64_t out_bytes, PlanFn plan_fn, RefFn ref_fn) {
    const ExchangeShape sh = Shape();
    const auto before = testing::RandomBytes(out_bytes, 321);
    for (int src = 0; src < sh.world; ++src) {
      for (int dst = 0; dst < sh.world; ++dst) {
        auto via_plan = before;
        auto via_ref = before;
        for (const absl::StatusOr<RowCopyPlan>& plan : plan_fn(src, dst, via_plan.data())) {
          ASSERT_TRUE(plan.ok()) << plan.status();
          internal::RunPlanOnHost(*plan);
        }
        ref_fn(src, dst, via_ref.data());
        ASSERT_EQ(via_plan, via_ref) << "src " << src << " dst " << dst;
      }
    }
  }
};

TEST_P(ExchangePlanTest, ScatterHeadsPlanMatchesRef) {
  const ExchangeShape sh = Shape();
  for (const Variant& variant : kVariants) {
    SCOPED_TRACE(VariantName(variant));
    std::vector<HostView> x;
    for (int j = 0; j < sh.world; ++j) {
      x.push_back(
          MakeView(variant, sh.batch, sh.seq_local, sh.heads, sh.head_dim, sh.itemsize, 7 * j + 1));
    }
    ExpectSameForAllPairs(
        sh.batch * GlobalSeq(sh) * LocalHeads(sh) * sh.head_dim * sh.itemsize,
        [&](int src, int dst, void* out) {
          return std::vector{internal::PlanScatterHeadsBlock(sh, x[src].view(), src, dst, out)};
        },
        [&](int src, int dst, void* out) {
          ScatterHeadsBlockRef(sh, x[src].view(), src, dst, out);
        });
  }
}

TEST_P(ExchangePlanTest, GatherHeadsPlanMatchesRef) {
  const ExchangeShape sh = Shape();
  for (const Variant& variant : kVariants) {
    SCOPED_TRACE(VariantName(variant));
    std::vector<HostView> y;
    for (int p = 0; p < sh.world; ++p) {
      y.push_back(MakeView(variant, sh.batch, GlobalSeq(sh), LocalHeads(sh), sh.head_dim,
                           sh.itemsize, 7 * p + 2));
    }
    ExpectSameForAllPairs(
        sh.batch * sh.seq_local * sh.heads * sh.head_dim * sh.itemsize,
        [&](int src, int dst, void* out) {
          return std::vector{internal::PlanGatherHeadsBlock(sh, y[src].view(), src, dst, out)};
        },
        [&](int src, int dst, void* out) {
          GatherHeadsBlockRef(sh, y[src].view(), src, dst, out);
        });
  }
}

TEST_P(ExchangePlanTest, HeadChunkPlansMatchRefs) {
  const ExchangeShape sh = Shape();
  const int32_t hl = static_cast<int32_t>(LocalHeads(sh));
  const int32_t offset = hl > 2 ? 1 : 0;
  const int32_t count = hl > 2 ? hl - 2 : hl;  // a band strictly inside H_l when possible
  for (const Variant& variant : kVariants) {
    SCOPED_TRACE(VariantName(variant));
    std::vector<HostView> q, k, v, x;
    for (int j = 0; j < sh.world; ++j) {
      q.push_back(MakeView(variant, sh.batch, sh.seq_local, sh.heads, sh.head_dim, sh.itemsize,
                           10 * j + 3));
      k.push_back(MakeView(variant, sh.batch, sh.seq_local, sh.heads, sh.head_dim, sh.itemsize,
                           10 * j + 4));
      v.push_back(MakeView(variant, sh.batch, sh.seq_local, sh.heads, sh.head_dim, sh.itemsize,
                           10 * j + 5));
      x.push_back(
          MakeView(variant, sh.batch, GlobalSeq(sh), count, sh.head_dim, sh.itemsize, 10 * j + 6));
    }
    ExpectSameForAllPairs(
        sh.batch * GlobalSeq(sh) * count * 3 * sh.head_dim * sh.itemsize,
        [&](int src, int dst, void* out) {
          std::vector<absl::StatusOr<RowCopyPlan>> plans;
          const HostView* parts[3] = {&q[src], &k[src], &v[src]};
          for (int part = 0; part < 3; ++part) {
            plans.push_back(internal::PlanScatterQkvHeadChunkPart(sh, parts[part]->view(), part,
                                                                  offset, count, src, dst, out));
          }
          return plans;
        },
        [&](int src, int dst, void* out) {
          ScatterQkvHeadChunkBlockRef(sh, q[src].view(), k[src].view(), v[src].view(), offset,
                                      count, src, dst, out);
        });
    ExpectSameForAllPairs(
        sh.batch * sh.seq_local * sh.world * count * sh.head_dim * sh.itemsize,
        [&](int src, int dst, void* stage) {
          return std::vector{
              internal::PlanGatherOutputHeadChunkBlock(sh, x[src].view(), count, src, dst, stage)};
        },
        [&](int src, int dst, void* stage) {
          GatherOutputHeadChunkBlockRef(sh, x[src].view(), count, src, dst, stage);
        });

    // Merge into a view of `variant`'s layout: both start from the same random contents.
    const auto stage = testing::RandomBytes(
        sh.batch * sh.seq_local * sh.world * count * sh.head_dim * sh.itemsize, 55);
    HostView via_plan =
        MakeView(variant, sh.batch, sh.seq_local, sh.heads, sh.head_dim, sh.itemsize, 56);
    HostView via_ref = via_plan;
    auto plan = internal::PlanGatherOutputHeadChunkMerge(sh, stage.data(), offset, count,
                                                         via_plan.mut_view());
    ASSERT_TRUE(plan.ok()) << plan.status();
    internal::RunPlanOnHost(*plan);
    GatherOutputHeadChunkMergeRef(sh, stage.data(), offset, count, via_ref.mut_view());
    EXPECT_EQ(via_plan.buffer, via_ref.buffer);
  }
}

// A transport that moves blocks as flat bytes packs each block on its source and unpacks it on
// its destination; the destination's buffer must end exactly as the direct block plan leaves
// it, whichever unit width each side runs (the misaligned variant packs element-wise and
// unpacks with 16-byte units).
TEST_P(ExchangePlanTest, PackedBlocksUnpackToTheDirectBlock) {
  const ExchangeShape sh = Shape();
  const int32_t hl = static_cast<int32_t>(LocalHeads(sh));
  const int32_t offset = hl > 2 ? 1 : 0;
  const int32_t count = hl > 2 ? hl - 2 : hl;
  struct alignas(16) Chunk {
    uint8_t bytes[16];
  };
  for (const Variant& variant : kVariants) {
    SCOPED_TRACE(VariantName(variant));
    const HostView x = MakeView(variant, sh.batch, sh.seq_local, sh.heads, sh.head_dim, sh.itemsize, 71);
    const HostView y =
        MakeView(variant, sh.batch, GlobalSeq(sh), hl, sh.head_dim, sh.itemsize, 72);
    const HostView k = MakeView(variant, sh.batch, sh.seq_local, sh.heads, sh.head_dim, sh.itemsize, 73);
    const HostView v = MakeView(variant, sh.batch, sh.seq_local, sh.heads, sh.head_dim, sh.itemsize, 74);
    const HostView o = MakeView(variant, sh.batch, GlobalSeq(sh), count, sh.head_dim, sh.itemsize, 75);
    const int64_t full = sh.batch * sh.seq_local * sh.heads * sh.head_dim * sh.itemsize;
    struct Case {
      BlockOperands ops;
      int64_t out_bytes;
    };
    const Case cases[] = {
        {{BlockKind::kScatterHeads, {x.view(), x.view(), x.view()}, 0, 0}, full},
        {{BlockKind::kGatherHeads, {y.view(), y.view(), y.view()}, 0, 0}, full},
        {{BlockKind::kScatterQkvHeadChunk, {x.view(), k.view(), v.view()}, offset, count},
         sh.batch * GlobalSeq(sh) * count * 3 * sh.head_dim * sh.itemsize},
        {{BlockKind::kGatherOutputHeadChunk, {o.view(), o.view(), o.view()}, offset, count},
         sh.batch * sh.seq_local * sh.world * count * sh.head_dim * sh.itemsize},
    };
    for (const Case& c : cases) {
      SCOPED_TRACE(static_cast<int>(c.ops.kind));
      auto bytes = internal::PackedBlockBytes(sh, c.ops);
      ASSERT_TRUE(bytes.ok()) << bytes.status();
      ASSERT_EQ(*bytes * sh.world, c.out_bytes);
      const auto before = testing::RandomBytes(c.out_bytes, 76);
      for (int src = 0; src < sh.world; ++src) {
        for (int dst = 0; dst < sh.world; ++dst) {
          auto direct = before;
          auto via_packed = before;
          auto plans = internal::PlanBlock(sh, c.ops, src, dst, direct.data());
          ASSERT_TRUE(plans.ok()) << plans.status();
          for (int i = 0; i < plans->count; ++i) internal::RunPlanOnHost(plans->plans[i]);
          // One chunk past the block, which the pack must not touch.
          std::vector<Chunk> packed(static_cast<size_t>(*bytes / 16 + 2));
          std::memset(packed.data(), 0xA5, packed.size() * sizeof(Chunk));
          auto pack = internal::PlanPackBlock(sh, c.ops, src, dst, packed.data());
          ASSERT_TRUE(pack.ok()) << pack.status();
          for (int i = 0; i < pack->count; ++i) internal::RunPlanOnHost(pack->plans[i]);
          const auto* tail = reinterpret_cast<const uint8_t*>(packed.data()) + *bytes;
          for (int64_t i = 0; i < 16; ++i) ASSERT_EQ(tail[i], 0xA5) << "byte " << i << " past the block";
          auto unpack =
              internal::PlanUnpackBlock(sh, c.ops, src, dst, packed.data(), via_packed.data());
          ASSERT_TRUE(unpack.ok()) << unpack.status();
          for (int i = 0; i < unpack->count; ++i) internal::RunPlanOnHost(unpack->plans[i]);
          ASSERT_EQ(via_packed, direct) << "src " << src << " dst " << dst;
        }
      }
    }
  }
}

TEST(PackedBlockTest, MisalignedPackedBufferIsRefusedByName) {
  const ExchangeShape sh{2, 1, 4, 8, 64, 2};
  struct alignas(16) Chunk {
    uint8_t bytes[16];
  };
  std::vector<Chunk> x(static_cast<size_t>(4 * 8 * 64 * 2 / 16)), packed(x.size() + 1);
  const BlockOperands ops{BlockKind::kScatterHeads,
                          {ContiguousConstView(x.data(), 4, 8, 64)},
                          0,
                          0};
  auto* off = reinterpret_cast<uint8_t*>(packed.data()) + 2;
  auto pack = internal::PlanPackBlock(sh, ops, 0, 1, off);
  ASSERT_FALSE(pack.ok());
  EXPECT_EQ(pack.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(pack.status().message().find("packed"), std::string::npos) << pack.status();
  auto unpack = internal::PlanUnpackBlock(sh, ops, 0, 1, off, x.data());
  ASSERT_FALSE(unpack.ok());
  EXPECT_NE(unpack.status().message().find("packed"), std::string::npos) << unpack.status();
  BlockOperands bad = ops;
  bad.kind = static_cast<BlockKind>(9);
  EXPECT_EQ(internal::PackedBlockBytes(sh, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(ExchangePlanTest, CopyPlansMatchRefs) {
  const ExchangeShape sh = Shape();
  const int64_t shape[4] = {sh.batch, sh.seq_local, sh.heads, sh.head_dim};
  const int64_t bytes = sh.batch * sh.seq_local * sh.heads * sh.head_dim * sh.itemsize;
  for (const Variant& variant : kVariants) {
    SCOPED_TRACE(VariantName(variant));
    const HostView src = MakeView(variant, shape[0], shape[1], shape[2], shape[3], sh.itemsize, 61);
    std::vector<uint8_t> via_plan(bytes), via_ref(bytes);
    auto plan = internal::PlanCopyViewToContiguous(src.view(), shape, sh.itemsize, via_plan.data());
    ASSERT_TRUE(plan.ok()) << plan.status();
    internal::RunPlanOnHost(*plan);
    CopyViewToContiguousRef(src.view(), shape, sh.itemsize, via_ref.data());
    EXPECT_EQ(via_plan, via_ref);

    const auto dense = testing::RandomBytes(bytes, 62);
    HostView dst_plan = MakeView(variant, shape[0], shape[1], shape[2], shape[3], sh.itemsize, 63);
    HostView dst_ref = dst_plan;
    plan =
        internal::PlanCopyContiguousToView(dense.data(), shape, sh.itemsize, dst_plan.mut_view());
    ASSERT_TRUE(plan.ok()) << plan.status();
    internal::RunPlanOnHost(*plan);
    CopyContiguousToViewRef(dense.data(), shape, sh.itemsize, dst_ref.mut_view());
    EXPECT_EQ(dst_plan.buffer, dst_ref.buffer);
  }
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  const auto& [world, dims, dtype] = info.param;
  return "W" + std::to_string(world) + "_B" + std::to_string(dims.batch) + "_S" +
         std::to_string(dims.seq_local) + "_D" + std::to_string(dims.head_dim) + "_" +
         testing::DtypeName(dtype);
}

INSTANTIATE_TEST_SUITE_P(Shapes, ExchangePlanTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 6, 8),
                                            ::testing::Values(Dims{1, 8, 24, 128},
                                                              Dims{2, 16, 24, 64},
                                                              Dims{1, 5, 24, 3}),
                                            ::testing::Values(Dtype::kFp16, Dtype::kFp32)),
                         ParamName);

// Planning never dereferences pointers, so fake, exactly-aligned addresses are enough here.
void* Fake(uintptr_t address) { return reinterpret_cast<void*>(address); }

RowCopyPlan ScatterPlan(int32_t head_dim, int32_t itemsize, ConstView x) {
  const ExchangeShape sh{2, 1, 4, 8, head_dim, itemsize};
  auto plan = internal::PlanScatterHeadsBlock(sh, x, 1, 1, Fake(0x100000));
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : RowCopyPlan{};
}

ConstView Contig(uintptr_t address, int64_t head_dim) {
  return ContiguousConstView(Fake(address), 4, 8, head_dim);
}

TEST(RowCopyPlanTest, UsesSixteenByteUnitsForAlignedRows) {
  RowCopyPlan p = ScatterPlan(128, 2, Contig(0x200000, 128));
  EXPECT_EQ(p.unit_bytes, 16);
  EXPECT_EQ(p.units_per_row, 16);
  EXPECT_EQ(p.lanes, 16);
  EXPECT_EQ(p.rows, 1 * 4 * 4);  // B * S_l * H_l

  p = ScatterPlan(128, 4, Contig(0x200000, 128));
  EXPECT_EQ(p.unit_bytes, 16);
  EXPECT_EQ(p.units_per_row, 32);
  EXPECT_EQ(p.lanes, 32);

  p = ScatterPlan(4, 4, Contig(0x200000, 4));  // 16-byte rows
  EXPECT_EQ(p.unit_bytes, 16);
  EXPECT_EQ(p.units_per_row, 1);

  // Padded heads (q of a [B, S, H, 3, D] pack) keep every row start aligned.
  p = ScatterPlan(64, 2, ConstView{Fake(0x200000 + 128), {4 * 8 * 3 * 64, 8 * 3 * 64, 3 * 64, 1}});
  EXPECT_EQ(p.unit_bytes, 16);

  // A dimension of extent 1 (B = 1) may have any stride.
  p = ScatterPlan(128, 2, ConstView{Fake(0x200000), {7, 8 * 128, 128, 1}});
  EXPECT_EQ(p.unit_bytes, 16);
}

TEST(RowCopyPlanTest, FallsBackToElementUnits) {
  RowCopyPlan p = ScatterPlan(3, 2, Contig(0x200000, 3));  // 6-byte rows
  EXPECT_EQ(p.unit_bytes, 2);
  EXPECT_EQ(p.units_per_row, 3);
  EXPECT_EQ(p.lanes, 4);

  p = ScatterPlan(4, 2, Contig(0x200000, 4));  // 8-byte rows
  EXPECT_EQ(p.unit_bytes, 2);

  p = ScatterPlan(128, 2, Contig(0x200002, 128));  // data one element off alignment
  EXPECT_EQ(p.unit_bytes, 2);

  p = ScatterPlan(128, 4, ConstView{Fake(0x200000), {4 * 8 * 256, 8 * 256, 256, 2}});
  EXPECT_EQ(p.unit_bytes, 4);  // element stride 2
  EXPECT_EQ(p.src_unit_step, 8);
  EXPECT_EQ(p.dst_unit_step, 4);

  p = ScatterPlan(128, 2, ConstView{Fake(0x200000), {4 * 8 * 132, 8 * 132, 132, 1}});
  EXPECT_EQ(p.unit_bytes, 2);  // head stride of 264 bytes is not a multiple of 16
}

void ExpectInvalid(const absl::StatusOr<RowCopyPlan>& plan, const std::string& needle) {
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
  EXPECT_NE(plan.status().message().find(needle), std::string::npos) << plan.status();
}

TEST(RowCopyPlanTest, RejectsBadArgumentsNamingThem) {
  const ExchangeShape ok{4, 1, 4, 8, 16, 2};
  const ConstView x = Contig(0x1000, 16);
  void* out = Fake(0x2000);

  ExchangeShape bad = ok;
  bad.heads = 6;
  ExpectInvalid(internal::PlanScatterHeadsBlock(bad, x, 0, 0, out), "divisible");
  bad = ok;
  bad.itemsize = 3;
  ExpectInvalid(internal::PlanScatterHeadsBlock(bad, x, 0, 0, out), "itemsize");
  bad = ok;
  bad.head_dim = 0;
  ExpectInvalid(internal::PlanGatherHeadsBlock(bad, x, 0, 0, out), "head_dim");
  bad = ok;
  bad.seq_local = -1;
  ExpectInvalid(internal::PlanGatherHeadsBlock(bad, x, 0, 0, out), "seq_local");

  ExpectInvalid(internal::PlanScatterHeadsBlock(ok, x, 4, 0, out), "src rank 4");
  ExpectInvalid(internal::PlanGatherHeadsBlock(ok, x, 0, -1, out), "dst rank -1");
  ExpectInvalid(internal::PlanScatterHeadsBlock(ok, x, 0, 0, nullptr), "out_dst");
  ExpectInvalid(internal::PlanGatherHeadsBlock(ok, ConstView{nullptr, {1, 1, 1, 1}}, 0, 0, out),
                "y_src");
  ConstView zero_stride = x;
  zero_stride.stride[3] = 0;
  ExpectInvalid(internal::PlanScatterHeadsBlock(ok, zero_stride, 0, 0, out), "x_src.stride[3]");

  ExpectInvalid(internal::PlanScatterQkvHeadChunkPart(ok, x, 1, 1, 2, 0, 0, out),
                "exceeds local_heads");
  ExpectInvalid(internal::PlanScatterQkvHeadChunkPart(ok, x, 0, 0, 0, 0, 0, out), "head_count");
  ExpectInvalid(internal::PlanScatterQkvHeadChunkPart(ok, x, 0, -1, 1, 0, 0, out), "head_offset");
  ExpectInvalid(internal::PlanScatterQkvHeadChunkPart(ok, x, 3, 0, 1, 0, 0, out), "part");
  ExpectInvalid(internal::PlanGatherOutputHeadChunkBlock(ok, x, 3, 0, 0, out), "local_heads");
  ExpectInvalid(
      internal::PlanGatherOutputHeadChunkMerge(ok, nullptr, 0, 1, MutView{out, {1, 1, 1, 1}}),
      "stage");

  const int64_t zero_shape[4] = {1, 0, 1, 1};
  ExpectInvalid(internal::PlanCopyViewToContiguous(x, zero_shape, 2, out), "shape[1]");
}

}  // namespace
}  // namespace ulysses::kernels
