// Index semantics of the scatter/gather references against the formulas of DESIGN.md section 4,
// written out element by element here (never through the block functions under test).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "exchange_test_util.h"
#include "ulysses/kernels/exchange.h"
#include "ulysses/kernels/reference.h"

namespace ulysses::kernels {
namespace {

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

// out_r[b, j*S_l + s, h, d] = x_j[b, s, r*H_l + h, d] for the block (src = j, dst = r).
void ExpectedScatterBlock(const ExchangeShape& sh, const HostView& x, int j, int r, uint8_t* out) {
  const int64_t hl = sh.heads / sh.world, sg = sh.world * sh.seq_local, isz = sh.itemsize;
  for (int64_t b = 0; b < sh.batch; ++b)
    for (int64_t s = 0; s < sh.seq_local; ++s)
      for (int64_t h = 0; h < hl; ++h)
        for (int64_t d = 0; d < sh.head_dim; ++d)
          std::memcpy(out + (((b * sg + j * sh.seq_local + s) * hl + h) * sh.head_dim + d) * isz,
                      x.At(b, s, r * hl + h, d), isz);
}

// out_r[b, s, p*H_l + h, d] = y_p[b, r*S_l + s, h, d] for the block (src = p, dst = r).
void ExpectedGatherBlock(const ExchangeShape& sh, const HostView& y, int p, int r, uint8_t* out) {
  const int64_t hl = sh.heads / sh.world, isz = sh.itemsize;
  for (int64_t b = 0; b < sh.batch; ++b)
    for (int64_t s = 0; s < sh.seq_local; ++s)
      for (int64_t h = 0; h < hl; ++h)
        for (int64_t d = 0; d < sh.head_dim; ++d)
          std::memcpy(
              out + (((b * sh.seq_local + s) * sh.heads + p * hl + h) * sh.head_dim + d) * isz,
              y.At(b, r * sh.seq_local + s, h, d), isz);
}

class ExchangeRefTest : public ::testing::TestWithParam<Param> {
 protected:
  ExchangeShape Shape() const {
    const auto& [world, dims, dtype] = GetParam();
    return ExchangeShape{world,      dims.batch,    dims.seq_local,
                         dims.heads, dims.head_dim, testing::ItemSize(dtype)};
  }
  uint64_t Seed(int rank, Layout layout, int salt) const {
    const auto& [world, dims, dtype] = GetParam();
    return (uint64_t(world) << 40) ^ (uint64_t(dims.head_dim) << 28) ^
           (uint64_t(dims.seq_local) << 20) ^ (uint64_t(dtype) << 16) ^ (uint64_t(layout) << 12) ^
           (uint64_t(salt) << 8) ^ uint64_t(rank);
  }
  // Rank j's scatter input [B, S_l, H, D].
  std::vector<HostView> ScatterInputs(Layout layout, int salt) const {
    const ExchangeShape sh = Shape();
    std::vector<HostView> x;
    for (int j = 0; j < sh.world; ++j) {
      x.push_back(testing::MakeHostView(layout, sh.batch, sh.seq_local, sh.heads, sh.head_dim,
                                        sh.itemsize, Seed(j, layout, salt)));
    }
    return x;
  }
  // Rank p's gather input [B, S_g, H_l, D], independent of any scatter output.
  std::vector<HostView> GatherInputs(Layout layout, int salt) const {
    const ExchangeShape sh = Shape();
    std::vector<HostView> y;
    for (int p = 0; p < sh.world; ++p) {
      y.push_back(testing::MakeHostView(layout, sh.batch, GlobalSeq(sh), LocalHeads(sh),
                                        sh.head_dim, sh.itemsize, Seed(p, layout, salt)));
    }
    return y;
  }
  int64_t ScatterOutBytes() const {
    const ExchangeShape sh = Shape();
    return sh.batch * GlobalSeq(sh) * LocalHeads(sh) * sh.head_dim * sh.itemsize;
  }
  int64_t GatherOutBytes() const {
    const ExchangeShape sh = Shape();
    return sh.batch * sh.seq_local * sh.heads * sh.head_dim * sh.itemsize;
  }
};

std::vector<ConstView> Views(const std::vector<HostView>& hv) {
  std::vector<ConstView> out;
  for (const auto& v : hv) out.push_back(v.view());
  return out;
}

std::vector<ConstView> ContiguousViews(const std::vector<HostBuffer>& bufs, int64_t n1, int64_t n2,
                                       int64_t n3) {
  std::vector<ConstView> out;
  for (const auto& b : bufs) out.push_back(ContiguousConstView(b.data(), n1, n2, n3));
  return out;
}

TEST_P(ExchangeRefTest, ScatterHeadsMatchesFormula) {
  const ExchangeShape sh = Shape();
  for (Layout layout : testing::kAllLayouts) {
    SCOPED_TRACE(testing::LayoutName(layout));
    const auto x = ScatterInputs(layout, 1);
    auto out = ScatterHeadsRef(sh, Views(x));
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->size(), static_cast<size_t>(sh.world));
    for (int r = 0; r < sh.world; ++r) {
      std::vector<uint8_t> expected(ScatterOutBytes());
      for (int j = 0; j < sh.world; ++j) ExpectedScatterBlock(sh, x[j], j, r, expected.data());
      ASSERT_EQ((*out)[r].size(), expected.size());
      EXPECT_EQ(std::memcmp((*out)[r].data(), expected.data(), expected.size()), 0) << "rank " << r;
    }
  }
}

TEST_P(ExchangeRefTest, GatherHeadsMatchesFormulaOnIndependentInput) {
  const ExchangeShape sh = Shape();
  for (Layout layout : testing::kAllLayouts) {
    SCOPED_TRACE(testing::LayoutName(layout));
    const auto y = GatherInputs(layout, 2);
    auto out = GatherHeadsRef(sh, Views(y));
    ASSERT_TRUE(out.ok()) << out.status();
    for (int r = 0; r < sh.world; ++r) {
      std::vector<uint8_t> expected(GatherOutBytes());
      for (int p = 0; p < sh.world; ++p) ExpectedGatherBlock(sh, y[p], p, r, expected.data());
      ASSERT_EQ((*out)[r].size(), expected.size());
      EXPECT_EQ(std::memcmp((*out)[r].data(), expected.data(), expected.size()), 0) << "rank " << r;
    }
  }
}

TEST_P(ExchangeRefTest, GatherUndoesScatter) {
  const ExchangeShape sh = Shape();
  for (Layout layout : testing::kAllLayouts) {
    SCOPED_TRACE(testing::LayoutName(layout));
    const auto x = ScatterInputs(layout, 3);
    auto scattered = ScatterHeadsRef(sh, Views(x));
    ASSERT_TRUE(scattered.ok()) << scattered.status();
    auto back =
        GatherHeadsRef(sh, ContiguousViews(*scattered, GlobalSeq(sh), LocalHeads(sh), sh.head_dim));
    ASSERT_TRUE(back.ok()) << back.status();
    for (int j = 0; j < sh.world; ++j) {
      EXPECT_EQ((*back)[j], x[j].Dense()) << "rank " << j;
    }
  }
}

TEST_P(ExchangeRefTest, ScatterUndoesGather) {
  const ExchangeShape sh = Shape();
  for (Layout layout : testing::kAllLayouts) {
    SCOPED_TRACE(testing::LayoutName(layout));
    const auto y = GatherInputs(layout, 4);
    auto gathered = GatherHeadsRef(sh, Views(y));
    ASSERT_TRUE(gathered.ok()) << gathered.status();
    auto back =
        ScatterHeadsRef(sh, ContiguousViews(*gathered, sh.seq_local, sh.heads, sh.head_dim));
    ASSERT_TRUE(back.ok()) << back.status();
    for (int p = 0; p < sh.world; ++p) {
      EXPECT_EQ((*back)[p], y[p].Dense()) << "rank " << p;
    }
  }
}

// The daemon writes each (src, dst) block straight into dst's receive slot, so a block
// function must leave every byte outside its block as it was.
TEST_P(ExchangeRefTest, EachBlockWritesOnlyItsOwnBlock) {
  const ExchangeShape sh = Shape();
  for (Layout layout : {Layout::kContiguous, Layout::kTransposed}) {
    SCOPED_TRACE(testing::LayoutName(layout));
    const auto x = ScatterInputs(layout, 5);
    const auto y = GatherInputs(layout, 6);
    const auto scatter_before = testing::RandomBytes(ScatterOutBytes(), 77);
    const auto gather_before = testing::RandomBytes(GatherOutBytes(), 78);
    for (int src = 0; src < sh.world; ++src) {
      for (int dst = 0; dst < sh.world; ++dst) {
        auto got = scatter_before;
        auto expected = scatter_before;
        ScatterHeadsBlockRef(sh, x[src].view(), src, dst, got.data());
        ExpectedScatterBlock(sh, x[src], src, dst, expected.data());
        ASSERT_EQ(got, expected) << "scatter block src " << src << " dst " << dst;

        got = gather_before;
        expected = gather_before;
        GatherHeadsBlockRef(sh, y[src].view(), src, dst, got.data());
        ExpectedGatherBlock(sh, y[src], src, dst, expected.data());
        ASSERT_EQ(got, expected) << "gather block src " << src << " dst " << dst;
      }
    }
  }
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  const auto& [world, dims, dtype] = info.param;
  return "W" + std::to_string(world) + "_B" + std::to_string(dims.batch) + "_S" +
         std::to_string(dims.seq_local) + "_H" + std::to_string(dims.heads) + "_D" +
         std::to_string(dims.head_dim) + "_" + testing::DtypeName(dtype);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ExchangeRefTest,
    ::testing::Combine(::testing::Values(1, 2, 3, 4, 6, 8),
                       ::testing::Values(Dims{1, 8, 24, 128}, Dims{2, 16, 24, 64},
                                         Dims{1, 5, 24, 3}),
                       ::testing::Values(Dtype::kFp16, Dtype::kBf16, Dtype::kFp32)),
    ParamName);

TEST(ExchangeCopyRefTest, ViewToContiguousAndBackRoundTrips) {
  for (int32_t itemsize : {2, 4}) {
    for (Layout layout : testing::kAllLayouts) {
      SCOPED_TRACE(testing::LayoutName(layout) + " itemsize " + std::to_string(itemsize));
      const int64_t shape[4] = {2, 5, 3, 7};
      auto view = testing::MakeHostView(layout, 2, 5, 3, 7, itemsize, 11);
      std::vector<uint8_t> dense(2 * 5 * 3 * 7 * itemsize);
      CopyViewToContiguousRef(view.view(), shape, itemsize, dense.data());
      EXPECT_EQ(dense, view.Dense());

      // Writing new values through the view changes exactly the view's elements.
      const auto fresh = testing::RandomBytes(dense.size(), 12);
      auto target = testing::MakeHostView(layout, 2, 5, 3, 7, itemsize, 13);
      auto expected_buffer = target.buffer;
      size_t pos = 0;
      for (int64_t a = 0; a < 2; ++a)
        for (int64_t b = 0; b < 5; ++b)
          for (int64_t c = 0; c < 3; ++c)
            for (int64_t d = 0; d < 7; ++d, pos += itemsize)
              std::memcpy(expected_buffer.data() + target.ByteAt(a, b, c, d), fresh.data() + pos,
                          itemsize);
      CopyContiguousToViewRef(fresh.data(), shape, itemsize, target.mut_view());
      EXPECT_EQ(target.buffer, expected_buffer);
    }
  }
}

TEST(ExchangeCollectiveRefTest, RejectsBadArguments) {
  std::vector<uint8_t> buf(1024);
  const ConstView v = ContiguousConstView(buf.data(), 1, 4, 2);
  const ExchangeShape ok{2, 1, 1, 4, 2, 2};

  ExchangeShape bad = ok;
  bad.heads = 3;
  auto st = ScatterHeadsRef(bad, {v, v}).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("divisible"), std::string::npos) << st;

  bad = ok;
  bad.itemsize = 8;
  st = GatherHeadsRef(bad, {v, v}).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("itemsize"), std::string::npos) << st;

  st = ScatterHeadsRef(ok, {v}).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("world"), std::string::npos) << st;

  ConstView negative = v;
  negative.stride[2] = -2;
  st = GatherHeadsRef(ok, {v, negative}).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("y[1].stride[2]"), std::string::npos) << st;

  st = ScatterQkvHeadChunkRef(ok, {v, v}, {v, v}, {v, v}, 1, 2).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("exceeds local_heads"), std::string::npos) << st;

  std::vector<uint8_t> out_buf(1024, 0x5A);
  const MutView o = ContiguousMutView(out_buf.data(), 1, 4, 2);
  st = GatherOutputHeadChunkRef(ok, {v, v}, 0, 0, {o, o});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("head_count"), std::string::npos) << st;
  EXPECT_EQ(out_buf, std::vector<uint8_t>(1024, 0x5A)) << "nothing is written on error";
}

}  // namespace
}  // namespace ulysses::kernels
