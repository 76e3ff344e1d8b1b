// The shared-memory call path against a real daemon: many clients with random calls, and a
// client that forges descriptors or corrupts its ring.
#include <cstring>
#include <random>
#include <thread>

#include "cluster_util.h"
#include "raw_client.h"
#include "demo_lib.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "ulysses/client/client.h"
#include "ulysses/common/session_layout.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/client_segment.h"
#include "ulysses/ipc/shm.h"
#include "ulysses/ipc/unix_socket.h"
#include "ulysses/kernels/reference.h"
#include "ulysses/v1/admin.grpc.pb.h"
#include "ulysses/v1/control.grpc.pb.h"

namespace ulysses {
namespace {

using ::testing::HasSubstr;

class RingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = demo::MakeRunDir();
    ASSERT_TRUE(dir.ok());
    dir_ = *dir;
    auto d = demo::StartDaemon(ULYSSESD_PATH, dir_, 0, "host", {"--call-timeout-ms", "2000"});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = std::move(*d);
  }
  void TearDown() override {
    daemon_ = demo::DaemonProcess();
    demo::RemoveRunDir(dir_);
  }
  int NumClients() {
    auto stub = testing_util::AdminStub(daemon_.socket());
    v1::ListClientsResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(stub->ListClients(&ctx, {}, &resp).ok());
    return resp.clients_size();
  }
  std::string dir_;
  demo::DaemonProcess daemon_;
};

// Expected result of one call with W=1, from the CPU references.
std::vector<uint8_t> Expected(const CallArgs& a, int32_t H, int32_t D, int32_t es,
                              const uint8_t* base, std::vector<uint8_t>* merged_out) {
  kernels::ExchangeShape sh{1, a.batch, a.seq, H, D, es};
  auto view = [&](const OperandRef& r) {
    return kernels::ContiguousConstView(base + r.offset_bytes, a.seq, H, D);
  };
  switch (a.op) {
    case OpKind::kScatterHeads: return (*kernels::ScatterHeadsRef(sh, {view(a.inputs[0])}))[0];
    case OpKind::kGatherHeads: return (*kernels::GatherHeadsRef(sh, {view(a.inputs[0])}))[0];
    case OpKind::kScatterQkvHeadChunk:
      return (*kernels::ScatterQkvHeadChunkRef(sh, {view(a.inputs[0])}, {view(a.inputs[1])},
                                               {view(a.inputs[2])}, a.head_offset, a.head_count))[0];
    case OpKind::kGatherOutputHeadChunk: {
      auto x = kernels::ContiguousConstView(base + a.inputs[0].offset_bytes, a.seq, a.head_count, D);
      auto out = kernels::ContiguousMutView(merged_out->data(), a.seq, H, D);
      EXPECT_TRUE(kernels::GatherOutputHeadChunkRef(sh, {x}, a.head_offset, a.head_count, {out}).ok());
      return *merged_out;
    }
    default: return {};
  }
}

TEST_F(RingTest, FourClientsRandomCallsNoneLostDuplicatedOrMisrouted) {
  constexpr int kClients = 4, kCalls = 10000;
  constexpr int32_t H = 8, D = 8, es = 2;
  constexpr int64_t kMaxTokens = 16;
  constexpr uint64_t kTensor = kMaxTokens * H * D * es;
  std::vector<std::string> errors(kClients);
  std::vector<int64_t> done(kClients, 0);
  std::vector<std::thread> threads;
  for (int ci = 0; ci < kClients; ++ci) {
    threads.emplace_back([&, ci] {
      auto fail = [&](const std::string& e) { errors[ci] = e; };
      auto c = client::Client::Connect({daemon_.socket(), StrCat("stress-", ci)});
      if (!c.ok()) return fail(c.status().ToString());
      if (!(*c)->uses_rings()) return fail("no rings");
      auto g = (*c)->JoinGroup({StrCat("stress-", ci), 1, 0, {daemon_.socket()}, "auto", 0});
      if (!g.ok()) return fail(g.status().ToString());
      auto s = (*c)->CreateSession(*g, {H, D, DType::kBFloat16, kMaxTokens, 2, {}, 0});
      if (!s.ok()) return fail(s.status().ToString());
      // One buffer with four tensors (inputs) and one output region.
      auto buf = (*c)->AllocBuffer(5 * kTensor);
      if (!buf.ok()) return fail(buf.status().ToString());
      auto* base = static_cast<uint8_t*>(buf->data);
      std::mt19937_64 rng(1234 + ci);
      for (uint64_t i = 0; i < 4 * kTensor; ++i) base[i] = static_cast<uint8_t>(rng());
      std::vector<uint8_t> merged(kMaxTokens * H * D * es, 0);
      for (int n = 0; n < kCalls; ++n) {
        CallArgs a;
        a.op = static_cast<OpKind>(1 + rng() % 4);
        a.batch = 1;
        a.seq = 1 + static_cast<int64_t>(rng() % kMaxTokens);
        for (int i = 0; i < 3; ++i) a.inputs[i] = buf->Ref(i * kTensor);
        if (a.op == OpKind::kScatterHeads || a.op == OpKind::kGatherHeads) {
          a.inputs[1] = a.inputs[2] = OperandRef{};
        }
        if (a.op == OpKind::kScatterQkvHeadChunk || a.op == OpKind::kGatherOutputHeadChunk) {
          a.head_offset = static_cast<int32_t>(rng() % H);
          a.head_count = 1 + static_cast<int32_t>(rng() % (H - a.head_offset));
        }
        if (a.op == OpKind::kGatherOutputHeadChunk) {
          a.inputs[1] = a.inputs[2] = OperandRef{};
          a.out = buf->Ref(4 * kTensor);
          // The merge writes into out: start it from a known state on both sides.
          std::memcpy(base + 4 * kTensor, merged.data(), a.seq * H * D * es);
        }
        // Each call writes one input's first element with the call number so that a result
        // routed from another call (or client) cannot match.
        const uint16_t stamp = static_cast<uint16_t>(n * 4 + ci);
        std::memcpy(base, &stamp, 2);
        std::vector<uint8_t> want = Expected(a, H, D, es, base, &merged);
        auto r = (*s)->Call(a);
        if (!r.ok()) return fail(StrCat("call ", n, ": ", r.status().ToString()));
        const uint8_t* got = a.op == OpKind::kGatherOutputHeadChunk
                                 ? base + 4 * kTensor
                                 : static_cast<const uint8_t*>(r->data);
        const size_t bytes = a.op == OpKind::kGatherOutputHeadChunk ? a.seq * H * D * es : want.size();
        if (r->epoch != static_cast<uint64_t>(n + 1))
          return fail(StrCat("call ", n, ": epoch ", r->epoch));
        if (std::memcmp(got, want.data(), bytes) != 0)
          return fail(StrCat("call ", n, " (", OpName(a.op), "): result differs from the reference"));
        ++done[ci];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int ci = 0; ci < kClients; ++ci) {
    EXPECT_EQ(errors[ci], "") << "client " << ci;
    EXPECT_EQ(done[ci], kCalls) << "client " << ci;
  }
}

// After the first call of each op and row count, the ring path allocates no host memory: the
// daemon's count of its call path's allocations stays put over hundreds of calls of those ops
// and row counts, successful and bit-exact.
// Every op at W = 1 at three row counts per pass, each result checked against the CPU
// reference, through a client on the rings (`rings`) or on the Control.Call RPC; returns the
// daemon's state before the first pass and after the first and the last. Skips where the daemon
// build does not count its allocations.
struct AllocationCounts {
  v1::DaemonState before, warm, after;
  int calls_after_warm = 0;
};
void CountOpsPasses(const std::string& socket, bool rings, int rounds, AllocationCounts* counts) {
  auto stub = testing_util::AdminStub(socket);
  auto state = [&] {
    v1::DaemonState st;
    grpc::ClientContext ctx;
    EXPECT_TRUE(stub->GetState(&ctx, {}, &st).ok());
    return st;
  };
  if (!state().host_allocations_counted())
    GTEST_SKIP() << "this daemon build does not count its allocations (a sanitizer build)";
  constexpr int32_t H = 4, D = 16, es = 2;
  constexpr int64_t kMaxTokens = 32;
  constexpr uint64_t kTensor = kMaxTokens * H * D * es;
  client::ConnectOptions options{socket, "steady"};
  options.use_rings = rings;
  auto c = client::Client::Connect(options);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ((*c)->uses_rings(), rings);
  auto g = (*c)->JoinGroup({"steady", 1, 0, {socket}, "auto", 0});
  ASSERT_TRUE(g.ok()) << g.status();
  auto s = (*c)->CreateSession(*g, {H, D, DType::kBFloat16, kMaxTokens, 2, {}, 0});
  ASSERT_TRUE(s.ok()) << s.status();
  auto buf = (*c)->AllocBuffer(5 * kTensor);
  ASSERT_TRUE(buf.ok()) << buf.status();
  auto* base = static_cast<uint8_t*>(buf->data);
  std::mt19937_64 rng(7);
  for (uint64_t i = 0; i < 4 * kTensor; ++i) base[i] = static_cast<uint8_t>(rng());
  std::vector<uint8_t> merged(kTensor, 0);
  const int64_t rows[] = {1, 7, kMaxTokens};
  int calls = 0;
  // One pass: every op at every row count, each result checked against the CPU reference.
  auto pass = [&](int round) {
    for (int op = 1; op <= 4; ++op)
      for (int64_t seq : rows) {
        CallArgs a;
        a.op = static_cast<OpKind>(op);
        a.batch = 1;
        a.seq = seq;
        a.inputs[0] = buf->Ref(0);
        if (a.op == OpKind::kScatterQkvHeadChunk) {
          a.inputs[1] = buf->Ref(kTensor);
          a.inputs[2] = buf->Ref(2 * kTensor);
        }
        if (a.op == OpKind::kScatterQkvHeadChunk || a.op == OpKind::kGatherOutputHeadChunk) {
          a.head_offset = 1;
          a.head_count = 2;
        }
        if (a.op == OpKind::kGatherOutputHeadChunk) {
          a.out = buf->Ref(4 * kTensor);
          std::memcpy(base + 4 * kTensor, merged.data(), seq * H * D * es);
        }
        std::vector<uint8_t> want = Expected(a, H, D, es, base, &merged);
        auto r = (*s)->Call(a);
        ++calls;
        ASSERT_TRUE(r.ok()) << "round " << round << " " << OpName(a.op) << ": " << r.status();
        const bool merge = a.op == OpKind::kGatherOutputHeadChunk;
        const uint8_t* got = merge ? base + 4 * kTensor : static_cast<const uint8_t*>(r->data);
        ASSERT_EQ(std::memcmp(got, want.data(), merge ? seq * H * D * es : want.size()), 0)
            << "round " << round << " " << OpName(a.op) << " seq " << seq;
      }
  };
  counts->before = state();
  ASSERT_NO_FATAL_FAILURE(pass(0));
  counts->warm = state();
  calls = 0;
  for (int round = 1; round <= rounds; ++round) ASSERT_NO_FATAL_FAILURE(pass(round));
  counts->after = state();
  counts->calls_after_warm = calls;
}

TEST_F(RingTest, PreparedCallsAllocateNoHostMemory) {
  AllocationCounts n;
  ASSERT_NO_FATAL_FAILURE(CountOpsPasses(daemon_.socket(), /*rings=*/true, 25, &n));
  if (IsSkipped()) return;
  EXPECT_EQ(n.after.call_path_host_allocations(), n.warm.call_path_host_allocations())
      << n.calls_after_warm << " calls of ops and row counts already seen allocated host memory";
  EXPECT_EQ(n.after.grpc_call_host_allocations(), n.before.grpc_call_host_allocations())
      << "ring calls were counted as Control.Call's";
}

// The Control.Call path: per call, the handler allocates only what gRPC makes for it: the map
// of the request's metadata, built when the handler reads the client's id and token (one node
// per item; the client library sends three), and the response's shape field (gRPC makes a new
// response per call). Anything the daemon's own code allocated per call would show here.
TEST_F(RingTest, CallsOverGrpcAllocateOnlyWhatGrpcMakesPerCall) {
  constexpr uint64_t kGrpcOwnedPerCall = 4;
  AllocationCounts n;
  ASSERT_NO_FATAL_FAILURE(CountOpsPasses(daemon_.socket(), /*rings=*/false, 10, &n));
  if (IsSkipped()) return;
  ASSERT_EQ(n.calls_after_warm, 120);
  const uint64_t counted =
      n.after.grpc_call_host_allocations() - n.warm.grpc_call_host_allocations();
  EXPECT_GT(counted, 0u) << "Control.Call's handler is not counted";
  EXPECT_LE(counted, kGrpcOwnedPerCall * n.calls_after_warm)
      << counted << " allocations in " << n.calls_after_warm << " calls";
  EXPECT_EQ(n.after.call_path_host_allocations(), n.before.call_path_host_allocations())
      << "Control.Call's allocations were counted as the ring path's";
}

using testing_util::RawClient;

ipc::CallDescriptor Scatter(uint64_t session, uint64_t epoch, uint64_t buffer, uint64_t offset) {
  ipc::CallDescriptor d{};
  d.session_id = session;
  d.epoch = epoch;
  d.op = static_cast<uint32_t>(OpKind::kScatterHeads);
  d.num_inputs = 1;
  d.batch = 1;
  d.seq = 16;
  d.inputs[0].buffer_id = buffer;
  d.inputs[0].offset_bytes = offset;
  return d;
}

const SessionControlBlock* Control(const ipc::Mapping& seg) {
  return static_cast<const SessionControlBlock*>(seg.data());
}

bool SlotPoisoned(const ipc::Mapping& seg, int slot) {
  const auto* cb = Control(seg);
  const auto* data = static_cast<const uint8_t*>(seg.data()) + cb->slots_offset_bytes +
                     cb->slot_stride_bytes * slot;
  for (uint64_t i = 0; i < 16 * 4 * 8 * 4; ++i)
    if (data[i] != 0xff) return false;
  return true;
}

TEST_F(RingTest, ForgedDescriptorsAreRefusedWithTheRightCodeAndWriteNothing) {
  RawClient a, b;
  ASSERT_TRUE(a.Connect(daemon_.socket()).ok());
  ASSERT_TRUE(b.Connect(daemon_.socket()).ok());
  ipc::Mapping xa, xb;
  const uint64_t bytes = 16 * 4 * 8 * 4;
  const uint64_t buf_a = a.Alloc(bytes, &xa);
  const uint64_t buf_b = b.Alloc(bytes, &xb);

  // A good descriptor works, and its words are set.
  ipc::Mapping seg1;
  const uint64_t s1 = a.Session(daemon_.socket(), &seg1);
  ipc::Completion c = a.Roundtrip(Scatter(s1, 1, buf_a, 0));
  EXPECT_EQ(c.code, 0) << c.message;
  EXPECT_EQ(Control(seg1)->slots[0].done.load(), 1u);

  // Epoch replay: refused, nothing touched, the session goes on.
  c = a.Roundtrip(Scatter(s1, 1, buf_a, 0));
  EXPECT_EQ(c.code, static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(c.message, HasSubstr("replayed"));
  EXPECT_EQ(c.next_epoch, 2u);
  EXPECT_TRUE(SlotPoisoned(seg1, 1));
  c = a.Roundtrip(Scatter(s1, 2, buf_a, 0));
  EXPECT_EQ(c.code, 0) << c.message;

  // Another client's buffer: PERMISSION_DENIED; the epoch completes with its error word set
  // (no waiter hangs), the slot is not written, and the session is broken.
  ipc::Mapping seg2;
  const uint64_t s2 = a.Session(daemon_.socket(), &seg2);
  c = a.Roundtrip(Scatter(s2, 1, buf_b, 0));
  EXPECT_EQ(c.code, static_cast<int>(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(c.message, HasSubstr("belongs to another client"));
  EXPECT_EQ(Control(seg2)->slots[0].done.load(), 1u);
  EXPECT_EQ(Control(seg2)->slots[0].error.load(), 1u);
  EXPECT_TRUE(SlotPoisoned(seg2, 0));
  c = a.Roundtrip(Scatter(s2, 2, buf_a, 0));
  EXPECT_EQ(c.code, static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(c.message, HasSubstr("broken"));

  // A buffer id nobody has, and an offset past the end: INVALID_ARGUMENT naming the operand.
  ipc::Mapping seg3;
  const uint64_t s3 = a.Session(daemon_.socket(), &seg3);
  c = a.Roundtrip(Scatter(s3, 1, 987654321, 0));
  EXPECT_EQ(c.code, static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(c.message, HasSubstr("not registered"));
  EXPECT_TRUE(SlotPoisoned(seg3, 0));
  ipc::Mapping seg4;
  const uint64_t s4 = a.Session(daemon_.socket(), &seg4);
  c = a.Roundtrip(Scatter(s4, 1, buf_a, 64));
  EXPECT_EQ(c.code, static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(c.message, HasSubstr("x: bytes"));
  EXPECT_TRUE(SlotPoisoned(seg4, 0));

  // Another client's session: PERMISSION_DENIED, and b's session is untouched.
  ipc::Mapping segb;
  const uint64_t sb = b.Session(daemon_.socket(), &segb);
  c = a.Roundtrip(Scatter(sb, 1, buf_a, 0));
  EXPECT_EQ(c.code, static_cast<int>(absl::StatusCode::kPermissionDenied));
  EXPECT_EQ(Control(segb)->slots[0].done.load(), 0u);
  EXPECT_EQ(Control(segb)->slots[0].open.load(), 0u);
  EXPECT_TRUE(SlotPoisoned(segb, 0));
  c = b.Roundtrip(Scatter(sb, 1, buf_b, 0));
  EXPECT_EQ(c.code, 0) << c.message;
}

TEST_F(RingTest, CorruptedRingPositionsDropTheClientNotTheDaemon) {
  RawClient a;
  ASSERT_TRUE(a.Connect(daemon_.socket()).ok());
  ASSERT_EQ(NumClients(), 1);
  // Forge the producer position far past the consumer's: the daemon refuses to read it.
  a.submit->tail.store(a.submit->head.load() + 5 * ipc::kRingCapacity);
  ASSERT_TRUE(a.submit_bell.Signal().ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (a.header->abort.load() == 0 && absl::Now() < deadline) {
  }
  EXPECT_NE(a.header->abort.load(), 0u);
  // The daemon still serves others.
  auto c = client::Client::Connect({daemon_.socket(), "after"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->uses_rings());
}

}  // namespace
}  // namespace ulysses
