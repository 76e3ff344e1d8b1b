// CUDA exchange launchers against the CPU references, bit for bit: every (src, dst) block is
// launched into device buffers pre-filled with random bytes, the same blocks are run by the
// references on host copies of those bytes, and the whole buffers must match (so a launcher
// also may not write outside its block). Covers the 16-byte vector path (aligned D = 64, 128)
// and the element path (D = 3, element stride 2, misaligned data), strided inputs included.
#include "ulysses/kernels/exchange_cuda.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "exchange_test_util.h"
#include "ulysses/kernels/exchange.h"

namespace ulysses::kernels {
namespace {

using testing::Dtype;
using testing::HostView;
using testing::Layout;

#define ULY_SKIP_WITHOUT_GPU()                             \
  do {                                                     \
    const absl::StatusOr<int> devices = CudaDeviceCount(); \
    ASSERT_TRUE(devices.ok()) << devices.status();         \
    if (*devices == 0) GTEST_SKIP() << "no CUDA device";   \
  } while (0)

#define ASSERT_CUDA_OK(call)                                          \
  do {                                                                \
    const cudaError_t uly_err_ = (call);                              \
    ASSERT_EQ(uly_err_, cudaSuccess) << cudaGetErrorString(uly_err_); \
  } while (0)

// Device copy of a host buffer; freed on destruction.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(const std::vector<uint8_t>& host) : bytes_(host.size()) {
    EXPECT_EQ(cudaMalloc(&data_, bytes_), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data_, host.data(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
    // From pageable memory cudaMemcpy may return before the DMA lands, and the launches run on
    // non-blocking streams that do not order after the legacy stream: wait for the copy.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  uint8_t* data() const { return static_cast<uint8_t*>(data_); }
  std::vector<uint8_t> Download() const {
    std::vector<uint8_t> host(bytes_);
    EXPECT_EQ(cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  size_t bytes_;
  void* data_ = nullptr;
};

class Stream {
 public:
  Stream() { EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess); }
  ~Stream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// A HostView and its device twin (same bytes, same base and strides).
struct TwinView {
  HostView host;
  std::unique_ptr<DeviceBuffer> device;

  explicit TwinView(HostView h) : host(std::move(h)), device(new DeviceBuffer(host.buffer)) {}
  ConstView device_view() const {
    return ConstView{device->data() + host.base * host.itemsize,
                     {host.stride[0], host.stride[1], host.stride[2], host.stride[3]}};
  }
  MutView device_mut_view() const {
    return MutView{device->data() + host.base * host.itemsize,
                   {host.stride[0], host.stride[1], host.stride[2], host.stride[3]}};
  }
};

struct Variant {
  Layout layout;
  bool misaligned;  // data one element past a 16-byte boundary: forces the element path
};
const Variant kVariants[] = {{Layout::kContiguous, false},
                             {Layout::kPaddedHeads, false},
                             {Layout::kTransposed, false},
                             {Layout::kContiguous, true}};

std::string VariantName(const Variant& v) {
  return testing::LayoutName(v.layout) + (v.misaligned ? "_misaligned" : "");
}

TwinView MakeTwin(const Variant& v, int64_t n0, int64_t n1, int64_t n2, int64_t n3,
                  int32_t itemsize, uint64_t seed) {
  HostView view = testing::MakeHostView(v.layout, n0, n1, n2, n3, itemsize, seed);
  if (v.misaligned) {
    view.buffer.resize(view.buffer.size() + itemsize);
    view.base += 1;
  }
  return TwinView(std::move(view));
}

struct Dims {
  int64_t batch, seq_local;
  int32_t heads, head_dim;
};
void PrintTo(const Dims& d, std::ostream* os) {
  *os << "B" << d.batch << " S_l" << d.seq_local << " H" << d.heads << " D" << d.head_dim;
}
using Param = std::tuple<int, Dims, Dtype>;

class GpuExchangeTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    ULY_SKIP_WITHOUT_GPU();
    stream_ = std::make_unique<Stream>();
  }
  cudaStream_t stream() const { return stream_->get(); }

  ExchangeShape Shape() const {
    const auto& [world, dims, dtype] = GetParam();
    return ExchangeShape{world,      dims.batch,    dims.seq_local,
                         dims.heads, dims.head_dim, testing::ItemSize(dtype)};
  }

  // Every rank's [B, S_l, H, D] input laid out as `variant`: rank j's from seed
  // `stride * j + seed`.
  std::vector<TwinView> RankInputs(const Variant& variant, uint64_t seed, uint64_t stride) const {
    const ExchangeShape sh = Shape();
    std::vector<TwinView> in;
    for (int j = 0; j < sh.world; ++j)
      in.push_back(MakeTwin(variant, sh.batch, sh.seq_local, sh.heads, sh.head_dim, sh.itemsize,
                            stride * j + seed));
    return in;
  }

  // For every (src, dst): `launch(src, dst, device_out)` and `ref(src, dst, host_out)` into
  // W output buffers that start as the same random bytes; then all buffers must be equal.
  template <typename Launch, typename Ref>
  void ExpectLaunchesMatchRefs(int64_t out_bytes, Launch launch, Ref ref) {
    const ExchangeShape sh = Shape();
    std::vector<std::vector<uint8_t>> host_out;
    std::vector<std::unique_ptr<DeviceBuffer>> device_out;
    for (int dst = 0; dst < sh.world; ++dst) {
      host_out.push_back(testing::RandomBytes(out_bytes, 900 + dst));
      device_out.emplace_back(new DeviceBuffer(host_out.back()));
    }
    for (int src = 0; src < sh.world; ++src) {
      for (int dst = 0; dst < sh.world; ++dst) {
        const absl::Status status = launch(src, dst, device_out[dst]->data());
        ASSERT_TRUE(status.ok()) << status;
        ref(src, dst, host_out[dst].data());
      }
    }
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream()));
    for (int dst = 0; dst < sh.world; ++dst) {
      EXPECT_EQ(device_out[dst]->Download(), host_out[dst]) << "dst " << dst;
    }
  }

  std::unique_ptr<Stream> stream_;
};

TEST_P(GpuExchangeTest, ScatterHeadsBlocksMatchRef) {
  const ExchangeShape sh = Shape();
  for (const Variant& variant : kVariants) {
    SCOPED_TRACE(VariantName(variant));
    std::vector<TwinView> x;
    for (int j = 0; j < sh.world; ++j) {
      x.push_back(MakeTwin(variant, sh.batch, sh.seq_local, sh.heads, sh.head_dim, sh.itemsize,
                           11 * j + 1));
    }
    ExpectLaunchesMatchRefs(
        sh.batch * GlobalSeq(sh) * LocalHeads(sh) * sh.head_dim * sh.itemsize,
        [&](int src, int dst, void* out) {
          return LaunchScatterHeadsBlock(sh, x[src].device_view(), src, dst, out, stream());
        },
        [&](int src, int dst, void* out) {
          ScatterHeadsBlockRef(sh, x[src].host.view(), src, dst, out);
        });
  }
}

TEST_P(GpuExchangeTest, GatherHeadsBlocksMatchRef) {
  const ExchangeShape sh = Shape();
  for (const Variant& variant : kVariants) {
    SCOPED_TRACE(VariantName(variant));
    std::vector<TwinView> y;
    for (int p = 0; p < sh.world; ++p) {
      y.push_back(MakeTwin(variant, sh.batch, GlobalSeq(sh), LocalHeads(sh), sh.head_dim,
                           sh.itemsize, 11 * p + 2));
    }
    ExpectLaunchesMatchRefs(
        sh.batch * sh.seq_local * sh.heads * sh.head_dim * sh.itemsize,
        [&](int src, int dst, void* out) {
          return LaunchGatherHeadsBlock(sh, y[src].device_view(), src, dst, out, stream());
        },
        [&](int src, int dst, void* out) {
          GatherHeadsBlockRef(sh, y[src].host.view(), src, dst, out);
        });
  }
}

TEST_P(GpuExchangeTest, HeadChunkBlocksMatchRef) {
  const ExchangeShape sh = Shape();
  const int32_t hl = static_cast<int32_t>(LocalHeads(sh));
  const int32_t offset = hl > 2 ? 1 : 0;
  const int32_t count = hl > 2 ? hl - 2 : hl;
  for (const Variant& variant : kVariants) {
    SCOPED_TRACE(VariantName(variant));
    const std::vector<TwinView> q = RankInputs(variant, 3, 20), k = RankInputs(variant, 4, 20),
                                v = RankInputs(variant, 5, 20);
    std::vector<TwinView> x;
    for (int j = 0; j < sh.world; ++j)
      x.push_back(
          MakeTwin(variant, sh.batch, GlobalSeq(sh), count, sh.head_dim, sh.itemsize, 20 * j + 6));
    ExpectLaunchesMatchRefs(
        sh.batch * GlobalSeq(sh) * count * 3 * sh.head_dim * sh.itemsize,
        [&](int src, int dst, void* out) {
          return LaunchScatterQkvHeadChunkBlock(sh, q[src].device_view(), k[src].device_view(),
                                                v[src].device_view(), offset, count, src, dst, out,
                                                stream());
        },
        [&](int src, int dst, void* out) {
          ScatterQkvHeadChunkBlockRef(sh, q[src].host.view(), k[src].host.view(),
                                      v[src].host.view(), offset, count, src, dst, out);
        });
    ExpectLaunchesMatchRefs(
        sh.batch * sh.seq_local * sh.world * count * sh.head_dim * sh.itemsize,
        [&](int src, int dst, void* stage) {
          return LaunchGatherOutputHeadChunkBlock(sh, x[src].device_view(), count, src, dst, stage,
                                                  stream());
        },
        [&](int src, int dst, void* stage) {
          GatherOutputHeadChunkBlockRef(sh, x[src].host.view(), count, src, dst, stage);
        });

    const auto stage = testing::RandomBytes(
        sh.batch * sh.seq_local * sh.world * count * sh.head_dim * sh.itemsize, 77);
    DeviceBuffer stage_dev(stage);
    TwinView out =
        MakeTwin(variant, sh.batch, sh.seq_local, sh.heads, sh.head_dim, sh.itemsize, 78);
    const absl::Status status = LaunchGatherOutputHeadChunkMerge(
        sh, stage_dev.data(), offset, count, out.device_mut_view(), stream());
    ASSERT_TRUE(status.ok()) << status;
    GatherOutputHeadChunkMergeRef(sh, stage.data(), offset, count, out.host.mut_view());
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream()));
    EXPECT_EQ(out.device->Download(), out.host.buffer);
  }
}

// LaunchBlocks: every block of one source in one launch (two when the views' vector widths
// differ), against the block references; a null destination is left untouched.
TEST_P(GpuExchangeTest, AllBlocksOfASourceInOneLaunchMatchRef) {
  const ExchangeShape sh = Shape();
  const int32_t hl = static_cast<int32_t>(LocalHeads(sh));
  const int32_t offset = hl > 2 ? 1 : 0;
  const int32_t count = hl > 2 ? hl - 2 : hl;
  const Variant misaligned{Layout::kContiguous, true};
  for (const Variant& variant : kVariants) {
    SCOPED_TRACE(VariantName(variant));
    std::vector<TwinView> q, k, v;
    for (int j = 0; j < sh.world; ++j) {
      q.push_back(MakeTwin(variant, sh.batch, sh.seq_local, sh.heads, sh.head_dim, sh.itemsize,
                           30 * j + 3));
      // k of another alignment than q and v: its plans need a launch of their own width.
      k.push_back(MakeTwin(misaligned, sh.batch, sh.seq_local, sh.heads, sh.head_dim,
                           sh.itemsize, 30 * j + 4));
      v.push_back(MakeTwin(variant, sh.batch, sh.seq_local, sh.heads, sh.head_dim, sh.itemsize,
                           30 * j + 5));
    }
    struct Case {
      BlockKind kind;
      int64_t out_bytes;
      int skipped;  // destination left out (null), or -1
    };
    const Case cases[] = {
        {BlockKind::kScatterHeads, sh.batch * GlobalSeq(sh) * hl * sh.head_dim * sh.itemsize, -1},
        {BlockKind::kScatterHeads, sh.batch * GlobalSeq(sh) * hl * sh.head_dim * sh.itemsize,
         sh.world - 1},
        {BlockKind::kScatterQkvHeadChunk,
         sh.batch * GlobalSeq(sh) * count * 3 * sh.head_dim * sh.itemsize, -1},
    };
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << "kind " << static_cast<int>(c.kind) << " skipped "
                                      << c.skipped);
      std::vector<std::vector<uint8_t>> host_out;
      std::vector<std::unique_ptr<DeviceBuffer>> device_out;
      for (int dst = 0; dst < sh.world; ++dst) {
        host_out.push_back(testing::RandomBytes(c.out_bytes, 700 + dst));
        device_out.emplace_back(new DeviceBuffer(host_out.back()));
      }
      for (int src = 0; src < sh.world; ++src) {
        const BlockOperands ops{c.kind,
                                {q[src].device_view(), k[src].device_view(), v[src].device_view()},
                                offset,
                                count};
        std::vector<void*> outs(sh.world);
        for (int dst = 0; dst < sh.world; ++dst)
          outs[dst] = dst == c.skipped ? nullptr : device_out[dst]->data();
        const absl::Status status = LaunchBlocks(sh, ops, src, outs.data(), stream());
        ASSERT_TRUE(status.ok()) << status;
        for (int dst = 0; dst < sh.world; ++dst) {
          if (dst == c.skipped) continue;
          if (c.kind == BlockKind::kScatterHeads)
            ScatterHeadsBlockRef(sh, q[src].host.view(), src, dst, host_out[dst].data());
          else
            ScatterQkvHeadChunkBlockRef(sh, q[src].host.view(), k[src].host.view(),
                                        v[src].host.view(), offset, count, src, dst,
                                        host_out[dst].data());
        }
      }
      ASSERT_CUDA_OK(cudaStreamSynchronize(stream()));
      for (int dst = 0; dst < sh.world; ++dst)
        EXPECT_EQ(device_out[dst]->Download(), host_out[dst]) << "dst " << dst;
    }
  }
}

// The nccl transport's path: block (src, dst) packed into flat bytes, then unpacked into dst's
// buffer, stores what the direct block stores, bit for bit; with the unpack's cancel word set
// it stores nothing.
TEST_P(GpuExchangeTest, PackedBlocksUnpackAsTheDirectBlockAndNotOnceCancelled) {
  const ExchangeShape sh = Shape();
  const int32_t hl = static_cast<int32_t>(LocalHeads(sh));
  const int64_t out_bytes = sh.batch * GlobalSeq(sh) * hl * 3 * sh.head_dim * sh.itemsize;
  const std::vector<uint8_t> zero(sizeof(uint64_t), 0), one{1, 0, 0, 0, 0, 0, 0, 0};
  DeviceBuffer go(zero), cancelled(one);
  for (const Variant& variant : kVariants) {
    SCOPED_TRACE(VariantName(variant));
    const std::vector<TwinView> q = RankInputs(variant, 3, 40), k = RankInputs(variant, 4, 40),
                                v = RankInputs(variant, 5, 40);
    for (const BlockKind kind : {BlockKind::kScatterHeads, BlockKind::kScatterQkvHeadChunk}) {
      SCOPED_TRACE(::testing::Message() << "kind " << static_cast<int>(kind));
      std::vector<std::vector<uint8_t>> host_out;
      std::vector<std::unique_ptr<DeviceBuffer>> unpacked, untouched;
      for (int dst = 0; dst < sh.world; ++dst) {
        host_out.push_back(testing::RandomBytes(out_bytes, 600 + dst));
        unpacked.emplace_back(new DeviceBuffer(host_out.back()));
        untouched.emplace_back(new DeviceBuffer(host_out.back()));
      }
      const std::vector<std::vector<uint8_t>> before = host_out;
      for (int src = 0; src < sh.world; ++src) {
        const BlockOperands ops{
            kind, {q[src].device_view(), k[src].device_view(), v[src].device_view()}, 0, hl};
        absl::StatusOr<int64_t> packed_bytes = PackedBlockBytes(sh, ops);
        ASSERT_TRUE(packed_bytes.ok()) << packed_bytes.status();
        for (int dst = 0; dst < sh.world; ++dst) {
          DeviceBuffer packed(std::vector<uint8_t>(static_cast<size_t>(*packed_bytes), 0));
          absl::Status st = LaunchPackBlock(sh, ops, src, dst, packed.data(), stream());
          ASSERT_TRUE(st.ok()) << st;
          st = LaunchUnpackBlock(sh, ops, src, dst, packed.data(), unpacked[dst]->data(),
                                 stream(), reinterpret_cast<const uint64_t*>(go.data()));
          ASSERT_TRUE(st.ok()) << st;
          st = LaunchUnpackBlock(sh, ops, src, dst, packed.data(), untouched[dst]->data(),
                                 stream(), reinterpret_cast<const uint64_t*>(cancelled.data()));
          ASSERT_TRUE(st.ok()) << st;
          // The packed buffer goes at the end of this scope: its kernels end first.
          ASSERT_CUDA_OK(cudaStreamSynchronize(stream()));
          if (kind == BlockKind::kScatterHeads)
            ScatterHeadsBlockRef(sh, q[src].host.view(), src, dst, host_out[dst].data());
          else
            ScatterQkvHeadChunkBlockRef(sh, q[src].host.view(), k[src].host.view(),
                                        v[src].host.view(), 0, hl, src, dst,
                                        host_out[dst].data());
        }
      }
      for (int dst = 0; dst < sh.world; ++dst) {
        EXPECT_EQ(unpacked[dst]->Download(), host_out[dst]) << "dst " << dst;
        EXPECT_EQ(untouched[dst]->Download(), before[dst]) << "dst " << dst << " (cancelled)";
      }
    }
  }
}

TEST_P(GpuExchangeTest, CopiesMatchRef) {
  const ExchangeShape sh = Shape();
  const int64_t shape[4] = {sh.batch, sh.seq_local, sh.heads, sh.head_dim};
  const int64_t bytes = sh.batch * sh.seq_local * sh.heads * sh.head_dim * sh.itemsize;
  for (const Variant& variant : kVariants) {
    SCOPED_TRACE(VariantName(variant));
    const TwinView src = MakeTwin(variant, shape[0], shape[1], shape[2], shape[3], sh.itemsize, 81);
    DeviceBuffer dense_dev(std::vector<uint8_t>(bytes, 0));
    absl::Status status = LaunchCopyViewToContiguous(src.device_view(), shape, sh.itemsize,
                                                     dense_dev.data(), stream());
    ASSERT_TRUE(status.ok()) << status;

    const auto dense = testing::RandomBytes(bytes, 82);
    DeviceBuffer fresh_dev(dense);
    TwinView dst = MakeTwin(variant, shape[0], shape[1], shape[2], shape[3], sh.itemsize, 83);
    status = LaunchCopyContiguousToView(fresh_dev.data(), shape, sh.itemsize, dst.device_mut_view(),
                                        stream());
    ASSERT_TRUE(status.ok()) << status;
    CopyContiguousToViewRef(dense.data(), shape, sh.itemsize, dst.host.mut_view());
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream()));

    EXPECT_EQ(dense_dev.Download(), src.host.Dense());
    EXPECT_EQ(dst.device->Download(), dst.host.buffer);
  }
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  const auto& [world, dims, dtype] = info.param;
  return "W" + std::to_string(world) + "_B" + std::to_string(dims.batch) + "_S" +
         std::to_string(dims.seq_local) + "_D" + std::to_string(dims.head_dim) + "_" +
         testing::DtypeName(dtype);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuExchangeTest,
    ::testing::Combine(::testing::Values(1, 2, 3, 4, 6, 8),
                       ::testing::Values(Dims{1, 8, 24, 128}, Dims{2, 16, 24, 64},
                                         Dims{1, 5, 24, 3}),
                       ::testing::Values(Dtype::kFp16, Dtype::kBf16, Dtype::kFp32)),
    ParamName);

// out_dst may live on another GPU: device 0 pushes its scatter block into device 1's buffer.
TEST(GpuPeerExchangeTest, ScatterBlockIntoPeerMemory) {
  ULY_SKIP_WITHOUT_GPU();
  int devices = 0;
  ASSERT_CUDA_OK(cudaGetDeviceCount(&devices));
  if (devices < 2) GTEST_SKIP() << "needs two CUDA devices";
  int can_access = 0;
  ASSERT_CUDA_OK(cudaDeviceCanAccessPeer(&can_access, 0, 1));
  if (!can_access) GTEST_SKIP() << "device 0 cannot access device 1";

  const ExchangeShape sh{2, 2, 16, 24, 128, 2};
  const int64_t out_bytes = sh.batch * GlobalSeq(sh) * LocalHeads(sh) * sh.head_dim * sh.itemsize;
  const auto before = testing::RandomBytes(out_bytes, 5);
  ASSERT_CUDA_OK(cudaSetDevice(1));
  DeviceBuffer peer_out(before);
  ASSERT_CUDA_OK(cudaSetDevice(0));
  const cudaError_t enable = cudaDeviceEnablePeerAccess(1, 0);
  ASSERT_TRUE(enable == cudaSuccess || enable == cudaErrorPeerAccessAlreadyEnabled);
  (void)cudaGetLastError();

  std::vector<TwinView> x;
  for (int j = 0; j < 2; ++j) {
    x.push_back(MakeTwin({Layout::kPaddedHeads, false}, sh.batch, sh.seq_local, sh.heads,
                         sh.head_dim, sh.itemsize, 60 + j));
  }
  Stream stream;
  auto want = before;
  for (int src = 0; src < 2; ++src) {
    const absl::Status status =
        LaunchScatterHeadsBlock(sh, x[src].device_view(), src, 1, peer_out.data(), stream.get());
    ASSERT_TRUE(status.ok()) << status;
    ScatterHeadsBlockRef(sh, x[src].host.view(), src, 1, want.data());
  }
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream.get()));
  EXPECT_EQ(peer_out.Download(), want);
}

TEST(GpuLauncherTest, DeviceCountIsZeroOrMoreAndNeverAnError) {
  // Runs with or without a device: no device or no driver is a count of 0, not an error.
  const absl::StatusOr<int> devices = CudaDeviceCount();
  ASSERT_TRUE(devices.ok()) << devices.status();
  EXPECT_GE(*devices, 0);
}

TEST(GpuLauncherTest, RejectsBadArgumentsBeforeLaunching) {
  // Arguments are checked on the host before anything is enqueued, so this needs no device;
  // the pointers are never dereferenced.
  void* fake = reinterpret_cast<void*>(uintptr_t{0x100000});
  const ConstView x = ContiguousConstView(fake, 4, 8, 16);
  const ExchangeShape ok{4, 1, 4, 8, 16, 2};

  ExchangeShape bad = ok;
  bad.heads = 6;
  absl::Status st = LaunchScatterHeadsBlock(bad, x, 0, 0, fake, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("divisible"), std::string::npos) << st;

  st = LaunchGatherHeadsBlock(ok, x, 0, 7, fake, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("dst rank 7"), std::string::npos) << st;

  bad = ok;
  bad.itemsize = 1;
  st = LaunchGatherHeadsBlock(bad, x, 0, 0, fake, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;

  st = LaunchScatterQkvHeadChunkBlock(ok, x, x, ConstView{nullptr, {1, 1, 1, 1}}, 0, 1, 0, 0, fake,
                                      nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("v is null"), std::string::npos) << st;

  st = LaunchGatherOutputHeadChunkMerge(ok, fake, 1, 2, MutView{fake, {1, 1, 1, 1}}, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("exceeds local_heads"), std::string::npos) << st;

  // LaunchBlocks plans every destination's block first: one bad block enqueues none.
  void* outs[4] = {fake, fake, fake, fake};
  const BlockOperands qkv{BlockKind::kScatterQkvHeadChunk, {x, x, ConstView{nullptr, {1, 1, 1, 1}}},
                          0, 1};
  st = LaunchBlocks(ok, qkv, 0, outs, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("v is null"), std::string::npos) << st;
  bad = ok;
  bad.world = 0;
  st = LaunchBlocks(bad, BlockOperands{BlockKind::kScatterHeads, {x, x, x}, 0, 0}, 0, outs, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("shape.world"), std::string::npos) << st;
  st = LaunchBlocks(ok, BlockOperands{BlockKind::kScatterHeads, {x, x, x}, 0, 0}, 0, nullptr, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("out"), std::string::npos) << st;
}

}  // namespace
}  // namespace ulysses::kernels
