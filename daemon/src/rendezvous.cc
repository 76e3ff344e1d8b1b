#include "rendezvous.h"

#include <algorithm>
#include <optional>
#include <set>

#include "ulysses/common/geometry.h"
#include "ulysses/common/happens_before.h"
#include "ulysses/common/logging.h"
#include "ulysses/common/sockets.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/proto/grpc_status.h"

namespace ulysses::daemon {

absl::Status ValidateArrival(const std::string& key, int64_t world_size, int64_t rank,
                             const std::string& agreement, const std::string& payload) {
  if (key.empty() || key.size() > kMaxRendezvousKeyBytes)
    return absl::InvalidArgumentError(
        StrCat("key: ", key.size(), " bytes, expected 1..", kMaxRendezvousKeyBytes));
  if (world_size < 1 || world_size > kMaxWorldSize)
    return absl::InvalidArgumentError(
        StrCat("world_size: ", world_size, " is not in [1, ", kMaxWorldSize, "]"));
  if (rank < 0 || rank >= world_size)
    return absl::InvalidArgumentError(StrCat("rank: ", rank, " is not in [0, ", world_size, ")"));
  if (agreement.size() > kMaxRendezvousAgreementBytes)
    return absl::InvalidArgumentError(StrCat("agreement: ", agreement.size(), " bytes exceed ",
                                             kMaxRendezvousAgreementBytes));
  if (payload.size() > kMaxRendezvousPayloadBytes)
    return absl::InvalidArgumentError(
        StrCat("payload: ", payload.size(), " bytes exceed ", kMaxRendezvousPayloadBytes));
  return absl::OkStatus();
}

RendezvousTable::RendezvousTable() : deadline_thread_([this] { DeadlineLoop(); }) {}

RendezvousTable::~RendezvousTable() {
  Answers answers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    while (!entries_.empty()) {
      auto it = entries_.begin();
      const std::string key = it->first;
      FinishLocked(key, *it->second,
                   absl::AbortedError(StrCat("rendezvous ", key, " aborted: the table is closing")),
                   &answers);
    }
  }
  deadline_cv_.notify_all();
  deadline_thread_.join();
  for (auto& [done, verdict] : answers) done(std::move(verdict));
}

absl::StatusOr<uint64_t> RendezvousTable::Arrive(const std::string& key, int world_size, int rank,
                                                 const std::string& agreement,
                                                 const std::string& payload, absl::Time deadline,
                                                 Done done, std::optional<uint32_t> client_uid) {
  ULY_RETURN_IF_ERROR(ValidateArrival(key, world_size, rank, agreement, payload));
  Answers answers;
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (const std::string* why = EndedLocked(key, absl::Now()))
      return absl::AbortedError(StrCat("rendezvous ", key, " aborted: ", *why));
    std::shared_ptr<Entry> e;
    if (auto it = entries_.find(key); it != entries_.end()) {
      e = it->second;
    } else {
      if (entries_.size() >= kMaxPendingRendezvous)
        return absl::ResourceExhaustedError(StrCat("rendezvous ", key, ": ", entries_.size(),
                                                   " keys are pending already (the limit)"));
      if (client_uid) {
        const auto opened = opened_by_uid_.find(*client_uid);
        if (opened != opened_by_uid_.end() && opened->second >= kMaxPendingRendezvousPerUid)
          return absl::ResourceExhaustedError(
              StrCat("rendezvous ", key, ": the clients of uid ", *client_uid, " have ",
                     opened->second, " steps pending at rank 0's daemon already (the limit)"));
      }
      // Built whole before it is published: no error path leaves a partial entry behind.
      auto fresh = std::make_shared<Entry>();
      fresh->opened_by = client_uid;
      if (client_uid) ++opened_by_uid_[*client_uid];
      fresh->serial = next_id_++;
      fresh->world_size = world_size;
      fresh->payloads.resize(world_size);
      fresh->agreements.resize(world_size);
      entries_.emplace(key, fresh);
      e = std::move(fresh);
    }
    id = next_id_++;
    e->waiters.push_back(Waiter{id, std::move(done)});
    arrivals_.emplace(id, Arrival{e, key, rank});
    ++waiting_;
    if (e->world_size != world_size) {
      FinishLocked(key, *e,
                   absl::InvalidArgumentError(StrCat("rendezvous ", key, ": world_size mismatch (",
                                                     e->world_size, " vs ", world_size,
                                                     " from rank ", rank, ")")),
                   &answers);
    } else if (e->payloads[rank].has_value()) {
      FinishLocked(key, *e,
                   absl::InvalidArgumentError(
                       StrCat("rendezvous ", key, ": rank ", rank, " arrived twice")),
                   &answers);
    } else {
      e->payloads[rank] = payload;
      e->agreements[rank] = agreement;
      if (++e->arrived == e->world_size) {
        absl::Status verdict;
        for (int r = 1; r < e->world_size && verdict.ok(); ++r) {
          if (e->agreements[r] != e->agreements[0])
            verdict = absl::InvalidArgumentError(
                StrCat("mismatch between ranks in ", key, ": rank 0 has {", e->agreements[0],
                       "}, rank ", r, " has {", e->agreements[r], "}"));
        }
        FinishLocked(key, *e, verdict, &answers);
      } else if (deadline < e->deadline) {
        // The earliest deadline of the ranks waiting ends the step.
        deadlines_.erase({e->deadline, e->serial});
        e->deadline = deadline;
        deadlines_.emplace(std::make_pair(deadline, e->serial), key);
        deadline_cv_.notify_all();
      }
    }
  }
  for (auto& [answer, verdict] : answers) answer(std::move(verdict));
  return id;
}

void RendezvousTable::Cancel(uint64_t id) {
  Answers answers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = arrivals_.find(id);
    if (it == arrivals_.end()) return;  // answered already
    const std::string key = it->second.key;
    const int rank = it->second.rank;
    std::shared_ptr<Entry> e = it->second.entry;
    FinishLocked(key, *e,
                 absl::AbortedError(StrCat("rendezvous ", key, " aborted: rank ", rank,
                                           "'s daemon went away during the rendezvous")),
                 &answers);
  }
  for (auto& [done, verdict] : answers) done(std::move(verdict));
}

void RendezvousTable::FinishLocked(const std::string& key, Entry& e, const absl::Status& verdict,
                                   Answers* out) {
  Verdict answer = std::vector<std::string>();
  if (verdict.ok()) {
    answer->reserve(e.world_size);
    for (auto& p : e.payloads) answer->push_back(*p);
  } else {
    answer = verdict;
  }
  for (Waiter& w : e.waiters) {
    arrivals_.erase(w.id);
    out->emplace_back(std::move(w.done), answer);
  }
  waiting_ -= e.waiters.size();
  e.waiters.clear();
  deadlines_.erase({e.deadline, e.serial});
  // Every rank that took part has its answer: the key can be used again at once.
  auto it = entries_.find(key);
  if (it != entries_.end() && it->second.get() == &e) {
    if (e.opened_by) {
      auto opened = opened_by_uid_.find(*e.opened_by);
      if (opened != opened_by_uid_.end() && --opened->second == 0) opened_by_uid_.erase(opened);
    }
    entries_.erase(it);
  }
}

void RendezvousTable::DeadlineLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (deadlines_.empty()) {
      deadline_cv_.wait(lock);
      continue;
    }
    const absl::Time first = deadlines_.begin()->first.first;
    if (absl::Now() < first) {
      deadline_cv_.wait_until(lock, absl::ToChronoTime(first));
      continue;
    }
    const std::string key = deadlines_.begin()->second;
    std::shared_ptr<Entry> e = entries_.at(key);
    std::string missing;
    for (int r = 0; r < e->world_size; ++r)
      if (!e->payloads[r].has_value()) missing += (missing.empty() ? "" : ",") + std::to_string(r);
    Answers answers;
    FinishLocked(key, *e,
                 absl::DeadlineExceededError(StrCat("rendezvous ", key, ": ranks [", missing,
                                                    "] did not arrive before the deadline")),
                 &answers);
    lock.unlock();
    for (auto& [done, verdict] : answers) done(std::move(verdict));
    lock.lock();
  }
}

absl::Status ValidateAbort(const std::string& key, const std::string& reason, bool prefix) {
  if (key.empty() || key.size() > kMaxRendezvousKeyBytes)
    return absl::InvalidArgumentError(
        StrCat("key: ", key.size(), " bytes, expected 1..", kMaxRendezvousKeyBytes));
  if (prefix && key.back() != '/')
    return absl::InvalidArgumentError("key: a prefix must end in '/'");
  if (reason.size() > kMaxRendezvousReasonBytes)
    return absl::InvalidArgumentError(
        StrCat("reason: ", reason.size(), " bytes exceed ", kMaxRendezvousReasonBytes));
  return absl::OkStatus();
}

absl::Status RendezvousTable::Abort(const std::string& key, const std::string& reason) {
  ULY_RETURN_IF_ERROR(ValidateAbort(key, reason));
  Answers answers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) return absl::OkStatus();
    std::shared_ptr<Entry> e = it->second;
    FinishLocked(key, *e, absl::AbortedError(StrCat("rendezvous ", key, " aborted: ", reason)),
                 &answers);
  }
  for (auto& [done, verdict] : answers) done(std::move(verdict));
  return absl::OkStatus();
}

absl::Status RendezvousTable::EndGroup(const std::string& prefix, const std::string& reason) {
  ULY_RETURN_IF_ERROR(ValidateAbort(prefix, reason, /*prefix=*/true));
  Answers answers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const absl::Time now = absl::Now();
    // Forget what is too old, then the oldest while the table is full.
    for (auto it = ended_.begin(); it != ended_.end();)
      it = now - it->second.at > kEndedGroupMemory ? ended_.erase(it) : std::next(it);
    while (ended_.size() >= kMaxEndedGroups && ended_.count(prefix) == 0) {
      auto oldest = ended_.begin();
      for (auto it = ended_.begin(); it != ended_.end(); ++it)
        if (it->second.serial < oldest->second.serial) oldest = it;
      ended_.erase(oldest);
    }
    ended_[prefix] = Ended{reason, now, next_id_++};
    // The waiting steps under the prefix: the keys from `prefix` up to the first that no
    // longer starts with it.
    for (auto it = entries_.lower_bound(prefix);
         it != entries_.end() && it->first.compare(0, prefix.size(), prefix) == 0;) {
      const std::string key = it->first;
      std::shared_ptr<Entry> e = it->second;
      ++it;  // FinishLocked erases the entry
      FinishLocked(key, *e, absl::AbortedError(StrCat("rendezvous ", key, " aborted: ", reason)),
                   &answers);
    }
  }
  for (auto& [done, verdict] : answers) done(std::move(verdict));
  return absl::OkStatus();
}

const std::string* RendezvousTable::EndedLocked(const std::string& key, absl::Time now) {
  if (ended_.empty()) return nullptr;
  // Every prefix of the key that ends in '/', shortest first.
  for (size_t slash = key.find('/'); slash != std::string::npos; slash = key.find('/', slash + 1)) {
    auto it = ended_.find(key.substr(0, slash + 1));
    if (it != ended_.end() && now - it->second.at <= kEndedGroupMemory) return &it->second.reason;
  }
  return nullptr;
}

size_t RendezvousTable::ended_groups() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ended_.size();
}

size_t RendezvousTable::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

size_t RendezvousTable::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiting_;
}

std::string GrpcTarget(const std::string& address) {
  if (address.rfind("unix:", 0) == 0) return address;
  if (!address.empty() && address[0] == '/') return "unix://" + address;
  return address;
}

absl::StatusOr<std::string> NodeSocketAddress(const std::string& address) {
  // In every unix form the path ends the address, so the suffix goes at its end.
  if (address.rfind("unix:", 0) == 0 || (!address.empty() && address[0] == '/'))
    return StrCat(address, kNodeSocketSuffix);
  return absl::InvalidArgumentError(
      StrCat("member address '", address,
             "' is not a unix socket: Peer is served on a daemon's node socket only"));
}

std::shared_ptr<grpc::Channel> ChannelCache::Get(const std::string& address, absl::Time now) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (now - it->second.last_used > idle_) it = entries_.erase(it);
    else ++it;
  }
  auto it = entries_.find(address);
  if (it == entries_.end()) {
    if (entries_.size() >= capacity_) {
      auto oldest = entries_.begin();
      for (auto e = entries_.begin(); e != entries_.end(); ++e)
        if (e->second.last_used < oldest->second.last_used) oldest = e;
      entries_.erase(oldest);
    }
    it = entries_
             .emplace(address, Entry{grpc::CreateChannel(GrpcTarget(address),
                                                         grpc::InsecureChannelCredentials()),
                                     now})
             .first;
  }
  it->second.last_used = now;
  return it->second.channel;
}

namespace {
// One EndGroup call to rank 0's table, alive until gRPC answers it.
struct EndGroupCall {
  std::unique_ptr<v1::Peer::Stub> stub;
  grpc::ClientContext ctx;
  v1::AbortRendezvousRequest req;
  v1::AbortRendezvousResponse resp;
};
}  // namespace

struct RendezvousClient::EndGroupCalls {
  std::mutex mu;
  std::condition_variable ended;
  std::set<std::shared_ptr<EndGroupCall>> calls;
};

RendezvousClient::RendezvousClient() : end_group_calls_(std::make_shared<EndGroupCalls>()) {}

RendezvousClient::~RendezvousClient() {
  EndGroupCalls& in_flight = *end_group_calls_;
  std::vector<std::shared_ptr<EndGroupCall>> pending;
  {
    std::lock_guard<std::mutex> lock(in_flight.mu);
    pending.assign(in_flight.calls.begin(), in_flight.calls.end());
  }
  // Outside the lock: a cancel may run the callback, which takes it.
  for (const auto& call : pending) call->ctx.TryCancel();
  pending.clear();
  {
    std::unique_lock<std::mutex> lock(in_flight.mu);
    if (!in_flight.ended.wait_for(lock, absl::ToChronoNanoseconds(kEndGroupDrain),
                                  [&] { return in_flight.calls.empty(); }))
      Logger("peer")->warn("{} end-of-group call(s) still unanswered at shutdown",
                           in_flight.calls.size());
  }
  std::lock_guard<std::mutex> lock(mu_);
  channels_.clear();
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> RendezvousClient::ChannelFor(
    const std::string& address) {
  ULY_ASSIGN_OR_RETURN(const std::string node, NodeSocketAddress(address));
  std::lock_guard<std::mutex> lock(mu_);
  return channels_.Get(node, absl::Now());
}

absl::Status RendezvousClient::Abort(const std::string& address, const std::string& key,
                                     const std::string& reason) {
  ULY_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, ChannelFor(address));
  auto stub = v1::Peer::NewStub(channel);
  v1::AbortRendezvousRequest req;
  req.set_key(key);
  req.set_reason(reason);
  v1::AbortRendezvousResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + RendezvousCall::kAbortTimeout));
  return FromGrpcStatus(stub->AbortRendezvous(&ctx, req, &resp));
}

absl::Status RendezvousClient::EndGroup(const std::string& address, const std::string& prefix,
                                        const std::string& reason) {
  ULY_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, ChannelFor(address));
  auto call = std::make_shared<EndGroupCall>();
  call->stub = v1::Peer::NewStub(channel);
  call->req.set_key(prefix);
  call->req.set_reason(reason);
  call->req.set_prefix(true);
  call->ctx.set_deadline(absl::ToChronoTime(absl::Now() + RendezvousCall::kAbortTimeout));
  // The call keeps itself (and its stub) alive until gRPC answers it, and is listed until its
  // callback is done, so that the destructor can wait for it.
  std::shared_ptr<EndGroupCalls> in_flight = end_group_calls_;
  {
    std::lock_guard<std::mutex> lock(in_flight->mu);
    in_flight->calls.insert(call);
  }
  HappensBefore(&call->ctx);
  call->stub->async()->AbortRendezvous(
      &call->ctx, &call->req, &call->resp, [call, address, in_flight](grpc::Status s) {
        HappensAfter(&call->ctx);
        if (!s.ok() && s.error_code() != grpc::StatusCode::CANCELLED)  // cancelled: shutdown
          Logger("peer")->warn("end of group {} at {}: {}", call->req.key(), address,
                               s.error_message());
        std::lock_guard<std::mutex> lock(in_flight->mu);
        in_flight->calls.erase(call);
        in_flight->ended.notify_all();
      });
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<RendezvousCall>> RendezvousClient::Start(
    const std::string& address, const std::string& key, int world_size, int rank,
    const std::string& agreement, const std::string& payload, absl::Duration timeout,
    RendezvousDone done, std::optional<uint32_t> client_uid) {
  ULY_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, ChannelFor(address));
  auto call = std::make_shared<RendezvousCall>();
  call->address_ = address;
  call->key_ = key;
  call->rank_ = rank;
  call->channel_ = std::move(channel);
  call->stub_ = v1::Peer::NewStub(call->channel_);
  call->done_ = std::move(done);
  call->req_.set_key(key);
  call->req_.set_world_size(world_size);
  call->req_.set_rank(rank);
  call->req_.set_agreement(agreement);
  call->req_.set_payload(payload);
  call->req_.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  if (client_uid) call->req_.set_client_uid(*client_uid);
  // The server enforces the timeout; the channel gets a little more so that the server's verdict
  // (the same on every rank) arrives rather than a local deadline.
  call->ctx_.set_deadline(absl::ToChronoTime(absl::Now() + timeout + absl::Seconds(5)));
  call->ctx_.set_wait_for_ready(true);
  // The call keeps itself alive until its verdict is delivered. gRPC runs the callback after the
  // call started, ordered by synchronization ThreadSanitizer cannot see (happens_before.h).
  HappensBefore(&call->ctx_);
  call->stub_->async()->Rendezvous(&call->ctx_, &call->req_, &call->resp_,
                                   [call](grpc::Status s) { call->Finished(s); });
  return call;
}

void RendezvousCall::Finished(const grpc::Status& s) {
  HappensAfter(&ctx_);
  finished_.store(true);
  RendezvousDone done = std::move(done_);
  if (s.ok()) {
    done(std::vector<std::string>(resp_.payloads().begin(), resp_.payloads().end()));
    return;
  }
  absl::Status st = FromGrpcStatus(s);
  // wait_for_ready turns a host not yet listening into a wait, so UNAVAILABLE here is a
  // connection that broke under the call: the host died.
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE)
    st = absl::UnavailableError(StrCat("rendezvous ", key_, ": rank 0's daemon, its host, went away (",
                                       address_, kNodeSocketSuffix, ": ", st.message(), ")"));
  else if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
    st = absl::Status(st.code(), StrCat("rendezvous with rank 0 at ", address_, kNodeSocketSuffix,
                                        ": ", st.message()));
  done(std::move(st));
}

void RendezvousCall::ClientGone() {
  if (finished_.load() || gone_.exchange(true)) return;
  abort_req_.set_key(key_);
  abort_req_.set_reason(StrCat("rank ", rank_, "'s client went away while the ranks met"));
  abort_ctx_.set_deadline(absl::ToChronoTime(absl::Now() + kAbortTimeout));
  std::shared_ptr<RendezvousCall> self = shared_from_this();
  // Once rank 0 took the abort, this rank's own call ends by itself: the table answered every
  // rank waiting on the key (this one too) with ABORTED, or the step was already decided and
  // its verdict is on its way. That verdict must not be lost to a cancel (a cancelled call
  // ignores an answer that comes after it): a step that succeeded for the other ranks is one
  // this daemon has to undo for them (a group joined for a client that went away is ended at
  // rank 0's table, JoinGroup), or they wait at the next step until its timeout. Only an abort
  // that rank 0 did not take cancels the call, which would otherwise wait for its deadline.
  HappensBefore(&abort_ctx_);
  stub_->async()->AbortRendezvous(&abort_ctx_, &abort_req_, &abort_resp_, [self](grpc::Status s) {
    HappensAfter(&self->abort_ctx_);
    if (s.ok()) return;
    Logger("peer")->warn("rendezvous {}: abort at {}: {}", self->key_, self->address_,
                         s.error_message());
    self->ctx_.TryCancel();
  });
}

absl::StatusOr<std::vector<std::string>> RendezvousClient::Rendezvous(
    const std::string& address, const std::string& key, int world_size, int rank,
    const std::string& agreement, const std::string& payload, absl::Duration timeout) {
  std::mutex mu;
  std::condition_variable cv;
  std::optional<RendezvousTable::Verdict> verdict;
  ULY_ASSIGN_OR_RETURN(std::shared_ptr<RendezvousCall> call,
                       Start(address, key, world_size, rank, agreement, payload, timeout,
                             [&](RendezvousTable::Verdict v) {
                               std::lock_guard<std::mutex> lock(mu);
                               verdict = std::move(v);
                               cv.notify_all();
                             }));
  std::unique_lock<std::mutex> lock(mu);
  // Bounded: the call's own deadline is the timeout plus a margin.
  cv.wait(lock, [&] { return verdict.has_value(); });
  return std::move(*verdict);
}

}  // namespace ulysses::daemon
