// A session: one prepared head-exchange operation on a group, on this rank. Owns this rank's
// session segment (control block + receive slots, a sealed memfd) and maps the segments of the
// other ranks, fetched from their daemons, so that each call writes its blocks straight into the
// peers' receive slots (host backend; the NVLink backend does the same with symmetric device
// memory). The connection each fetch keeps open to a peer's daemon tells this session at once
// when that daemon dies.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ulysses/common/fused.h"
#include "ulysses/common/geometry.h"
#include "ulysses/common/logging.h"
#include "ulysses/common/session_layout.h"
#include "ulysses/ipc/shm.h"
#include "fd_exports.h"
#include "transport.h"

namespace ulysses::daemon {

/// Outcome of one call.
struct CallOutcome {
  uint64_t epoch = 0;
  int32_t slot = 0;
  uint64_t slot_offset_bytes = 0;  ///< offset of the result in the session segment
  uint64_t result_bytes = 0;
  uint64_t bytes_sent = 0;  ///< bytes this rank wrote into receive slots (its own included)
  /// A stream-ordered call enqueued asynchronously: it finishes later (Session::Poll) and is
  /// reported by TakeFinished; the fields above are already final.
  bool pending = false;
};

/// How a call is issued.
struct ExecuteMode {
  /// Stream-ordered transports: return once the call is enqueued (the ring path); its end is
  /// collected through Poll/TakeFinished. Otherwise Execute returns when the call finished.
  bool async = false;
  /// The client's stream writes the call's ready word (see StreamCall::wait_ready).
  bool wait_ready = false;
  /// With wait_ready: the client's stream gave the slot's previous result back before the
  /// ready word, so the daemon's stream need not wait for the release word
  /// (ipc::kDescriptorReleasedInOrder).
  bool released_in_order = false;
};

/// A finished asynchronous call.
struct FinishedCall {
  uint64_t epoch = 0;
  absl::StatusOr<CallOutcome> outcome;
};

class Session {
 public:
  /// Creates this rank's control segment (its memory reserved: RESOURCE_EXHAUSTED naming the
  /// limit when it cannot be), lends it to the node's daemons through `exports`, and makes its
  /// receive slots through `backend`. Does not touch peers yet.
  /// A qkv_norm_rope_exchange session passes `fused` (its geometry must give `geometry` by
  /// SlotGeometry) and the buffers its weights live in, which the session keeps mapped.
  static absl::StatusOr<std::unique_ptr<Session>> Create(
      uint64_t id, uint64_t group_id, uint64_t owner_client, const SessionGeometry& geometry,
      FdExports& exports, Backend& backend, const FusedSetup* fused = nullptr,
      std::vector<std::shared_ptr<Buffer>> weight_buffers = {});
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  /// What this rank contributes to the session rendezvous: the ticket of its segment and its
  /// slot handle.
  std::string RendezvousPayload() const;
  /// After the rendezvous's first round: checks that every peer runs this backend
  /// (Transport::CheckPeers), maps the other ranks' segments from their payloads (rank
  /// order), and watches each peer's daemon: when one dies before completing the epoch a call
  /// waits on, the call ends at once with ABORTED instead of at its timeout. Local: its
  /// verdict is this rank's second-round payload.
  absl::Status MapPeers(const std::vector<std::string>& payloads, absl::Duration timeout);
  /// Whether the transport needs a third round (Transport::HasConnectHandle), and this rank's
  /// payload for it, made only once every rank mapped its peers.
  bool NeedsConnectHandles() const;
  absl::StatusOr<std::string> ConnectPayload();
  /// Connects the transport to the mapped peers (MapPeers first); `connect_payloads`: every
  /// rank's ConnectPayload in rank order, or empty without a third round.
  absl::Status ConnectTransport(const std::vector<std::string>& connect_payloads,
                                absl::Duration timeout);

  /// Runs one planned call: opens this rank's slot for the next epoch, writes this rank's block
  /// into every destination's slot once that destination opened it, waits for every source's
  /// block, then finishes (copy to `out`, head-chunk merge). Calls on one session are serialized.
  /// Waits are bounded by `timeout` and end early with ABORTED when a peer's session is gone.
  /// A failed call breaks the session (its epochs would no longer line up across ranks).
  /// `expected_epoch` (0: any) is the epoch the caller believes comes next (the ring path's
  /// descriptors carry it); a mismatch is FAILED_PRECONDITION and consumes nothing.
  absl::StatusOr<CallOutcome> Execute(const CallPlan& plan, const CallOperands& ops,
                                      absl::Duration timeout, uint64_t expected_epoch = 0,
                                      ExecuteMode mode = {});
  /// Stream-ordered sessions: finishes the enqueued calls whose device work completed (slot
  /// states, done words, counters) and fails every one of them when a peer failed or left, the
  /// session closed, or a call passed its deadline (the session breaks and its transport is
  /// cancelled, so no stream stays blocked). Cheap when nothing is in flight. Thread-safe.
  void Poll();
  /// Whether stream-ordered calls are enqueued and not finished yet.
  bool InFlight() const;
  /// The asynchronous calls finished since the last take, in epoch order, into `into` (its
  /// contents replaced). Swaps storage with the session: a caller that passes the same vector
  /// every time allocates nothing once both have grown to the calls a poll finishes.
  void TakeFinished(std::vector<FinishedCall>* into);
  /// A descriptor for `expected_epoch` that the daemon refused before running it: when it is
  /// the next epoch, the epoch is consumed (done and error words set, so no waiter hangs) and
  /// the session breaks, since its peers expect this rank's block. Returns the status to report.
  absl::Status Refuse(uint64_t expected_epoch, absl::Status why);
  /// The epoch the next call gets.
  uint64_t next_epoch() const;

  /// Marks the session gone: peers waiting on it for an epoch it did not complete end with
  /// ABORTED, and this rank's call waiting for a held slot ends too. Idempotent.
  void Abort(uint64_t code);

  /// OK while a call of `epoch` can still complete: this session is not aborted, and no peer
  /// left (its session aborted or its daemon gone) before completing `epoch`. ABORTED naming
  /// the first such rank otherwise. A peer that completed `epoch` wrote every word and block it
  /// owed for it, so its leaving afterwards fails nothing of `epoch`.
  absl::Status CanComplete(uint64_t epoch) const;
  /// True once every peer completed `epoch` or left (its session gone or broken, or its
  /// daemon gone): none can still be working on it. True before the peers are connected.
  bool PeersPast(uint64_t epoch) const;

  /// Gives back the slot holding the result of `epoch`. FAILED_PRECONDITION when no slot holds
  /// that epoch (never issued, copied out, or released already).
  absl::Status Release(uint64_t epoch);
  /// Lets the owner release held slots by writing `words[slot] = epoch` in its client segment
  /// (kept mapped by `keepalive`). `index` is the row reported to the client.
  void UseClientReleaseWords(int32_t index, const std::atomic<uint64_t>* words,
                             std::shared_ptr<const void> keepalive);
  /// Row of the client's release words, or -1 (release through the RPC).
  int32_t release_index() const { return release_index_; }

  /// Fills the slots that are not held with all-ones bytes (NaN in every supported dtype).
  /// Returns how many slots were filled. Waits for a running call to finish first.
  int Poison();

  uint64_t id() const { return id_; }
  uint64_t group_id() const { return group_id_; }
  uint64_t owner_client() const { return owner_client_; }
  /// The slots' geometry (for a fused session: SlotGeometry of its fused geometry).
  const SessionGeometry& geometry() const { return geometry_; }
  SessionKind kind() const {
    return fused_ ? SessionKind::kQkvNormRopeExchange : SessionKind::kHeadExchange;
  }
  /// A qkv_norm_rope_exchange session's geometry and path; null for head exchange.
  const FusedSetup* fused() const { return fused_ ? &*fused_ : nullptr; }
  /// Its weights as the owner registered them (buffer ids, offsets, shapes).
  const FusedWeightsArgs& fused_weights() const { return fused_weights_; }
  void set_fused_weights(const FusedWeightsArgs& w) { fused_weights_ = w; }
  /// Keeps `hold` (the session's share of the daemon's slot budget) until the session is
  /// destroyed: after its transport drained, or was kept with UndrainedBytes counting it.
  void HoldSlotMemory(std::shared_ptr<const void> hold) { slot_memory_hold_ = std::move(hold); }
  /// Keeps `charge` (against the session limits, Daemon::ChargeSession) until the session is
  /// destroyed, and for the daemon's life with a transport whose device work did not end: its
  /// descriptors and mappings stay too.
  void HoldCharge(std::shared_ptr<const void> charge) { charge_ = std::move(charge); }
  const SegmentLayout& layout() const { return layout_; }
  /// Bytes this session holds against the daemon's slot budget (segment and device slots).
  uint64_t reserved_bytes() const { return layout_.total_bytes + transport_->DeviceBytes(); }
  /// Slot bytes a session of `g` needs on `backend`, for the budget check before Create.
  static uint64_t BytesNeeded(const SessionGeometry& g, const Backend& backend,
                              const FusedSetup* fused = nullptr);
  /// The segment as the owning client gets it: read-only, size sealed.
  int client_segment_fd() const { return client_fd_.get(); }
  Transport& transport() const { return *transport_; }
  uint64_t calls() const { return calls_.load(); }
  uint64_t last_epoch() const { return last_epoch_.load(); }
  bool broken() const { return broken_.load(); }
  /// Sessions whose transport's device work did not end when they went (Transport::Drain),
  /// since the process started: their transports and buffers are kept, not freed.
  static size_t UndrainedCount();
  /// The device memory those sessions' transports hold: it stays charged to the slot budget.
  static uint64_t UndrainedBytes();
  /// The epoch and state of each slot for Admin.ListSlots.
  /// The slot state machine: free -> writing (a call fills it) -> held (the client has a view of
  /// the result) -> free (released, or copied out at once). A held slot is never overwritten:
  /// the call that needs it next waits for its release.
  enum class SlotState { kFree = 0, kWriting = 1, kHeld = 2 };
  static const char* SlotStateName(SlotState s);
  struct SlotView {
    int32_t slot;
    SlotState state;
    uint64_t epoch;  ///< the epoch last written into the slot (0: never)
    absl::Time since;
  };
  std::vector<SlotView> Slots();

 private:
  Session(uint64_t id, uint64_t group_id, uint64_t owner, SessionGeometry g, SegmentLayout l,
          ipc::SharedSegment seg, FdExports& exports);
  SessionControlBlock* Control(int rank) const;
  // Every other rank's slot handle out of its first-round payload (this rank's own: empty).
  absl::StatusOr<std::vector<std::string>> HandlesOf(
      const std::vector<std::string>& payloads) const;
  // ABORTED for this session's own abort word: why it was set.
  absl::Status OwnAbortError() const;
  absl::Status WaitWord(const std::atomic<uint64_t>& word, uint64_t target, int peer,
                        absl::Time deadline, const char* what) const;

  const uint64_t id_;
  const uint64_t group_id_;
  const uint64_t owner_client_;
  const SessionGeometry geometry_;
  const SegmentLayout layout_;
  ipc::SharedSegment segment_;
  ipc::UniqueFd client_fd_;                // read-only descriptor of segment_
  FdExports& exports_;
  uint64_t export_id_ = 0;                 // segment_ as lent to the peers
  std::string ticket_;                     // EncodeTicket of that loan
  std::vector<uint64_t> peer_watches_;     // FdExports::Watch ids of the peers' links
  std::atomic<uint64_t> peers_gone_{0};    // bit r: rank r's daemon is gone (its link hung up)
  std::vector<ipc::SharedSegment> peers_;  // index = rank; this rank's entry is empty
  std::vector<std::string> handles_;       // MapPeers: the peers' slot handles (own: empty)
  std::vector<uint8_t*> bases_;            // MapPeers: the segments' bases (own: null)
  std::optional<FusedSetup> fused_;
  FusedWeightsArgs fused_weights_;
  // Declared before transport_: the weights stay mapped until the transport is gone.
  std::vector<std::shared_ptr<Buffer>> weight_buffers_;
  std::shared_ptr<const void> slot_memory_hold_;  // given back after ~Session's drain
  std::shared_ptr<const void> charge_;            // the same, or kept with an undrained transport
  std::unique_ptr<Transport> transport_;
  mutable std::mutex call_mu_;            // one call in flight per session
  uint64_t epoch_ = 0;
  std::atomic<uint64_t> calls_{0};
  std::atomic<uint64_t> last_epoch_{0};
  std::atomic<bool> broken_{false};
  mutable LogBudget log_budget_;
  struct SlotEntry {
    SlotState state = SlotState::kFree;
    uint64_t epoch = 0;
    absl::Time since;
    // == epoch: the client gives that result back on its stream (the released device word),
    // which the daemon's stream waits for; the host word then only updates `state`.
    uint64_t stream_release = 0;
  };
  void SetSlot(int slot, SlotState state, uint64_t epoch, uint64_t stream_release = 0);
  bool stream_ordered() const { return transport_->StreamOrdered(); }
  absl::StatusOr<CallOutcome> ExecuteStream(const CallPlan& plan, const CallOperands& ops,
                                            absl::Duration timeout, uint64_t expected_epoch,
                                            ExecuteMode mode);
  // Breaks a stream-ordered session: every in-flight call fails with `why` (done and error words
  // set, slots freed), peers are told, the transport is cancelled. Caller holds inflight_mu_.
  void FailInFlightLocked(const absl::Status& why);
  // Marks the session broken and cancels its transport (no stream stays blocked).
  void Break();
  // Logs "session ID <what>" within this session's budget: its client decides how often its
  // calls fail or are refused.
  void Warn(const std::string& what) const;
  // The outcome of a call that finished, with its slot set held or free. `released_on_stream`:
  // the client gives a held result back on its stream (a stream-ordered call).
  CallOutcome FinishCall(const CallPlan& plan, int slot, uint64_t epoch,
                         bool released_on_stream = false);
  // What a call of `plan` in `slot` at `epoch` reports (no state changes).
  CallOutcome Outcome(const CallPlan& plan, int slot, uint64_t epoch) const;
  // The first failure a completed stream-ordered call shows: a peer that failed the same epoch,
  // or a peer that issued a different call. OK when the call is good.
  absl::Status CheckCompleted(uint64_t epoch, int slot, uint64_t call_shape, uint64_t call_op) const;
  struct InFlightCall {
    uint64_t epoch = 0;
    int slot = 0;
    CallPlan plan;
    uint64_t call_shape = 0, call_op = 0;
    absl::Time deadline;
    bool async = false;
    bool released_on_stream = false;
    std::array<std::shared_ptr<const void>, 4> keep;  // the operands' buffers (CallOperands)
  };
  // Keeps a transport whose device work did not end, and the buffers its calls used, for the
  // process's life (UndrainedCount counts them).
  static void KeepForever(std::unique_ptr<Transport> transport,
                          std::vector<std::shared_ptr<const void>> buffers);
  // "; protocol words: ..." for a call that did not finish on a stream-ordered transport, and
  // the same in the log at warn; empty where the transport has no words.
  std::string StuckWords(const InFlightCall& f) const;
  mutable std::mutex inflight_mu_;
  // Oldest first. At most one per slot (a call claims its slot first), so the capacity
  // reserved for num_slots serves every call without an allocation.
  std::vector<InFlightCall> inflight_;
  // Buffers of calls that failed while queued on a stream: their kernels may still run until
  // the transport drains its stream (its destruction), so they are held until then.
  std::vector<std::shared_ptr<const void>> failed_keep_;
  std::vector<FinishedCall> finished_;              // async calls, for TakeFinished
  // Calls whose caller waits (Execute without async), by epoch, for that caller. The nodes of
  // taken results are kept (as many as slots) and reused, so a call allocates none.
  using SyncResults = std::map<uint64_t, absl::StatusOr<CallOutcome>>;
  SyncResults finished_sync_;
  std::vector<SyncResults::node_type> spare_sync_nodes_;
  void PutSyncResultLocked(uint64_t epoch, absl::StatusOr<CallOutcome> outcome);
  // A held slot whose result the client released through its word becomes free. Caller holds
  // slot_mu_. Returns whether the slot is (now) not held.
  bool NotHeldLocked(int slot);
  mutable std::mutex slot_mu_;
  std::condition_variable slot_cv_;
  std::vector<SlotEntry> slots_;
  int32_t release_index_ = -1;
  const std::atomic<uint64_t>* client_released_ = nullptr;  // [num_slots], client-written
  std::shared_ptr<const void> client_words_keepalive_;
};

}  // namespace ulysses::daemon
