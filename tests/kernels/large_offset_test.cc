// 64-bit addressing: views whose largest element offset exceeds 2^31. The views live in sparse
// anonymous mappings (MAP_NORESERVE) of which only the used pages are touched, so the test
// needs a few pages of memory, not gigabytes.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstring>
#include <memory>
#include <vector>

#include "exchange_plan.h"
#include "exchange_test_util.h"
#include "ulysses/kernels/exchange.h"

namespace ulysses::kernels {
namespace {

constexpr int64_t kTwo31 = int64_t{1} << 31;

TEST(ViewOffsetTest, IsExactBeyondInt32) {
  constexpr int64_t stride[4] = {int64_t{1} << 33, kTwo31 + 5, int64_t{1} << 20, 3};
  static_assert(ViewOffset(stride, 1, 1, 1, 1) ==
                (int64_t{1} << 33) + kTwo31 + 5 + (int64_t{1} << 20) + 3);
  EXPECT_EQ(ViewOffset(stride, 3, 2, 7, 11),
            int64_t{25769803776} + int64_t{4294967306} + int64_t{7340032} + 33);
  const int64_t unit[4] = {1, 1, 1, 1};
  EXPECT_EQ(ViewOffset(unit, kTwo31, kTwo31, 0, 1), 2 * kTwo31 + 1);
}

// An anonymous mapping that reserves no memory: pages appear only when touched.
class SparseMapping {
 public:
  explicit SparseMapping(size_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
  }
  ~SparseMapping() {
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  SparseMapping(const SparseMapping&) = delete;
  SparseMapping& operator=(const SparseMapping&) = delete;
  uint8_t* data() const { return data_; }

 private:
  size_t bytes_;
  uint8_t* data_ = nullptr;
};

// W = 2, B = 1, S_l = 2, H = 2 (H_l = 1), D = 8, 2-byte elements. Rank j's scatter input has
// sequence stride 2^31 + 64 elements, so element [0, 1, h, d] sits past byte 2^32; rank p's
// gather input [1, 4, 1, 8] has sequence stride 2^30 + 32, so s = 3 sits past 2^31 elements.
class LargeOffsetTest : public ::testing::Test {
 protected:
  static constexpr int32_t kItem = 2;
  static constexpr int64_t kD = 8;
  static constexpr int64_t kXSeqStride = kTwo31 + 64;
  static constexpr int64_t kYSeqStride = (kTwo31 >> 1) + 32;

  void SetUp() override {
    x_map_ = std::make_unique<SparseMapping>(size_t((kXSeqStride + 4 * kD) * kItem) + 4096);
    y_map_ = std::make_unique<SparseMapping>(size_t((3 * kYSeqStride + 4 * kD) * kItem) + 4096);
    if (x_map_->data() == nullptr || y_map_->data() == nullptr) {
      GTEST_SKIP() << "this machine refuses a sparse 6 GiB anonymous mapping";
    }
    for (int j = 0; j < 2; ++j) {
      // Rank j's elements start at j * 2D; ranks interleave inside one mapping.
      x_[j] = ConstView{x_map_->data() + j * 2 * kD * kItem, {1, kXSeqStride, kD, 1}};
      y_[j] = ConstView{y_map_->data() + j * kD * kItem, {1, kYSeqStride, kD, 1}};
      for (int64_t s = 0; s < 2; ++s) {
        const auto bytes = testing::RandomBytes(2 * kD * kItem, 40 + 2 * j + s);
        std::memcpy(XAt(j, s, 0, 0), bytes.data(), bytes.size());
      }
      for (int64_t s = 0; s < 4; ++s) {
        const auto bytes = testing::RandomBytes(kD * kItem, 50 + 4 * j + s);
        std::memcpy(YAt(j, s, 0), bytes.data(), bytes.size());
      }
    }
  }

  uint8_t* XAt(int j, int64_t s, int64_t h, int64_t d) const {
    return x_map_->data() + (j * 2 * kD + s * kXSeqStride + h * kD + d) * kItem;
  }
  uint8_t* YAt(int p, int64_t s, int64_t d) const {
    return y_map_->data() + (p * kD + s * kYSeqStride + d) * kItem;
  }

  const ExchangeShape shape_{2, 1, 2, 2, int32_t{kD}, kItem};
  std::unique_ptr<SparseMapping> x_map_, y_map_;
  ConstView x_[2]{};
  ConstView y_[2]{};
};

TEST_F(LargeOffsetTest, ScatterReadsElementsPastFourGiB) {
  for (int dst = 0; dst < 2; ++dst) {
    std::vector<uint8_t> ref(4 * kD * kItem, 0), plan_out(4 * kD * kItem, 0), want(4 * kD * kItem);
    for (int src = 0; src < 2; ++src) {
      ScatterHeadsBlockRef(shape_, x_[src], src, dst, ref.data());
      auto plan = internal::PlanScatterHeadsBlock(shape_, x_[src], src, dst, plan_out.data());
      ASSERT_TRUE(plan.ok()) << plan.status();
      internal::RunPlanOnHost(*plan);
      // out_dst[0, src*S_l + s, 0, d] = x_src[0, s, dst*H_l + 0, d]
      for (int64_t s = 0; s < 2; ++s)
        std::memcpy(want.data() + (src * 2 + s) * kD * kItem, XAt(src, s, dst, 0), kD * kItem);
    }
    EXPECT_EQ(ref, want) << "dst " << dst;
    EXPECT_EQ(plan_out, want) << "dst " << dst;
  }
}

TEST_F(LargeOffsetTest, GatherReadsElementsPastTwoGiElements) {
  for (int dst = 0; dst < 2; ++dst) {
    std::vector<uint8_t> ref(2 * 2 * kD * kItem, 0), plan_out(ref.size(), 0), want(ref.size());
    for (int src = 0; src < 2; ++src) {
      GatherHeadsBlockRef(shape_, y_[src], src, dst, ref.data());
      auto plan = internal::PlanGatherHeadsBlock(shape_, y_[src], src, dst, plan_out.data());
      ASSERT_TRUE(plan.ok()) << plan.status();
      internal::RunPlanOnHost(*plan);
      // out_dst[0, s, src*H_l + 0, d] = y_src[0, dst*S_l + s, 0, d]
      for (int64_t s = 0; s < 2; ++s)
        std::memcpy(want.data() + (s * 2 + src) * kD * kItem, YAt(src, dst * 2 + s, 0), kD * kItem);
    }
    EXPECT_EQ(ref, want) << "dst " << dst;
    EXPECT_EQ(plan_out, want) << "dst " << dst;
  }
}

TEST_F(LargeOffsetTest, CopiesReachFarElements) {
  const int64_t shape[4] = {1, 4, 1, kD};
  std::vector<uint8_t> want(4 * kD * kItem);
  for (int64_t s = 0; s < 4; ++s)
    std::memcpy(want.data() + s * kD * kItem, YAt(1, s, 0), kD * kItem);

  std::vector<uint8_t> ref(want.size()), plan_out(want.size());
  CopyViewToContiguousRef(y_[1], shape, kItem, ref.data());
  auto plan = internal::PlanCopyViewToContiguous(y_[1], shape, kItem, plan_out.data());
  ASSERT_TRUE(plan.ok()) << plan.status();
  internal::RunPlanOnHost(*plan);
  EXPECT_EQ(ref, want);
  EXPECT_EQ(plan_out, want);

  // And back out through a writable far view (rank 0's slots of the same mapping).
  const auto fresh = testing::RandomBytes(want.size(), 99);
  MutView far{y_map_->data(), {1, kYSeqStride, kD, 1}};
  CopyContiguousToViewRef(fresh.data(), shape, kItem, far);
  for (int64_t s = 0; s < 4; ++s) {
    EXPECT_EQ(std::memcmp(YAt(0, s, 0), fresh.data() + s * kD * kItem, kD * kItem), 0) << s;
  }
}

}  // namespace
}  // namespace ulysses::kernels
