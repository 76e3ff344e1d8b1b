#include "session.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "ulysses/common/failpoint.h"
#include "ulysses/common/logging.h"
#include "ulysses/common/protocol_words.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/wait.h"

namespace ulysses::daemon {

namespace {
// A call's identity as the call words carry it: (batch << 32 | seq_local) and
// (op << 48 | head_offset << 24 | head_count).
uint64_t CallShapeWord(const CallPlan& plan) {
  return static_cast<uint64_t>(plan.batch) << 32 | static_cast<uint64_t>(plan.seq_local);
}
uint64_t CallOpWord(const CallPlan& plan) {
  return static_cast<uint64_t>(plan.op) << 48 | static_cast<uint64_t>(plan.head_offset) << 24 |
         static_cast<uint64_t>(plan.head_count);
}
absl::Status CallMismatch(uint64_t session, uint64_t epoch, int them, uint64_t their_shape,
                          uint64_t their_op, int me, uint64_t shape, uint64_t op) {
  auto describe = [](uint64_t sh, uint64_t o) {
    return StrCat(OpName(static_cast<OpKind>(o >> 48)), " B=", sh >> 32, " S_l=", sh & 0xffffffffu,
                  " band ", (o >> 24) & 0xffffffu, "+", o & 0xffffffu);
  };
  return absl::InvalidArgumentError(StrCat("session ", session, " epoch ", epoch,
                                           ": ranks issued different calls (rank ", them, ": ",
                                           describe(their_shape, their_op), "; rank ", me, ": ",
                                           describe(shape, op), ")"));
}

// The control segment holds the slots too when the backend keeps them in host memory.
SegmentLayout ControlLayout(const SessionGeometry& g, const Backend& backend) {
  return SegmentLayout::For(backend.slots_in_segment() ? static_cast<uint64_t>(g.SlotBytes()) : 0,
                            g.num_slots);
}
}  // namespace

uint64_t Session::BytesNeeded(const SessionGeometry& g, const Backend& backend,
                              const FusedSetup* fused) {
  uint64_t bytes = ControlLayout(g, backend).total_bytes;
  if (fused != nullptr) bytes += backend.FusedPlanBytes(*fused);
  if (!backend.slots_in_segment())
    bytes += AlignUp(static_cast<uint64_t>(g.SlotBytes()), kSegmentAlign) * g.num_slots;
  return bytes + backend.StagingBytes(g.world_size, static_cast<uint64_t>(g.SlotBytes()));
}

absl::StatusOr<std::unique_ptr<Session>> Session::Create(
    uint64_t id, uint64_t group_id, uint64_t owner_client, const SessionGeometry& g,
    FdExports& exports, Backend& backend, const FusedSetup* fused,
    std::vector<std::shared_ptr<Buffer>> weight_buffers) {
  SegmentLayout layout = ControlLayout(g, backend);
  ULY_ASSIGN_OR_RETURN(ipc::SharedSegment seg,
                       ipc::SharedSegment::Create(StrCat("ulysses-session-", id), layout.total_bytes));
  ULY_ASSIGN_OR_RETURN(ipc::UniqueFd client_fd, seg.ReadOnlyFd());
  // A fresh segment is zero-filled: every word starts at epoch 0, abort 0.
  auto* cb = static_cast<SessionControlBlock*>(seg.data());
  cb->magic = kSessionMagic;
  cb->version = kSessionLayoutVersion;
  cb->world_size = static_cast<uint32_t>(g.world_size);
  cb->rank = static_cast<uint32_t>(g.rank);
  cb->num_slots = static_cast<uint32_t>(g.num_slots);
  cb->slot_bytes = layout.slot_bytes;
  cb->slot_stride_bytes = layout.slot_stride_bytes;
  cb->slots_offset_bytes = layout.slots_offset_bytes;
  TransportSetup setup;
  setup.geometry = g;
  setup.slot_bytes = static_cast<uint64_t>(g.SlotBytes());
  setup.own_segment = static_cast<uint8_t*>(seg.data());
  setup.slots_offset_bytes = layout.slots_offset_bytes;
  setup.slot_stride_bytes = layout.slot_stride_bytes;
  setup.segment_fd = client_fd.get();  // what the transport hands the client: read-only
  setup.segment_bytes = layout.total_bytes;
  if (fused != nullptr) setup.fused = *fused;
  ULY_ASSIGN_OR_RETURN(ExportTicket ticket, exports.Lend(seg.fd()));
  std::unique_ptr<Session> session(
      new Session(id, group_id, owner_client, g, layout, std::move(seg), exports));
  session->client_fd_ = std::move(client_fd);
  session->export_id_ = ticket.id;
  session->ticket_ = EncodeTicket(ticket);
  session->fused_ = setup.fused;
  session->weight_buffers_ = std::move(weight_buffers);
  const Session* self = session.get();  // owns the transport, so outlives it
  setup.can_complete = [self](uint64_t epoch) { return self->CanComplete(epoch); };
  setup.peers_past = [self](uint64_t epoch) { return self->PeersPast(epoch); };
  ULY_ASSIGN_OR_RETURN(session->transport_, backend.MakeTransport(setup));
  return session;
}

std::string Session::RendezvousPayload() const {
  return StrCat(ticket_, "\n", transport_->LocalHandle());
}

Session::Session(uint64_t id, uint64_t group_id, uint64_t owner, SessionGeometry g,
                 SegmentLayout l, ipc::SharedSegment seg, FdExports& exports)
    : id_(id),
      group_id_(group_id),
      owner_client_(owner),
      geometry_(std::move(g)),
      layout_(l),
      segment_(std::move(seg)),
      exports_(exports),
      slots_(geometry_.num_slots, SlotEntry{SlotState::kFree, 0, absl::Now()}) {
  inflight_.reserve(geometry_.num_slots);
  finished_.reserve(geometry_.num_slots);
  spare_sync_nodes_.reserve(geometry_.num_slots);
}

const char* Session::SlotStateName(SlotState s) {
  switch (s) {
    case SlotState::kFree: return "free";
    case SlotState::kWriting: return "writing";
    case SlotState::kHeld: return "held";
  }
  return "unknown";
}

void Session::SetSlot(int slot, SlotState state, uint64_t epoch, uint64_t stream_release) {
  {
    std::lock_guard<std::mutex> lock(slot_mu_);
    slots_[slot] = SlotEntry{state, epoch, absl::Now(), stream_release};
  }
  slot_cv_.notify_all();
}

void Session::UseClientReleaseWords(int32_t index, const std::atomic<uint64_t>* words,
                                    std::shared_ptr<const void> keepalive) {
  release_index_ = index;
  client_released_ = words;
  client_words_keepalive_ = std::move(keepalive);
}

bool Session::NotHeldLocked(int s) {
  SlotEntry& e = slots_[s];
  if (e.state != SlotState::kHeld) return true;
  // The word is the client's: it is only a hint that this epoch's result was given back, and
  // only an exact-or-later epoch of this slot counts.
  if (client_released_ == nullptr ||
      client_released_[s].load(std::memory_order_acquire) < e.epoch)
    return false;
  e.state = SlotState::kFree;  // epoch and stream_release stay: the stream may still wait
  e.since = absl::Now();
  Control(geometry_.rank)->slots[s].released.store(e.epoch, std::memory_order_release);
  return true;
}

absl::Status Session::Release(uint64_t epoch) {
  if (epoch == 0) return absl::InvalidArgumentError("epoch: must be > 0");
  const int s = static_cast<int>((epoch - 1) % geometry_.num_slots);
  {
    std::lock_guard<std::mutex> lock(slot_mu_);
    SlotEntry& e = slots_[s];
    if (NotHeldLocked(s) || e.epoch != epoch)
      return absl::FailedPreconditionError(StrCat("epoch: session ", id_, " holds no result of epoch ",
                                                  epoch, " (released already, copied out, or never issued)"));
    e = SlotEntry{SlotState::kFree, epoch, absl::Now()};
  }
  Control(geometry_.rank)->slots[s].released.store(epoch, std::memory_order_release);
  slot_cv_.notify_all();
  return absl::OkStatus();
}

int Session::Poison() {
  std::lock_guard<std::mutex> call_lock(call_mu_);
  int n = 0;
  for (int s = 0; s < geometry_.num_slots; ++s) {
    std::lock_guard<std::mutex> lock(slot_mu_);
    // A slot whose call is still running is not free either: its result is on the way. One
    // given back on the client's stream is free for the next call, which waits for that
    // release on the device (or whose ready word carries it), but not for a fill: nothing
    // orders one after the client's last read, whatever the client's host word says.
    const SlotEntry& e = slots_[s];
    if (e.state == SlotState::kWriting || (e.stream_release != 0 && e.stream_release == e.epoch) ||
        !NotHeldLocked(s))
      continue;
    if (absl::Status st = transport_->Poison(s); !st.ok()) {
      Warn(StrCat("slot ", s, ": poison: ", st.message()));
      continue;
    }
    ++n;
  }
  return n;
}

Session::~Session() {
  Failpoint("session.destroy");
  // A call that finished on the device but was not collected yet completes as it did: failing
  // it now would fail the peers' calls of its epoch, which they completed over its blocks.
  if (transport_ != nullptr) Poll();
  {
    // Calls still enqueued end with the session: their error words first. The transport's
    // drain then cancels its stream, whose waits pass and whose arrival words reach the
    // peers; a peer whose call completes on them finds the error word and fails that epoch,
    // instead of taking the blocks this rank never stored as a result.
    std::lock_guard<std::mutex> lock(inflight_mu_);
    SessionControlBlock* mine = Control(geometry_.rank);
    for (const InFlightCall& f : inflight_) {
      mine->slots[f.slot].error.store(f.epoch, std::memory_order_release);
      mine->slots[f.slot].done.store(f.epoch, std::memory_order_release);
    }
  }
  Abort(kAbortClosed);
  for (uint64_t w : peer_watches_) exports_.Unwatch(w);
  // No new peer can fetch the segment; the memory stays mapped in peers until they close their
  // sessions, and goes with the last mapping.
  if (export_id_ != 0) exports_.Withdraw(export_id_);
  // The transport drains its stream first; only then may the calls' buffers be unmapped. A
  // stream that never drains may still read and write them (a fused session's weights too):
  // they stay, with the transport. (A session whose Create failed has no transport.)
  if (transport_ != nullptr && !transport_->Drain()) {
    std::lock_guard<std::mutex> lock(inflight_mu_);
    std::vector<std::shared_ptr<const void>> buffers = std::move(failed_keep_);
    for (const InFlightCall& f : inflight_)
      for (const auto& k : f.keep)
        if (k) buffers.push_back(k);
    for (auto& w : weight_buffers_) buffers.push_back(std::move(w));
    Logger("exec")->error("session {}: its device work did not end; its transport and the "
                          "{} buffers its calls used stay for the daemon's life",
                          id_, buffers.size());
    // It still holds the daemon's descriptors and mappings: it stays charged to its client.
    if (charge_) buffers.push_back(std::move(charge_));
    KeepForever(std::move(transport_), std::move(buffers));
    return;
  }
  transport_.reset();
}

namespace {
// What sessions whose device work never ended left behind, for the process's life.
struct Undrained {
  std::mutex mu;
  std::vector<std::unique_ptr<Transport>> transports;
  std::vector<std::shared_ptr<const void>> buffers;
  uint64_t device_bytes = 0;
};
Undrained& UndrainedSessions() {
  static Undrained* const kept = new Undrained();  // never destroyed: the work may outlive exit
  return *kept;
}
}  // namespace

void Session::KeepForever(std::unique_ptr<Transport> transport,
                          std::vector<std::shared_ptr<const void>> buffers) {
  Undrained& u = UndrainedSessions();
  std::lock_guard<std::mutex> lock(u.mu);
  u.device_bytes += transport->DeviceBytes();
  u.transports.push_back(std::move(transport));
  for (auto& b : buffers) u.buffers.push_back(std::move(b));
}

size_t Session::UndrainedCount() {
  Undrained& u = UndrainedSessions();
  std::lock_guard<std::mutex> lock(u.mu);
  return u.transports.size();
}

uint64_t Session::UndrainedBytes() {
  Undrained& u = UndrainedSessions();
  std::lock_guard<std::mutex> lock(u.mu);
  return u.device_bytes;
}

absl::Status CheckPeersRunThisBackend(const std::vector<std::string>& handles, int me,
                                      const std::function<bool(int, const std::string&)>& ours,
                                      std::string_view advice) {
  for (int r = 0; r < static_cast<int>(handles.size()); ++r)
    if (r != me && !ours(r, handles[r]))
      return absl::FailedPreconditionError(StrCat("rank ", r,
                                                  " runs another backend (slot handle '",
                                                  handles[r].substr(0, 64), "')", advice));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> Session::HandlesOf(
    const std::vector<std::string>& payloads) const {
  if (static_cast<int>(payloads.size()) != geometry_.world_size)
    return absl::InternalError(StrCat("session ", id_, ": expected ", geometry_.world_size,
                                      " peer payloads, got ", payloads.size()));
  std::vector<std::string> handles(payloads.size());
  for (int r = 0; r < geometry_.world_size; ++r) {
    if (r == geometry_.rank) continue;
    const size_t nl = payloads[r].find('\n');
    if (nl == std::string::npos)
      return absl::FailedPreconditionError(
          StrCat("session ", id_, ": rank ", r, " sent a malformed session handle"));
    handles[r] = payloads[r].substr(nl + 1);
  }
  return handles;
}

absl::Status Session::MapPeers(const std::vector<std::string>& payloads,
                               absl::Duration timeout) {
  ULY_ASSIGN_OR_RETURN(handles_, HandlesOf(payloads));
  ULY_RETURN_IF_ERROR(transport_->CheckPeers(handles_));
  std::vector<ipc::SharedSegment> peers(payloads.size());
  std::vector<ipc::UniqueFd> links(payloads.size());
  std::vector<uint8_t*> bases(payloads.size(), nullptr);
  for (int r = 0; r < geometry_.world_size; ++r) {
    if (r == geometry_.rank) continue;
    const size_t nl = payloads[r].find('\n');
    absl::StatusOr<ExportTicket> ticket = DecodeTicket(std::string_view(payloads[r]).substr(0, nl));
    if (!ticket.ok())
      return absl::FailedPreconditionError(
          StrCat("session ", id_, ": rank ", r, ": ", ticket.status().message()));
    absl::StatusOr<FetchedExport> fetched = FdExports::FetchAndHold(*ticket, timeout);
    if (!fetched.ok())
      return absl::Status(fetched.status().code(),
                          StrCat("session ", id_, ": segment of rank ", r, ": ",
                                 fetched.status().message()));
    // The segment must be sealed and of this session's size: nobody may cut it short under
    // this daemon's mapping.
    absl::StatusOr<ipc::SharedSegment> seg =
        ipc::SharedSegment::Adopt(std::move(fetched->fd), layout_.total_bytes);
    if (!seg.ok())
      return absl::FailedPreconditionError(StrCat("session ", id_, ": segment of rank ", r, ": ",
                                                  seg.status().message()));
    peers[r] = std::move(*seg);
    links[r] = std::move(fetched->link);
    auto* cb = static_cast<const SessionControlBlock*>(peers[r].data());
    if (cb->magic != kSessionMagic || cb->version != kSessionLayoutVersion ||
        cb->rank != static_cast<uint32_t>(r) || cb->slot_bytes != layout_.slot_bytes)
      return absl::FailedPreconditionError(
          StrCat("session ", id_, ": the segment of rank ", r,
                 " does not match this session's layout"));
    bases[r] = static_cast<uint8_t*>(peers[r].data());
  }
  bases_ = std::move(bases);
  // The peers are mapped and watched before the transport connects, so that its waits (NCCL's
  // communicator setup) see a peer that aborts or whose daemon dies. A peer daemon that dies
  // closes its end of the link: each rank watches every peer itself, so its waits for an epoch
  // the peer did not complete end at once. A peer that hangs keeps the link open; the call
  // timeout covers it.
  peers_ = std::move(peers);
  for (int r = 0; r < geometry_.world_size; ++r) {
    if (!links[r].valid()) continue;
    absl::StatusOr<uint64_t> w = exports_.Watch(std::move(links[r]), [this, r] {
      peers_gone_.fetch_or(uint64_t{1} << r, std::memory_order_acq_rel);
      slot_cv_.notify_all();
    });
    if (!w.ok()) return w.status();
    peer_watches_.push_back(*w);
  }
  return absl::OkStatus();
}

bool Session::NeedsConnectHandles() const { return transport_->HasConnectHandle(); }

absl::StatusOr<std::string> Session::ConnectPayload() { return transport_->ConnectHandle(); }

absl::Status Session::ConnectTransport(const std::vector<std::string>& connect_payloads,
                                       absl::Duration timeout) {
  if (static_cast<int>(bases_.size()) != geometry_.world_size)
    return absl::InternalError(StrCat("session ", id_, ": connected before its peers were mapped"));
  if (!connect_payloads.empty() && static_cast<int>(connect_payloads.size()) != geometry_.world_size)
    return absl::InternalError(StrCat("session ", id_, ": expected ", geometry_.world_size,
                                      " connect payloads, got ", connect_payloads.size()));
  return transport_->Connect(handles_, connect_payloads, bases_, timeout);
}

SessionControlBlock* Session::Control(int rank) const {
  void* base = rank == geometry_.rank ? segment_.data() : peers_[rank].data();
  return static_cast<SessionControlBlock*>(base);
}

absl::Status Session::WaitWord(const std::atomic<uint64_t>& word, uint64_t target, int peer,
                               absl::Time deadline, const char* what) const {
  // The peer's abort word ends the spin at once; whether it ends the wait is CanComplete's
  // call (a peer that completed this epoch and then left does not).
  const std::atomic<uint64_t>* peer_abort = &Control(peer)->abort;
  // Slices, so that this session's own abort (its client is gone) and every other peer's end
  // are seen too.
  for (;;) {
    const absl::Time slice = std::min(deadline, absl::Now() + absl::Milliseconds(20));
    // A plain outcome, no status: the errors below name the session, and a call whose peer is
    // slow allocates nothing at the end of each slice.
    const ipc::WaitOutcome w = ipc::WaitFor(word, target, slice, peer_abort);
    if (w.end == ipc::WaitOutcome::kReached) return absl::OkStatus();
    // The word may have been stored between the wait's last look at it and its look at the
    // abort: a rank writes all of an epoch's words before it completes the epoch and leaves.
    if (word.load(std::memory_order_acquire) >= target) return absl::OkStatus();
    ULY_RETURN_IF_ERROR(CanComplete(target));
    if (w.end == ipc::WaitOutcome::kAborted) peer_abort = nullptr;  // it completed `target`
    if (absl::Now() >= deadline)
      return absl::DeadlineExceededError(StrCat("session ", id_, ": timed out waiting for rank ",
                                                peer, " (", what, ", epoch ", target, ")"));
  }
}

absl::Status Session::OwnAbortError() const {
  return absl::AbortedError(StrCat("session ", id_, ": closed while a call waited"));
}

absl::Status Session::CanComplete(uint64_t epoch) const {
  if (Control(geometry_.rank)->abort.load(std::memory_order_acquire) != 0) return OwnAbortError();
  if (peers_.empty()) return absl::OkStatus();  // not connected yet
  const uint64_t gone = peers_gone_.load(std::memory_order_acquire);
  for (int r = 0; r < geometry_.world_size; ++r) {
    if (r == geometry_.rank) continue;
    const bool daemon_gone = (gone >> r & 1) != 0;
    if (!AbortEnds(*Control(r), epoch, daemon_gone)) continue;
    if (daemon_gone && Control(r)->abort.load(std::memory_order_acquire) == 0)
      return absl::AbortedError(StrCat("session ", id_, ": the daemon of rank ", r,
                                       " is gone (its peer link hung up) before epoch ", epoch));
    return absl::AbortedError(StrCat("session ", id_, ": rank ", r,
                                     " aborted the group (its session is gone or broken) before ",
                                     "epoch ", epoch));
  }
  return absl::OkStatus();
}

bool Session::PeersPast(uint64_t epoch) const {
  if (peers_.empty()) return true;  // not connected: no peer ever took an epoch with this rank
  const uint64_t gone = peers_gone_.load(std::memory_order_acquire);
  for (int r = 0; r < geometry_.world_size; ++r) {
    if (r == geometry_.rank) continue;
    const SessionControlBlock& theirs = *Control(r);
    if (theirs.completed.load(std::memory_order_acquire) >= epoch) continue;
    if (theirs.abort.load(std::memory_order_acquire) != 0 || (gone >> r & 1) != 0) continue;
    return false;
  }
  return true;
}

uint64_t Session::next_epoch() const {
  std::lock_guard<std::mutex> lock(call_mu_);
  return epoch_ + 1;
}

absl::Status Session::Refuse(uint64_t expected_epoch, absl::Status why) {
  std::lock_guard<std::mutex> lock(call_mu_);
  if (stream_ordered()) {
    // The client's stream already waits for this call's done word; only a cancel ends it.
    if (expected_epoch == epoch_ + 1) {
      const uint64_t e = ++epoch_;
      const int s = static_cast<int>((e - 1) % geometry_.num_slots);
      Control(geometry_.rank)->slots[s].error.store(e, std::memory_order_release);
      Control(geometry_.rank)->slots[s].done.store(e, std::memory_order_release);
    }
    {
      std::lock_guard<std::mutex> inflight(inflight_mu_);
      FailInFlightLocked(why);
    }
    Warn(StrCat("epoch ", expected_epoch, ": descriptor refused: ", why.message()));
    return why;
  }
  if (expected_epoch != epoch_ + 1) return why;  // not this session's next call: touch nothing
  const uint64_t e = ++epoch_;
  const int s = static_cast<int>((e - 1) % geometry_.num_slots);
  SessionControlBlock* mine = Control(geometry_.rank);
  mine->slots[s].error.store(e, std::memory_order_release);
  mine->slots[s].done.store(e, std::memory_order_release);
  broken_.store(true);
  Abort(kAbortCallFailed);
  Warn(StrCat("epoch ", e, ": descriptor refused: ", why.message()));
  return why;
}

absl::StatusOr<CallOutcome> Session::Execute(const CallPlan& plan, const CallOperands& ops,
                                             absl::Duration timeout, uint64_t expected_epoch,
                                             ExecuteMode mode) {
  if (stream_ordered()) return ExecuteStream(plan, ops, timeout, expected_epoch, mode);
  std::lock_guard<std::mutex> lock(call_mu_);
  if (expected_epoch != 0 && expected_epoch != epoch_ + 1)
    return absl::FailedPreconditionError(StrCat("epoch: descriptor for epoch ", expected_epoch,
                                                ", session ", id_, " expects epoch ", epoch_ + 1,
                                                " (replayed or out of order)"));
  if (broken_.load())
    return absl::FailedPreconditionError(
        StrCat("session ", id_, " is broken by an earlier failed call; close it and create a new one"));
  if (peers_.empty() && geometry_.world_size > 1)
    return absl::FailedPreconditionError(StrCat("session ", id_, " is not connected to its peers"));
  const uint64_t e = ++epoch_;
  const int s = static_cast<int>((e - 1) % geometry_.num_slots);
  const int W = geometry_.world_size;
  const int me = geometry_.rank;
  const absl::Time deadline = absl::Now() + timeout;
  SessionControlBlock* mine = Control(me);
  {
    // A held slot is never overwritten: wait for the client to release the result it holds.
    std::unique_lock<std::mutex> lock(slot_mu_);
    const absl::Duration poll = client_released_ ? absl::Milliseconds(1) : absl::Milliseconds(20);
    while (!NotHeldLocked(s)) {
      if (mine->abort.load(std::memory_order_acquire) != 0) {
        --epoch_;
        return absl::AbortedError(StrCat("session ", id_, ": closed while a call waited for slot ", s));
      }
      if (absl::Status end = CanComplete(e); !end.ok()) {
        --epoch_;  // nothing was opened or written
        return end;
      }
      if (slot_cv_.wait_until(lock, absl::ToChronoTime(std::min(deadline, absl::Now() + poll))) ==
              std::cv_status::timeout &&
          absl::Now() >= deadline && !NotHeldLocked(s)) {
        // Nothing was opened or written: the epoch is not consumed and the session stays usable.
        --epoch_;
        return absl::DeadlineExceededError(StrCat(
            "session ", id_, ": receive slot ", s, " still holds the result of epoch ",
            slots_[s].epoch, "; release it before the call that needs the slot"));
      }
    }
    slots_[s] = SlotEntry{SlotState::kWriting, e, absl::Now()};
  }
  const uint64_t call_shape = CallShapeWord(plan);
  const uint64_t call_op = CallOpWord(plan);
  mine->slots[s].call_shape.store(call_shape, std::memory_order_relaxed);
  mine->slots[s].call_op.store(call_op, std::memory_order_relaxed);
  // Open (release: the call words above are visible to whoever sees the epoch): peers may now
  // overwrite slot s; its previous result, epoch e - num_slots, is given up.
  mine->slots[s].open.store(e, std::memory_order_release);

  absl::Status status;
  const bool at_once = transport_->PushesAtOnce(plan);
  // Destinations in rotated order starting after this rank, so ranks do not all hit rank 0.
  // A transport that writes every block in one pass waits for every destination first.
  for (int k = 1; k <= W && status.ok(); ++k) {
    const int dst = (me + k) % W;
    SessionControlBlock* theirs = Control(dst);
    status = WaitWord(theirs->slots[s].open, e, dst, deadline, "opening its receive slot");
    if (!status.ok()) break;
    const uint64_t their_shape = theirs->slots[s].call_shape.load(std::memory_order_relaxed);
    const uint64_t their_op = theirs->slots[s].call_op.load(std::memory_order_relaxed);
    if (their_shape != call_shape || their_op != call_op) {
      status = CallMismatch(id_, e, dst, their_shape, their_op, me, call_shape, call_op);
      break;
    }
    if (!at_once) status = transport_->Push(plan, ops, dst, s);
  }
  if (at_once && status.ok()) status = transport_->PushAll(plan, ops, s, e);
  // Every block must be in place (a GPU backend's kernels finished) before the arrival words
  // announce them; release order makes the bytes visible before the word.
  if (status.ok()) status = transport_->Flush();
  for (int dst = 0; dst < W && status.ok(); ++dst) {
    Control(dst)->slots[s].arrive[me].store(e, std::memory_order_release);
    if (dst == 0) Failpoint("session.after_first_arrival");
  }
  for (int src = 0; src < W && status.ok(); ++src)
    status = WaitWord(mine->slots[s].arrive[src], e, src, deadline, "writing its block");
  if (status.ok()) status = transport_->Finish(plan, ops, s);
  if (status.ok()) return FinishCall(plan, s, e);
  // The ranks' epochs no longer line up: fail this session and tell the peers at once.
  mine->slots[s].error.store(e, std::memory_order_release);
  mine->slots[s].done.store(e, std::memory_order_release);
  SetSlot(s, SlotState::kFree, e);
  broken_.store(true);
  Abort(kAbortCallFailed);
  Warn(StrCat("epoch ", e, ": call failed: ", status.message()));
  return status;
}

CallOutcome Session::FinishCall(const CallPlan& plan, int s, uint64_t e, bool released_on_stream) {
  SessionControlBlock* mine = Control(geometry_.rank);
  mine->slots[s].done.store(e, std::memory_order_release);
  // Every word this rank owes for epoch e is written: peers may see it leave from now on.
  mine->completed.store(e, std::memory_order_release);
  // The result is the client's view until it releases it, unless it was copied out.
  const bool copied_out = plan.has_out;
  SetSlot(s, copied_out ? SlotState::kFree : SlotState::kHeld, e,
          !copied_out && released_on_stream ? e : 0);
  if (copied_out) mine->slots[s].released.store(e, std::memory_order_release);
  calls_.fetch_add(1);
  last_epoch_.store(e);
  return Outcome(plan, s, e);
}

CallOutcome Session::Outcome(const CallPlan& plan, int s, uint64_t e) const {
  CallOutcome out;
  out.epoch = e;
  out.slot = s;
  out.slot_offset_bytes = transport_->SlotOffset(s);
  out.result_bytes = static_cast<uint64_t>(plan.slot_elems) * geometry_.itemsize();
  // Every op moves exactly what this rank's inputs hold for the exchanged heads.
  out.bytes_sent = out.result_bytes;
  return out;
}

void Session::Warn(const std::string& what) const {
  WarnWithin(log_budget_, *Logger("exec"), "session {} {}", id_, what);
}

void Session::Break() {
  broken_.store(true);
  Abort(kAbortCallFailed);
  transport_->Cancel();
}

void Session::FailInFlightLocked(const absl::Status& why) {
  SessionControlBlock* mine = Control(geometry_.rank);
  for (const InFlightCall& f : inflight_) {
    mine->slots[f.slot].error.store(f.epoch, std::memory_order_release);
    mine->slots[f.slot].done.store(f.epoch, std::memory_order_release);
    SetSlot(f.slot, SlotState::kFree, f.epoch);
    if (f.async) finished_.push_back(FinishedCall{f.epoch, why});
    else PutSyncResultLocked(f.epoch, why);
    Warn(StrCat("epoch ", f.epoch, ": call failed: ", why.message()));
    for (const auto& k : f.keep)
      if (k) failed_keep_.push_back(k);
  }
  inflight_.clear();
  Break();
}

void Session::PutSyncResultLocked(uint64_t epoch, absl::StatusOr<CallOutcome> outcome) {
  if (spare_sync_nodes_.empty()) {
    finished_sync_.emplace(epoch, std::move(outcome));
    return;
  }
  SyncResults::node_type node = std::move(spare_sync_nodes_.back());
  spare_sync_nodes_.pop_back();
  node.key() = epoch;
  node.mapped() = std::move(outcome);
  finished_sync_.insert(std::move(node));
}

absl::Status Session::CheckCompleted(uint64_t e, int s, uint64_t call_shape,
                                     uint64_t call_op) const {
  for (int r = 0; r < geometry_.world_size; ++r) {
    if (r == geometry_.rank) continue;
    const SessionControlBlock* theirs = Control(r);
    // A peer that failed this epoch may have let its stream announce a block it never stored.
    if (theirs->slots[s].error.load(std::memory_order_acquire) == e)
      return absl::AbortedError(StrCat("session ", id_, ": rank ", r, " failed epoch ", e));
    const CallSignature& sig = theirs->signatures[e % kSignatureRing];
    if (sig.epoch.load(std::memory_order_acquire) != e) {
      // A peer that closed or broke without ever taking this epoch: its cancel's words let
      // this call complete, over blocks it never stored.
      if (theirs->abort.load(std::memory_order_acquire) != 0 &&
          sig.epoch.load(std::memory_order_acquire) != e)
        return absl::AbortedError(StrCat("session ", id_, ": rank ", r,
                                         " aborted the group before epoch ", e));
      continue;
    }
    const uint64_t shape = sig.call_shape.load(std::memory_order_relaxed);
    const uint64_t op = sig.call_op.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (sig.epoch.load(std::memory_order_relaxed) != e) continue;  // overwritten meanwhile
    if (shape != call_shape || op != call_op)
      return CallMismatch(id_, e, r, shape, op, geometry_.rank, call_shape, call_op);
  }
  return absl::OkStatus();
}

bool Session::InFlight() const {
  std::lock_guard<std::mutex> lock(inflight_mu_);
  return !inflight_.empty();
}

void Session::TakeFinished(std::vector<FinishedCall>* into) {
  into->clear();
  std::lock_guard<std::mutex> lock(inflight_mu_);
  into->swap(finished_);
}

std::string Session::StuckWords(const InFlightCall& f) const {
  std::string words = transport_->DescribeStuck(f.slot, f.epoch);
  if (words.empty()) return {};
  // Where each peer stood, from its session segment: the part of the picture a transport
  // whose daemons map no peer's words (nccl) cannot give.
  if (geometry_.world_size > 1 && !peers_.empty()) {
    std::vector<PeerProgress> peers;
    for (int r = 0; r < geometry_.world_size; ++r) {
      if (r == geometry_.rank) continue;
      const SessionControlBlock& theirs = *Control(r);
      const uint64_t completed = theirs.completed.load(std::memory_order_acquire);
      const bool took =
          theirs.signatures[f.epoch % kSignatureRing].epoch.load(std::memory_order_acquire) ==
              f.epoch ||
          completed >= f.epoch;
      peers.push_back({r, took, completed, theirs.abort.load(std::memory_order_acquire),
                       (peers_gone_.load(std::memory_order_acquire) >> r & 1) != 0});
    }
    words += StrCat("; ", FormatPeerProgress(f.epoch, peers));
  }
  Warn(StrCat("epoch ", f.epoch, " slot ", f.slot, " did not finish; its protocol words: ",
              words));
  return StrCat("; protocol words: ", words);
}

void Session::Poll() {
  std::lock_guard<std::mutex> lock(inflight_mu_);
  while (!inflight_.empty()) {
    const InFlightCall& f = inflight_.front();
    absl::Status failure;
    absl::StatusOr<bool> done = transport_->Completed(f.slot, f.epoch);
    if (!done.ok()) {
      failure = done.status();
    } else if (*done) {
      failure = CheckCompleted(f.epoch, f.slot, f.call_shape, f.call_op);
    } else {
      // Closed, or a peer left (session gone or broken, or its daemon gone) before completing
      // this epoch. One that completed it stored its blocks and words already.
      failure = CanComplete(f.epoch);
      // A peer that took this epoch with another call, or failed it: the call cannot end well,
      // and on a transport whose peers must post matching transfers (nccl) it may never end.
      if (failure.ok()) failure = CheckCompleted(f.epoch, f.slot, f.call_shape, f.call_op);
      if (!failure.ok()) (void)StuckWords(f);  // where this rank's stream stood, for the logs
      if (failure.ok() && absl::Now() >= f.deadline)
        failure = absl::DeadlineExceededError(StrCat(
            "session ", id_, ": the call of epoch ", f.epoch,
            " did not finish within the call timeout (a peer or the client's stream never arrived, "
            "or the stream never gave back the slot's previous result)", StuckWords(f)));
      if (failure.ok()) return;  // still running
    }
    if (!failure.ok()) {
      FailInFlightLocked(failure);
      return;
    }
    CallOutcome out = FinishCall(f.plan, f.slot, f.epoch, f.released_on_stream);
    if (f.async) finished_.push_back(FinishedCall{f.epoch, out});
    else PutSyncResultLocked(f.epoch, out);
    inflight_.erase(inflight_.begin());
  }
}

absl::StatusOr<CallOutcome> Session::ExecuteStream(const CallPlan& plan, const CallOperands& ops,
                                                   absl::Duration timeout,
                                                   uint64_t expected_epoch, ExecuteMode mode) {
  const int me = geometry_.rank;
  SessionControlBlock* mine = Control(me);
  uint64_t e = 0;
  int s = 0;
  {
    std::lock_guard<std::mutex> lock(call_mu_);
    // Every refusal breaks a stream-ordered session: the client's stream already waits for this
    // call's done word, and only a cancel ends that wait.
    absl::Status refused;
    if (expected_epoch != 0 && expected_epoch != epoch_ + 1)
      refused = absl::FailedPreconditionError(StrCat(
          "epoch: descriptor for epoch ", expected_epoch, ", session ", id_, " expects epoch ",
          epoch_ + 1, " (replayed or out of order)"));
    else if (broken_.load())
      refused = absl::FailedPreconditionError(StrCat(
          "session ", id_, " is broken by an earlier failed call; close it and create a new one"));
    else if (peers_.empty() && geometry_.world_size > 1)
      refused = absl::FailedPreconditionError(StrCat("session ", id_, " is not connected to its peers"));
    if (!refused.ok()) {
      std::lock_guard<std::mutex> inflight(inflight_mu_);
      FailInFlightLocked(refused);
      return refused;
    }
    e = ++epoch_;
    s = static_cast<int>((e - 1) % geometry_.num_slots);
    const absl::Time deadline = absl::Now() + timeout;
    bool claimed = false;  // slot s is this call's (kWriting)
    auto fail = [&](absl::Status why) {
      mine->slots[s].error.store(e, std::memory_order_release);
      mine->slots[s].done.store(e, std::memory_order_release);
      // A slot never claimed still holds (or is still being written with) an earlier result:
      // its entry stays, so neither a fill nor a later call takes it for free.
      if (claimed) SetSlot(s, SlotState::kFree, e);
      std::lock_guard<std::mutex> inflight(inflight_mu_);
      FailInFlightLocked(why);
      Warn(StrCat("epoch ", e, ": call failed: ", why.message()));
      return why;
    };
    // At most num_slots calls in flight: slot s's previous call must have finished and its
    // result been given back (a held slot is never overwritten). A result the client gives
    // back on its stream is waited for there, not here.
    uint64_t wait_released = 0;
    for (;;) {
      Poll();
      std::unique_lock<std::mutex> lk(slot_mu_);
      const SlotEntry& prev = slots_[s];
      const bool writing = prev.state == SlotState::kWriting;
      const bool on_stream = prev.stream_release != 0 && prev.stream_release == prev.epoch;
      if (!writing && (on_stream || NotHeldLocked(s))) {
        // The client's ready word, written after its release on the same stream, implies it.
        // The claim is about epoch e - num_slots: only then is that the result held here.
        const bool implied = mode.wait_ready && mode.released_in_order &&
                             prev.epoch + static_cast<uint64_t>(geometry_.num_slots) == e;
        wait_released = on_stream && !implied ? prev.stream_release : 0;
        slots_[s] = SlotEntry{SlotState::kWriting, e, absl::Now()};
        claimed = true;
        break;
      }
      const uint64_t previous = slots_[s].epoch;
      if (broken_.load()) {
        lk.unlock();
        return fail(absl::AbortedError(StrCat("session ", id_, " broke while a call waited for slot ", s)));
      }
      if (absl::Status end = CanComplete(e); !end.ok()) {
        lk.unlock();
        return fail(end);
      }
      if (absl::Now() >= deadline) {
        lk.unlock();
        return fail(absl::DeadlineExceededError(
            writing ? StrCat("session ", id_, ": the call of epoch ", previous, " in slot ", s,
                             " did not finish within the call timeout")
                    : StrCat("session ", id_, ": receive slot ", s, " still holds the result of epoch ",
                             previous, "; release it before the call that needs the slot")));
      }
      const absl::Duration poll = writing ? absl::Microseconds(20) : absl::Milliseconds(1);
      slot_cv_.wait_until(lk, absl::ToChronoTime(std::min(deadline, absl::Now() + poll)));
    }
    const uint64_t call_shape = CallShapeWord(plan), call_op = CallOpWord(plan);
    CallSignature& sig = mine->signatures[e % kSignatureRing];
    sig.call_shape.store(call_shape, std::memory_order_relaxed);
    sig.call_op.store(call_op, std::memory_order_relaxed);
    sig.epoch.store(e, std::memory_order_release);
    mine->slots[s].call_shape.store(call_shape, std::memory_order_relaxed);
    mine->slots[s].call_op.store(call_op, std::memory_order_relaxed);
    mine->slots[s].open.store(e, std::memory_order_release);  // bookkeeping: the grant is on the GPU
    std::unique_lock<std::mutex> inflight(inflight_mu_);
    if (absl::Status st =
            transport_->Enqueue(plan, ops, StreamCall{s, e, mode.wait_ready, wait_released});
        !st.ok()) {
      // Part of the call may be on the stream already: its buffers stay until the stream
      // drains, as a failed in-flight call's do.
      for (const auto& k : ops.keep)
        if (k) failed_keep_.push_back(k);
      inflight.unlock();
      return fail(st);
    }
    inflight_.push_back(InFlightCall{e, s, plan, call_shape, call_op, deadline, mode.async,
                                     /*released_on_stream=*/mode.wait_ready,
                                     {ops.keep[0], ops.keep[1], ops.keep[2], ops.keep[3]}});
  }
  if (mode.async) {
    CallOutcome out = Outcome(plan, s, e);
    out.pending = true;
    return out;
  }
  // A caller that waits (the Call RPC): poll until this epoch finished; Poll ends it by the
  // deadline at the latest.
  for (;;) {
    Poll();
    {
      std::lock_guard<std::mutex> lock(inflight_mu_);
      auto it = finished_sync_.find(e);
      if (it != finished_sync_.end()) {
        SyncResults::node_type node = finished_sync_.extract(it);
        absl::StatusOr<CallOutcome> out = std::move(node.mapped());
        if (spare_sync_nodes_.size() < spare_sync_nodes_.capacity())
          spare_sync_nodes_.push_back(std::move(node));
        return out;
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void Session::Abort(uint64_t code) {
  auto* cb = Control(geometry_.rank);
  uint64_t expected = 0;
  cb->abort.compare_exchange_strong(expected, code, std::memory_order_acq_rel);
  slot_cv_.notify_all();
}

std::vector<Session::SlotView> Session::Slots() {
  std::vector<SlotView> out;
  std::lock_guard<std::mutex> lock(slot_mu_);
  for (int i = 0; i < geometry_.num_slots; ++i) {
    NotHeldLocked(i);
    out.push_back(SlotView{i, slots_[i].state, slots_[i].epoch, slots_[i].since});
  }
  return out;
}

}  // namespace ulysses::daemon
