// Head-chunk reconstruction (DESIGN.md section 4): q, k, v are non-contiguous views of one
// [B, S, H, 3, D] pack; each chunk of a schedule is scattered, an identity "attention" takes the
// Q part of the chunk's records, and gather_output_head_chunk merges it into a NaN-poisoned
// output. After all chunks the output must equal q bit for bit.
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

constexpr int kWorld = 4;
constexpr int64_t kBatch = 2;
constexpr int32_t kHeads = 56;  // H_l = 14
constexpr int32_t kLocalHeads = kHeads / kWorld;
constexpr int32_t kHeadDim = 32;

struct Schedule {
  std::string name;
  std::vector<int32_t> counts;
};

// kContiguous: attention output copied into a contiguous [B, S_g, HC, D] buffer, contiguous out.
// kStrided: attention output is a view into the [B, S_g, HC, 3D] records; out is slot 1 of a
// [B, S_l, H, 2, D] buffer.
enum class Mode { kContiguous, kStrided };

void PrintTo(const Schedule& s, std::ostream* os) { *os << s.name; }
void PrintTo(Mode m, std::ostream* os) { *os << (m == Mode::kStrided ? "strided" : "contiguous"); }

using Param = std::tuple<int64_t, Schedule, Dtype, Mode>;

class HeadChunkTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    const auto& [seq_local, schedule, dtype, mode] = GetParam();
    shape_ = ExchangeShape{kWorld, kBatch, seq_local, kHeads, kHeadDim, testing::ItemSize(dtype)};
    isz_ = shape_.itemsize;
    int32_t sum = 0;
    for (int32_t c : schedule.counts) sum += c;
    ASSERT_EQ(sum, kLocalHeads) << "schedule must cover H_l";
    for (int j = 0; j < kWorld; ++j) {
      packs_.push_back(testing::RandomBytes(kBatch * seq_local * kHeads * 3 * kHeadDim * isz_,
                                            1000 * seq_local + 10 * j + int(dtype)));
    }
  }

  int64_t Sl() const { return shape_.seq_local; }
  Mode mode() const { return std::get<3>(GetParam()); }
  const std::vector<int32_t>& counts() const { return std::get<1>(GetParam()).counts; }

  // Element [b, s, h, part, d] of rank j's pack, by the pack's own row-major formula.
  const uint8_t* PackAt(int j, int64_t b, int64_t s, int64_t h, int part, int64_t d) const {
    return packs_[j].data() + ((((b * Sl() + s) * kHeads + h) * 3 + part) * kHeadDim + d) * isz_;
  }

  // q (part 0), k (part 1) or v (part 2) of rank j: base part*D, strides (S*H*3D, H*3D, 3D, 1).
  std::vector<ConstView> PartViews(int part) const {
    std::vector<ConstView> views;
    for (int j = 0; j < kWorld; ++j) {
      views.push_back(
          ConstView{packs_[j].data() + part * kHeadDim * isz_,
                    {Sl() * kHeads * 3 * kHeadDim, kHeads * 3 * kHeadDim, 3 * kHeadDim, 1}});
    }
    return views;
  }

  // Output buffers poisoned with NaN (padding included) and their views.
  void MakeOutputs() {
    const int64_t elems = kBatch * Sl() * kHeads * kHeadDim * (mode() == Mode::kStrided ? 2 : 1);
    out_bufs_.assign(kWorld, testing::FilledBytes(elems, isz_, testing::NanBits(isz_)));
    out_views_.clear();
    for (auto& buf : out_bufs_) {
      if (mode() == Mode::kContiguous) {
        out_views_.push_back(ContiguousMutView(buf.data(), Sl(), kHeads, kHeadDim));
      } else {
        out_views_.push_back(
            MutView{buf.data() + kHeadDim * isz_,
                    {Sl() * kHeads * 2 * kHeadDim, kHeads * 2 * kHeadDim, 2 * kHeadDim, 1}});
      }
    }
  }

  // Element [b, s, h, d] of rank j's output, by this test's own layout formula.
  const uint8_t* OutAt(int j, int64_t b, int64_t s, int64_t h, int64_t d) const {
    if (mode() == Mode::kContiguous) {
      return out_bufs_[j].data() + (((b * Sl() + s) * kHeads + h) * kHeadDim + d) * isz_;
    }
    return out_bufs_[j].data() + ((((b * Sl() + s) * kHeads + h) * 2 + 1) * kHeadDim + d) * isz_;
  }
  const uint8_t* OutPaddingAt(int j, int64_t b, int64_t s, int64_t h, int64_t d) const {
    return out_bufs_[j].data() + ((((b * Sl() + s) * kHeads + h) * 2 + 0) * kHeadDim + d) * isz_;
  }

  // Runs one chunk: scatter, identity attention, gather into out_views_.
  void RunChunk(int32_t offset, int32_t count) {
    auto packed =
        ScatterQkvHeadChunkRef(shape_, PartViews(0), PartViews(1), PartViews(2), offset, count);
    ASSERT_TRUE(packed.ok()) << packed.status();
    const int64_t sg = GlobalSeq(shape_);
    std::vector<HostBuffer> attn_bufs;
    std::vector<ConstView> attn;
    for (int r = 0; r < kWorld; ++r) {
      const uint8_t* rec = (*packed)[r].data();
      if (mode() == Mode::kStrided) {
        attn.push_back(
            ConstView{rec, {sg * count * 3 * kHeadDim, count * 3 * kHeadDim, 3 * kHeadDim, 1}});
        continue;
      }
      HostBuffer q_part(kBatch * sg * count * kHeadDim * isz_);
      for (int64_t row = 0; row < kBatch * sg * count; ++row) {
        std::memcpy(q_part.data() + row * kHeadDim * isz_, rec + row * 3 * kHeadDim * isz_,
                    kHeadDim * isz_);
      }
      attn_bufs.push_back(std::move(q_part));
    }
    for (const auto& buf : attn_bufs) {
      attn.push_back(ContiguousConstView(buf.data(), sg, count, kHeadDim));
    }
    ASSERT_TRUE(GatherOutputHeadChunkRef(shape_, attn, offset, count, out_views_).ok());
  }

  // Counts elements of out that differ from q (inside `band`) or from NaN (outside it).
  int64_t CountMismatches(int32_t offset, int32_t count, bool all_heads) const {
    const uint32_t nan = testing::NanBits(isz_);
    int64_t bad = 0;
    for (int j = 0; j < kWorld; ++j)
      for (int64_t b = 0; b < kBatch; ++b)
        for (int64_t s = 0; s < Sl(); ++s)
          for (int64_t h = 0; h < kHeads; ++h)
            for (int64_t d = 0; d < kHeadDim; ++d) {
              const int64_t local = h % kLocalHeads;
              const bool in_band = all_heads || (local >= offset && local < offset + count);
              const void* want = in_band ? static_cast<const void*>(PackAt(j, b, s, h, 0, d))
                                         : static_cast<const void*>(&nan);
              if (std::memcmp(OutAt(j, b, s, h, d), want, isz_) != 0) ++bad;
              if (mode() == Mode::kStrided &&
                  std::memcmp(OutPaddingAt(j, b, s, h, d), &nan, isz_) != 0) {
                ++bad;
              }
            }
    return bad;
  }

  ExchangeShape shape_{};
  int64_t isz_ = 0;
  std::vector<HostBuffer> packs_;
  std::vector<HostBuffer> out_bufs_;
  std::vector<MutView> out_views_;
};

TEST_P(HeadChunkTest, PackedRecordsMatchFormula) {
  const int64_t sg = GlobalSeq(shape_);
  int32_t offset = 0;
  for (int32_t count : counts()) {
    auto packed =
        ScatterQkvHeadChunkRef(shape_, PartViews(0), PartViews(1), PartViews(2), offset, count);
    ASSERT_TRUE(packed.ok()) << packed.status();
    int64_t bad = 0;
    // packed_r[b, j*S_l + s, hc, part*D + d] = pack_j[b, s, r*H_l + offset + hc, part, d].
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_EQ((*packed)[r].size(), size_t(kBatch * sg * count * 3 * kHeadDim * isz_));
      for (int j = 0; j < kWorld; ++j)
        for (int64_t b = 0; b < kBatch; ++b)
          for (int64_t s = 0; s < Sl(); ++s)
            for (int64_t hc = 0; hc < count; ++hc)
              for (int part = 0; part < 3; ++part)
                for (int64_t d = 0; d < kHeadDim; ++d) {
                  const uint8_t* got =
                      (*packed)[r].data() +
                      ((((b * sg + j * Sl() + s) * count + hc) * 3 + part) * kHeadDim + d) * isz_;
                  if (std::memcmp(got, PackAt(j, b, s, r * kLocalHeads + offset + hc, part, d),
                                  isz_) != 0) {
                    ++bad;
                  }
                }
    }
    EXPECT_EQ(bad, 0) << "chunk at offset " << offset;
    offset += count;
  }
}

TEST_P(HeadChunkTest, ReconstructsQueriesAfterAllChunks) {
  MakeOutputs();
  int32_t offset = 0;
  for (int32_t count : counts()) {
    RunChunk(offset, count);
    offset += count;
  }
  EXPECT_EQ(CountMismatches(0, kLocalHeads, /*all_heads=*/true), 0);
}

TEST_P(HeadChunkTest, SingleChunkWritesOnlyItsBand) {
  int32_t offset = 0;
  for (int32_t count : counts()) {
    MakeOutputs();
    RunChunk(offset, count);
    EXPECT_EQ(CountMismatches(offset, count, /*all_heads=*/false), 0)
        << "chunk at offset " << offset << " count " << count;
    offset += count;
  }
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  const auto& [seq_local, schedule, dtype, mode] = info.param;
  return "S" + std::to_string(seq_local) + "_" + schedule.name + "_" + testing::DtypeName(dtype) +
         (mode == Mode::kStrided ? "_strided" : "_contiguous");
}

INSTANTIATE_TEST_SUITE_P(Schedules, HeadChunkTest,
                         ::testing::Combine(::testing::Values(int64_t{7}, int64_t{11}, int64_t{13}),
                                            ::testing::Values(Schedule{"c3_8_3", {3, 8, 3}},
                                                              Schedule{"c5_5_4", {5, 5, 4}},
                                                              Schedule{"c1x14",
                                                                       std::vector<int32_t>(14, 1)},
                                                              Schedule{"c14", {14}}),
                                            ::testing::Values(Dtype::kBf16, Dtype::kFp32),
                                            ::testing::Values(Mode::kContiguous, Mode::kStrided)),
                         ParamName);

}  // namespace
}  // namespace ulysses::kernels
