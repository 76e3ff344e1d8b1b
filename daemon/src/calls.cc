// The call path shared by the Call RPC and the shared-memory rings: find the session, validate
// against the caller's buffers (never trusting the client), run, account.
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>

#include "daemon.h"
#include "host_allocations.h"
#include "ulysses/common/failpoint.h"
#include "ulysses/common/logging.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/shm.h"

namespace ulysses::daemon {
namespace {

// Resolves buffer ids against one client's buffers; another client's id is PERMISSION_DENIED.
class ClientBuffers : public BufferResolver {
 public:
  ClientBuffers(Daemon* d, ClientRecord* c) : d_(d), c_(c) {}
  absl::StatusOr<BufferInfo> Resolve(uint64_t id) const override {
    if (std::shared_ptr<Buffer> b = Find(id))
      return BufferInfo{b->size, b->device ? nullptr : b->data};
    for (auto& other : d_->Clients()) {
      if (other.get() == c_) continue;
      std::lock_guard<std::mutex> lock(other->mu);
      if (other->buffers.count(id))
        return absl::PermissionDeniedError(StrCat("buffer ", id, " belongs to another client"));
    }
    return absl::InvalidArgumentError(StrCat("buffer ", id, " is not registered"));
  }
  std::shared_ptr<Buffer> Find(uint64_t id) const {
    std::lock_guard<std::mutex> lock(c_->mu);
    auto it = c_->buffers.find(id);
    return it == c_->buffers.end() ? nullptr : it->second;
  }

 private:
  Daemon* d_;
  ClientRecord* c_;
};

// What a ring worker reserves up front: calls in flight, sessions with calls in flight, and
// calls one poll of a session finishes. Past them the lists grow once, and keep the room.
constexpr size_t kPendingReserved = 64;
constexpr size_t kSessionsReserved = 8;
constexpr size_t kFinishedReserved = 16;

}  // namespace

absl::StatusOr<std::shared_ptr<Session>> Daemon::FindSession(ClientRecord& c, uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.sessions.find(id);
    if (it != c.sessions.end()) return it->second;
  }
  for (auto& other : Clients()) {
    if (other.get() == &c) continue;
    std::lock_guard<std::mutex> lock(other->mu);
    if (other->sessions.count(id))
      return absl::PermissionDeniedError(StrCat("session_id: ", id, " belongs to another client"));
  }
  return absl::NotFoundError(StrCat("session_id: ", id, " is not open"));
}

absl::Status Daemon::RefuseDescriptor(ClientRecord& c, uint64_t session_id, uint64_t epoch,
                                      absl::Status why) {
  if (epoch == 0) return why;  // names no call: nothing to spend
  absl::StatusOr<std::shared_ptr<Session>> s = FindSession(c, session_id);
  if (!s.ok()) return why;
  return (*s)->Refuse(epoch, std::move(why));
}

absl::StatusOr<CallResult> Daemon::RunCall(ClientRecord& c, uint64_t session_id,
                                           const CallArgs& args, uint64_t expected_epoch,
                                           ExecuteMode mode, CallRecord* rec,
                                           std::shared_ptr<Session>* session) {
  ULY_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, FindSession(c, session_id));
  *session = s;
  ClientBuffers buffers(this, &c);
  absl::StatusOr<CallPlan> plan =
      s->fused() != nullptr
          ? PlanQkvCall(s->fused()->geometry, args, buffers, &s->fused_weights())
          : PlanCall(s->geometry(), args, buffers);
  // Every refusal of a descriptor already counted on its epoch goes through here: the epoch is
  // spent and the session breaks, so the peers see ABORTED instead of waiting out their timeout.
  auto refuse = [&](absl::Status why) {
    if (expected_epoch != 0) return s->Refuse(expected_epoch, std::move(why));
    return why;
  };
  if (!plan.ok()) return refuse(plan.status());
  // Hold the buffers for the call: a concurrent FreeBuffer cannot unmap them underneath.
  std::shared_ptr<Buffer> held[4];
  CallOperands ops;
  for (int i = 0; i < plan->num_inputs; ++i) {
    held[i] = buffers.Find(plan->inputs[i].buffer_id);
    if (!held[i]) return refuse(absl::InvalidArgumentError(StrCat("inputs[", i, "]: buffer freed")));
    ops.inputs[i] = static_cast<const uint8_t*>(held[i]->data) + plan->inputs[i].offset_bytes;
  }
  if (plan->has_out) {
    held[3] = buffers.Find(plan->out.buffer_id);
    if (!held[3]) return refuse(absl::InvalidArgumentError("out: buffer freed"));
  }
  // The backend's kernels address one kind of memory; the other kind would fault (a GPU
  // backend) or read garbage, so refuse it before anything runs.
  const bool wants_device = !backend_impl().slots_in_segment();
  for (int i = 0; i < 4; ++i) {
    if (!held[i] || held[i]->device == wants_device) continue;
    const std::string what = i == 3 ? std::string("out") : StrCat("inputs[", i, "]");
    absl::Status bad = absl::InvalidArgumentError(StrCat(
        what, ": buffer ", held[i]->id, " is ", held[i]->device ? "device" : "host",
        " memory; the ", backend(), " backend needs ", wants_device ? "device" : "host", " memory"));
    return refuse(std::move(bad));
  }
  if (plan->has_out) {
    ops.out = static_cast<uint8_t*>(held[3]->data) + plan->out.offset_bytes;
  }
  for (int i = 0; i < 4; ++i) ops.keep[i] = held[i];
  rec->started = absl::Now();
  CallResult r;
  ULY_ASSIGN_OR_RETURN(r.outcome, s->Execute(*plan, ops, absl::Milliseconds(config_.call_timeout_ms),
                                             expected_epoch, mode));
  if (r.outcome.pending) rec->enqueued = absl::Now();
  r.out_shape = plan->out_shape;
  rec->epoch = r.outcome.epoch;
  rec->bytes_sent = r.outcome.bytes_sent;
  c.calls.fetch_add(1);
  return r;
}

absl::StatusOr<FusedWeightsHeld> Daemon::ResolveFusedWeights(ClientRecord& c,
                                                              const FusedGeometry& g,
                                                              const FusedWeightsArgs& w) {
  ClientBuffers buffers(this, &c);
  ULY_RETURN_IF_ERROR(ValidateFusedWeights(g, w, buffers));
  const bool wants_device = !backend_impl().slots_in_segment();
  FusedWeightsHeld held;
  const std::pair<const char*, const FusedTensorRef*> named[] = {
      {"w_qkv", &w.w_qkv}, {"q_norm", &w.q_norm}, {"k_norm", &w.k_norm}, {"cos_sin", &w.cos_sin}};
  const void* ptrs[4] = {};
  for (int i = 0; i < 4; ++i) {
    std::shared_ptr<Buffer> b = buffers.Find(named[i].second->buffer_id);
    if (!b) return absl::InvalidArgumentError(StrCat(named[i].first, ": buffer freed"));
    if (b->device != wants_device)
      return absl::InvalidArgumentError(StrCat(
          named[i].first, ": buffer ", b->id, " is ", b->device ? "device" : "host", " memory; the ",
          backend(), " backend needs ", wants_device ? "device" : "host", " memory"));
    ptrs[i] = static_cast<const uint8_t*>(b->data) + named[i].second->offset_bytes;
    held.buffers.push_back(std::move(b));
  }
  held.weights = kernels::QkvWeights{ptrs[0], ptrs[1], ptrs[2], static_cast<const float*>(ptrs[3])};
  return held;
}

absl::StatusOr<CallResult> Daemon::Call(ClientRecord& c, uint64_t session_id, const CallArgs& args,
                                        uint64_t expected_epoch, ExecuteMode mode,
                                        PendingCall* pending) {
  CallRecord rec;
  rec.client_id = c.id;
  rec.session_id = session_id;
  rec.op = args.op;
  rec.batch = args.batch;
  rec.seq = args.seq;
  rec.epoch = expected_epoch;
  rec.queued = absl::Now();
  CallStarted();
  std::shared_ptr<Session> session;
  absl::StatusOr<CallResult> r = RunCall(c, session_id, args, expected_epoch, mode, &rec, &session);
  if (r.ok() && r->outcome.pending && pending != nullptr) {
    // Enqueued on the session's stream: accounted when it finishes (FinishPending).
    pending->session = session;
    pending->session_id = session_id;
    pending->epoch = r->outcome.epoch;
    pending->out_shape = r->out_shape;
    pending->record = std::move(rec);
    return r;
  }
  rec.done = absl::Now();
  if (rec.started == absl::Time()) rec.started = rec.done;
  rec.code = r.status().code();
  rec.message = std::string(r.status().message());
  if (r.ok()) r->elapsed_us = absl::ToInt64Microseconds(rec.done - rec.queued);
  else
    Logger("exec")->debug("client {} session {} epoch {}: {}", c.id, session_id, rec.epoch,
                          r.status().ToString());
  CallFinished(std::move(rec));
  return r;
}

absl::StatusOr<CallResult> Daemon::FinishPending(PendingCall& p,
                                                 absl::StatusOr<CallOutcome> outcome) {
  CallRecord& rec = p.record;
  rec.done = absl::Now();
  rec.code = outcome.status().code();
  rec.message = std::string(outcome.status().message());
  CallFinished(rec);
  if (!outcome.ok()) {
    Logger("exec")->debug("client {} session {} epoch {}: {}", p.record.client_id, p.session_id,
                          p.epoch, outcome.status().ToString());
    return outcome.status();
  }
  CallResult r;
  r.outcome = *outcome;
  r.out_shape = p.out_shape;
  r.elapsed_us = absl::ToInt64Microseconds(rec.done - rec.queued);
  return r;
}

absl::StatusOr<std::shared_ptr<ClientRings>> Daemon::CreateRings(
    const std::shared_ptr<ClientRecord>& c) {
  auto rings = std::make_shared<ClientRings>();
  ULY_ASSIGN_OR_RETURN(rings->memfd, ipc::CreateMemfd(StrCat("ulysses-client-", c->id),
                                                      ipc::ClientSegmentLayout::kTotal));
  ULY_RETURN_IF_ERROR(ipc::SealSize(rings->memfd.get()));
  ULY_ASSIGN_OR_RETURN(rings->mapping, ipc::Mapping::Map(rings->memfd.get(),
                                                         ipc::ClientSegmentLayout::kTotal, true));
  auto* base = static_cast<uint8_t*>(rings->mapping.data());
  rings->header = reinterpret_cast<ipc::ClientSegmentHeader*>(base + ipc::ClientSegmentLayout::kHeader);
  rings->header->magic = ipc::kClientSegmentMagic;
  rings->header->version = ipc::kClientSegmentVersion;
  rings->header->ring_capacity = ipc::kRingCapacity;
  rings->header->client_id = c->id;
  ULY_ASSIGN_OR_RETURN(rings->submit, ipc::SubmitRing::Create(base + ipc::ClientSegmentLayout::kSubmit,
                                                              sizeof(ipc::SubmitRing)));
  ULY_ASSIGN_OR_RETURN(rings->complete,
                       ipc::CompletionRing::Create(base + ipc::ClientSegmentLayout::kComplete,
                                                   sizeof(ipc::CompletionRing)));
  using Ends = std::pair<ipc::Doorbell, ipc::Doorbell>;  // ringing end, waiting end
  ULY_ASSIGN_OR_RETURN(Ends submit, ipc::Doorbell::Create());
  ULY_ASSIGN_OR_RETURN(Ends complete, ipc::Doorbell::Create());
  rings->submit_bell = std::move(submit.second);
  rings->submit_ring = std::move(submit.first);
  rings->complete_bell = std::move(complete.first);
  rings->complete_wait = std::move(complete.second);
  return rings;
}

void Daemon::StartRingWorker(const std::shared_ptr<ClientRecord>& c,
                             const std::shared_ptr<ClientRings>& rings) {
  std::thread previous;
  {
    // Started under the lock, so the worker's exit (which takes it) finds its entry.
    std::lock_guard<std::mutex> lock(workers_mu_);
    if (stopping_.load() || rings->worker_running.load()) return;
    if (auto it = workers_.find(c->id); it != workers_.end()) {
      previous = std::move(it->second);  // this client's last worker, which has ended
      workers_.erase(it);
      std::erase(workers_done_, c->id);
    }
    rings->worker_running.store(true);
    workers_.emplace(c->id, std::thread([this, c, rings] { RingWorker(c, rings); }));
  }
  if (previous.joinable()) previous.join();  // it has returned or is about to
}

void Daemon::JoinFinishedWorkers() {
  std::vector<std::thread> done;
  {
    std::lock_guard<std::mutex> lock(workers_mu_);
    for (uint64_t id : workers_done_) {
      auto it = workers_.find(id);
      if (it == workers_.end()) continue;
      done.push_back(std::move(it->second));
      workers_.erase(it);
    }
    workers_done_.clear();
  }
  for (std::thread& t : done) t.join();  // each has returned or is about to
}

// Every wait inside a step is bounded by the call timeout (a peer's slot, its block, a free
// slot), so a step that outlasts it by timeouts.worker_stall_ms holds something unbounded: on a
// GPU backend, a CUDA call that waits for the device.
void Daemon::ReportStalledWorkers(const std::vector<std::shared_ptr<ClientRecord>>& clients,
                                  absl::Time now) {
  if (config_.worker_stall_ms <= 0) return;
  const absl::Duration limit =
      absl::Milliseconds(config_.call_timeout_ms) + absl::Milliseconds(config_.worker_stall_ms);
  for (const auto& c : clients) {
    std::shared_ptr<ClientRings> rings;
    {
      std::lock_guard<std::mutex> lock(c->mu);
      rings = c->rings;
    }
    if (!rings) continue;
    std::optional<WorkerWatch::Stall> stall = rings->watch.Check(now, limit);
    if (!stall) continue;
    Logger("exec")->warn(
        "client {} ({}): its ring worker has been {} (session {}) for {:.1f} s, past the call "
        "timeout ({} ms) by more than timeouts.worker_stall_ms ({} ms); it neither serves the "
        "client nor times its calls out meanwhile (docs/operations.md, troubleshooting)",
        c->id, c->name, stall->what, stall->session_id, absl::ToDoubleSeconds(stall->running),
        config_.call_timeout_ms, config_.worker_stall_ms);
    worker_stalls_.fetch_add(1);
  }
}

// One thread per client, while the client has calls, drains its submit ring in order and posts
// one completion per descriptor. It ends when the client is reclaimed (the header's abort word),
// or when it has had nothing to do for kRingWorkerIdle: then the fd thread watches the submit
// bell, and starts a worker again at the client's next ring. Its last check of the ring came
// after its last wait on the bell (PopWait), so a descriptor pushed after that check leaves the
// bell rung and is not lost.
void Daemon::RingWorker(std::shared_ptr<ClientRecord> c, std::shared_ptr<ClientRings> rings) {
  auto log = Logger("exec");
  // Each step that calls into the backend is watched (WorkerWatch); one the fd thread reported
  // as stalled is reported again here when it returns.
  auto step = [&](const char* what, uint64_t session_id, auto&& body) {
    rings->watch.Begin(what, session_id, absl::Now());
    auto result = body();
    if (std::optional<absl::Duration> ran = rings->watch.End(absl::Now()))
      log->warn("client {} ({}): its ring worker returned from {} (session {}) after {:.1f} s",
                c->id, c->name, what, session_id, absl::ToDoubleSeconds(*ran));
    return result;
  };
  // Calls enqueued on stream-ordered sessions, oldest first: their completions are posted when
  // Session::Poll finds them finished, while this worker goes on draining the ring. Like
  // `polled` below, it keeps its storage from call to call, so that a steady stream of calls
  // allocates nothing here.
  std::vector<PendingCall> pending;
  // Per session with calls in flight: its calls finished at this collect. An entry stays while
  // its session lives.
  struct Polled {
    uint64_t session_id = 0;
    std::weak_ptr<Session> session;
    bool done = false;  // polled at this collect (or its session is closed)
    std::vector<FinishedCall> finished;
  };
  std::vector<Polled> polled;
  pending.reserve(kPendingReserved);
  polled.reserve(kSessionsReserved);
  absl::Time last_progress = absl::Now();
  auto post = [&](const ipc::CallDescriptor& d, const absl::StatusOr<CallResult>& r) -> bool {
    ipc::Completion done{};
    done.session_id = d.session_id;
    done.epoch = d.epoch;
    done.code = static_cast<int32_t>(r.status().code());
    if (r.ok()) {
      done.slot = r->outcome.slot;
      done.slot_offset_bytes = r->outcome.slot_offset_bytes;
      done.result_bytes = r->outcome.result_bytes;
      done.elapsed_us = r->elapsed_us;
      for (int i = 0; i < 4; ++i) done.out_shape[i] = r->out_shape[i];
    } else {
      const std::string msg(r.status().message());
      std::strncpy(done.message, msg.c_str(), sizeof done.message - 1);
    }
    absl::StatusOr<std::shared_ptr<Session>> s = FindSession(*c, d.session_id);
    done.next_epoch = s.ok() ? (*s)->next_epoch() : 0;
    // The client drains completions while it submits or waits; a client that stops doing so
    // stalls only itself, and its worker backs off instead of spinning. Give up when it is
    // reclaimed.
    const absl::Status pushed = ipc::PushBackoff(*rings->complete, done, &rings->stop);
    if (!pushed.ok()) {
      if (pushed.code() != absl::StatusCode::kAborted) {
        // The client corrupted its own completion ring: it cannot be served any more.
        log->warn("client {}: completion ring: {}; dropping the client", c->id,
                  std::string(pushed.message()));
        Reclaim(c->id, StrCat("corrupted completion ring: ", pushed.message()));
      }
      return false;
    }
    (void)rings->complete_bell.Signal();
    return true;
  };
  // The entry of `p`'s session, made at its first call in flight.
  auto polled_for = [&](const PendingCall& p) -> Polled& {
    for (Polled& e : polled)
      if (e.session_id == p.session_id) return e;
    polled.push_back(Polled{p.session_id, p.session, false, {}});
    // It swaps storage with its session's list (Session::TakeFinished): both must have room.
    polled.back().finished.reserve(kFinishedReserved);
    return polled.back();
  };
  // Posts every pending call that finished (or whose session is gone). False: the client left.
  auto collect = [&]() -> bool {
    host_allocations::CallPathScope on_call_path;
    for (Polled& e : polled) {
      e.done = false;
      e.finished.clear();
    }
    for (PendingCall& p : pending) {
      Polled& e = polled_for(p);
      if (e.done) continue;
      e.done = true;
      std::shared_ptr<Session> s = p.session.lock();
      if (!s) continue;  // closed: its pending calls end below
      // The step holds the last reference a closing session may leave here, so that its
      // teardown is watched too.
      step("polling its calls in flight", p.session_id, [&] {
        s->Poll();
        s->TakeFinished(&e.finished);
        s.reset();
        return true;
      });
    }
    for (auto it = pending.begin(); it != pending.end();) {
      std::vector<FinishedCall>& f = polled_for(*it).finished;
      auto match = std::find_if(f.begin(), f.end(),
                                [&](const FinishedCall& fc) { return fc.epoch == it->epoch; });
      if (match == f.end() && !it->session.expired()) {
        ++it;
        continue;
      }
      // Its error is built only for a call whose session closed under it.
      absl::StatusOr<CallOutcome> outcome =
          match != f.end() ? std::move(match->outcome)
                           : absl::StatusOr<CallOutcome>(absl::AbortedError(StrCat(
                                 "session ", it->session_id,
                                 " was closed while its call was in flight")));
      ipc::CallDescriptor d{};
      d.session_id = it->session_id;
      d.epoch = it->epoch;
      absl::StatusOr<CallResult> r = FinishPending(*it, std::move(outcome));
      it = pending.erase(it);
      last_progress = absl::Now();
      if (!post(d, r)) return false;
    }
    std::erase_if(polled, [](const Polled& e) { return e.session.expired(); });
    return true;
  };
  // After a call, the worker polls its ring this long before it sleeps (rings.worker_spin_us).
  const absl::Duration spin = absl::Microseconds(config_.ring_spin_us);
  for (;;) {
    ipc::CallDescriptor d;
    // With calls in flight, poll them every 20 us for 2 ms after the last progress, then about
    // every millisecond; with none, sleep on the doorbell.
    const absl::Time now = absl::Now();
    const absl::Duration window = pending.empty()                           ? kRingWorkerIdle
                                  : now - last_progress < absl::Milliseconds(2) ? absl::Microseconds(20)
                                                                                : absl::Milliseconds(1);
    absl::StatusOr<bool> got = ipc::PopWait(*rings->submit, &d, rings->submit_bell, now + window,
                                            &rings->stop, spin);
    if (!got.ok()) {
      if (got.status().code() != absl::StatusCode::kAborted) {
        // The client corrupted its own ring: it cannot be served any more.
        log->warn("client {}: submit ring: {}; dropping the client", c->id,
                  std::string(got.status().message()));
        Reclaim(c->id, StrCat("corrupted submit ring: ", got.status().message()));
      }
      break;
    }
    if (!*got) {
      if (pending.empty()) break;  // idle: the fd thread takes over the bell
      if (!collect()) break;
      continue;
    }
    // From here to the completion's post, a prepared call allocates no host memory: the
    // ulyssesd executable counts what it does (GetState call_path_host_allocations).
    host_allocations::CallPathScope on_call_path;
    absl::StatusOr<CallArgs> args = ipc::CallArgsFromDescriptor(d);
    const ExecuteMode mode{/*async=*/true,
                           /*wait_ready=*/(d.flags & ipc::kDescriptorStreamOrdered) != 0,
                           /*released_in_order=*/(d.flags & ipc::kDescriptorReleasedInOrder) != 0};
    PendingCall p;
    absl::StatusOr<CallResult> r = step("executing a call", d.session_id, [&] {
      Failpoint("ring_worker.execute");
      return args.ok() ? Call(*c, d.session_id, *args, d.epoch, mode, &p)
                       : RefuseDescriptor(*c, d.session_id, d.epoch, args.status());
    });
    if (r.ok() && r->outcome.pending) {
      if (pending.empty()) last_progress = absl::Now();
      pending.push_back(std::move(p));
    } else if (!post(d, r)) {
      break;
    }
    if (!pending.empty() && !collect()) break;
  }
  // Idle, or the client is gone: then its calls still in flight end with it (their sessions are
  // reclaimed and cancelled with the client).
  for (PendingCall& p : pending)
    (void)FinishPending(p, absl::AbortedError("the client was reclaimed while its call was in flight"));
  {
    std::lock_guard<std::mutex> lock(workers_mu_);
    rings->worker_running.store(false);
    workers_done_.push_back(c->id);
  }
  // The fd thread rebuilds its poll set, now with this client's submit bell.
  if (poll_wake_) (void)poll_wake_->Signal();
}

}  // namespace ulysses::daemon
