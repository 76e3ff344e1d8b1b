// The qkv_norm_rope_exchange session on the host backend: real daemons, real clients (ring and
// RPC paths mixed in one group), every rank's head band checked against the fp32 step-by-step
// reference (projection + norm + RoPE of each source rank, then its block scattered), at
// atol = rtol = 1e-2 with one-ulp bf16 flips counted and printed; and the refusals, on every
// rank, before anything is written.
#include <cstring>
#include <iostream>
#include <thread>

#include "cluster_util.h"
#include "raw_client.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "qkv_test_util.h"
#include "ulysses/client/client.h"
#include "ulysses/common/session_layout.h"
#include "ulysses/common/strings.h"
#include "ulysses/kernels/qkv_norm_rope.h"
#include "ulysses/proto/fused_spec.h"
#include "ulysses/v1/admin.grpc.pb.h"
#include "ulysses/v1/control.grpc.pb.h"

namespace ulysses {
namespace {

using ::testing::HasSubstr;
using kernels::QkvNormRopeShape;
using kernels::testing::Bf16Diff;
using kernels::testing::CompareBf16;
using kernels::testing::QkvProblem;

constexpr int64_t kBatch = 2, kSeqLocal = 200;
constexpr int32_t kHeadDim = 16, kMaxPos = 512;
constexpr uint16_t kNan = 0xffff;  // what PoisonSlots leaves

// Byte offsets of the four weights inside one buffer, each 32-byte aligned.
struct WeightLayout {
  uint64_t w_qkv = 0, q_norm = 0, k_norm = 0, cos_sin = 0, total = 0;
  explicit WeightLayout(const QkvProblem& p) {
    auto next = [](uint64_t at, uint64_t bytes) { return AlignUp(at + bytes, 32); };
    q_norm = next(w_qkv, p.w_qkv.size() * 2);
    k_norm = next(q_norm, p.q_norm.size() * 2);
    cos_sin = next(k_norm, p.k_norm.size() * 2);
    total = next(cos_sin, p.cos_sin.size() * 4);
  }
};

// One rank's client, group, weights, inputs and session.
struct FusedRank {
  std::unique_ptr<client::Client> client;
  client::Group group;
  client::Buffer weights, x, positions, out;
  std::unique_ptr<client::Session> session;
  client::FusedSessionSpec spec;
};

class FusedCluster : public testing_util::ClusterTest {
 protected:
  QkvNormRopeShape Shape(int world, int heads) const {
    return QkvNormRopeShape{world, heads, kHeadDim, kMaxPos, kBatch, kSeqLocal};
  }

  // Connects rank r (rings on even ranks, RPC on odd ones), joins `group_name`, uploads the
  // problem's weights and rank r's inputs, and fills the spec (the session is not created).
  absl::Status SetUpRank(const QkvProblem& p, int r, QkvLayout layout, const std::string& name,
                         FusedRank* out) {
    const int world = p.shape.world;
    auto c = client::Client::Connect({Members(world)[r], name, absl::Seconds(10), r % 2 == 0});
    if (!c.ok()) return c.status();
    out->client = std::move(*c);
    ULY_ASSIGN_OR_RETURN(out->group, out->client->JoinGroup({name, world, r, Members(world),
                                                             "host", 20000}));
    const WeightLayout wl(p);
    ULY_ASSIGN_OR_RETURN(out->weights, out->client->AllocBuffer(wl.total, "weights"));
    auto* wb = static_cast<uint8_t*>(out->weights.data);
    std::memcpy(wb + wl.w_qkv, p.w_qkv.data(), p.w_qkv.size() * 2);
    std::memcpy(wb + wl.q_norm, p.q_norm.data(), p.q_norm.size() * 2);
    std::memcpy(wb + wl.k_norm, p.k_norm.data(), p.k_norm.size() * 2);
    std::memcpy(wb + wl.cos_sin, p.cos_sin.data(), p.cos_sin.size() * 4);
    ULY_ASSIGN_OR_RETURN(out->x, out->client->AllocBuffer(p.x[r].size() * 2, "x"));
    std::memcpy(out->x.data, p.x[r].data(), p.x[r].size() * 2);
    ULY_ASSIGN_OR_RETURN(out->positions,
                         out->client->AllocBuffer(p.positions[r].size() * 4, "positions"));
    std::memcpy(out->positions.data, p.positions[r].data(), p.positions[r].size() * 4);
    const int64_t hidden = kernels::QkvHidden(p.shape), dim = p.shape.head_dim;
    ULY_ASSIGN_OR_RETURN(out->out, out->client->AllocBuffer(
                                       3 * kernels::QkvPlaneElems(p.shape) * 2 + 64, "out"));
    client::FusedSessionSpec& s = out->spec;
    s.hidden = static_cast<int32_t>(hidden);
    s.num_heads = p.shape.heads;
    s.head_dim = p.shape.head_dim;
    s.layout = layout;
    s.max_tokens = kBatch * kSeqLocal;
    s.max_pos = kMaxPos;
    s.weights.w_qkv = out->weights.Tensor(DType::kBFloat16, {3 * hidden, hidden}, wl.w_qkv);
    s.weights.q_norm = out->weights.Tensor(DType::kBFloat16, {dim}, wl.q_norm);
    s.weights.k_norm = out->weights.Tensor(DType::kBFloat16, {dim}, wl.k_norm);
    s.weights.cos_sin = out->weights.Tensor(DType::kFloat32, {kMaxPos, dim}, wl.cos_sin);
    s.timeout_ms = 20000;
    return absl::OkStatus();
  }

  // Rank `dst`'s receive slot as the step-by-step reference fills it: every source's whole
  // local op (projection, then norm + RoPE), then its block for dst. NaN where nothing lands.
  static std::vector<uint16_t> Expected(const QkvProblem& p, QkvLayout layout, int dst) {
    const int64_t rows = kernels::QkvRows(p.shape), features = kernels::QkvFeatures(p.shape);
    std::vector<uint16_t> slot(static_cast<size_t>(3 * kernels::QkvPlaneElems(p.shape)), kNan);
    std::vector<uint16_t> qkv(static_cast<size_t>(rows * features));
    for (int src = 0; src < p.shape.world; ++src) {
      kernels::QkvNormRopeRef(p.shape, p.weights(), p.x[src].data(), p.positions[src].data(),
                              qkv.data());
      kernels::ScatterQkvBlockRef(p.shape, layout, qkv.data(), src, dst, slot.data());
    }
    return slot;
  }

  v1::SessionState AdminSession(int r, uint64_t id) {
    v1::GetSessionRequest req;
    req.set_session_id(id);
    v1::SessionState st;
    grpc::ClientContext ctx;
    const grpc::Status s = Admin(r)->GetSession(&ctx, req, &st);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return st;
  }
};

struct Case {
  int world;
  QkvLayout layout;
};

class FusedSemantics : public FusedCluster, public ::testing::WithParamInterface<Case> {};

TEST_P(FusedSemantics, EveryRankGetsItsHeadBandOfTheReference) {
  // Plain names, not a structured binding: the lambdas below capture them (clang 14, which
  // the sanitizer build uses, cannot capture a binding).
  const int world = GetParam().world;
  const QkvLayout layout = GetParam().layout;
  Start(world);
  const QkvProblem p = kernels::testing::MakeQkvProblem(Shape(world, 8), 77 + world);
  const int64_t plane = kernels::QkvPlaneElems(p.shape), hl = 8 / world;
  std::vector<std::string> errors(world);
  std::vector<uint64_t> session_ids(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto fail = [&](const std::string& e) { errors[r] = e; };
      FusedRank rank;
      if (absl::Status s = SetUpRank(p, r, layout, StrCat("fused", world), &rank); !s.ok())
        return fail(s.ToString());
      auto session = rank.client->CreateFusedSession(rank.group, rank.spec);
      if (!session.ok()) return fail(session.status().ToString());
      rank.session = std::move(*session);
      session_ids[r] = rank.session->id();
      if (!rank.session->PoisonSlots().ok()) return fail("poison");
      auto views = rank.session->QkvNormRopeExchange(rank.x.Ref(), rank.positions.Ref(), kBatch,
                                                     kSeqLocal);
      if (!views.ok()) return fail(views.status().ToString());
      const size_t nviews = layout == QkvLayout::kBshd ? 3 : 1;
      if (views->size() != nviews) return fail(StrCat(views->size(), " views"));
      const std::array<int64_t, 4> want_shape =
          layout == QkvLayout::kBshd
              ? std::array<int64_t, 4>{kBatch, world * kSeqLocal, hl, kHeadDim}
              : std::array<int64_t, 4>{kBatch, world * kSeqLocal, hl, 3 * kHeadDim};
      std::vector<uint16_t> got;
      for (const client::Result& v : *views) {
        if (v.shape != want_shape) return fail("shape");
        if (!v.held() || v.epoch != 1) return fail("view not held at epoch 1");
        const auto* d = static_cast<const uint16_t*>(v.data);
        got.insert(got.end(), d, d + v.bytes / 2);
      }
      if (static_cast<int64_t>(got.size()) != 3 * plane) return fail("result size");
      const std::vector<uint16_t> want = Expected(p, layout, r);
      const Bf16Diff diff = CompareBf16(got.data(), want.data(), 3 * plane);
      std::cout << "W=" << world << " " << QkvLayoutName(layout) << " rank " << r << ": " << diff
                << "\n";
      if (diff.mismatches != 0 || diff.flips > diff.elements / 100)
        return fail(StrCat("against the reference: ", diff.mismatches, " mismatches, ",
                           diff.flips, " flips"));
      // out=: the same bytes in the caller's buffer (at a 32-byte offset), the slot released
      // at once, and the views pointing into the copy.
      const uint64_t out_offset = 32;
      auto copied = rank.session->QkvNormRopeExchange(rank.x.Ref(), rank.positions.Ref(), kBatch,
                                                      kSeqLocal, rank.out.Ref(out_offset));
      if (!copied.ok()) return fail(copied.status().ToString());
      const auto* out_base = static_cast<const uint8_t*>(rank.out.data) + out_offset;
      if ((*copied)[0].data != out_base || (*copied)[0].held() || (*copied)[0].epoch != 2)
        return fail("out= views");
      if (std::memcmp(out_base, got.data(), got.size() * 2) != 0)
        return fail("out= differs from the slot result");
      // The held first result was not touched by the second call (it used the other slot).
      if (std::memcmp((*views)[0].data, got.data(), (*views)[0].bytes) != 0)
        return fail("the held result changed");
      auto described = rank.session->Describe();
      if (!described.ok() || described->find("reference") == std::string::npos)
        return fail("describe: " + (described.ok() ? *described : described.status().ToString()));
      const v1::SessionState st = AdminSession(r, rank.session->id());
      if (st.kind() != "qkv_norm_rope_exchange" ||
          st.info().kind() != v1::SESSION_KIND_QKV_NORM_ROPE_EXCHANGE ||
          st.info().fused().hidden() != rank.spec.hidden || st.calls() != 2 ||
          st.info().plan().empty())
        return fail("Admin.GetSession: " + st.ShortDebugString());
      for (client::Result& v : *views)
        if (!v.Release().ok()) return fail("release");
      // Two more calls, queued at once on the ranks with rings (the others call): the same
      // bytes as a view and in out=.
      std::vector<client::Result> queued_view, queued_out;
      std::memset(static_cast<uint8_t*>(rank.out.data) + out_offset, 0xff, got.size() * 2);
      if (r % 2 == 0) {
        auto e1 = rank.session->SubmitQkvNormRopeExchange(rank.x.Ref(), rank.positions.Ref(),
                                                          kBatch, kSeqLocal);
        auto e2 = rank.session->SubmitQkvNormRopeExchange(
            rank.x.Ref(), rank.positions.Ref(), kBatch, kSeqLocal, rank.out.Ref(out_offset));
        if (!e1.ok() || !e2.ok() || *e1 != 3 || *e2 != 4) return fail("submit");
        auto w1 = rank.session->WaitQkvNormRopeExchange(*e1);
        auto w2 = rank.session->WaitQkvNormRopeExchange(*e2);
        if (!w1.ok()) return fail(w1.status().ToString());
        if (!w2.ok()) return fail(w2.status().ToString());
        queued_view = std::move(*w1);
        queued_out = std::move(*w2);
      } else {
        auto c1 = rank.session->QkvNormRopeExchange(rank.x.Ref(), rank.positions.Ref(), kBatch,
                                                    kSeqLocal);
        auto c2 = rank.session->QkvNormRopeExchange(rank.x.Ref(), rank.positions.Ref(), kBatch,
                                                    kSeqLocal, rank.out.Ref(out_offset));
        if (!c1.ok() || !c2.ok()) return fail("the calls beside the queued ones");
        queued_view = std::move(*c1);
        queued_out = std::move(*c2);
      }
      if (queued_view.size() != nviews || queued_out.size() != nviews) return fail("views");
      if (!queued_view[0].held() || queued_view[0].epoch != 3 || queued_out[0].held() ||
          queued_out[0].data != out_base)
        return fail("queued views");
      for (size_t i = 0, at = 0; i < nviews; at += queued_view[i].bytes, ++i)
        if (std::memcmp(queued_view[i].data, got.data() + at / 2, queued_view[i].bytes) != 0 ||
            std::memcmp(queued_out[i].data, got.data() + at / 2, queued_out[i].bytes) != 0)
          return fail(StrCat("queued call: view ", i, " differs from the first result"));
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Ranks, FusedSemantics,
                         ::testing::Values(Case{1, QkvLayout::kBshd}, Case{1, QkvLayout::kFused},
                                           Case{2, QkvLayout::kBshd}, Case{2, QkvLayout::kFused},
                                           Case{4, QkvLayout::kBshd}, Case{4, QkvLayout::kFused}),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return StrCat("W", i.param.world, "_",
                                         QkvLayoutName(i.param.layout));
                         });

// Every rank passes the same bad argument: every rank gets the error naming it, and nothing
// is written (the held result of the one good call stays as it was, the epoch count goes on).
TEST_F(FusedCluster, BadArgumentsAreRefusedOnEveryRankAndWriteNothing) {
  constexpr int kWorld = 2;
  Start(kWorld);
  const QkvProblem p = kernels::testing::MakeQkvProblem(Shape(kWorld, 8), 5);
  std::vector<std::string> errors(kWorld);
  auto expect = [](const absl::Status& s, absl::StatusCode code, const std::string& what,
                   std::string* err) {
    if (s.code() != code || std::string(s.message()).find(what) == std::string::npos)
      *err += StrCat("[", what, ": got ", s.ToString(), "] ");
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      std::string& err = errors[r];
      FusedRank rank;
      if (absl::Status s = SetUpRank(p, r, QkvLayout::kBshd, "bad", &rank); !s.ok()) {
        err = s.ToString();
        return;
      }
      using Code = absl::StatusCode;
      // Session arguments, refused by the library before the rendezvous.
      client::FusedSessionSpec bad = rank.spec;
      bad.weights.w_qkv.offset_bytes += 16;
      expect(rank.client->CreateFusedSession(rank.group, bad).status(), Code::kInvalidArgument,
             "w_qkv: offset_bytes 16 is not 32-byte aligned", &err);
      bad = rank.spec;
      bad.weights.cos_sin.shape[1] = kHeadDim / 2;
      expect(rank.client->CreateFusedSession(rank.group, bad).status(), Code::kInvalidArgument,
             "cos_sin: shape is [512,8], must be [512,16]", &err);
      bad = rank.spec;
      bad.weights.q_norm.dtype = DType::kFloat32;
      expect(rank.client->CreateFusedSession(rank.group, bad).status(), Code::kInvalidArgument,
             "q_norm: dtype is float32", &err);
      bad = rank.spec;
      bad.num_heads = 7;
      bad.hidden = 7 * kHeadDim;
      bad.weights = {};
      expect(rank.client->CreateFusedSession(rank.group, bad).status(), Code::kInvalidArgument,
             "num_heads: H=7 must be divisible by world_size W=2", &err);

      auto session = rank.client->CreateFusedSession(rank.group, rank.spec);
      if (!session.ok()) {
        err += session.status().ToString();
        return;
      }
      rank.session = std::move(*session);
      auto first = rank.session->QkvNormRopeExchange(rank.x.Ref(), rank.positions.Ref(), kBatch,
                                                     kSeqLocal);
      if (!first.ok()) {
        err += first.status().ToString();
        return;
      }
      const std::vector<uint8_t> held(static_cast<const uint8_t*>((*first)[0].data),
                                      static_cast<const uint8_t*>((*first)[0].data) +
                                          3 * (*first)[0].bytes);
      client::Session& s = *rank.session;
      // Call arguments, refused by the library.
      expect(s.QkvNormRopeExchange(rank.x.Ref(), rank.positions.Ref(), kBatch, kSeqLocal + 1)
                 .status(),
             Code::kResourceExhausted, "capacity", &err);
      expect(s.QkvNormRopeExchange(rank.x.Ref(2), rank.positions.Ref(), kBatch, kSeqLocal)
                 .status(),
             Code::kInvalidArgument, "x: offset_bytes 2 is not 32-byte aligned", &err);
      expect(s.ScatterHeads(rank.x.Ref(), kBatch, kSeqLocal).status(), Code::kInvalidArgument,
             "op: scatter_heads is not an op of a qkv_norm_rope_exchange session", &err);
      expect(s.QkvNormRopeExchange(rank.out.Ref(), rank.positions.Ref(), kBatch, kSeqLocal,
                                   rank.out.Ref(64))
                 .status(),
             Code::kInvalidArgument, "out: overlaps input x", &err);
      auto* pos = static_cast<int32_t*>(rank.positions.data);
      const int32_t saved = pos[3];
      pos[3] = kMaxPos;
      expect(s.QkvNormRopeExchange(rank.x.Ref(), rank.positions.Ref(), kBatch, kSeqLocal)
                 .status(),
             Code::kInvalidArgument, "positions[3]: 512 is not in [0, max_pos=512)", &err);
      pos[3] = saved;
      // Nothing was written and no epoch was used: the next call is epoch 2, into slot 1.
      auto next = s.QkvNormRopeExchange(rank.x.Ref(), rank.positions.Ref(), kBatch, kSeqLocal);
      if (!next.ok() || (*next)[0].epoch != 2) err += "next call is not epoch 2; ";
      if (std::memcmp(held.data(), (*first)[0].data, held.size()) != 0)
        err += "the held result changed; ";
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// The daemon never trusts the client: a client that skips the library gets the same
// refusals from every rank's daemon, and nothing is created or written.
TEST_F(FusedCluster, DaemonRefusesBadWeightsPositionsAndCapacityItself) {
  constexpr int kWorld = 2;
  Start(kWorld);
  const QkvProblem p = kernels::testing::MakeQkvProblem(Shape(kWorld, 8), 9);
  const WeightLayout wl(p);
  const int64_t hidden = kernels::QkvHidden(p.shape), rows = kBatch * kSeqLocal;
  std::vector<std::string> errors(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      std::string& err = errors[r];
      const std::string socket = Members(kWorld)[r];
      testing_util::RawClient raw;
      if (absl::Status s = raw.Connect(socket); !s.ok()) {
        err = s.ToString();
        return;
      }
      ipc::Mapping wmap, xmap, pmap;
      const uint64_t wbuf = raw.Alloc(wl.total, &wmap);
      const uint64_t xbuf = raw.Alloc(p.x[r].size() * 2, &xmap);
      const uint64_t pbuf = raw.Alloc(p.positions[r].size() * 4, &pmap);
      std::memcpy(xmap.data(), p.x[r].data(), p.x[r].size() * 2);
      std::memcpy(pmap.data(), p.positions[r].data(), p.positions[r].size() * 4);
      v1::JoinGroupRequest j;
      j.set_name("raw-fused");
      j.set_world_size(kWorld);
      j.set_rank(r);
      for (const auto& m : Members(kWorld)) j.add_members(m);
      j.set_timeout_ms(20000);
      v1::GroupInfo group;
      {
        grpc::ClientContext ctx;
        raw.Prepare(&ctx);
        if (!raw.stub->JoinGroup(&ctx, j, &group).ok()) {
          err = "join";
          return;
        }
      }
      FusedSessionArgs args;
      args.geometry.hidden = static_cast<int32_t>(hidden);
      args.geometry.num_heads = 8;
      args.geometry.head_dim = kHeadDim;
      args.geometry.layout = QkvLayout::kFused;
      args.geometry.max_tokens = rows;
      args.geometry.max_pos = kMaxPos;
      args.weights.w_qkv = {wbuf, wl.w_qkv, DType::kBFloat16, {3 * hidden, hidden}, 2};
      args.weights.q_norm = {wbuf, wl.q_norm, DType::kBFloat16, {kHeadDim}, 1};
      args.weights.k_norm = {wbuf, wl.k_norm, DType::kBFloat16, {kHeadDim}, 1};
      args.weights.cos_sin = {wbuf, wl.cos_sin, DType::kFloat32, {kMaxPos, kHeadDim}, 2};
      auto create = [&](const FusedSessionArgs& a, v1::SessionInfo* info) {
        v1::CreateSessionRequest req;
        req.set_group_id(group.group_id());
        req.set_kind(v1::SESSION_KIND_QKV_NORM_ROPE_EXCHANGE);
        req.set_timeout_ms(20000);
        FusedSessionToProto(a, req.mutable_fused());
        grpc::ClientContext ctx;
        raw.Prepare(&ctx);
        return raw.stub->CreateSession(&ctx, req, info);
      };
      auto expect = [&](const grpc::Status& s, grpc::StatusCode code, const std::string& what) {
        if (s.error_code() != code || s.error_message().find(what) == std::string::npos)
          err += StrCat("[", what, ": got ", s.error_code(), " ", s.error_message(), "] ");
      };
      v1::SessionInfo info;
      FusedSessionArgs bad = args;
      bad.weights.k_norm.offset_bytes += 8;
      expect(create(bad, &info), grpc::StatusCode::INVALID_ARGUMENT,
             "k_norm: offset_bytes 98344 is not 32-byte aligned");
      bad = args;
      bad.weights.w_qkv.shape[0] = hidden;
      expect(create(bad, &info), grpc::StatusCode::INVALID_ARGUMENT,
             "w_qkv: shape is [128,128], must be [384,128]");
      bad = args;
      bad.geometry.num_heads = 7;
      expect(create(bad, &info), grpc::StatusCode::INVALID_ARGUMENT,
             "num_heads: H=7 must be divisible by world_size W=2");
      if (NumSessions(r) != 0) err += "a refused session exists; ";
      if (grpc::Status s = create(args, &info); !s.ok()) {
        err += "create: " + s.error_message();
        return;
      }
      auto frame = ipc::RecvMessage(raw.fd_socket.get());  // the session segment's fd
      if (!frame.ok()) err += "no session frame; ";
      auto call = [&](int64_t seq, v1::CallResponse* resp) {
        v1::CallRequest c;
        c.set_session_id(info.session_id());
        c.set_op(v1::OP_KIND_QKV_NORM_ROPE_EXCHANGE);
        c.set_batch(kBatch);
        c.set_seq(seq);
        c.add_inputs()->set_buffer_id(xbuf);
        c.add_inputs()->set_buffer_id(pbuf);
        grpc::ClientContext ctx;
        raw.Prepare(&ctx);
        return raw.stub->Call(&ctx, c, resp);
      };
      v1::CallResponse resp;
      auto* pos = static_cast<int32_t*>(pmap.data());
      pos[rows - 1] = -1;
      expect(call(kSeqLocal, &resp), grpc::StatusCode::INVALID_ARGUMENT,
             StrCat("positions[", rows - 1, "]: -1 is not in [0, max_pos=512)"));
      pos[rows - 1] = p.positions[r][rows - 1];
      expect(call(kSeqLocal + 1, &resp), grpc::StatusCode::RESOURCE_EXHAUSTED, "capacity");
      // Nothing was consumed: the first good call is epoch 1 on both ranks.
      if (grpc::Status s = call(kSeqLocal, &resp); !s.ok() || resp.epoch() != 1)
        err += StrCat("good call: ", s.error_message(), " epoch ", resp.epoch());
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Ranks that issue different calls at one epoch fail instead of mixing data.
// LastOutputs gives the views the last call returned, sharing its hold: while a view still
// holds the slot, and always for a call copied into out; refused before any call and once the
// result was given back.
TEST_F(FusedCluster, LastOutputsGivesTheLastCallsViewsWhileTheyAreHeld) {
  constexpr int kWorld = 2;
  Start(kWorld);
  const QkvProblem p = kernels::testing::MakeQkvProblem(Shape(kWorld, 8), 21);
  std::vector<std::string> errors(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      auto fail = [&](const std::string& e) { errors[r] = e; };
      FusedRank rank;
      if (absl::Status s = SetUpRank(p, r, QkvLayout::kBshd, "last", &rank); !s.ok())
        return fail(s.ToString());
      auto session = rank.client->CreateFusedSession(rank.group, rank.spec);
      if (!session.ok()) return fail(session.status().ToString());
      client::Session& sess = **session;
      if (auto none = sess.LastOutputs();
          none.status().code() != absl::StatusCode::kFailedPrecondition)
        return fail(StrCat("before any call: ", none.status().ToString()));
      auto views = sess.QkvNormRopeExchange(rank.x.Ref(), rank.positions.Ref(), kBatch, kSeqLocal);
      if (!views.ok() || views->size() != 3) return fail("call 1");
      const uint64_t epoch = (*views)[0].epoch;
      auto last = sess.LastOutputs();
      if (!last.ok() || last->size() != 3) return fail(StrCat("call 1: ", last.status().ToString()));
      for (int i = 0; i < 3; ++i) {
        const client::Result& a = (*views)[i];
        const client::Result& b = (*last)[i];
        if (b.epoch != epoch || b.data != a.data || b.bytes != a.bytes || b.shape != a.shape ||
            !b.held())
          return fail(StrCat("view ", i, " differs from the call's"));
      }
      // The bytes are the call's result.
      const std::vector<uint16_t> want = Expected(p, QkvLayout::kBshd, r);
      if (std::memcmp((*last)[0].data, want.data(), want.size() * 2) != 0)
        return fail("LastOutputs' views do not read the call's result");
      // The call's own views dropped, the copies LastOutputs gave still hold the slot.
      views->clear();
      if (!sess.LastOutputs().ok()) return fail("copies dropped the hold");
      // Released through any copy: given back for all, and refused from now on.
      if (!(*last)[1].Release().ok()) return fail("release");
      auto gone = sess.LastOutputs();
      if (gone.status().code() != absl::StatusCode::kFailedPrecondition ||
          gone.status().message().find(StrCat("epoch ", epoch, " was given back")) ==
              std::string::npos)
        return fail(StrCat("after release: ", gone.status().ToString()));
      last->clear();
      // A call copied into out: the views point into out and hold nothing.
      auto copied = sess.QkvNormRopeExchange(rank.x.Ref(), rank.positions.Ref(), kBatch,
                                             kSeqLocal, rank.out.Ref());
      if (!copied.ok()) return fail(copied.status().ToString());
      copied->clear();
      auto into_out = sess.LastOutputs();
      if (!into_out.ok() || into_out->size() != 3 || (*into_out)[0].data != rank.out.data ||
          (*into_out)[0].held())
        return fail("out=: " + into_out.status().ToString());
      if (std::memcmp(rank.out.data, want.data(), want.size() * 2) != 0)
        return fail("out= holds another result");
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST_F(FusedCluster, RanksIssuingDifferentCallsFail) {
  constexpr int kWorld = 2;
  Start(kWorld, {"--call-timeout-ms", "5000"});
  const QkvProblem p = kernels::testing::MakeQkvProblem(Shape(kWorld, 8), 11);
  std::vector<absl::Status> results(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      FusedRank rank;
      if (absl::Status s = SetUpRank(p, r, QkvLayout::kBshd, "differ", &rank); !s.ok()) {
        results[r] = s;
        return;
      }
      auto session = rank.client->CreateFusedSession(rank.group, rank.spec);
      if (!session.ok()) {
        results[r] = session.status();
        return;
      }
      // Rank 1 passes half the sequence.
      results[r] = (*session)
                       ->QkvNormRopeExchange(rank.x.Ref(), rank.positions.Ref(), kBatch,
                                             r == 0 ? kSeqLocal : kSeqLocal / 2)
                       .status();
    });
  }
  for (auto& t : threads) t.join();
  int differ = 0;
  for (const absl::Status& s : results) {
    EXPECT_TRUE(s.code() == absl::StatusCode::kInvalidArgument ||
                s.code() == absl::StatusCode::kAborted)
        << s;
    if (s.code() == absl::StatusCode::kInvalidArgument) {
      EXPECT_THAT(std::string(s.message()), HasSubstr("ranks issued different calls"));
      ++differ;
    }
  }
  EXPECT_GE(differ, 1);
}

}  // namespace
}  // namespace ulysses
