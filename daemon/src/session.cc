#include "session.h"

#include <algorithm>
#include <cstring>

#include "ulysses/common/logging.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/wait.h"

namespace ulysses::daemon {

namespace {
// The control segment holds the slots too when the backend keeps them in host memory.
SegmentLayout ControlLayout(const SessionGeometry& g, const Backend& backend) {
  return SegmentLayout::For(backend.slots_in_segment() ? static_cast<uint64_t>(g.SlotBytes()) : 0,
                            g.num_slots);
}
}  // namespace

uint64_t Session::BytesNeeded(const SessionGeometry& g, const Backend& backend) {
  uint64_t bytes = ControlLayout(g, backend).total_bytes;
  if (!backend.slots_in_segment())
    bytes += AlignUp(static_cast<uint64_t>(g.SlotBytes()), kSegmentAlign) * g.num_slots;
  return bytes;
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
      slots_(geometry_.num_slots, SlotEntry{SlotState::kFree, 0, absl::Now()}) {}

const char* Session::SlotStateName(SlotState s) {
  switch (s) {
    case SlotState::kFree: return "free";
    case SlotState::kWriting: return "writing";
    case SlotState::kHeld: return "held";
  }
  return "unknown";
}

void Session::SetSlot(int slot, SlotState state, uint64_t epoch) {
  {
    std::lock_guard<std::mutex> lock(slot_mu_);
    slots_[slot] = SlotEntry{state, epoch, absl::Now()};
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
  e = SlotEntry{SlotState::kFree, e.epoch, absl::Now()};
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
    if (!NotHeldLocked(s)) continue;
    if (absl::Status st = transport_->Poison(s); !st.ok()) {
      Logger("exec")->warn("session {}: poison slot {}: {}", id_, s, std::string(st.message()));
      continue;
    }
    ++n;
  }
  return n;
}

Session::~Session() {
  Abort(kAbortClosed);
  for (uint64_t w : peer_watches_) exports_.Unwatch(w);
  // No new peer can fetch the segment; the memory stays mapped in peers until they close their
  // sessions, and goes with the last mapping.
  if (export_id_ != 0) exports_.Withdraw(export_id_);
}

absl::Status Session::ConnectPeers(const std::vector<std::string>& payloads,
                                   absl::Duration timeout) {
  if (static_cast<int>(payloads.size()) != geometry_.world_size)
    return absl::InternalError(StrCat("session ", id_, ": expected ", geometry_.world_size,
                                      " peer segments, got ", payloads.size()));
  std::vector<ipc::SharedSegment> peers(payloads.size());
  std::vector<ipc::UniqueFd> links(payloads.size());
  std::vector<std::string> handles(payloads.size());
  std::vector<uint8_t*> bases(payloads.size(), nullptr);
  for (int r = 0; r < geometry_.world_size; ++r) {
    if (r == geometry_.rank) continue;
    const size_t nl = payloads[r].find('\n');
    if (nl == std::string::npos)
      return absl::FailedPreconditionError(
          StrCat("session ", id_, ": rank ", r, " sent a malformed session handle"));
    handles[r] = payloads[r].substr(nl + 1);
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
  ULY_RETURN_IF_ERROR(transport_->Connect(handles, bases, timeout));
  peers_ = std::move(peers);
  // A peer daemon that dies closes its end of the link: this rank aborts, which its own waits
  // and every other rank's waits see at once. A peer that hangs keeps the link open; the call
  // timeout covers it.
  for (int r = 0; r < geometry_.world_size; ++r) {
    if (!links[r].valid()) continue;
    absl::StatusOr<uint64_t> w = exports_.Watch(std::move(links[r]), [this, r] {
      int none = -1;
      peer_gone_.compare_exchange_strong(none, r);
      Abort(kAbortPeerGone);
    });
    if (!w.ok()) return w.status();
    peer_watches_.push_back(*w);
  }
  return absl::OkStatus();
}

SessionControlBlock* Session::Control(int rank) const {
  void* base = rank == geometry_.rank ? segment_.data() : peers_[rank].data();
  return static_cast<SessionControlBlock*>(base);
}

absl::Status Session::WaitWord(const std::atomic<uint64_t>& word, uint64_t target, int peer,
                               absl::Time deadline, const char* what) const {
  const std::atomic<uint64_t>& own_abort = Control(geometry_.rank)->abort;
  const std::atomic<uint64_t>& peer_abort = Control(peer)->abort;
  // Slices, so that this session's own abort (its client is gone) also ends the wait.
  for (;;) {
    const absl::Time slice = std::min(deadline, absl::Now() + absl::Milliseconds(20));
    absl::Status s = ipc::WaitAtLeast(word, target, slice, &peer_abort,
                                      StrCat("session ", id_, " rank ", peer, " ", what));
    if (s.ok()) return s;
    if (s.code() == absl::StatusCode::kAborted)
      return absl::AbortedError(StrCat("session ", id_, ": rank ", peer,
                                       " aborted the group (its session is gone or broken)"));
    if (own_abort.load(std::memory_order_acquire) != 0) return OwnAbortError();
    if (absl::Now() >= deadline)
      return absl::DeadlineExceededError(StrCat("session ", id_, ": timed out waiting for rank ",
                                                peer, " (", what, ", epoch ", target, ")"));
  }
}

absl::Status Session::OwnAbortError() const {
  if (Control(geometry_.rank)->abort.load(std::memory_order_acquire) == kAbortPeerGone)
    return absl::AbortedError(StrCat("session ", id_, ": the daemon of rank ", peer_gone_.load(),
                                     " is gone (its peer link hung up)"));
  return absl::AbortedError(StrCat("session ", id_, ": closed while a call waited"));
}

uint64_t Session::next_epoch() const {
  std::lock_guard<std::mutex> lock(call_mu_);
  return epoch_ + 1;
}

absl::Status Session::Refuse(uint64_t expected_epoch, absl::Status why) {
  std::lock_guard<std::mutex> lock(call_mu_);
  if (expected_epoch != epoch_ + 1) return why;  // not this session's next call: touch nothing
  const uint64_t e = ++epoch_;
  const int s = static_cast<int>((e - 1) % geometry_.num_slots);
  SessionControlBlock* mine = Control(geometry_.rank);
  mine->slots[s].error.store(e, std::memory_order_release);
  mine->slots[s].done.store(e, std::memory_order_release);
  broken_.store(true);
  Abort(kAbortCallFailed);
  Logger("exec")->warn("session {} epoch {}: descriptor refused: {}", id_, e, std::string(why.message()));
  return why;
}

absl::StatusOr<CallOutcome> Session::Execute(const CallPlan& plan, const CallOperands& ops,
                                             absl::Duration timeout, uint64_t expected_epoch) {
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
  const uint64_t call_shape = static_cast<uint64_t>(plan.batch) << 32 | static_cast<uint64_t>(plan.seq_local);
  const uint64_t call_op = static_cast<uint64_t>(plan.op) << 48 |
                           static_cast<uint64_t>(plan.head_offset) << 24 |
                           static_cast<uint64_t>(plan.head_count);
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
      status = absl::InvalidArgumentError(StrCat(
          "session ", id_, " epoch ", e, ": ranks issued different calls (rank ", dst, ": ",
          OpName(static_cast<OpKind>(their_op >> 48)), " B=", their_shape >> 32,
          " S_l=", their_shape & 0xffffffffu, " band ", (their_op >> 24) & 0xffffffu, "+",
          their_op & 0xffffffu, "; rank ", me, ": ", OpName(plan.op), " B=", plan.batch,
          " S_l=", plan.seq_local, " band ", plan.head_offset, "+", plan.head_count, ")"));
      break;
    }
    if (!at_once) status = transport_->Push(plan, ops, dst, s);
  }
  if (at_once && status.ok()) status = transport_->PushAll(plan, ops, s, e);
  // Every block must be in place (a GPU backend's kernels finished) before the arrival words
  // announce them; release order makes the bytes visible before the word.
  if (status.ok()) status = transport_->Flush();
  for (int dst = 0; dst < W && status.ok(); ++dst)
    Control(dst)->slots[s].arrive[me].store(e, std::memory_order_release);
  for (int src = 0; src < W && status.ok(); ++src)
    status = WaitWord(mine->slots[s].arrive[src], e, src, deadline, "writing its block");
  if (status.ok()) status = transport_->Finish(plan, ops, s);
  if (status.ok()) {
    const int32_t itemsize = geometry_.itemsize();
    mine->slots[s].done.store(e, std::memory_order_release);
    // The result is the client's view until it releases it, unless it was copied out.
    const bool copied_out = plan.has_out;
    SetSlot(s, copied_out ? SlotState::kFree : SlotState::kHeld, e);
    if (copied_out) mine->slots[s].released.store(e, std::memory_order_release);
    calls_.fetch_add(1);
    last_epoch_.store(e);
    CallOutcome out;
    out.epoch = e;
    out.slot = s;
    out.slot_offset_bytes = transport_->SlotOffset(s);
    out.result_bytes = static_cast<uint64_t>(plan.slot_elems) * itemsize;
    // Every op moves exactly what this rank's inputs hold for the exchanged heads.
    out.bytes_sent = out.result_bytes;
    return out;
  }
  // The ranks' epochs no longer line up: fail this session and tell the peers at once.
  mine->slots[s].error.store(e, std::memory_order_release);
  mine->slots[s].done.store(e, std::memory_order_release);
  SetSlot(s, SlotState::kFree, e);
  broken_.store(true);
  Abort(kAbortCallFailed);
  Logger("exec")->warn("session {} epoch {}: call failed: {}", id_, e, std::string(status.message()));
  return status;
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
