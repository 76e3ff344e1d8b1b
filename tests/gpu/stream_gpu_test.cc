// The stream-ordered protocol on the GPU backends: calls return before the client's stream has
// run them, the daemon's stream waits for the client's inputs, releases follow the stream (a
// slot is reused only after the stream that read it gave it back), a session closed right
// after a call still runs it (its result readable after the close), and a client stream that
// never arrives ends in an error within the call timeout (no stream stays blocked, and the
// daemons serve the next group), nor does a stream whose call's daemon died. Every case runs
// once per GPU backend (StreamBackends): nvlink, and nccl in its test mode (an NCCL_HOSTID per
// daemon). Skips without a CUDA device.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <thread>

#include "absl/strings/match.h"
#include "cluster_util.h"
#include "gtest/gtest.h"
#include "ulysses/client/client.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/cuda_memory.h"

namespace ulysses {
namespace {

class StreamCluster : public testing_util::ClusterTest {
 protected:
  void SetUp() override {
    if (ipc::cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    backend_ = "nvlink";
  }
};

// A case once per GPU backend (the parameter). nccl runs in its one-GPU test mode: every
// daemon its own NCCL_HOSTID, so NCCL moves the blocks over its socket transport.
class StreamBackends : public StreamCluster, public testing::WithParamInterface<std::string> {
 protected:
  void SetUp() override {
    StreamCluster::SetUp();
    if (IsSkipped()) return;
    backend_ = GetParam();
    if (backend_ != "nccl") return;
    // Under MPS a daemon of an nccl group killed mid-call was seen to fault the surviving
    // daemon's context, and with it every process on the GPU (docs/operations.md, section 4):
    // the nccl cases run without MPS.
    absl::StatusOr<ipc::cuda::DeviceInfo> device = ipc::cuda::Describe(0);
    if (device.ok() && device->mps) GTEST_SKIP() << "the nccl cases run without MPS";
    env_ = [](int r) { return std::vector<std::string>{StrCat("NCCL_HOSTID=ulysses-test-", r)}; };
  }
};

// A stream held at a host function until Open(): everything enqueued after it waits.
class Gate {
 public:
  explicit Gate(cudaStream_t s) {
    EXPECT_EQ(cudaLaunchHostFunc(s, &Gate::Hold, this), cudaSuccess);
  }
  void Open() { open_.store(true); }

 private:
  static void Hold(void* p) {
    auto* g = static_cast<Gate*>(p);
    while (!g->open_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::atomic<bool> open_{false};
};

// A rank's input value at x[b, s, h, d] in iteration `it`: distinct per rank and iteration.
float Value(int rank, int it, int64_t b, int64_t s, int64_t h, int64_t d) {
  return static_cast<float>(((rank * 7 + it) * 131 + b * 977 + s * 31 + h * 13 + d) % 4093);
}

constexpr int kW = 2, kB = 2, kS = 24, kH = 8, kD = 64, kSlots = 2, kIters = 5;

// scatter_heads: rank dst's result [B, W*S, H/W, D] holds source src's heads of dst's band at
// sequence positions src*S + s. The elements of `got` (rank dst, iteration it) that do not.
int64_t WrongScatterElements(const std::vector<float>& got, int dst, int it) {
  const int64_t hl = kH / kW;
  int64_t wrong = 0;
  for (int64_t b = 0; b < kB; ++b)
    for (int src = 0; src < kW; ++src)
      for (int64_t q = 0; q < kS; ++q)
        for (int64_t h = 0; h < hl; ++h)
          for (int64_t d = 0; d < kD; ++d) {
            const float want = Value(src, it, b, q, dst * hl + h, d);
            const float have = got[((b * kW * kS + src * kS + q) * hl + h) * kD + d];
            if (std::memcmp(&want, &have, 4) != 0) ++wrong;
          }
  return wrong;
}

// Rank r's inputs of `iterations` calls, one [B, S, H, D] float32 tensor after the other.
void FillInputs(float* in, int r, int iterations) {
  const int64_t elems = int64_t{kB} * kS * kH * kD;
  for (int it = 0; it < iterations; ++it)
    for (int64_t i = 0; i < elems; ++i)
      in[it * elems + i] =
          Value(r, it, i / (kS * kH * kD), (i / (kH * kD)) % kS, (i / kD) % kH, i % kD);
}

// Every rank's result of every call (got[rank][call]) is that call's scatter, bit for bit.
void ExpectEveryScatter(const std::vector<std::vector<std::vector<float>>>& got, int calls) {
  for (int dst = 0; dst < kW; ++dst)
    for (int it = 0; it < calls; ++it)
      EXPECT_EQ(WrongScatterElements(got[dst][it], dst, it), 0)
          << "rank " << dst << " call " << it + 1;
}

TEST_P(StreamBackends, CallsReturnBeforeTheStreamRunsThemAndFollowItsOrder) {
  Start(kW);
  const int64_t hl = kH / kW, in_elems = int64_t{kB} * kS * kH * kD;
  const int64_t out_elems = int64_t{kB} * kS * kW * hl * kD;
  std::vector<std::string> errors(kW);
  std::vector<std::vector<std::vector<float>>> got(kW);
  std::vector<std::unique_ptr<Gate>> gates(kW);
  std::atomic<int> returned{0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < kW; ++r) {
    ranks.emplace_back([&, r] {
      auto fail = [&](const std::string& e) { errors[r] = e; };
      auto c = client::Client::Connect({Members(kW)[r], "stream"});
      if (!c.ok()) return fail(c.status().ToString());
      auto g = (*c)->JoinGroup({"stream", kW, r, Members(kW), backend_, 0});
      if (!g.ok()) return fail(g.status().ToString());
      auto s = (*c)->CreateSession(*g, {kH, kD, DType::kFloat32, kB * kS, kSlots, {}, 0});
      if (!s.ok()) return fail(s.status().ToString());
      auto x = (*c)->AllocBuffer(in_elems * 4, "x");
      if (!x.ok()) return fail(x.status().ToString());
      cudaStream_t stream = nullptr;
      if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
        return fail("stream");
      float* host_in = nullptr;
      float* host_out = nullptr;
      cudaMallocHost(reinterpret_cast<void**>(&host_in), in_elems * 4 * kIters);
      cudaMallocHost(reinterpret_cast<void**>(&host_out), out_elems * 4 * kIters);
      FillInputs(host_in, r, kIters);
      (*s)->set_stream(stream);
      gates[r] = std::make_unique<Gate>(stream);
      // Every iteration rewrites x on the stream, calls, copies the result out and releases
      // it, all enqueued behind the closed gate: the daemon must read each x only after this
      // stream wrote it, and reuse a slot only after the copy that read it.
      std::fprintf(stderr, "rank %d: enqueueing %d calls behind the gate\n", r, kIters);
      for (int it = 0; it < kIters; ++it) {
        cudaMemcpyAsync(x->data,
                        host_in + it * in_elems, in_elems * 4, cudaMemcpyHostToDevice, stream);
        auto res = (*s)->ScatterHeads(x->Ref(), kB, kS);
        if (!res.ok()) return fail(StrCat("iteration ", it, ": ", res.status().ToString()));
        cudaMemcpyAsync(host_out + it * out_elems, res->data, out_elems * 4,
                        cudaMemcpyDeviceToHost, stream);
        if (!res->Release().ok()) return fail("release");
      }
      if (cudaStreamQuery(stream) != cudaErrorNotReady)
        return fail("the stream ran ahead of its gate");
      returned.fetch_add(1);
      while (returned.load() < kW) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      std::fprintf(stderr, "rank %d: every call returned; opening the gate\n", r);
      gates[r]->Open();
      if (cudaStreamSynchronize(stream) != cudaSuccess) return fail("sync");
      std::fprintf(stderr, "rank %d: stream done\n", r);
      if (absl::Status st = (*s)->Synchronize(); !st.ok()) return fail(st.ToString());
      got[r].resize(kIters);
      for (int it = 0; it < kIters; ++it)
        got[r][it].assign(host_out + it * out_elems, host_out + (it + 1) * out_elems);
      cudaFreeHost(host_in);
      cudaFreeHost(host_out);
      cudaStreamDestroy(stream);
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kW; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  ExpectEveryScatter(got, kIters);
}

// A result is given back on the stream that reads it; the call that needs its slot next may
// come on another stream. The daemon's stream waits for the release on the device, so the
// slot is not overwritten before the read, and the daemon's host does not wait: another
// session of the same client is served meanwhile.
// Rank 0's W = 1 input of iteration `it` ([B*S, H, D] float32): its values in `in`, the same
// bytes in a shared buffer of `c` in `x`.
void MakeInput(client::Client& c, int it, std::vector<float>* in, client::Buffer* x) {
  const int64_t elems = int64_t{kB} * kS * kH * kD;
  in->resize(elems);
  for (int64_t i = 0; i < elems; ++i)
    (*in)[i] = Value(0, it, 0, i / (kH * kD), (i / kD) % kH, i % kD);
  auto buf = c.AllocBuffer(elems * 4, "x");
  ASSERT_TRUE(buf.ok()) << buf.status();
  *x = *buf;
  ASSERT_EQ(cudaMemcpy(x->data, in->data(), elems * 4, cudaMemcpyHostToDevice), cudaSuccess);
}

// A client of a one-rank group named `name` running `backend` and `sessions` float32 sessions
// of one slot in it (the sessions go before the client).
struct OneRank {
  std::unique_ptr<client::Client> client;
  std::vector<std::unique_ptr<client::Session>> sessions;
};
void OpenOneRank(const std::vector<std::string>& members, const std::string& name,
                 const std::string& backend, int sessions, OneRank* r) {
  auto c = client::Client::Connect({members[0], name});
  ASSERT_TRUE(c.ok()) << c.status();
  r->client = std::move(*c);
  auto g = r->client->JoinGroup({name, 1, 0, members, backend, 0});
  ASSERT_TRUE(g.ok()) << g.status();
  for (int i = 0; i < sessions; ++i) {
    auto s = r->client->CreateSession(*g, {kH, kD, DType::kFloat32, kB * kS, /*num_slots=*/1, {}, 0});
    ASSERT_TRUE(s.ok()) << s.status();
    r->sessions.push_back(std::move(*s));
  }
}

TEST_P(StreamBackends, ASlotIsReusedOnlyAfterTheStreamThatReadItReleasedIt) {
  Start(1);
  const int64_t elems = int64_t{kB} * kS * kH * kD;  // W = 1: the result has the input's size
  OneRank r;
  ASSERT_NO_FATAL_FAILURE(OpenOneRank(Members(1), "reuse", backend_, 2, &r));
  client::Session* s1 = r.sessions[0].get();
  client::Session* s2 = r.sessions[1].get();
  std::vector<float> in[2];
  // Pinned: a copy into pageable memory would wait on the host for the gated stream.
  float* out1 = nullptr;
  float* out2 = nullptr;
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&out1), elems * 4), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&out2), elems * 4), cudaSuccess);
  std::vector<client::Buffer> x(2);
  for (int it = 0; it < 2; ++it) ASSERT_NO_FATAL_FAILURE(MakeInput(*r.client, it, &in[it], &x[it]));
  cudaStream_t a = nullptr, b = nullptr, other = nullptr;
  for (cudaStream_t* st : {&a, &b, &other})
    ASSERT_EQ(cudaStreamCreateWithFlags(st, cudaStreamNonBlocking), cudaSuccess);
  s1->set_stream(a);
  auto first = s1->ScatterHeads(x[0].Ref(), kB, kS);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(cudaStreamSynchronize(a), cudaSuccess);
  {
    // Stream a reads the first result and releases it, behind a closed gate.
    Gate gate(a);
    struct OpenOnExit {
      Gate& g;
      ~OpenOnExit() { g.Open(); }
    } open_on_exit{gate};
    ASSERT_EQ(cudaMemcpyAsync(out1, first->data, elems * 4, cudaMemcpyDeviceToHost, a),
              cudaSuccess);
    ASSERT_TRUE(first->Release().ok());
    // The next call of the one slot, on stream b: it returns, and b waits for a's release
    // (b's ready word follows the point where a released the result).
    s1->set_stream(b);
    auto second = s1->ScatterHeads(x[1].Ref(), kB, kS);
    ASSERT_TRUE(second.ok()) << second.status();
    ASSERT_EQ(cudaMemcpyAsync(out2, second->data, elems * 4, cudaMemcpyDeviceToHost, b),
              cudaSuccess);
    // Another session of the client is served while the first one's slot waits.
    s2->set_stream(other);
    auto served = s2->ScatterHeads(x[0].Ref(), kB, kS);
    ASSERT_TRUE(served.ok()) << served.status();
    ASSERT_TRUE(served->Release().ok());
    ASSERT_TRUE(s2->Synchronize(absl::Seconds(20)).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_EQ(cudaStreamQuery(b), cudaErrorNotReady) << "the second call ran before the release";
    std::fprintf(stderr, "second session served, the second call waits; opening the gate\n");
  }
  ASSERT_EQ(cudaStreamSynchronize(a), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess);
  ASSERT_TRUE(s1->Synchronize().ok());
  EXPECT_EQ(std::memcmp(out1, in[0].data(), elems * 4), 0) << "the first result was overwritten";
  EXPECT_EQ(std::memcmp(out2, in[1].data(), elems * 4), 0) << "the second result is wrong";
  for (cudaStream_t st : {a, b, other}) cudaStreamDestroy(st);
  cudaFreeHost(out1);
  cudaFreeHost(out2);
  // The flight recorder has each stream-ordered call's enqueue time, between its start and the
  // host's finding it finished.
  v1::ListRecentCallsResponse recent;
  grpc::ClientContext ctx;
  ASSERT_TRUE(Admin(0)->ListRecentCalls(&ctx, {}, &recent).ok());
  int timed = 0;
  for (const v1::CallRecord& call : recent.calls()) {
    if (call.session_id() != s1->id()) continue;
    ++timed;
    EXPECT_GE(call.enqueued_unix_us(), call.started_unix_us()) << "epoch " << call.epoch();
    EXPECT_LE(call.enqueued_unix_us(), call.done_unix_us()) << "epoch " << call.epoch();
  }
  EXPECT_EQ(timed, 2);
}

// The same on one stream: the release is enqueued on the stream the next call uses, so the
// call's ready word implies it and the daemon's stream does not wait for the release word
// (ipc::kDescriptorReleasedInOrder). The first result is still read before it is overwritten.
TEST_P(StreamBackends, AReleaseOnTheCallsOwnStreamIsImpliedByItsReadyWord) {
  Start(1);
  const int64_t elems = int64_t{kB} * kS * kH * kD;
  OneRank r;
  ASSERT_NO_FATAL_FAILURE(OpenOneRank(Members(1), "in-order", backend_, 1, &r));
  client::Session* s = r.sessions[0].get();
  std::vector<float> in[3];
  std::vector<client::Buffer> x(3);
  std::vector<float*> out(3, nullptr);
  for (int it = 0; it < 3; ++it) {
    ASSERT_NO_FATAL_FAILURE(MakeInput(*r.client, it, &in[it], &x[it]));
    ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&out[it]), elems * 4), cudaSuccess);
  }
  cudaStream_t a = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
  s->set_stream(a);
  {
    // Three calls of the one slot on stream a, each result read and released on a, all of it
    // enqueued behind a closed gate: every later call's only order is a's.
    Gate gate(a);
    struct OpenOnExit {
      Gate& g;
      ~OpenOnExit() { g.Open(); }
    } open_on_exit{gate};
    for (int it = 0; it < 3; ++it) {
      auto r = s->ScatterHeads(x[it].Ref(), kB, kS);
      ASSERT_TRUE(r.ok()) << "call " << it << ": " << r.status();
      ASSERT_EQ(cudaMemcpyAsync(out[it], r->data, elems * 4, cudaMemcpyDeviceToHost, a),
                cudaSuccess);
      ASSERT_TRUE(r->Release().ok());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_EQ(cudaStreamQuery(a), cudaErrorNotReady) << "the gate did not hold the stream";
  }
  ASSERT_EQ(cudaStreamSynchronize(a), cudaSuccess);
  ASSERT_TRUE(s->Synchronize().ok());
  for (int it = 0; it < 3; ++it)
    EXPECT_EQ(std::memcmp(out[it], in[it].data(), elems * 4), 0) << "result " << it << " is wrong";
  cudaStreamDestroy(a);
  for (float* p : out) cudaFreeHost(p);
}

// Calls submitted before the results of their slot's earlier calls are taken, results waited
// for on the host (no set_stream: the legacy stream). One slot: calls 1 and 2 submitted, then
// result 1 taken, read and released. Call 2 could not carry result 1's release, so the
// release is a word, which call 2's daemon waits for. Both results are read intact, and
// nothing waits out the call timeout. (On a stream of its own that waits for each call's
// done, the same order would deadlock: the stream reaches the release only after call 2.)
TEST_P(StreamBackends, AResultTakenAfterItsSlotsNextCallWasSubmittedIsGivenBackByAWord) {
  Start(1);
  const int64_t elems = int64_t{kB} * kS * kH * kD;
  OneRank r;
  ASSERT_NO_FATAL_FAILURE(OpenOneRank(Members(1), "late-take", backend_, 1, &r));
  client::Session* s = r.sessions[0].get();
  std::vector<float> in[3];
  std::vector<client::Buffer> x(3);
  for (int it = 0; it < 3; ++it) ASSERT_NO_FATAL_FAILURE(MakeInput(*r.client, it, &in[it], &x[it]));
  auto submit = [&](int it) -> absl::StatusOr<uint64_t> {
    CallArgs args;
    args.op = OpKind::kScatterHeads;
    args.batch = kB;
    args.seq = kS;
    args.inputs[0] = x[it].Ref();
    return s->Submit(args);
  };
  std::vector<float> got(elems);
  uint64_t epochs[3] = {};
  for (int it = 0; it < 2; ++it) {
    auto e = submit(it);
    ASSERT_TRUE(e.ok()) << "call " << it << ": " << e.status();
    epochs[it] = *e;
  }
  for (int it = 0; it < 3; ++it) {
    auto r = s->Wait(epochs[it], absl::Seconds(20));
    ASSERT_TRUE(r.ok()) << "result " << it << ": " << r.status();
    ASSERT_EQ(cudaMemcpy(got.data(), r->data, elems * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(std::memcmp(got.data(), in[it].data(), elems * 4), 0) << "result " << it;
    ASSERT_TRUE(r->Release().ok());
    if (it == 1) {
      // And a call made after the release, as usual, carries it.
      auto e = submit(2);
      ASSERT_TRUE(e.ok()) << "call 2: " << e.status();
      epochs[2] = *e;
    }
  }
  ASSERT_TRUE(s->Synchronize(absl::Seconds(20)).ok());
}

// A session closed right after its last call: the close lets that call run first, so its
// result (read on the stream after the close) holds the exchange, and the stream that waits for
// the call passes. Repeated: the close races the daemon's ring worker for the descriptor.
TEST_P(StreamBackends, ACallMadeJustBeforeTheCloseRunsAndItsResultIsReadableAfterIt) {
  Start(kW);
  constexpr int kRounds = 8;
  const int64_t hl = kH / kW, in_elems = int64_t{kB} * kS * kH * kD;
  const int64_t out_elems = int64_t{kB} * kS * kW * hl * kD;
  std::vector<std::string> errors(kW);
  std::vector<std::vector<std::vector<float>>> got(kW, std::vector<std::vector<float>>(kRounds));
  std::vector<std::thread> ranks;
  for (int r = 0; r < kW; ++r) {
    ranks.emplace_back([&, r] {
      auto fail = [&](const std::string& e) { errors[r] = e; };
      auto c = client::Client::Connect({Members(kW)[r], "close"});
      if (!c.ok()) return fail(c.status().ToString());
      auto x = (*c)->AllocBuffer(in_elems * 4, "x");
      if (!x.ok()) return fail(x.status().ToString());
      cudaStream_t stream = nullptr;
      if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
        return fail("stream");
      float* host_in = nullptr;
      float* host_out = nullptr;
      cudaMallocHost(reinterpret_cast<void**>(&host_in), in_elems * 4 * kRounds);
      cudaMallocHost(reinterpret_cast<void**>(&host_out), out_elems * 4 * kRounds);
      for (int it = 0; it < kRounds; ++it)
        for (int64_t i = 0; i < in_elems; ++i)
          host_in[it * in_elems + i] = Value(r, it, i / (kS * kH * kD), (i / (kH * kD)) % kS,
                                             (i / kD) % kH, i % kD);
      for (int it = 0; it < kRounds && errors[r].empty(); ++it) {
        const std::string name = StrCat("close", it);
        auto g = (*c)->JoinGroup({name, kW, r, Members(kW), backend_, 0});
        if (!g.ok()) return fail(g.status().ToString());
        auto s = (*c)->CreateSession(*g, {kH, kD, DType::kFloat32, kB * kS, kSlots, {}, 0});
        if (!s.ok()) return fail(s.status().ToString());
        (*s)->set_stream(stream);
        cudaMemcpyAsync(x->data, host_in + it * in_elems, in_elems * 4, cudaMemcpyHostToDevice,
                        stream);
        auto res = (*s)->ScatterHeads(x->Ref(), kB, kS);
        if (!res.ok()) return fail(StrCat("round ", it, ": ", res.status().ToString()));
        if (absl::Status st = (*s)->Close(); !st.ok())
          return fail(StrCat("round ", it, ": close: ", st.ToString()));
        cudaMemcpyAsync(host_out + it * out_elems, res->data, out_elems * 4,
                        cudaMemcpyDeviceToHost, stream);
        if (cudaStreamSynchronize(stream) != cudaSuccess) return fail("sync");
        if (!res->Release().ok()) return fail("release");
        got[r][it].assign(host_out + it * out_elems, host_out + (it + 1) * out_elems);
      }
      cudaFreeHost(host_in);
      cudaFreeHost(host_out);
      cudaStreamDestroy(stream);
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kW; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  for (int dst = 0; dst < kW; ++dst)
    for (int it = 0; it < kRounds; ++it)
      EXPECT_EQ(WrongScatterElements(got[dst][it], dst, it), 0) << "rank " << dst << " round " << it;
}

// A buffer freed while its call still waits on the client's stream: the daemon keeps the memory
// mapped until the call ran, so the kernel reads the data, not an unmapped range (a GPU fault).
TEST_P(StreamBackends, ABufferFreedWhileItsCallWaitsOnTheStreamStaysMappedUntilTheCallRan) {
  Start(1);
  auto c = client::Client::Connect({Members(1)[0], "free"});
  ASSERT_TRUE(c.ok()) << c.status();
  auto g = (*c)->JoinGroup({"free", 1, 0, Members(1), backend_, 0});
  ASSERT_TRUE(g.ok()) << g.status();
  auto s = (*c)->CreateSession(*g, {kH, kD, DType::kFloat32, kB * kS, kSlots, {}, 0});
  ASSERT_TRUE(s.ok()) << s.status();
  const int64_t elems = int64_t{kB} * kS * kH * kD;
  std::vector<float> in(elems), out(elems, -1.0f);
  for (int64_t i = 0; i < elems; ++i)
    in[i] = Value(0, 0, i / (kS * kH * kD), (i / (kH * kD)) % kS, (i / kD) % kH, i % kD);
  auto x = (*c)->AllocBuffer(elems * 4, "x");
  ASSERT_TRUE(x.ok()) << x.status();
  ASSERT_EQ(cudaMemcpy(x->data, in.data(), elems * 4, cudaMemcpyHostToDevice), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  (*s)->set_stream(stream);
  absl::StatusOr<client::Result> res;
  {
    Gate gate(stream);
    res = (*s)->ScatterHeads(x->Ref(), kB, kS);
    // The ring worker enqueues the call within microseconds; the free comes well after (had
    // it come first, the call would fail with "buffer freed", never pass).
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    absl::Status freed = res.ok() ? (*c)->FreeBuffer(x->id) : absl::OkStatus();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    gate.Open();
    ASSERT_TRUE(res.ok()) << res.status();
    ASSERT_TRUE(freed.ok()) << freed;
  }
  ASSERT_EQ(cudaMemcpyAsync(out.data(), res->data, elems * 4, cudaMemcpyDeviceToHost, stream),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_TRUE((*s)->Synchronize().ok());
  // W = 1: the scatter is the identity on [B, S, H, D].
  EXPECT_EQ(std::memcmp(out.data(), in.data(), elems * 4), 0);
  ASSERT_TRUE(res->Release().ok());
  // The daemon and the GPU serve on: a call on a new buffer.
  auto y = (*c)->AllocBuffer(elems * 4, "y");
  ASSERT_TRUE(y.ok()) << y.status();
  auto again = (*s)->ScatterHeads(y->Ref(), kB, kS);
  EXPECT_TRUE(again.ok()) << again.status();
  if (again.ok()) {
    EXPECT_TRUE(again->Release().ok());
  }
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);
}

// One rank's client, session (kH heads of kD, fp32, kB * kS tokens, kSlots slots) and input
// buffer, in group `name` of kW ranks on `members` running `backend`.
struct Rank {
  std::unique_ptr<client::Client> client;
  std::unique_ptr<client::Session> session;
  client::Buffer x;
};
absl::StatusOr<Rank> OpenRank(const std::vector<std::string>& members, const std::string& name,
                              int r, const std::string& backend) {
  Rank k;
  ULY_ASSIGN_OR_RETURN(k.client, client::Client::Connect({members[r], name}));
  ULY_ASSIGN_OR_RETURN(const client::Group g,
                       k.client->JoinGroup({name, kW, r, members, backend, 0}));
  ULY_ASSIGN_OR_RETURN(k.session,
                       k.client->CreateSession(g, {kH, kD, DType::kFloat32, kB * kS, kSlots, {}, 0}));
  ULY_ASSIGN_OR_RETURN(k.x, k.client->AllocBuffer(int64_t{kB} * kS * kH * kD * 4, "x"));
  return k;
}

// The daemons on `members` serve a new group `name` of kW ranks running `backend`, whose call
// completes on every rank: nothing of an earlier failure was left blocked or broken on the
// device.
void ExpectANewGroupServes(const std::vector<std::string>& members, const std::string& name,
                           const std::string& backend) {
  std::vector<absl::Status> next(kW);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kW; ++r)
    ranks.emplace_back([&, r] {
      absl::StatusOr<Rank> k = OpenRank(members, name, r, backend);
      next[r] = k.ok() ? k->session->ScatterHeads(k->x.Ref(), kB, kS).status() : k.status();
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kW; ++r) EXPECT_TRUE(next[r].ok()) << "rank " << r << ": " << next[r];
}

TEST_P(StreamBackends, AClientStreamThatNeverArrivesEndsInAnErrorAndBlocksNothing) {
  Start(kW, {"--call-timeout-ms", "2000"});
  uint64_t baseline[kW];
  for (int r = 0; r < kW; ++r) baseline[r] = State(r).device_bytes();
  std::vector<std::string> errors(kW);
  absl::Status late, waited;
  absl::Duration took;
  std::vector<std::thread> ranks;
  for (int r = 0; r < kW; ++r) {
    ranks.emplace_back([&, r] {
      auto fail = [&](const std::string& e) { errors[r] = e; };
      absl::StatusOr<Rank> k = OpenRank(Members(kW), "stall", r, backend_);
      if (!k.ok()) return fail(k.status().ToString());
      std::unique_ptr<client::Session>& s = k->session;
      client::Buffer& x = k->x;
      if (r == 1) {
        // Rank 1's stream is held past the call timeout: its ready word comes too late.
        cudaStream_t stream = nullptr;
        if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
          return fail("stream");
        Gate gate(stream);
        s->set_stream(stream);
        auto res = s->ScatterHeads(x.Ref(), kB, kS);
        if (!res.ok()) return fail(res.status().ToString());
        res->Release().IgnoreError();
        std::fprintf(stderr, "rank 1: call returned; holding the stream\n");
        std::this_thread::sleep_for(std::chrono::milliseconds(3500));
        gate.Open();
        // The daemon's cancel passed the stream's wait for done: it drains.
        if (cudaStreamSynchronize(stream) != cudaSuccess) return fail("sync");
        std::fprintf(stderr, "rank 1: stream drained\n");
        late = s->Synchronize();
        cudaStreamDestroy(stream);
      } else {
        const absl::Time t0 = absl::Now();
        waited = s->ScatterHeads(x.Ref(), kB, kS).status();
        took = absl::Now() - t0;
        std::fprintf(stderr, "rank 0: call ended: %s\n", waited.ToString().c_str());
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kW; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  EXPECT_FALSE(waited.ok());
  EXPECT_TRUE(waited.code() == absl::StatusCode::kAborted ||
              waited.code() == absl::StatusCode::kDeadlineExceeded)
      << waited;
  EXPECT_LT(took, absl::Seconds(10)) << "rank 0 waited " << took;
  EXPECT_TRUE(late.code() == absl::StatusCode::kDeadlineExceeded ||
              late.code() == absl::StatusCode::kAborted)
      << late;
  for (int r = 0; r < kW; ++r)
    EXPECT_TRUE(testing_util::Eventually([&] { return State(r).device_bytes() == baseline[r]; }))
        << "rank " << r << ": " << State(r).device_bytes() << " bytes, baseline " << baseline[r];
  // Nothing was left blocked or broken on the device.
  ExpectANewGroupServes(Members(kW), "after-stall", backend_);
}

// Ranks that issue different calls at one epoch (rank 1 with fewer tokens) fail that call
// well before the call timeout: each rank's daemon compares the peers' call signatures while
// its call is in flight, not only once it finished (on nccl the ranks' transfers then differ
// in size and may never finish). The daemons serve a new group afterwards.
TEST_P(StreamBackends, RanksThatCallDifferentlyAtOneEpochFailLongBeforeTheTimeout) {
  Start(kW, {"--call-timeout-ms", "60000"});
  std::vector<absl::Status> got(kW);
  std::vector<absl::Duration> took(kW);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kW; ++r)
    ranks.emplace_back([&, r] {
      absl::StatusOr<Rank> k = OpenRank(Members(kW), "mismatch", r, backend_);
      if (!k.ok()) {
        got[r] = absl::InternalError(StrCat("setup: ", k.status().ToString()));
        return;
      }
      const absl::Time t0 = absl::Now();
      got[r] = k->session->ScatterHeads(k->x.Ref(), kB, r == 0 ? kS : kS - 8).status();
      took[r] = absl::Now() - t0;
    });
  for (auto& t : ranks) t.join();
  int named = 0;
  for (int r = 0; r < kW; ++r) {
    EXPECT_TRUE(got[r].code() == absl::StatusCode::kInvalidArgument ||
                got[r].code() == absl::StatusCode::kAborted)
        << "rank " << r << ": " << got[r];
    EXPECT_LT(took[r], absl::Seconds(20)) << "rank " << r << " waited " << took[r];
    if (absl::StrContains(got[r].message(), "ranks issued different calls")) ++named;
  }
  EXPECT_GE(named, 1) << "no rank named the mismatch: " << got[0] << " / " << got[1];
  ExpectANewGroupServes(Members(kW), "after-mismatch", backend_);
}

// A peer that runs ahead never stores into a slot whose result is still held: rank 0 keeps
// its epoch 1 result while both ranks make epoch 2, and rank 1, which gives each result back
// before its next call, goes on to epoch 3, whose blocks for rank 0 go into the slot of that
// result. Rank 0 copies the result 300 ms later: still epoch 1's. Rank 1's epoch 3 completes
// once rank 0 gave it back and made the call. Every result is checked.
TEST_P(StreamBackends, APeerAheadNeverStoresIntoAHeldResultsSlot) {
  Start(kW);
  constexpr int kCalls = 3;
  const int64_t elems = int64_t{kB} * kS * kH * kD;  // input and result alike
  std::vector<std::string> errors(kW);
  std::vector<std::vector<std::vector<float>>> got(kW);
  std::atomic<bool> third_submitted{false};
  std::vector<std::thread> ranks;
  for (int r = 0; r < kW; ++r)
    ranks.emplace_back([&, r] {
      auto fail = [&](const std::string& e) {
        errors[r] = e;
        if (r == 1) third_submitted.store(true);  // rank 0 waits for nothing more
      };
      absl::StatusOr<Rank> k = OpenRank(Members(kW), "ahead", r, backend_);
      if (!k.ok()) return fail(k.status().ToString());
      cudaStream_t stream = nullptr;
      if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
        return fail("stream");
      k->session->set_stream(stream);
      float* in = nullptr;
      float* out = nullptr;
      if (cudaMallocHost(reinterpret_cast<void**>(&in), elems * 4 * kCalls) != cudaSuccess ||
          cudaMallocHost(reinterpret_cast<void**>(&out), elems * 4 * kCalls) != cudaSuccess)
        return fail("pinned memory");
      FillInputs(in, r, kCalls);
      // Call `it`: its input written on the stream first.
      auto call = [&](int it) {
        cudaMemcpyAsync(k->x.data, in + it * elems, elems * 4, cudaMemcpyHostToDevice, stream);
        return k->session->ScatterHeads(k->x.Ref(), kB, kS);
      };
      auto read = [&](client::Result& res, int it) {
        cudaMemcpyAsync(out + it * elems, res.data, elems * 4, cudaMemcpyDeviceToHost, stream);
        return res.Release();
      };
      absl::StatusOr<client::Result> first = call(0);
      if (!first.ok()) return fail(first.status().ToString());
      if (r == 1 && !read(*first, 0).ok()) return fail("release 1");
      absl::StatusOr<client::Result> second = call(1);
      if (!second.ok()) return fail(second.status().ToString());
      if (!read(*second, 1).ok()) return fail("release 2");
      if (r == 1) {
        absl::StatusOr<client::Result> third = call(2);
        third_submitted.store(true);
        if (!third.ok()) return fail(third.status().ToString());
        if (!read(*third, 2).ok()) return fail("release 3");
      } else {
        while (!third_submitted.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        // Long enough for rank 1's epoch 3 to have stored into this slot, had it been granted.
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        if (!read(*first, 0).ok()) return fail("release 1");
        absl::StatusOr<client::Result> third = call(2);
        if (!third.ok()) return fail(third.status().ToString());
        if (!read(*third, 2).ok()) return fail("release 3");
      }
      if (cudaStreamSynchronize(stream) != cudaSuccess) return fail("sync");
      if (absl::Status st = k->session->Synchronize(); !st.ok()) return fail(st.ToString());
      for (int it = 0; it < kCalls; ++it)
        got[r].emplace_back(out + it * elems, out + (it + 1) * elems);
      cudaFreeHost(in);
      cudaFreeHost(out);
      cudaStreamDestroy(stream);
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kW; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  ExpectEveryScatter(got, kCalls);
}

// A call that times out says where its stream stood: its slot's words as the device holds
// them (read through the rescue stream) and where each peer stood at its epoch, in the error
// and in the flight recorder's record of the call; on nccl also the communicator's state.
// Rank 1 joins the session but never calls.
TEST_P(StreamBackends, ATimedOutCallReportsItsWordsAndWhereThePeersStood) {
  Start(kW, {"--call-timeout-ms", "1500"});
  std::atomic<bool> rank0_done{false};
  std::vector<std::string> errors(kW);
  absl::Status got;
  uint64_t session_id = 0;
  std::vector<std::thread> ranks;
  for (int r = 0; r < kW; ++r)
    ranks.emplace_back([&, r] {
      absl::StatusOr<Rank> k = OpenRank(Members(kW), "words", r, backend_);
      if (!k.ok()) errors[r] = k.status().ToString();
      if (r == 1) {
        while (k.ok() && !rank0_done.load())
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        return;
      }
      if (k.ok()) {
        session_id = k->session->id();
        got = k->session->ScatterHeads(k->x.Ref(), kB, kS).status();
      }
      rank0_done.store(true);
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kW; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  EXPECT_EQ(got.code(), absl::StatusCode::kDeadlineExceeded) << got;
  v1::ListRecentCallsResponse calls;
  grpc::ClientContext ctx;
  ASSERT_TRUE(Admin(0)->ListRecentCalls(&ctx, {}, &calls).ok());
  std::string recorded;
  for (const v1::CallRecord& c : calls.calls())
    if (c.session_id() == session_id && c.epoch() == 1) recorded = c.message();
  // The client's copy of the message is cut to the completion record's length; the
  // recorder keeps it whole.
  EXPECT_TRUE(absl::StrContains(got.message(), "did not finish within the call timeout")) << got;
  EXPECT_TRUE(absl::StrContains(recorded, "protocol words: rank 0 slot 0 epoch 1: ready "))
      << recorded;
  EXPECT_TRUE(absl::StrContains(recorded, ", done 0")) << recorded;
  EXPECT_TRUE(
      absl::StrContains(recorded, "; peers at epoch 1: rank 1 has not taken it, completed 0"))
      << recorded;
  EXPECT_TRUE(absl::StrContains(recorded, "; its stream on hardware queue ")) << recorded;
  // NCCL's state, whatever it is (its error, "aborted", or "no error" while the transfers wait
  // for rank 1's part).
  if (backend_ == "nccl") {
    EXPECT_TRUE(absl::StrContains(recorded, "; communicator: ")) << recorded;
  }
  std::fprintf(stderr, "rank 0's call: %s\n", recorded.c_str());
}

// A client's own daemon killed while the client's stream waits for a call's done word: the
// daemon can neither finish the call nor cancel it, so the client library writes the word past
// every epoch itself once the daemon's end of its socket closed. The stream drains, and the
// session's next call and Synchronize fail UNAVAILABLE. Rank 1 never calls, so rank 0's call
// waits for it until its daemon dies (the call timeout is far beyond the test).
TEST_P(StreamBackends, AStreamWaitingForACallWhoseDaemonDiedIsLetGo) {
  Start(kW, {"--call-timeout-ms", "120000"});
  std::atomic<bool> rank0_done{false};
  std::vector<std::string> errors(kW);
  bool drained = false;
  absl::Status next_call, synchronized;
  std::vector<std::thread> ranks;
  for (int r = 0; r < kW; ++r) {
    ranks.emplace_back([&, r] {
      // Rank 1 keeps its session open until rank 0 is through, on every path of rank 0.
      struct Through {
        std::atomic<bool>* flag;
        ~Through() {
          if (flag != nullptr) flag->store(true);
        }
      } through{r == 0 ? &rank0_done : nullptr};
      auto fail = [&](const std::string& e) { errors[r] = e; };
      absl::StatusOr<Rank> k = OpenRank(Members(kW), "orphan", r, backend_);
      if (!k.ok()) return fail(k.status().ToString());
      std::unique_ptr<client::Session>& s = k->session;
      client::Buffer& x = k->x;
      if (r == 1) {
        while (!rank0_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        return;
      }
      cudaStream_t stream = nullptr;
      if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
        return fail("stream");
      s->set_stream(stream);
      auto res = s->ScatterHeads(x.Ref(), kB, kS);
      if (!res.ok()) return fail(res.status().ToString());
      res->Release().IgnoreError();
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      if (cudaStreamQuery(stream) != cudaErrorNotReady) return fail("the call did not wait");
      daemons_[0].Kill();
      std::fprintf(stderr, "rank 0: daemon killed while the stream waits\n");
      // Bounded so that a stream that stays blocked fails the case instead of hanging it.
      const absl::Time give_up = absl::Now() + absl::Seconds(30);
      cudaError_t q;
      while ((q = cudaStreamQuery(stream)) == cudaErrorNotReady && absl::Now() < give_up)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      drained = q == cudaSuccess;
      std::fprintf(stderr, "rank 0: stream %s\n", drained ? "drained" : cudaGetErrorString(q));
      next_call = s->ScatterHeads(x.Ref(), kB, kS).status();
      synchronized = s->Synchronize();
      if (drained) cudaStreamDestroy(stream);
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kW; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  EXPECT_TRUE(drained) << "rank 0's stream still waits for its dead daemon";
  EXPECT_EQ(next_call.code(), absl::StatusCode::kUnavailable) << next_call;
  EXPECT_EQ(synchronized.code(), absl::StatusCode::kUnavailable) << synchronized;
}

INSTANTIATE_TEST_SUITE_P(Backends, StreamBackends,
#if ULYSSES_TEST_NCCL
                         testing::Values("nvlink", "nccl"),
#else
                         testing::Values("nvlink"),
#endif
                         [](const testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace ulysses
