// The gRPC services. Each handler authenticates, converts the request, calls into the daemon
// and converts absl::Status to grpc::Status at the edge. The calls that wait on others
// (Control.Watch, JoinGroup, CreateSession, Peer.Rendezvous) are reactors of gRPC's callback
// API, which hold no thread while they wait; the other unary calls of Control and Admin are
// synchronous, each bounded (docs/architecture.md section 2.7).
#include <unistd.h>

#include <future>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "daemon.h"
#include "host_allocations.h"
#include "pages.h"
#include "requests.h"
#include "ulysses/common/sockets.h"
#include "ulysses/ipc/cuda_memory.h"
#include "nlohmann/json.hpp"
#include "ulysses/common/backend_choice.h"
#include "ulysses/common/failpoint.h"
#include "ulysses/common/happens_before.h"
#include "ulysses/common/logging.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/shm.h"
#include "ulysses/proto/fused_spec.h"
#include "ulysses/proto/grpc_status.h"
#include "ulysses/v1/admin.grpc.pb.h"
#include "ulysses/v1/control.grpc.pb.h"
#include "ulysses/v1/peer.grpc.pb.h"

namespace ulysses::daemon {
namespace {

void FillGroupInfo(const Group& g, v1::GroupInfo* out) {
  out->set_group_id(g.id);
  out->set_name(g.name);
  out->set_world_size(g.world_size);
  out->set_rank(g.rank);
  out->set_backend(g.backend);
  out->set_backend_reason(g.backend_reason);
  for (const auto& m : g.members) out->add_members(m);
}

void FillSpec(const SessionGeometry& g, v1::SessionSpec* spec) {
  spec->set_num_heads(g.num_heads);
  spec->set_head_dim(g.head_dim);
  spec->set_dtype(static_cast<v1::DType>(g.dtype));
  spec->set_max_tokens(g.max_tokens);
  spec->set_num_slots(g.num_slots);
  for (int32_t c : g.schedule) spec->add_schedule(c);
}

void FillSessionInfo(const Session& s, const Group& g, v1::SessionInfo* out) {
  out->set_session_id(s.id());
  out->set_group_id(s.group_id());
  FillSpec(s.geometry(), out->mutable_spec());
  out->set_world_size(s.geometry().world_size);
  out->set_rank(s.geometry().rank);
  out->set_slot_bytes(s.layout().slot_bytes);
  out->set_slot_stride_bytes(s.layout().slot_stride_bytes);
  out->set_slot_offset_bytes(s.layout().slots_offset_bytes);
  out->set_segment_bytes(s.layout().total_bytes);
  out->set_backend(g.backend);
  out->set_backend_reason(g.backend_reason);
  out->set_release_index(s.release_index());
  const ClientSlotMapping slots = s.transport().ClientMapping();
  if (slots.device) {
    out->set_device_slots_bytes(slots.bytes);
    out->set_slot_stride_bytes(s.transport().SlotOffset(1) - s.transport().SlotOffset(0));
    out->set_slot_offset_bytes(s.transport().SlotOffset(0));
    out->set_device_words_bytes(slots.words_bytes);
  }
  out->set_kind(static_cast<v1::SessionKind>(s.kind()));
  if (const FusedSetup* f = s.fused())
    FusedSessionToProto(FusedSessionArgs{f->geometry, f->path, s.fused_weights()},
                        out->mutable_fused());
  out->set_plan(s.transport().Describe());
}

// One page of an Admin listing: `fill` offers the entries to the page, which goes into `out`
// (the response's repeated field), with the next page's token. A page also ends before 3 MiB
// of entries (a group's members alone can take 16 KiB), below gRPC's 4 MiB a client receives.
constexpr size_t kMaxPageBytes = 3 << 20;

template <typename Request, typename Response, typename Entry, typename Fill>
grpc::Status ListPage(const Request& req, Response* resp,
                      google::protobuf::RepeatedPtrField<Entry>* out, Fill fill) {
  absl::StatusOr<PageRequest> request = ParsePageRequest(req.page_size(), req.page_token());
  if (!request.ok()) return ToGrpcStatus(request.status());
  PageBuilder<Entry> page(*request);
  fill(page);
  std::string next;
  std::vector<Entry> entries =
      page.Take(&next, [](const Entry& e) { return e.ByteSizeLong(); }, kMaxPageBytes);
  out->Reserve(static_cast<int>(entries.size()));
  for (Entry& e : entries) *out->Add() = std::move(e);
  resp->set_next_page_token(std::move(next));
  return grpc::Status::OK;
}

void FillSessionState(const ClientRecord& c, uint64_t id, const Session& s, v1::SessionState* out) {
  auto git = c.groups.find(s.group_id());
  if (git != c.groups.end()) FillSessionInfo(s, *git->second, out->mutable_info());
  out->set_owner_client_id(c.id);
  out->set_kind(std::string(SessionKindName(s.kind())));
  out->set_calls(s.calls());
  out->set_last_epoch(s.last_epoch());
}

// Canonical rendering of what every rank of a session must agree on.
std::string SpecAgreement(const SessionGeometry& g) {
  std::string sched;
  for (int32_t c : g.schedule) sched += StrCat(sched.empty() ? "" : ",", c);
  return StrCat("num_heads=", g.num_heads, " head_dim=", g.head_dim, " dtype=", DTypeName(g.dtype),
                " max_tokens=", g.max_tokens, " num_slots=", g.num_slots, " schedule=[", sched, "]");
}

// The same for a fused session: its geometry and path (each rank's weights are its own).
std::string FusedAgreement(const FusedGeometry& g, FusedPath path) {
  return StrCat("kind=qkv_norm_rope_exchange hidden=", g.hidden, " num_heads=", g.num_heads,
                " head_dim=", g.head_dim, " dtype=", DTypeName(g.dtype),
                " layout=", QkvLayoutName(g.layout), " max_tokens=", g.max_tokens,
                " num_slots=", g.num_slots, " max_pos=", g.max_pos, " path=", FusedPathName(path));
}

// gRPC orders each reactor below: the handler that made it comes before its first reaction, a
// StartRead or Finish before the reactions it leads to, every reaction before OnDone. It does so
// with synchronization ThreadSanitizer cannot see, so each reactor says so on itself
// (HappensBefore just before it hands itself back to gRPC, HappensAfter first in a reaction).

// Control.Watch, the client's liveness stream. It holds no thread while it is open: it reads
// until the stream ends (the client closed it, its connection broke, or Reclaim cancelled it),
// then reclaims the client.
class WatchReactor final : public grpc::ServerBidiReactor<v1::WatchRequest, v1::WatchEvent> {
 public:
  WatchReactor(Daemon* d, grpc::CallbackServerContext* ctx) : d_(d), ctx_(ctx) {
    absl::StatusOr<std::shared_ptr<ClientRecord>> c = d_->Authenticate(ctx);
    if (!c.ok()) {
      HappensBefore(this);
      Finish(ToGrpcStatus(c.status()));
      return;
    }
    c_ = std::move(*c);
    bool gone = false, second = false;
    {
      // Reclaim cancels the stream, so a client reclaimed for another reason (it never bound
      // its fd socket, say) does not keep it open; one reclaimed already has nothing to watch.
      // One stream per client: Reclaim cancels that one, and a second would keep the client's
      // record (its rings and descriptors) alive past its reclaim.
      std::lock_guard<std::mutex> lock(c_->mu);
      gone = c_->gone;
      second = !gone && c_->watch != nullptr;
      if (!gone && !second) c_->watch = ctx;
    }
    HappensBefore(this);
    if (gone || second) {
      const grpc::Status s =
          second ? grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                                StrCat("client ", c_->id, " has its liveness stream open already"))
                 : grpc::Status::OK;
      c_.reset();  // OnReadDone never runs: nothing else needs the record
      Finish(s);
      return;
    }
    StartRead(&req_);
  }

  void OnReadDone(bool ok) override {
    HappensAfter(this);
    if (ok) {
      HappensBefore(this);
      StartRead(&req_);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(c_->mu);
      if (c_->watch == ctx_) c_->watch = nullptr;
    }
    // The stream ends when the client closes it or its process (and connection) is gone.
    d_->Reclaim(c_->id, "liveness stream ended");
    HappensBefore(this);
    Finish(grpc::Status::OK);
  }

  void OnDone() override {
    HappensAfter(this);
    delete this;
  }

 private:
  Daemon* d_;
  grpc::CallbackServerContext* ctx_;
  std::shared_ptr<ClientRecord> c_;
  v1::WatchRequest req_;
};

// One Control request's place among those its client, and the bound clients of its uid, have
// in progress (limits.calls_in_progress_per_client, calls_in_progress_per_uid): a unary
// request holds a thread of the synchronous server until it returns, a collective one a place
// in a rendezvous (and CreateSession a thread of its own for a while), so one client, or one
// uid, may hold only so many. Given back when destroyed.
class RequestPlace {
 public:
  static absl::StatusOr<RequestPlace> Take(Daemon* d, ClientRecord& c) {
    RequestPlace place(d, c);  // counted from here: given back on every path
    const int32_t limit = d->config().limits.calls_in_progress_per_client;
    const int32_t before = c.requests_in_progress.fetch_add(1);
    if (before >= limit)
      return d->RefuseOverLimit(
          Limit::kCallsInProgressPerClient,
          StrCat("client ", c.id, " has ", before, " requests in progress already"));
    // Each client is bound for good once counted, so its uid does not change.
    ULY_ASSIGN_OR_RETURN(place.counted_in_uid_, d->EnterUidRequest(c));
    return place;
  }
  RequestPlace(RequestPlace&& o) noexcept
      : d_(std::exchange(o.d_, nullptr)), c_(o.c_), counted_in_uid_(o.counted_in_uid_) {}
  RequestPlace& operator=(RequestPlace&&) = delete;
  ~RequestPlace() {
    if (d_ == nullptr) return;
    if (counted_in_uid_) d_->LeaveUidRequest(c_->uid);
    c_->requests_in_progress.fetch_sub(1);
  }

 private:
  RequestPlace(Daemon* d, ClientRecord& c) : d_(d), c_(&c) {}
  Daemon* d_;
  ClientRecord* c_;  // kept alive by whoever holds the place
  bool counted_in_uid_ = false;
};

// The collective steps of Control (JoinGroup, CreateSession) are served by the callback API:
// while the ranks meet at rank 0's table, no thread waits for them. gRPC's callback threads
// are few and shared by every callback call of the process, so nothing that blocks runs on
// them: the rendezvous verdict arrives there, and a step whose own work can block (a session's
// allocations, its peers' segments) does that work on a thread of its own. When the client
// goes away (its call is cancelled) while the ranks meet, the step is aborted for every rank.

// JoinGroup: checks, the rendezvous, then the group's backend from the ranks' offers (reads
// and a record only, done on the thread that delivers the verdict).
class JoinGroupReactor final : public grpc::ServerUnaryReactor {
 public:
  JoinGroupReactor(Daemon* d, grpc::CallbackServerContext* ctx, const v1::JoinGroupRequest* req,
                   v1::GroupInfo* resp)
      : d_(d), req_(*req), resp_(resp) {
    absl::StatusOr<std::shared_ptr<ClientRecord>> c = d_->Authenticate(ctx);
    absl::Status started = c.ok() ? Start(std::move(*c)) : c.status();
    if (!started.ok()) {
      EndJoin();
      Done(ToGrpcStatus(started));
    }
    HappensBefore(this);
  }

  // Called only once the handler returned, so after Start.
  void OnCancel() override {
    HappensAfter(this);
    std::shared_ptr<RendezvousCall> call;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = true;
      call = call_;
    }
    if (call) call->ClientGone();
    HappensBefore(this);
  }

  void OnDone() override {
    HappensAfter(this);
    delete this;
  }

 private:
  absl::Status Start(std::shared_ptr<ClientRecord> c) {
    c_ = std::move(c);
    absl::StatusOr<RequestPlace> place = RequestPlace::Take(d_, *c_);
    if (!place.ok()) return place.status();
    place_.emplace(*std::move(place));
    absl::StatusOr<std::string> checked = CheckJoinRequest(req_);
    if (!checked.ok()) return checked.status();
    ULY_RETURN_IF_ERROR(CheckMembers(req_, d_->config().devices));
    ULY_RETURN_IF_ERROR(CheckOwnRank(req_, d_->config().socket));
    requested_ = *checked;
    Backend* const nccl = d_->nccl_backend();
    if (requested_ != "auto" && requested_ != d_->backend() && !(requested_ == "nccl" && nccl))
      return absl::FailedPreconditionError(StrCat("backend: '", requested_,
                                                  "' is not available: this daemon runs the ",
                                                  d_->backend(), " backend (",
                                                  d_->backend_reason(), ")"));
    std::string members;
    for (const auto& m : req_.members()) members += m + ",";
    const std::string agreement = StrCat("name=", req_.name(), " world_size=", req_.world_size(),
                                         " members=[", members, "] backend=", requested_);
    ULY_ASSIGN_OR_RETURN(const int64_t timeout_ms,
                         RendezvousTimeoutMs(req_.timeout_ms(), d_->config().peer_timeout_ms));
    // Payload: this daemon's backend (and whether it also runs nccl) and device, so that every
    // rank reaches the same verdict on the group's backend (ChooseGroupBackend).
    const std::string mine =
        EncodeOffer({d_->backend(), nccl != nullptr, d_->config().device, RandomToken()});
    ULY_RETURN_IF_ERROR(d_->StartGroupJoin(*c_));
    {
      std::lock_guard<std::mutex> lock(c_->mu);
      joining_ = true;
    }
    ULY_ASSIGN_OR_RETURN(
        std::shared_ptr<RendezvousCall> call,
        d_->rendezvous_client().Start(req_.members(0), StrCat("join/", req_.name()),
                                      req_.world_size(), req_.rank(), agreement, mine,
                                      absl::Milliseconds(timeout_ms),
                                      [this](RendezvousTable::Verdict payloads) {
                                        const absl::Status s = Complete(std::move(payloads));
                                        EndJoin();
                                        HappensBefore(this);
                                        Done(ToGrpcStatus(s));
                                      },
                                      c_->BoundUid()));
    std::lock_guard<std::mutex> lock(mu_);
    call_ = std::move(call);
    return absl::OkStatus();
  }

  absl::Status Complete(RendezvousTable::Verdict payloads) {
    ULY_RETURN_IF_ERROR(payloads.status());
    std::vector<BackendOffer> offers;
    for (size_t r = 0; r < payloads->size(); ++r) {
      ULY_ASSIGN_OR_RETURN(BackendOffer offer, DecodeOffer((*payloads)[r], static_cast<int>(r)));
      offers.push_back(std::move(offer));
    }
    // Every process on the node can tell whether any two devices map each other's memory, so
    // every rank judges every pair alike.
    const DeviceReach reach = [](int32_t from, int32_t to) -> absl::StatusOr<bool> {
      if (from == to) return true;
      const int n = ipc::cuda::DeviceCount();
      if (from < 0 || to < 0 || from >= n || to >= n) return false;
      return ipc::cuda::CanAccessPeer(to, from);
    };
    ULY_ASSIGN_OR_RETURN(const BackendVerdict verdict,
                         ChooseGroupBackend(requested_, offers, reach));
    auto g = std::make_shared<Group>();
    g->id = d_->NextId();
    g->name = req_.name();
    g->world_size = req_.world_size();
    g->rank = req_.rank();
    g->members.assign(req_.members().begin(), req_.members().end());
    g->backend = verdict.backend;
    const bool own = verdict.backend == d_->backend();
    g->impl = own ? &d_->backend_impl() : d_->nccl_backend();
    g->backend_reason =
        own ? StrCat(verdict.reason, " (", d_->backend_reason(), ")") : verdict.reason;
    g->owner_client = c_->id;
    g->instance = offers[0].instance;
    // The request cancelled (its client went away, or gave up on it) while the ranks met: the
    // client will not learn of the group, which the other ranks have.
    bool gone = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      gone = cancelled_;
    }
    {
      std::lock_guard<std::mutex> lock(c_->mu);
      gone = gone || c_->gone;
      EndJoinLocked();  // the group counts from here as one joined
      if (!gone) c_->groups[g->id] = g;
    }
    // Reclaimed or cancelled while the ranks met: the group's end is told here, since the
    // reclaim did not know of it.
    if (gone) d_->EndGroup(*g, StrCat("rank ", g->rank, "'s client went away"));
    FillGroupInfo(*g, resp_);
    return absl::OkStatus();
  }

  // The join stops counting against limits.groups_per_client (once; c_->mu held).
  void EndJoinLocked() {
    if (joining_) --c_->groups_joining;
    joining_ = false;
  }
  void EndJoin() {
    if (!c_) return;
    std::lock_guard<std::mutex> lock(c_->mu);
    EndJoinLocked();
  }
  // Finishes the request, its place among the client's requests given back first: the
  // client may send its next request as soon as it has this one's answer. (OnDone, which
  // destroys what is left, comes after Finish.)
  void Done(const grpc::Status& s) {
    place_.reset();
    HappensBefore(this);
    Finish(s);
  }

  Daemon* d_;
  const v1::JoinGroupRequest& req_;
  v1::GroupInfo* resp_;
  std::shared_ptr<ClientRecord> c_;
  std::optional<RequestPlace> place_;  // after c_, whose record it counts in
  bool joining_ = false;  // counted in c_->groups_joining; under c_->mu
  std::string requested_;
  std::mutex mu_;  // guards what follows
  std::shared_ptr<RendezvousCall> call_;
  bool cancelled_ = false;  // OnCancel came
};

// CreateSession: Prepare (checks, the slot budget, the segment and transport) on a thread of
// its own, the rendezvous, then Complete (the peers' segments, the client's frame) on another.
class CreateSessionReactor final : public grpc::ServerUnaryReactor {
 public:
  CreateSessionReactor(Daemon* d, grpc::CallbackServerContext* ctx,
                       const v1::CreateSessionRequest* req, v1::SessionInfo* resp)
      : d_(d), ctx_(ctx), req_(*req), resp_(resp) {
    // The client and its place first, on this thread. A caller that is no client, or a client
    // past its requests in progress, costs no thread: the latter's refusal makes nothing, so
    // it arrives from here.
    absl::Status admitted = Admit();
    if (admitted.ok() && !place_refused_.ok()) admitted = Prepare();
    if (!admitted.ok()) {
      EndRefusedArrival();  // it never arrived
      Done(ToGrpcStatus(admitted));
    } else if (place_refused_.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      prepare_ = std::thread([this] {
        absl::Status s = Prepare();
        if (!s.ok()) Done(ToGrpcStatus(s));
      });
    }
    HappensBefore(this);
  }

  void OnCancel() override {
    HappensAfter(this);
    std::vector<std::shared_ptr<RendezvousCall>> calls;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = true;  // a round not started yet aborts itself once it arrived (Track)
      calls = calls_;
    }
    // Every round's call: one whose verdict came ignores it.
    for (const auto& call : calls) call->ClientGone();
    HappensBefore(this);
  }

  // OnDone comes after Finish, and never on either thread; each has returned or is about to.
  // (Prepare may still be storing the call under mu_: join without holding it.) Joining them
  // orders what they did before what follows; ThreadSanitizer sees that itself.
  void OnDone() override {
    HappensAfter(this);
    std::thread prepare, complete;
    {
      std::lock_guard<std::mutex> lock(mu_);
      prepare.swap(prepare_);
      complete.swap(complete_);
    }
    if (prepare.joinable()) prepare.join();
    if (complete.joinable()) complete.join();
    delete this;
  }

 private:
  // The client, and its place among its requests in progress. A refused place is this rank's
  // verdict on the request (Prepare): the rank still arrives, so that every rank moves its
  // group's session counter on together; but only so many refused requests of one client
  // arrive at once (as many as it may have in progress), and the ones past those are refused
  // outright, where they would hold a place in rank 0's table each until their timeout.
  absl::Status Admit() {
    ULY_ASSIGN_OR_RETURN(c_, d_->Authenticate(ctx_));
    absl::StatusOr<RequestPlace> place = RequestPlace::Take(d_, *c_);
    if (place.ok()) {
      place_.emplace(*std::move(place));
      return absl::OkStatus();
    }
    place_refused_ = place.status();
    if (c_->refused_arriving.fetch_add(1) >= d_->config().limits.calls_in_progress_per_client) {
      c_->refused_arriving.fetch_sub(1);
      return place_refused_;
    }
    // And as many of its uid's (limits.calls_in_progress_per_uid).
    absl::StatusOr<bool> uid_counted = d_->EnterUidRequest(*c_, /*refused_arrival=*/true);
    if (!uid_counted.ok()) {
      c_->refused_arriving.fetch_sub(1);
      return place_refused_;
    }
    refused_arriving_ = true;
    refused_counted_in_uid_ = *uid_counted;
    return absl::OkStatus();
  }

  // Finishes the request, its place among the client's requests given back first: the
  // client may send its next request as soon as it has this one's answer. (OnDone, which
  // destroys what is left, comes after Finish.)
  void Done(const grpc::Status& s) {
    place_.reset();
    HappensBefore(this);
    Finish(s);
  }

  // A refused request that arrived stops counting once its verdict came (or it never
  // arrived).
  void EndRefusedArrival() {
    if (!refused_arriving_) return;
    c_->refused_arriving.fetch_sub(1);
    if (refused_counted_in_uid_) d_->LeaveUidRequest(c_->uid, /*refused_arrival=*/true);
    refused_arriving_ = false;
  }

  // Up to the rendezvous. An error before the group is known answers at once; every later one
  // still arrives, with an error payload: every rank gets the same verdict at once, and every
  // rank's session counter (the key) moves on.

  absl::Status Prepare() {
    ClientRecord& c = *c_;
    {
      std::lock_guard<std::mutex> lock(c.mu);
      auto it = c.groups.find(req_.group_id());
      if (it != c.groups.end()) g_ = it->second;
    }
    if (!g_)
      return absl::NotFoundError(
          StrCat("group_id: ", req_.group_id(), " not joined by this client"));
    Backend& backend = g_->impl != nullptr ? *g_->impl : d_->backend_impl();
    SessionRequest checked;
    local_ = CheckCreateSessionRequest(req_, g_->world_size, g_->rank, backend.slots_in_segment(),
                                       d_->config().peer_timeout_ms, &checked);
    if (local_.ok()) local_ = place_refused_;
    const SessionGeometry& geo = checked.geometry;
    const std::optional<FusedSessionArgs>& fused = checked.fused;
    if (d_->draining()) local_ = absl::UnavailableError("daemon is draining; no new sessions");
    if (fused) agreement_ = FusedAgreement(fused->geometry, fused->path);
    else if (IsHeadExchange(req_.kind())) agreement_ = SpecAgreement(geo);
    else agreement_ = StrCat("kind=", static_cast<int>(req_.kind()));
    // The revision of the rounds that follow: a daemon that meets in other rounds disagrees
    // in the first one, instead of waiting out a round the other never joins.
    agreement_ = StrCat("rendezvous=2;", agreement_);
    id_ = d_->NextId();
    const uint64_t seq = g_->sessions_created.fetch_add(1);
    timeout_ = absl::Milliseconds(checked.timeout_ms);
    key_ = StrCat(SessionKeyPrefix(*g_), seq);
    // A fused session's weights are this rank's own: a rank that refuses them still arrives.
    FusedWeightsHeld weights;
    FusedSetup fused_setup;
    if (local_.ok() && fused) {
      absl::StatusOr<FusedWeightsHeld> held =
          d_->ResolveFusedWeights(c, fused->geometry, fused->weights);
      if (held.ok()) {
        weights = std::move(*held);
        fused_setup = FusedSetup{fused->geometry, fused->path, weights.weights,
                                 d_->config().fused_projection == "cutlass"};
      } else {
        local_ = held.status();
      }
    }
    // Counted from here to the session's end, so that sessions being created count too.
    if (local_.ok()) local_ = d_->headroom().Check("CreateSession");
    if (local_.ok()) {
      absl::StatusOr<std::shared_ptr<const void>> charged = d_->ChargeSession(c);
      if (charged.ok()) charge_ = std::move(*charged);
      else local_ = charged.status();
    }
    if (local_.ok()) {
      const uint64_t bytes = Session::BytesNeeded(geo, backend, fused ? &fused_setup : nullptr);
      local_ = d_->ReserveSlotMemory(c.uid, bytes);
      if (local_.ok()) needed_ = bytes;
    }
    if (local_.ok()) {
      absl::StatusOr<std::unique_ptr<Session>> created =
          Session::Create(id_, g_->id, c.id, geo, d_->peer_exports(), backend,
                          fused ? &fused_setup : nullptr, std::move(weights.buffers));
      if (created.ok()) {
        session_ = std::move(*created);
        if (fused) session_->set_fused_weights(fused->weights);
        // The budget holds what the session holds (allocations round up to the device's
        // granularity), so that its close gives back exactly what it took.
        const uint64_t held = session_->reserved_bytes();
        if (held > needed_) {
          local_ = d_->ReserveSlotMemory(c.uid, held - needed_);
          if (local_.ok()) {
            needed_ = held;
          } else {
            session_.reset();
            d_->ReleaseSlotMemory(c.uid, needed_);
            needed_ = 0;
          }
        } else if (held < needed_) {
          d_->ReleaseSlotMemory(c.uid, needed_ - held);
          needed_ = held;
        }
        // From here the session holds its share: it gives it back once its device work ended.
        if (session_) {
          session_->HoldSlotMemory(d_->SlotMemoryHold(c.uid, needed_));
          session_->HoldCharge(std::move(charge_));
          needed_ = 0;
        }
      } else {
        local_ = created.status();
        d_->ReleaseSlotMemory(c.uid, needed_);
        needed_ = 0;
      }
    }
    if (!local_.ok()) charge_.reset();  // nothing was made: the place is free again
    const std::string payload = local_.ok() ? StrCat("ok:", session_->RendezvousPayload())
                                            : StrCat("error:", local_.message());
    absl::StatusOr<std::shared_ptr<RendezvousCall>> call = d_->rendezvous_client().Start(
        g_->members[0], key_, g_->world_size, g_->rank, agreement_, payload, timeout_,
        [this](RendezvousTable::Verdict names) {
          // A rank that made nothing has nothing to connect: its verdict is given here.
          if (!local_.ok()) {
            EndRefusedArrival();
            Done(ToGrpcStatus(Complete(std::move(names))));
            return;
          }
          std::lock_guard<std::mutex> lock(mu_);
          complete_ = std::thread([this, names = std::move(names)]() mutable {
            Done(ToGrpcStatus(Complete(std::move(names))));
          });
        },
        c_->BoundUid());
    if (!call.ok()) {
      EndRefusedArrival();
      Done(ToGrpcStatus(Complete(call.status())));
      return absl::OkStatus();
    }
    Track(*call);
    return absl::OkStatus();
  }

  // Keeps `call` for OnCancel, which aborts it for every rank when the client goes away (at
  // once when it already went).
  void Track(const std::shared_ptr<RendezvousCall>& call) {
    bool gone = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      calls_.push_back(call);
      gone = cancelled_;
    }
    if (gone) call->ClientGone();
  }

  // A later round of the session rendezvous under key_ + `suffix`: this rank arrives with
  // `mine` ("ok:<payload>", or "error:<message>" when it failed), and every rank gets the same
  // verdict: every rank's payload, or FAILED_PRECONDITION naming the first rank that failed.
  // Blocks the completing thread until the verdict (bounded by the rendezvous timeout).
  absl::StatusOr<std::vector<std::string>> Round(std::string_view suffix,
                                                 const absl::StatusOr<std::string>& mine) {
    const std::string payload =
        mine.ok() ? StrCat("ok:", *mine) : StrCat("error:", mine.status().message());
    auto verdict = std::make_shared<std::promise<RendezvousTable::Verdict>>();
    std::future<RendezvousTable::Verdict> answered = verdict->get_future();
    ULY_ASSIGN_OR_RETURN(std::shared_ptr<RendezvousCall> call,
                         d_->rendezvous_client().Start(
                             g_->members[0], StrCat(key_, suffix), g_->world_size, g_->rank,
                             agreement_, payload, timeout_,
                             [verdict](RendezvousTable::Verdict v) {
                               verdict->set_value(std::move(v));
                             },
                             c_->BoundUid()));
    Track(call);
    ULY_ASSIGN_OR_RETURN(std::vector<std::string> payloads, answered.get());
    ULY_RETURN_IF_ERROR(StripOk(payloads, "could not connect its session"));
    return payloads;
  }

  // Every payload "ok:<x>" becomes x; else FAILED_PRECONDITION "rank R <what>: <its message>"
  // for the first that is not.
  static absl::Status StripOk(std::vector<std::string>& payloads, std::string_view what) {
    for (size_t r = 0; r < payloads.size(); ++r) {
      std::string& p = payloads[r];
      if (p.rfind("ok:", 0) == 0) {
        p.erase(0, 3);
        continue;
      }
      const std::string_view message =
          p.rfind("error:", 0) == 0 ? std::string_view(p).substr(6) : std::string_view(p);
      return absl::FailedPreconditionError(StrCat("rank ", r, " ", what, ": ", message));
    }
    return absl::OkStatus();
  }

  // After the first round: this rank maps its peers (second round: every rank did, or the
  // same error everywhere), then, where the transport needs it, makes what may be made only
  // once every rank is about to connect (third round: NCCL's unique id), then connects.
  absl::Status Connect(const std::vector<std::string>& segs) {
    absl::Status mapped = FailpointFired("session.connect_handle")
                              ? absl::InternalError("the failpoint session.connect_handle fired")
                              : session_->MapPeers(segs, timeout_);
    Failpoint("session.connect_round");
    ULY_RETURN_IF_ERROR(
        Round("/mapped", mapped.ok() ? absl::StatusOr<std::string>("") : mapped).status());
    std::vector<std::string> connect;
    if (session_->NeedsConnectHandles()) {
      ULY_ASSIGN_OR_RETURN(connect, Round("/connect", session_->ConnectPayload()));
    }
    if (FailpointFired("session.connect_transport"))
      return absl::InternalError("the failpoint session.connect_transport fired");
    return session_->ConnectTransport(connect, timeout_);
  }

  absl::Status Complete(RendezvousTable::Verdict names) {
    ClientRecord& c = *c_;
    absl::Status status = names.status();
    if (status.ok() && !local_.ok()) status = local_;
    if (status.ok()) {
      std::vector<std::string> segs = *std::move(names);
      status = StripOk(segs, "could not create its session");
      if (status.ok()) status = Connect(segs);
    }
    if (status.ok()) {
      // A verdict that came after the request was cancelled (RendezvousCall::ClientGone): the
      // client will not learn of the session, so none is kept for it.
      std::lock_guard<std::mutex> lock(mu_);
      if (cancelled_)
        status = absl::CancelledError("session: the request was cancelled while the ranks met");
    }
    if (status.ok()) {
      const ClientSlotMapping slots = session_->transport().ClientMapping();
      if (slots.device) {
        int fds[3] = {session_->client_segment_fd(), slots.fd, slots.words_fd};
        status = d_->SendToClient(c, StrCat("{\"session_id\": ", id_, "}"),
                                  std::span<const int>(fds, slots.words_fd >= 0 ? 3 : 2));
      } else {
        status = d_->SendToClient(c, StrCat("{\"session_id\": ", id_, "}"),
                                  session_->client_segment_fd());
      }
    }
    if (!status.ok()) {
      session_.reset();  // gives back its share of the budget
      d_->ReleaseSlotMemory(c.uid, needed_);
      return status;
    }
    {
      // Ring clients release held slots through their segment instead of an RPC.
      std::lock_guard<std::mutex> lock(c.mu);
      if (c.rings && c.release_rows_used < static_cast<int32_t>(ipc::kMaxReleaseSessions)) {
        const int32_t row = c.release_rows_used++;
        session_->UseClientReleaseWords(row, &c.rings->header->released[row][0], c.rings);
      }
    }
    std::shared_ptr<Session> shared(std::move(session_));
    bool gone = false;
    {
      std::lock_guard<std::mutex> lock(c.mu);
      gone = c.gone;
      if (!gone) c.sessions[id_] = shared;
    }
    // Reclaimed since the session was sent: nothing would end it for its peers.
    if (gone) {
      shared->Abort(kAbortClosed);
      return absl::UnavailableError(StrCat("client ", c.id, " is gone"));
    }
    FillSessionInfo(*shared, *g_, resp_);
    Logger("exec")->debug("client {}: session {} on group {} ({})", c.id, id_, g_->name,
                          agreement_);
    return absl::OkStatus();
  }

  Daemon* d_;
  grpc::CallbackServerContext* ctx_;
  const v1::CreateSessionRequest& req_;
  v1::SessionInfo* resp_;
  std::shared_ptr<ClientRecord> c_;  // Admit's
  std::optional<RequestPlace> place_;  // after c_, whose record it counts in
  absl::Status place_refused_;  // why no place was given (Admit)
  bool refused_arriving_ = false;  // counted in c_->refused_arriving
  bool refused_counted_in_uid_ = false;  // and in its uid's
  // Prepare's results, which Complete reads: written before the rendezvous starts.
  std::shared_ptr<Group> g_;
  absl::Status local_;  // this rank's own verdict on the request
  std::string agreement_;
  std::string key_;  // the first round's rendezvous key; the later ones add a suffix
  uint64_t id_ = 0;
  absl::Duration timeout_;
  uint64_t needed_ = 0;  // reserved against the slot budget, not yet held by the session
  std::shared_ptr<const void> charge_;  // against the session limits, until the session holds it
  std::unique_ptr<Session> session_;

  std::mutex mu_;  // guards what follows
  bool cancelled_ = false;
  std::vector<std::shared_ptr<RendezvousCall>> calls_;  // every round's, in order
  std::thread prepare_, complete_;
};

class ControlService final
    : public v1::Control::WithCallbackMethod_Watch<v1::Control::WithCallbackMethod_JoinGroup<
          v1::Control::WithCallbackMethod_CreateSession<v1::Control::Service>>> {
 public:
  explicit ControlService(Daemon* d) : d_(d) {}

  grpc::Status Attach(grpc::ServerContext* ctx, const v1::AttachRequest* req,
                      v1::AttachResponse* resp) override {
    if (d_->draining()) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "daemon is draining");
    // Every Control call comes through the gate. No uid means the connection already ended
    // (its caller could not take the answer): nothing is attached uncounted. Looked up before
    // the cancellation is checked, as gRPC cancels a connection's calls before it closes the
    // descriptor, which a newer connection may then get.
    const std::optional<uid_t> uid = d_->ConnectionUid(*ctx);
    if (!uid || ctx->IsCancelled())
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the connection of this Attach ended");
    absl::StatusOr<std::shared_ptr<ClientRecord>> c =
        d_->AttachClient(req->client_name(), req->reported_pid(), *uid);
    if (!c.ok()) return ToGrpcStatus(c.status());
    resp->set_client_id((*c)->id);
    resp->set_token((*c)->token);
    resp->set_fd_socket(d_->config().socket + ".fd");
    resp->set_daemon_version(ULYSSES_VERSION);
    resp->set_device(d_->config().device);
    resp->set_backend(d_->backend());
    resp->set_mps_mode(d_->mps_mode());
    return grpc::Status::OK;
  }

  grpc::Status Detach(grpc::ServerContext* ctx, const v1::DetachRequest*,
                      v1::DetachResponse*) override {
    return AsClient(ctx, [&](ClientRecord& c) {
      d_->Reclaim(c.id, "detached");
      return absl::OkStatus();
    });
  }

  grpc::ServerBidiReactor<v1::WatchRequest, v1::WatchEvent>* Watch(
      grpc::CallbackServerContext* ctx) override {
    return new WatchReactor(d_, ctx);
  }

  grpc::Status AllocBuffer(grpc::ServerContext* ctx, const v1::AllocBufferRequest* req,
                           v1::BufferInfo* resp) override {
    return AsClient(ctx, [&](ClientRecord& c) -> absl::Status {
      ULY_RETURN_IF_ERROR(CheckAllocRequest(*req));
      // Charged before anything is allocated, given back if the allocation fails.
      ULY_RETURN_IF_ERROR(d_->ChargeBuffer(c, req->size_bytes()));
      absl::Status s = DoAlloc(c, *req, resp);
      if (!s.ok()) d_->UnchargeBuffer(c, req->size_bytes());
      return s;
    });
  }

  grpc::Status RegisterBuffer(grpc::ServerContext* ctx, const v1::RegisterBufferRequest* req,
                              v1::BufferInfo* resp) override {
    return AsClient(ctx, [&](ClientRecord& c) -> absl::Status {
      ULY_RETURN_IF_ERROR(CheckRegisterRequest(*req));
      bool charged_already = false;
      ULY_RETURN_IF_ERROR(DoRegister(c, *req, resp, &charged_already));
      if (charged_already) return absl::OkStatus();
      // The size of a device buffer is known only once it is open: one over a limit is
      // dropped again (the memory is the client's; the daemon had only mapped it).
      absl::Status charged = d_->ChargeBuffer(c, resp->size_bytes());
      if (!charged.ok()) {
        std::lock_guard<std::mutex> lock(c.mu);
        c.buffers.erase(resp->buffer_id());
      }
      return charged;
    });
  }

  grpc::Status FreeBuffer(grpc::ServerContext* ctx, const v1::FreeBufferRequest* req,
                          v1::FreeBufferResponse*) override {
    return AsClient(ctx, [&](ClientRecord& c) {
      uint64_t size = 0;
      {
        std::lock_guard<std::mutex> lock(c.mu);
        auto it = c.buffers.find(req->buffer_id());
        if (it == c.buffers.end())
          return absl::InvalidArgumentError(
              StrCat("buffer_id: ", req->buffer_id(), " is not registered"));
        size = it->second->size;
        c.buffers.erase(it);
      }
      d_->UnchargeBuffer(c, size);
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* JoinGroup(grpc::CallbackServerContext* ctx,
                                      const v1::JoinGroupRequest* req,
                                      v1::GroupInfo* resp) override {
    return new JoinGroupReactor(d_, ctx, req, resp);
  }

  grpc::Status LeaveGroup(grpc::ServerContext* ctx, const v1::LeaveGroupRequest* req,
                          v1::LeaveGroupResponse*) override {
    return AsClient(ctx, [&](ClientRecord& c) {
      std::lock_guard<std::mutex> lock(c.mu);
      for (auto& [id, s] : c.sessions)
        if (s->group_id() == req->group_id())
          return absl::FailedPreconditionError(
              StrCat("group_id: group ", req->group_id(), " still has session ", id));
      auto it = c.groups.find(req->group_id());
      if (it == c.groups.end())
        return absl::NotFoundError(
            StrCat("group_id: ", req->group_id(), " not joined by this client"));
      // The other ranks' later sessions of the group end at once instead of waiting for this one.
      d_->EndGroup(*it->second, StrCat("rank ", it->second->rank, " left the group"));
      c.groups.erase(it);
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* ctx,
                                          const v1::CreateSessionRequest* req,
                                          v1::SessionInfo* resp) override {
    return new CreateSessionReactor(d_, ctx, req, resp);
  }

  grpc::Status Call(grpc::ServerContext* ctx, const v1::CallRequest* req,
                    v1::CallResponse* resp) override {
    // Counted apart from the ring path: what the handler does, gRPC's work before and after it
    // not (GetState grpc_call_host_allocations).
    host_allocations::CallPathScope on_call_path(host_allocations::g_grpc_counted);
    return AsClient(ctx, [&](ClientRecord& c) -> absl::Status {
      ULY_ASSIGN_OR_RETURN(CallArgs args, CallArgsFromRequest(*req));
      ULY_ASSIGN_OR_RETURN(CallResult r, d_->Call(c, req->session_id(), args, /*expected_epoch=*/0));
      resp->set_epoch(r.outcome.epoch);
      resp->set_slot(r.outcome.slot);
      resp->mutable_out_shape()->Reserve(static_cast<int>(r.out_shape.size()));
      for (int64_t d : r.out_shape) resp->add_out_shape(d);
      resp->set_slot_offset_bytes(r.outcome.slot_offset_bytes);
      resp->set_result_bytes(r.outcome.result_bytes);
      resp->set_elapsed_us(r.elapsed_us);
      return absl::OkStatus();
    });
  }

  grpc::Status CloseSession(grpc::ServerContext* ctx, const v1::CloseSessionRequest* req,
                            v1::CloseSessionResponse*) override {
    return AsClient(ctx, [&](ClientRecord& c) {
      std::shared_ptr<Session> s;
      {
        std::lock_guard<std::mutex> lock(c.mu);
        auto it = c.sessions.find(req->session_id());
        if (it == c.sessions.end())
          return absl::NotFoundError(StrCat("session_id: ", req->session_id(), " is not open"));
        s = it->second;
        c.sessions.erase(it);
      }
      // Its share of the slot budget comes back when it is destroyed (after its last in-flight
      // call, once its device work ended).
      s->Abort(kAbortClosed);
      return absl::OkStatus();
    });
  }

  grpc::Status Release(grpc::ServerContext* ctx, const v1::ReleaseRequest* req,
                       v1::ReleaseResponse*) override {
    return AsClient(ctx, [&](ClientRecord& c) -> absl::Status {
      ULY_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, d_->FindSession(c, req->session_id()));
      return s->Release(req->epoch());
    });
  }

  grpc::Status PoisonSlots(grpc::ServerContext* ctx, const v1::PoisonSlotsRequest* req,
                           v1::PoisonSlotsResponse* resp) override {
    return AsClient(ctx, [&](ClientRecord& c) -> absl::Status {
      ULY_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, d_->FindSession(c, req->session_id()));
      resp->set_poisoned(s->Poison());
      return absl::OkStatus();
    });
  }

  grpc::Status DescribeSession(grpc::ServerContext* ctx, const v1::DescribeSessionRequest* req,
                               v1::SessionInfo* resp) override {
    return AsClient(ctx, [&](ClientRecord& c) -> absl::Status {
      ULY_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, d_->FindSession(c, req->session_id()));
      std::lock_guard<std::mutex> lock(c.mu);
      auto git = c.groups.find(s->group_id());
      if (git == c.groups.end())
        return absl::FailedPreconditionError(
            StrCat("session_id: ", req->session_id(), ": its group is gone"));
      FillSessionInfo(*s, *git->second, resp);
      return absl::OkStatus();
    });
  }

 private:
  // Authenticates the caller, runs `f(ClientRecord&) -> absl::Status`, and converts the status
  // at the edge.
  template <typename F>
  grpc::Status AsClient(grpc::ServerContext* ctx, F&& f) {
    absl::StatusOr<std::shared_ptr<ClientRecord>> c = d_->Authenticate(ctx);
    if (!c.ok()) return ToGrpcStatus(c.status());
    ClientRecord& client = **c;
    absl::StatusOr<RequestPlace> place = RequestPlace::Take(d_, client);
    if (!place.ok()) return ToGrpcStatus(place.status());
    return ToGrpcStatus(f(client));
  }

  absl::Status DoAlloc(ClientRecord& c, const v1::AllocBufferRequest& req, v1::BufferInfo* resp) {
    ULY_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> b, d_->backend_impl().AllocBuffer(req.size_bytes()));
    b->id = d_->NextId();
    b->name = req.name();
    ULY_RETURN_IF_ERROR(d_->SendToClient(
        c, StrCat("{\"buffer_id\": ", b->id, ", \"device\": ", b->device ? "true" : "false", "}"),
        b->fd.get()));
    // The client has its copy; the mapping keeps the memory. Holding the descriptor for the
    // buffer's life would only count against the daemon's descriptors.
    b->fd.reset();
    {
      std::lock_guard<std::mutex> lock(c.mu);
      c.buffers[b->id] = b;
    }
    resp->set_buffer_id(b->id);
    resp->set_size_bytes(b->size);
    resp->set_name(b->name);
    resp->set_device(b->device);
    return absl::OkStatus();
  }

  // The descriptors of a VMM registration, taken in order; on any failure the ones that did
  // arrive are taken too (and closed), so that none stays held against the client's quota.
  absl::StatusOr<std::shared_ptr<Buffer>> ImportVmm(ClientRecord& c,
                                                    const v1::RegisterBufferRequest& req) {
    std::vector<ipc::UniqueFd> fds;
    std::vector<ipc::cuda::VmmMapping::Part> parts;
    absl::Status st;
    for (const v1::VmmMapping& m : req.vmm_mappings()) {
      if (!st.ok()) {
        (void)d_->TakeIncomingFd(c, m.tag(), absl::ZeroDuration());
        continue;
      }
      absl::StatusOr<ipc::UniqueFd> fd = d_->TakeIncomingFd(c, m.tag());
      if (!fd.ok()) {
        st = absl::Status(fd.status().code(),
                          StrCat("vmm_mappings[", parts.size(), "]: ", fd.status().message()));
        continue;
      }
      parts.push_back({fd->get(), m.size_bytes()});
      fds.push_back(*std::move(fd));
    }
    ULY_RETURN_IF_ERROR(st);
    ULY_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> b, d_->backend_impl().ImportVmmBuffer(parts));
    b->allocation_id = req.allocation_id();
    return b;
  }

  // Sets *charged when it charged the buffer itself (a memfd: before it is mapped).
  absl::Status DoRegister(ClientRecord& c, const v1::RegisterBufferRequest& req,
                          v1::BufferInfo* resp, bool* charged) {
    auto b = std::make_shared<Buffer>();
    if (req.vmm_mappings_size() > 0) {
      ULY_ASSIGN_OR_RETURN(b, ImportVmm(c, req));
    } else if (!req.cuda_ipc_handle().empty()) {
      ULY_ASSIGN_OR_RETURN(b, d_->backend_impl().ImportIpcBuffer(req.cuda_ipc_handle(),
                                                                  req.size_bytes()));
      b->allocation_id = req.allocation_id();
    } else {
      ULY_ASSIGN_OR_RETURN(ipc::UniqueFd fd, d_->TakeIncomingFd(c, req.tag()));
      // A client could shrink an unsealed memfd under the daemon's mapping (SIGBUS): refuse it.
      ULY_RETURN_IF_ERROR(ipc::CheckSealedShmem(fd.get()));
      ULY_ASSIGN_OR_RETURN(size_t size, ipc::FdSize(fd.get()));
      if (size == 0) return absl::InvalidArgumentError("fd: the buffer is empty");
      if (size > kMaxBufferBytes)
        return absl::InvalidArgumentError(
            StrCat("fd: the buffer's ", size, " bytes exceed ", kMaxBufferBytes));
      b->size = size;
      // Charged before it is mapped: a memfd of any size would take the daemon's address
      // space for as long as its mapping lasted.
      ULY_RETURN_IF_ERROR(d_->ChargeBuffer(c, size));
      // The mapping keeps the memory; the descriptor closes here, so that registrations hold
      // no descriptor of the daemon's each.
      absl::StatusOr<ipc::Mapping> mapped = ipc::Mapping::Map(fd.get(), size, /*writable=*/true);
      if (!mapped.ok()) {
        d_->UnchargeBuffer(c, size);
        return mapped.status();
      }
      *charged = true;
      ipc::Mapping m = *std::move(mapped);
      auto mapping = std::make_shared<ipc::Mapping>(std::move(m));
      b->data = mapping->data();
      b->keep = mapping;
    }
    b->id = d_->NextId();
    b->name = req.name();
    {
      std::lock_guard<std::mutex> lock(c.mu);
      c.buffers[b->id] = b;
    }
    resp->set_buffer_id(b->id);
    resp->set_size_bytes(b->size);
    resp->set_name(b->name);
    resp->set_device(b->device);
    return absl::OkStatus();
  }

  Daemon* d_;
};

// One Admin request's place among those running on its socket (limits.admin_calls_in_progress):
// each holds a thread of the synchronous server and carries no client identity, so a socket
// takes only so many at once, and the operator socket counts apart from the control socket.
class AdminPlace {
 public:
  AdminPlace(std::atomic<int32_t>& in_progress, Daemon& d)
      : in_progress_(in_progress), before_(in_progress.fetch_add(1)), d_(d) {}
  ~AdminPlace() { in_progress_.fetch_sub(1); }
  AdminPlace(const AdminPlace&) = delete;
  AdminPlace& operator=(const AdminPlace&) = delete;

  bool admitted() const { return before_ < d_.config().limits.admin_calls_in_progress; }
  grpc::Status refusal() const {
    return ToGrpcStatus(d_.RefuseOverLimit(
        Limit::kAdminCallsInProgress,
        StrCat(before_, " Admin requests are in progress on this socket already")));
  }

 private:
  std::atomic<int32_t>& in_progress_;
  const int32_t before_;
  Daemon& d_;
};

class AdminService final : public v1::Admin::Service {
 public:
  // `operator_socket`: this instance serves the operator socket, where the calls that change
  // the daemon's state are allowed; on the control socket they are PERMISSION_DENIED.
  AdminService(Daemon* d, bool operator_socket) : d_(d), operator_socket_(operator_socket) {}

  grpc::Status GetState(grpc::ServerContext*, const v1::GetStateRequest*,
                        v1::DaemonState* resp) override {
    const AdminPlace place(in_progress_, *d_);
    if (!place.admitted()) return place.refusal();
    resp->set_version(ULYSSES_VERSION);
    resp->set_device(d_->config().device);
    resp->set_backend(d_->backend());
    resp->set_pid(::getpid());
    resp->set_uptime_s(absl::ToDoubleSeconds(absl::Now() - d_->started()));
    resp->set_draining(d_->draining());
    resp->set_health(d_->draining() ? "NOT_SERVING" : "SERVING");
    resp->set_mps_mode(d_->mps_mode());
    resp->set_active_calls(d_->active_calls());
    resp->set_idle(d_->active_calls() == 0);
    resp->set_metrics_address(d_->metrics_address());
    resp->set_socket(d_->config().socket);
    int groups = 0, sessions = 0;
    auto clients = d_->Clients();
    for (auto& c : clients) {
      std::lock_guard<std::mutex> lock(c->mu);
      groups += static_cast<int>(c->groups.size());
      sessions += static_cast<int>(c->sessions.size());
    }
    resp->set_num_clients(static_cast<int>(clients.size()));
    resp->set_num_groups(groups);
    resp->set_num_sessions(sessions);
    resp->set_calls_total(d_->metrics().calls_total());
    resp->set_calls_failed(d_->metrics().calls_failed());
    const ipc::cuda::AllocationStats a = ipc::cuda::Stats();
    resp->set_device_allocations(a.created + a.imported + a.ipc_opened);
    resp->set_device_bytes(a.live_bytes);
    resp->set_device_mappings_open(a.imported_open + a.ipc_open);
    resp->set_call_path_host_allocations(host_allocations::Counted());
    resp->set_grpc_call_host_allocations(host_allocations::GrpcCounted());
    resp->set_host_allocations_counted(host_allocations::Counting());
    const QueueLaneCounts q = d_->backend_impl().Queues();
    resp->set_device_streams(q.streams_used);
    resp->set_hardware_queues(q.lanes);
    resp->set_hardware_queues_in_use(q.lanes_in_use);
    resp->set_queue_shared_streams(q.shared_streams);
    resp->set_queue_refusals(q.refused);
    resp->set_pending_rendezvous(static_cast<int32_t>(d_->rendezvous_table().pending()));
    resp->set_rendezvous_arrivals(static_cast<int32_t>(d_->rendezvous_table().waiting()));
    resp->set_slot_budget_used_bytes(d_->slot_memory_reserved());
    resp->set_slot_budget_bytes(d_->config().slot_memory_budget_bytes);
    const DeviceIdentity id = d_->backend_impl().identity();
    if (!id.uuid.empty()) resp->set_device_uuid(id.uuid);
    if (!id.pci_bus_id.empty()) resp->set_device_pci_bus_id(id.pci_bus_id);
    if (id.numa_node >= 0) resp->set_device_numa_node(id.numa_node);
    return grpc::Status::OK;
  }

  grpc::Status ListClients(grpc::ServerContext*, const v1::ListClientsRequest* req,
                           v1::ListClientsResponse* resp) override {
    const AdminPlace place(in_progress_, *d_);
    if (!place.admitted()) return place.refusal();
    Failpoint("admin.list_clients");
    return ListPage(*req, resp, resp->mutable_clients(),
                    [&](PageBuilder<v1::ClientState>& page) {
      for (auto& c : d_->Clients()) {
        if (!page.Wants({c->id, 0})) continue;
        std::lock_guard<std::mutex> lock(c->mu);
        v1::ClientState s;
        s.set_client_id(c->id);
        s.set_name(c->name);
        s.set_pid(c->pid);
        s.set_reported_pid(c->reported_pid);
        s.set_uid(c->uid);
        s.set_since_unix_ms(absl::ToUnixMillis(c->since));
        s.set_num_buffers(static_cast<int>(c->buffers.size()));
        uint64_t bytes = 0;
        for (auto& [id, b] : c->buffers) bytes += b->size;
        s.set_buffer_bytes(bytes);
        s.set_num_sessions(static_cast<int>(c->sessions.size()));
        s.set_calls(c->calls.load());
        page.Offer({c->id, 0}, std::move(s));
      }
    });
  }

  grpc::Status ListGroups(grpc::ServerContext*, const v1::ListGroupsRequest* req,
                          v1::ListGroupsResponse* resp) override {
    const AdminPlace place(in_progress_, *d_);
    if (!place.admitted()) return place.refusal();
    return ListPage(*req, resp, resp->mutable_groups(), [&](PageBuilder<v1::GroupState>& page) {
      for (auto& c : d_->Clients()) {
        std::lock_guard<std::mutex> lock(c->mu);
        for (auto& [id, g] : c->groups) {
          if (!page.Wants({c->id, id})) continue;
          v1::GroupState gs;
          FillGroupInfo(*g, gs.mutable_info());
          gs.add_client_ids(c->id);
          page.Offer({c->id, id}, std::move(gs));
        }
      }
    });
  }

  grpc::Status ListSessions(grpc::ServerContext*, const v1::ListSessionsRequest* req,
                            v1::ListSessionsResponse* resp) override {
    const AdminPlace place(in_progress_, *d_);
    if (!place.admitted()) return place.refusal();
    return ListPage(*req, resp, resp->mutable_sessions(),
                    [&](PageBuilder<v1::SessionState>& page) {
      for (auto& c : d_->Clients()) {
        std::lock_guard<std::mutex> lock(c->mu);
        for (auto& [id, s] : c->sessions) {
          if (!page.Wants({id, 0})) continue;
          v1::SessionState state;
          FillSessionState(*c, id, *s, &state);
          page.Offer({id, 0}, std::move(state));
        }
      }
    });
  }

  grpc::Status GetSession(grpc::ServerContext*, const v1::GetSessionRequest* req,
                          v1::SessionState* resp) override {
    const AdminPlace place(in_progress_, *d_);
    if (!place.admitted()) return place.refusal();
    for (auto& c : d_->Clients()) {
      std::lock_guard<std::mutex> lock(c->mu);
      auto it = c->sessions.find(req->session_id());
      if (it == c->sessions.end()) continue;
      FillSessionState(*c, it->first, *it->second, resp);
      return grpc::Status::OK;
    }
    return ToGrpcStatus(
        absl::NotFoundError(StrCat("session_id: ", req->session_id(), " is not open here")));
  }

  grpc::Status ListSlots(grpc::ServerContext*, const v1::ListSlotsRequest* req,
                         v1::ListSlotsResponse* resp) override {
    const AdminPlace place(in_progress_, *d_);
    if (!place.admitted()) return place.refusal();
    const absl::Time now = absl::Now();
    return ListPage(*req, resp, resp->mutable_slots(), [&](PageBuilder<v1::SlotState>& page) {
      for (auto& c : d_->Clients()) {
        for (const auto& s : c->SessionsNow()) {  // without the client's lock (Daemon::Gauges)
          for (const Session::SlotView& v : s->Slots()) {
            const PageKey key{s->id(), static_cast<uint64_t>(v.slot)};
            if (!page.Wants(key)) continue;
            v1::SlotState st;
            st.set_session_id(s->id());
            st.set_slot(v.slot);
            st.set_state(Session::SlotStateName(v.state));
            st.set_owner_client_id(c->id);
            st.set_epoch(v.epoch);
            st.set_age_ms(absl::ToInt64Milliseconds(now - v.since));
            page.Offer(key, std::move(st));
          }
        }
      }
    });
  }

  grpc::Status ListRecentCalls(grpc::ServerContext*, const v1::ListRecentCallsRequest* req,
                               v1::ListRecentCallsResponse* resp) override {
    const AdminPlace place(in_progress_, *d_);
    if (!place.admitted()) return place.refusal();
    for (const CallRecord& r : d_->recorder().Recent(RecentCallsLimit(*req))) {
      v1::CallRecord* out = resp->add_calls();
      out->set_client_id(r.client_id);
      out->set_session_id(r.session_id);
      out->set_epoch(r.epoch);
      out->set_op(std::string(OpName(r.op)));
      out->set_batch(r.batch);
      out->set_seq(r.seq);
      out->set_queued_unix_us(absl::ToUnixMicros(r.queued));
      out->set_started_unix_us(absl::ToUnixMicros(r.started));
      out->set_done_unix_us(absl::ToUnixMicros(r.done));
      if (r.enqueued != absl::Time()) out->set_enqueued_unix_us(absl::ToUnixMicros(r.enqueued));
      out->set_status(absl::StatusCodeToString(r.code));
      out->set_message(r.message);
      out->set_sent_bytes(r.bytes_sent);
    }
    resp->set_capacity(static_cast<int32_t>(d_->recorder().capacity()));
    return grpc::Status::OK;
  }

  grpc::Status Drain(grpc::ServerContext*, const v1::DrainRequest*,
                     v1::DrainResponse* resp) override {
    const AdminPlace place(in_progress_, *d_);
    if (!place.admitted()) return place.refusal();
    if (!operator_socket_) return OperatorOnly("Drain");
    d_->Drain();
    resp->set_draining(true);
    resp->set_active_calls(d_->active_calls());
    resp->set_idle(d_->active_calls() == 0);
    resp->set_num_sessions(static_cast<int32_t>(d_->Gauges().sessions));
    return grpc::Status::OK;
  }

  grpc::Status Undrain(grpc::ServerContext*, const v1::UndrainRequest*,
                       v1::UndrainResponse*) override {
    const AdminPlace place(in_progress_, *d_);
    if (!place.admitted()) return place.refusal();
    if (!operator_socket_) return OperatorOnly("Undrain");
    d_->Undrain();
    return grpc::Status::OK;
  }

  grpc::Status GetMetrics(grpc::ServerContext*, const v1::GetMetricsRequest*,
                          v1::GetMetricsResponse* resp) override {
    const AdminPlace place(in_progress_, *d_);
    if (!place.admitted()) return place.refusal();
    resp->set_text(d_->RenderMetrics());
    return grpc::Status::OK;
  }

 private:
  std::atomic<int32_t> in_progress_{0};  // this socket's Admin requests running (AdminPlace)
  grpc::Status OperatorOnly(const char* rpc) const {
    return ToGrpcStatus(absl::PermissionDeniedError(
        StrCat(rpc, " changes the daemon's state: call it on the operator socket ",
               d_->config().socket, kOperatorSocketSuffix, " (mode 0600)")));
  }

  Daemon* d_;
  bool operator_socket_;
};

// Peer.Rendezvous, one rank's arrival at this daemon's table. It holds no thread while the
// ranks meet: the table answers it from whichever thread decides the step. The arriving
// daemon's call is cancelled when its connection breaks (it died): the step then fails for
// every rank, naming it. Its own deadline is later than the table's (RendezvousClient adds a
// margin), so a call past its time is not taken for a death.
class RendezvousReactor final : public grpc::ServerUnaryReactor {
 public:
  RendezvousReactor(RendezvousTable& table, const v1::RendezvousRequest& req,
                    v1::RendezvousResponse* resp, int64_t timeout_ms)
      : table_(table) {
    absl::StatusOr<uint64_t> id = table_.Arrive(
        req.key(), req.world_size(), req.rank(), req.agreement(), req.payload(),
        absl::Now() + absl::Milliseconds(timeout_ms),
        [this, resp](RendezvousTable::Verdict v) {
          if (!v.ok()) {
            HappensBefore(this);
            return Finish(ToGrpcStatus(v.status()));
          }
          for (auto& p : *v) resp->add_payloads(std::move(p));
          HappensBefore(this);
          Finish(grpc::Status::OK);
        },
        req.has_client_uid() ? std::optional<uint32_t>(req.client_uid()) : std::nullopt);
    if (!id.ok()) Finish(ToGrpcStatus(id.status()));
    else arrival_ = *id;
    HappensBefore(this);
  }

  // Called only once the handler returned, so after Arrive; nothing once the step has its verdict.
  void OnCancel() override {
    HappensAfter(this);
    if (arrival_ != 0) table_.Cancel(arrival_);
    HappensBefore(this);
  }

  void OnDone() override {
    HappensAfter(this);
    delete this;
  }

 private:
  RendezvousTable& table_;
  uint64_t arrival_ = 0;  // 0: refused, never waited
};

class PeerService final : public v1::Peer::CallbackService {
 public:
  // `node_socket`: this instance serves the node socket; on the control socket, which every
  // client reaches, each call is PERMISSION_DENIED before its request is looked at.
  PeerService(Daemon* d, bool node_socket) : d_(d), node_socket_(node_socket) {}

  grpc::ServerUnaryReactor* Rendezvous(grpc::CallbackServerContext* ctx,
                                       const v1::RendezvousRequest* req,
                                       v1::RendezvousResponse* resp) override {
    if (!node_socket_) return Answer(ctx, NodeOnly("Rendezvous"));
    absl::StatusOr<int64_t> ms = CheckRendezvousRequest(*req, d_->config().peer_timeout_ms);
    if (!ms.ok()) return Answer(ctx, ToGrpcStatus(ms.status()));
    return new RendezvousReactor(d_->rendezvous_table(), *req, resp, *ms);
  }

  grpc::ServerUnaryReactor* AbortRendezvous(grpc::CallbackServerContext* ctx,
                                            const v1::AbortRendezvousRequest* req,
                                            v1::AbortRendezvousResponse*) override {
    if (!node_socket_) return Answer(ctx, NodeOnly("AbortRendezvous"));
    RendezvousTable& table = d_->rendezvous_table();
    return Answer(ctx, ToGrpcStatus(req->prefix() ? table.EndGroup(req->key(), req->reason())
                                                  : table.Abort(req->key(), req->reason())));
  }

 private:
  static grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* ctx, grpc::Status s) {
    grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
    r->Finish(std::move(s));
    return r;
  }

  grpc::Status NodeOnly(const char* rpc) const {
    return ToGrpcStatus(absl::PermissionDeniedError(
        StrCat("Peer.", rpc, " is for the node's daemons only: they call it on the node socket ",
               d_->config().socket, kNodeSocketSuffix, " (mode 0600)")));
  }

  Daemon* d_;
  bool node_socket_;
};

}  // namespace

std::unique_ptr<grpc::Service> MakeControlService(Daemon* d) {
  return std::make_unique<ControlService>(d);
}
std::unique_ptr<grpc::Service> MakeAdminService(Daemon* d, bool operator_socket) {
  return std::make_unique<AdminService>(d, operator_socket);
}
std::unique_ptr<grpc::Service> MakePeerService(Daemon* d, bool node_socket) {
  return std::make_unique<PeerService>(d, node_socket);
}

}  // namespace ulysses::daemon
