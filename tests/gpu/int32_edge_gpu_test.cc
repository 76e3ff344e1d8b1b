// The daemon's GPU backend at the int32 limits of PlanCall (tests/common/validation_test.cc,
// "int32 limits and capacity"): two ulyssesd processes sharing the GPU(s) present, one client
// thread per rank, calls at the largest shapes the limits accept, every element of every result
// checked bit for bit against the index semantics of docs/api.md section 2, and the shapes one
// past the limits refused before anything is written. Skips without a CUDA device.
//
// Inputs are bf16 bit patterns made on the host from each element's index (Val below), uploaded
// and read back in chunks, so host memory stays at a few chunks per rank whatever the shape.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "cluster_util.h"
#include "gtest/gtest.h"
#include "ulysses/client/client.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/cuda_memory.h"

namespace ulysses {
namespace {

constexpr int kW = 2;
constexpr int64_t kItem = 2;  // bf16

// The reference case of the host tests (Int32EdgeGeo): H = 2, D = 128, H_l = 1, and the most
// tokens whose scatter_qkv_head_chunk payload B*S_l*W*HC*3D fits in int32.
constexpr int32_t kEdgeHeads = 2;
constexpr int32_t kEdgeDim = 128;
constexpr int64_t kEdgeTokens = 2796202;
constexpr int64_t kEdgeSlotElems = kEdgeTokens * kW * 1 * 3 * kEdgeDim;
static_assert(kEdgeSlotElems == 2147483136, "the reference case's payload");
static_assert((kEdgeTokens + 1) * kW * 3 * kEdgeDim > kInt32Max, "one more token is past int32");

// The slot budget of the daemons started here: a session of two slots of 4 GiB holds 8 GiB
// and a few MiB of words and rounding, just over the default budget (8 GiB).
constexpr uint64_t kSlotBudgetBytes = uint64_t{16} << 30;

// Element i of tensor `salt`: a 64-bit mix of both, its top 16 bits. Every (rank, tensor)
// pair has its own salt above bit 40, clear of every index used here (< 2^33), so an element
// read from the wrong rank, tensor or place differs from the one expected.
inline uint16_t Val(uint64_t salt, uint64_t i) {
  uint64_t x = (salt | i) * 0x9E3779B97F4A7C15ull;
  x ^= x >> 32;
  x *= 0xD6E8FEB86659FD93ull;
  return static_cast<uint16_t>(x >> 48);
}

enum Tensor : uint64_t { kQ = 0, kK = 1, kV = 2, kX = 3, kY = 4, kMergeX = 5 };
constexpr const char* kPlaneNames[] = {"q", "k", "v"};
inline uint64_t Salt(int rank, Tensor t) {
  return (static_cast<uint64_t>(t) * kW + rank + 1) << 40;
}

// Elements moved between host and device at a time: 32 MiB of bf16.
constexpr int64_t kChunkElems = int64_t{1} << 24;

// Writes Val(salt, i) for i in [0, n) as n bf16 elements at `device`. "" or what failed.
std::string Fill(void* device, int64_t n, uint64_t salt) {
  std::vector<uint16_t> chunk(static_cast<size_t>(std::min(n, kChunkElems)));
  auto* dst = static_cast<uint16_t*>(device);
  for (int64_t at = 0; at < n; at += kChunkElems) {
    const int64_t len = std::min(kChunkElems, n - at);
    for (int64_t k = 0; k < len; ++k) chunk[k] = Val(salt, static_cast<uint64_t>(at + k));
    if (absl::Status s = ipc::cuda::Copy(dst + at, chunk.data(), len * kItem); !s.ok())
      return StrCat("upload: ", s.ToString());
  }
  return "";
}

// Reads `elems` bf16 elements of device memory back in order, `row` elements at a time (a
// chunk holds whole rows).
class DeviceRows {
 public:
  DeviceRows(const void* device, int64_t elems, int64_t row)
      : src_(static_cast<const uint16_t*>(device)), left_(elems), row_(row),
        buf_(static_cast<size_t>(std::max<int64_t>(1, kChunkElems / row) * row)) {}
  // The next row; null when none is left or the copy failed (error() says why).
  const uint16_t* Next() {
    if (at_ == filled_) {
      const int64_t n = std::min(static_cast<int64_t>(buf_.size()), left_);
      if (n < row_) {
        error_ = "the result ends early";
        return nullptr;
      }
      if (absl::Status s = ipc::cuda::Copy(buf_.data(), src_, n * kItem); !s.ok()) {
        error_ = StrCat("read back: ", s.ToString());
        return nullptr;
      }
      src_ += n;
      left_ -= n;
      at_ = 0;
      filled_ = n;
    }
    const uint16_t* r = buf_.data() + at_;
    at_ += row_;
    return r;
  }
  const std::string& error() const { return error_; }

 private:
  const uint16_t* src_;
  int64_t left_, row_;
  std::vector<uint16_t> buf_;
  int64_t at_ = 0, filled_ = 0;
  std::string error_;
};

// The first d < n where row[d] is not Val(salt, first + d), or -1. (The loop without an early
// exit vectorizes; the search runs only on a mismatch.)
int64_t FirstMismatch(const uint16_t* row, int64_t n, uint64_t salt, uint64_t first) {
  uint32_t diff = 0;
  for (int64_t d = 0; d < n; ++d) diff |= static_cast<uint32_t>(row[d] ^ Val(salt, first + d));
  if (diff == 0) return -1;
  for (int64_t d = 0; d < n; ++d)
    if (row[d] != Val(salt, first + d)) return d;
  return -1;
}

// Checks a result [1, S, H, D] at `data` on rank `r` of a gather: out_r[0, s, p*H_l + h, d] =
// x_p[0, r*S + s, h, d] for every source p, whose input [1, W*S, H_l, D] held tensor `t`.
// gather_heads gives it, and gather_output_head_chunk over the whole band into out.
std::string CheckGathered(const void* data, int r, int64_t S, int64_t H, int64_t D, Tensor t) {
  const int64_t HL = H / kW;
  DeviceRows rows(data, S * H * D, D);
  for (int64_t s = 0; s < S; ++s)
    for (int p = 0; p < kW; ++p)
      for (int64_t h = 0; h < HL; ++h) {
        const uint16_t* row = rows.Next();
        if (row == nullptr) return rows.error();
        const uint64_t first = static_cast<uint64_t>(((r * S + s) * HL + h) * D);
        if (const int64_t bad = FirstMismatch(row, D, Salt(p, t), first); bad >= 0)
          return StrCat("out[0, ", s, ", ", p * HL + h, ", ", bad, "] = ", row[bad], ", want ",
                        Val(Salt(p, t), first + bad));
      }
  return "";
}

std::string ShapeError(const std::string& op, const client::Result& res,
                       const std::array<int64_t, 4>& want, uint64_t bytes) {
  if (res.shape == want && res.bytes == bytes && res.device) return "";
  return StrCat(op, ": result [", res.shape[0], ", ", res.shape[1], ", ", res.shape[2], ", ",
                res.shape[3], "] of ", res.bytes, " bytes (device ", res.device, "), want [",
                want[0], ", ", want[1], ", ", want[2], ", ", want[3], "] of ", bytes);
}

class GpuInt32Edge : public testing_util::ClusterTest {
 protected:
  void SetUp() override {
    if (ipc::cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    backend_ = "nvlink";
  }

  // Two daemons whose slot budget (slots.memory_budget_bytes, a config key without a flag)
  // holds a session of two slots at the int32 edge.
  void StartTwo() {
    const std::string config = StrCat(::testing::TempDir(), "int32-edge-", ::getpid(), ".json");
    {
      std::ofstream(config) << "{\"slots\": {\"memory_budget_bytes\": " << kSlotBudgetBytes
                            << "}}";
    }
    Start(2, {"--config", config});
    ::unlink(config.c_str());
  }

  // One client per rank of the 2 daemons started, a group `group` of both and a session of
  // `spec` in it; `body` runs on both ranks at once, a thread each, and returns "" or what
  // failed.
  using RankBody = std::function<std::string(int rank, client::Client&, client::Session&)>;
  void OnBothRanks(const std::string& group, const client::SessionSpec& spec,
                   const RankBody& body) {
    std::string errors[kW];
    std::vector<std::thread> threads;
    for (int r = 0; r < kW; ++r) {
      threads.emplace_back([&, r] {
        auto c = client::Client::Connect({Members(kW)[r], StrCat(group, "-", r)});
        if (!c.ok()) return void(errors[r] = c.status().ToString());
        auto g = (*c)->JoinGroup({group, kW, r, Members(kW), "nvlink", 0});
        if (!g.ok()) return void(errors[r] = g.status().ToString());
        auto s = (*c)->CreateSession(*g, spec);
        if (!s.ok()) return void(errors[r] = s.status().ToString());
        errors[r] = body(r, **c, **s);
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < kW; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  }
};

// scatter_qkv_head_chunk at the largest payload the int32 limit accepts (the host tests'
// reference case: slot elements 2,147,483,136), on both ranks at once: out_r[0, j*S_l + s, 0,
// :] = q_j, k_j, v_j[0, s, r, :] in thirds. Two calls, so that both slots are written: the
// second begins just short of 4 GiB into the daemon's slot allocation and ends near 8 GiB, so
// a byte offset that wrapped at 32 bits would land in the first.
TEST_F(GpuInt32Edge, TheLargestQkvHeadChunkPayloadIsBitExactInBothSlots) {
  ASSERT_NO_FATAL_FAILURE(StartTwo());
  constexpr int64_t S = kEdgeTokens, H = kEdgeHeads, D = kEdgeDim, HL = H / kW;
  constexpr int64_t plane = S * H * D;  // q, k, v [1, S_l, H, D] one after the other
  auto body = [&](int r, client::Client& c, client::Session& session) -> std::string {
    auto in = c.AllocBuffer(3 * plane * kItem, "qkv");
    if (!in.ok()) return in.status().ToString();
    for (Tensor t : {kQ, kK, kV})
      if (std::string e = Fill(static_cast<uint16_t*>(in->data) + t * plane, plane, Salt(r, t));
          !e.empty())
        return e;
    const OperandRef q = in->Ref(0), k = in->Ref(plane * kItem), v = in->Ref(2 * plane * kItem);
    for (int call = 1; call <= 2; ++call) {
      auto res = session.ScatterQkvHeadChunk(q, k, v, 1, S, 0, 1);
      if (!res.ok()) return StrCat("call ", call, ": ", res.status().ToString());
      if (std::string e = ShapeError("scatter_qkv_head_chunk", *res, {1, kW * S, 1, 3 * D},
                                     kEdgeSlotElems * kItem);
          !e.empty())
        return e;
      if (res->epoch != static_cast<uint64_t>(call) || res->slot != call - 1)
        return StrCat("call ", call, ": epoch ", res->epoch, " slot ", res->slot);
      DeviceRows rows(res->data, kEdgeSlotElems, 3 * D);
      for (int64_t g = 0; g < kW * S; ++g) {
        const int j = static_cast<int>(g / S);
        const int64_t s = g % S;
        const uint16_t* row = rows.Next();
        if (row == nullptr) return StrCat("call ", call, ": ", rows.error());
        const uint64_t first = static_cast<uint64_t>((s * H + r * HL) * D);
        for (Tensor t : {kQ, kK, kV})
          if (const int64_t bad = FirstMismatch(row + t * D, D, Salt(j, t), first); bad >= 0)
            return StrCat("call ", call, ": out[0, ", g, ", 0, ", t * D + bad,
                          "] = ", row[t * D + bad], ", want ", Val(Salt(j, t), first + bad),
                          " (", kPlaneNames[t], " of rank ", j, ")");
      }
      if (absl::Status st = res->Release(); !st.ok()) return st.ToString();
    }
    return "";
  };
  OnBothRanks("int32-qkv", {kEdgeHeads, kEdgeDim, DType::kBFloat16, S, 2, {}, 0}, body);
}

// scatter_heads, gather_heads and gather_output_head_chunk over the whole band, each with the
// largest input the limits accept for its shape: the session's receive slot holds the head
// chunk's 3*max_tokens*H*D elements within int32, so B*S_l is at most max_tokens =
// floor((2^31-1) / (3*H*D)) and every input of these ops has at most (2^31-1)/3 elements.
// H2_D128 is the reference geometry (715,827,712 elements); H2_D3 reaches the bound itself,
// 715,827,882 elements, in a slot of 2,147,483,646 (2^31 - 2), with 6-byte rows.
struct EdgeShape {
  int32_t heads;
  int32_t head_dim;
  int64_t max_tokens;
};

void PrintTo(const EdgeShape& s, std::ostream* os) {
  *os << "H=" << s.heads << " D=" << s.head_dim << " max_tokens=" << s.max_tokens;
}

class GpuInt32EdgeShapes : public GpuInt32Edge, public testing::WithParamInterface<EdgeShape> {};

TEST_P(GpuInt32EdgeShapes, ScatterGatherAndMergeAtTheLargestInputAreBitExact) {
  const EdgeShape sh = GetParam();
  const int64_t S = sh.max_tokens, H = sh.heads, D = sh.head_dim, HL = H / kW;
  const int64_t n = S * H * D;  // every input's and every result's elements
  // The largest max_tokens of the shape: one more and the session's slot is past int32.
  ASSERT_LE(3 * S * H * D, kInt32Max);
  ASSERT_GT(3 * (S + 1) * H * D, kInt32Max);
  ASSERT_NO_FATAL_FAILURE(StartTwo());
  auto body = [&](int r, client::Client& c, client::Session& session) -> std::string {
    auto in = c.AllocBuffer(n * kItem, "in");
    auto out = c.AllocBuffer(n * kItem, "out");
    if (!in.ok() || !out.ok()) return StrCat("alloc: ", in.status(), " ", out.status());

    // scatter_heads: x[1, S_l, H, D] -> out_r[0, j*S_l + s, h, d] = x_j[0, s, r*H_l + h, d].
    if (std::string e = Fill(in->data, n, Salt(r, kX)); !e.empty()) return e;
    auto sc = session.ScatterHeads(in->Ref(), 1, S);
    if (!sc.ok()) return StrCat("scatter_heads: ", sc.status().ToString());
    if (std::string e = ShapeError("scatter_heads", *sc, {1, kW * S, HL, D}, n * kItem);
        !e.empty())
      return e;
    DeviceRows rows(sc->data, n, D);
    for (int64_t g = 0; g < kW * S; ++g) {
      const int j = static_cast<int>(g / S);
      const int64_t s = g % S;
      for (int64_t h = 0; h < HL; ++h) {
        const uint16_t* row = rows.Next();
        if (row == nullptr) return StrCat("scatter_heads: ", rows.error());
        const uint64_t first = static_cast<uint64_t>((s * H + r * HL + h) * D);
        if (const int64_t bad = FirstMismatch(row, D, Salt(j, kX), first); bad >= 0)
          return StrCat("scatter_heads: out[0, ", g, ", ", h, ", ", bad, "] = ", row[bad],
                        ", want ", Val(Salt(j, kX), first + bad));
      }
    }
    if (absl::Status st = sc->Release(); !st.ok()) return st.ToString();

    // gather_heads: y[1, S_g, H_l, D] -> [1, S_l, H, D].
    if (std::string e = Fill(in->data, n, Salt(r, kY)); !e.empty()) return e;
    auto ga = session.GatherHeads(in->Ref(), 1, kW * S);
    if (!ga.ok()) return StrCat("gather_heads: ", ga.status().ToString());
    if (std::string e = ShapeError("gather_heads", *ga, {1, S, H, D}, n * kItem); !e.empty())
      return e;
    if (std::string e = CheckGathered(ga->data, r, S, H, D, kY); !e.empty())
      return "gather_heads: " + e;
    if (absl::Status st = ga->Release(); !st.ok()) return st.ToString();

    // gather_output_head_chunk over the whole band (head_offset 0, HC = H_l), its largest
    // payload, into an out filled with all bits set: every element of out is written.
    if (std::string e = Fill(in->data, n, Salt(r, kMergeX)); !e.empty()) return e;
    if (absl::Status st = ipc::cuda::Fill(out->data, 0xff, n * kItem); !st.ok())
      return st.ToString();
    auto mg = session.GatherOutputHeadChunk(in->Ref(), 1, kW * S, 0, static_cast<int32_t>(HL),
                                            out->Ref());
    if (!mg.ok()) return StrCat("gather_output_head_chunk: ", mg.status().ToString());
    if (mg->shape != std::array<int64_t, 4>{1, S, H, D})
      return StrCat("gather_output_head_chunk: shape [", mg->shape[0], ", ", mg->shape[1], ", ",
                    mg->shape[2], ", ", mg->shape[3], "]");
    if (std::string e = CheckGathered(out->data, r, S, H, D, kMergeX); !e.empty())
      return "gather_output_head_chunk: " + e;
    return "";
  };
  OnBothRanks("int32-heads", {sh.heads, sh.head_dim, DType::kBFloat16, S, 2, {}, 0}, body);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuInt32EdgeShapes,
                         testing::Values(EdgeShape{2, 128, 2796202}, EdgeShape{2, 3, 119304647}),
                         [](const testing::TestParamInfo<EdgeShape>& p) {
                           return StrCat("H", p.param.heads, "_D", p.param.head_dim);
                         });

// One past the edge, on the reference session and with every operand inside its buffer, so
// that the int32 limit alone refuses: scatter_qkv_head_chunk with one token more (payload
// 2,147,483,904), and scatter_heads, gather_heads and gather_output_head_chunk with inputs of
// 2^31 elements. Each is INVALID_ARGUMENT, its message starting with the argument and naming
// the int32 limit (the host tests' verdicts), and writes nothing: the out given stays as it
// was, the held result of the call before stays exact, and no epoch is used. (The library
// reaches this verdict before anything is sent, docs/api.md section 4; the daemon's PlanCall
// is the same code.)
TEST_F(GpuInt32Edge, OnePastTheEdgeIsInvalidArgumentAndWritesNothing) {
  ASSERT_NO_FATAL_FAILURE(StartTwo());
  constexpr int64_t S = kEdgeTokens, S1 = S + 1, H = kEdgeHeads, D = kEdgeDim;
  constexpr int64_t plane = S1 * H * D;           // q, k, v of S_l + 1 tokens
  constexpr int64_t out_elems = kW * S1 * 3 * D;  // [1, W*(S_l+1), 1, 3D]
  constexpr int64_t kPast = int64_t{1} << 31;     // the refused inputs' elements
  static_assert(3 * plane >= kPast && out_elems >= kPast, "every operand lies in its buffer");
  // Every byte of plane t of rank j, and of out.
  auto pattern = [](int j, int t) { return 0x21 + 0x11 * t + 0x40 * j; };
  constexpr int kOutByte = 0x5a;
  auto body = [&](int r, client::Client& c, client::Session& session) -> std::string {
    auto in = c.AllocBuffer(3 * plane * kItem, "qkv");
    auto out = c.AllocBuffer(out_elems * kItem, "out");
    if (!in.ok() || !out.ok()) return StrCat("alloc: ", in.status(), " ", out.status());
    for (int t = 0; t < 3; ++t)
      if (absl::Status st = ipc::cuda::Fill(static_cast<uint8_t*>(in->data) + t * plane * kItem,
                                            pattern(r, t), plane * kItem);
          !st.ok())
        return st.ToString();
    if (absl::Status st = ipc::cuda::Fill(out->data, kOutByte, out_elems * kItem); !st.ok())
      return st.ToString();
    const OperandRef q = in->Ref(0), k = in->Ref(plane * kItem), v = in->Ref(2 * plane * kItem);
    // At the edge: accepted, and held in slot 0 while the refused calls are made.
    auto held = session.ScatterQkvHeadChunk(q, k, v, 1, S, 0, 1);
    if (!held.ok()) return StrCat("at the edge: ", held.status().ToString());

    struct Refused {
      const char* what;
      absl::StatusOr<client::Result> res;
      const char* arg;
    };
    Refused refused[] = {
        {"scatter_qkv_head_chunk of S_l + 1 tokens",
         session.ScatterQkvHeadChunk(q, k, v, 1, S1, 0, 1, out->Ref()), "seq: "},
        {"scatter_heads of x [1, 2^23, 2, 128]",
         session.ScatterHeads(in->Ref(), 1, kPast / (H * D), out->Ref()), "x: "},
        {"gather_heads of y [1, 2^24, 1, 128]",
         session.GatherHeads(in->Ref(), 1, kPast / D, out->Ref()), "y: "},
        {"gather_output_head_chunk of x [1, 2^24, 1, 128]",
         session.GatherOutputHeadChunk(in->Ref(), 1, kPast / D, 0, 1, out->Ref()), "x: "},
    };
    for (const Refused& f : refused) {
      if (f.res.ok()) return StrCat(f.what, ": accepted");
      const absl::Status& st = f.res.status();
      const std::string message(st.message());
      if (st.code() != absl::StatusCode::kInvalidArgument || message.rfind(f.arg, 0) != 0 ||
          message.find("int32") == std::string::npos)
        return StrCat(f.what, ": ", st.ToString());
    }

    // Nothing written: out as filled, the held result as the accepted call left it.
    DeviceRows outs(out->data, out_elems, 3 * D);
    for (int64_t g = 0; g < kW * S1; ++g) {
      const uint16_t* row = outs.Next();
      if (row == nullptr) return outs.error();
      for (int64_t e = 0; e < 3 * D; ++e)
        if (row[e] != kOutByte * 0x0101)
          return StrCat("out[0, ", g, ", 0, ", e, "] = ", row[e], " after the refused calls");
    }
    DeviceRows rows(held->data, kEdgeSlotElems, 3 * D);
    for (int64_t g = 0; g < kW * S; ++g) {
      const int j = static_cast<int>(g / S);
      const uint16_t* row = rows.Next();
      if (row == nullptr) return rows.error();
      for (int64_t e = 0; e < 3 * D; ++e)
        if (row[e] != pattern(j, static_cast<int>(e / D)) * 0x0101)
          return StrCat("held result[0, ", g, ", 0, ", e, "] = ", row[e]);
    }
    if (absl::Status st = held->Release(); !st.ok()) return st.ToString();
    // The refused calls used no epoch: the next call is the session's second.
    auto next = session.ScatterQkvHeadChunk(q, k, v, 1, 1, 0, 1);
    if (!next.ok()) return StrCat("the call after: ", next.status().ToString());
    if (next->epoch != 2) return StrCat("the call after the refused ones has epoch ", next->epoch);
    return "";
  };
  OnBothRanks("int32-past", {kEdgeHeads, kEdgeDim, DType::kBFloat16, S, 2, {}, 0}, body);
}

}  // namespace
}  // namespace ulysses
