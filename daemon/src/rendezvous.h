// Group rendezvous between daemons: an all-gather of one payload per rank under a key, with the
// same verdict (success, mismatch, timeout, abort) on every rank. Rank 0's daemon hosts the
// table; the others reach it through the Peer service on the node socket of the group's
// member address. A member address is the control socket of a daemon of the node (CheckMembers
// in requests.h: a unix socket path, and one of the node config's devices[] when it lists
// any); that daemon serves Peer on the path + kNodeSocketSuffix (ulysses/common/sockets.h),
// mode 0600, and refuses it on the control socket.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "ulysses/v1/peer.grpc.pb.h"

namespace ulysses::daemon {

/// Bounds on what one Peer request may ask the table to hold. The daemons' own requests stay
/// far below them: keys are "join/<group>" or "session/<group>/<n>", agreements a canonical
/// rendering of the collective's arguments (members included), payloads a segment name or an
/// error message.
inline constexpr size_t kMaxRendezvousKeyBytes = 1024;
inline constexpr size_t kMaxRendezvousAgreementBytes = 64 * 1024;
inline constexpr size_t kMaxRendezvousPayloadBytes = 64 * 1024;
inline constexpr size_t kMaxRendezvousReasonBytes = 4096;
/// Keys with ranks waiting at once; an arrival under a new key beyond it is RESOURCE_EXHAUSTED.
inline constexpr size_t kMaxPendingRendezvous = 4096;
/// Of those, the steps the clients of one uid may have opened (been first to arrive at): a
/// quarter, so that one uid's clients, on however many daemons, cannot fill the table.
inline constexpr size_t kMaxPendingRendezvousPerUid = kMaxPendingRendezvous / 4;
/// Longest wait one rank may ask for.
inline constexpr int64_t kMaxRendezvousTimeoutMs = 3600 * 1000;
/// Ended groups (RendezvousTable::EndGroup) remembered at once, and for how long: a prefix names
/// one group instance (its join's nonce), so an entry can never refuse a later group, and the
/// bounds only cap the memory (an arrival of an ended group older than both waits its timeout).
inline constexpr size_t kMaxEndedGroups = 4096;
inline constexpr absl::Duration kEndedGroupMemory = absl::Milliseconds(kMaxRendezvousTimeoutMs);

/// Checks the fields of one arrival before anything is allocated for it: `key` of
/// 1..kMaxRendezvousKeyBytes bytes, world_size in [1, kMaxWorldSize], rank in
/// [0, world_size), agreement and payload within their bounds. INVALID_ARGUMENT names the field.
absl::Status ValidateArrival(const std::string& key, int64_t world_size, int64_t rank,
                             const std::string& agreement, const std::string& payload);

/// Checks an abort: `key` of 1..kMaxRendezvousKeyBytes bytes, `reason` within
/// kMaxRendezvousReasonBytes, and a `prefix` abort's key ending in '/'. INVALID_ARGUMENT names
/// the field.
absl::Status ValidateAbort(const std::string& key, const std::string& reason, bool prefix = false);

/// Server side: the meeting point of the ranks of one collective step. Thread-safe. No arrival
/// holds a thread while it waits: each is answered through its callback, by whoever decides the
/// step (the arrival that completes it, an Abort or Cancel, or the table's one deadline thread).
class RendezvousTable {
 public:
  /// Every rank's payload in rank order, or why the step failed (the same for every rank).
  using Verdict = absl::StatusOr<std::vector<std::string>>;
  /// Receives one arrival's verdict, once, never under the table's lock. It runs on the thread
  /// that decided the step: the caller of the Arrive that completed or refused it, of Cancel or
  /// Abort, or the table's deadline thread.
  using Done = std::function<void(Verdict)>;

  /// Starts the deadline thread.
  RendezvousTable();
  /// Answers every arrival still waiting with ABORTED, then joins the deadline thread.
  ~RendezvousTable();
  RendezvousTable(const RendezvousTable&) = delete;
  RendezvousTable& operator=(const RendezvousTable&) = delete;

  /// Registers rank `rank`'s arrival under `key`. Once all `world_size` ranks arrived (agreement
  /// strings must be equal), `deadline` passes (the earliest of the ranks' deadlines counts), or
  /// the key is aborted, `done` gets the verdict; every rank gets the same. Returns the
  /// arrival's id, for Cancel. The fields are checked first (ValidateArrival), and an arrival
  /// under a new key beyond kMaxPendingRendezvous is RESOURCE_EXHAUSTED: an error leaves the
  /// table unchanged and `done` is never called. When this arrival decides the step, every
  /// rank's `done`, this one's included, has run before Arrive returns.
  /// `client_uid`, when known, is the uid of the client the arrival is for: an arrival that
  /// would open a new key past kMaxPendingRendezvousPerUid keys opened for that uid is
  /// RESOURCE_EXHAUSTED too.
  absl::StatusOr<uint64_t> Arrive(const std::string& key, int world_size, int rank,
                                  const std::string& agreement, const std::string& payload,
                                  absl::Time deadline, Done done,
                                  std::optional<uint32_t> client_uid = std::nullopt);
  /// The daemon that sent arrival `id` went away (its call was cancelled): its key fails for
  /// every rank with ABORTED naming its rank. Nothing once the key has its verdict.
  void Cancel(uint64_t id);
  /// Fails the key for every waiting rank with ABORTED. INVALID_ARGUMENT (and nothing aborted)
  /// when `key` or `reason` is over its bound.
  absl::Status Abort(const std::string& key, const std::string& reason);
  /// A member of a group left it (its client went away or left): every step whose key starts
  /// with `prefix` (one group instance's session keys, ending in '/') fails for every waiting
  /// rank with ABORTED, and so does every later arrival under such a key, at once, for
  /// kEndedGroupMemory (at most kMaxEndedGroups prefixes, the oldest forgotten first).
  /// INVALID_ARGUMENT (and nothing changed) when the fields fail ValidateAbort.
  absl::Status EndGroup(const std::string& prefix, const std::string& reason);
  /// Number of keys with ranks waiting (for tests and state).
  size_t pending() const;
  /// Number of ended-group prefixes remembered (for tests and state).
  size_t ended_groups() const;
  /// Number of arrivals not answered yet, over all keys (for tests and state).
  size_t waiting() const;

 private:
  struct Waiter {
    uint64_t id = 0;
    Done done;
  };
  struct Entry {
    uint64_t serial = 0;  // orders entries of equal deadline in deadlines_
    int world_size = 0;
    std::vector<std::optional<std::string>> payloads;
    std::vector<std::string> agreements;
    int arrived = 0;
    std::vector<Waiter> waiters;
    absl::Time deadline = absl::InfiniteFuture();
    std::optional<uint32_t> opened_by;  // the uid whose arrival made the entry, when known
  };
  struct Arrival {
    std::shared_ptr<Entry> entry;
    std::string key;
    int rank = 0;
  };
  /// Answers taken out of the table under its lock, to be given after it is released.
  using Answers = std::vector<std::pair<Done, Verdict>>;
  /// Gives `key`'s entry its verdict: removes it and its arrivals and deadline, and moves every
  /// waiter's answer into `out`. Caller holds mu_.
  void FinishLocked(const std::string& key, Entry& e, const absl::Status& verdict, Answers* out);
  /// Fails every entry whose deadline passed, until the table is destroyed.
  void DeadlineLoop();
  /// Why `key` belongs to an ended group, or null. Caller holds mu_.
  const std::string* EndedLocked(const std::string& key, absl::Time now);

  struct Ended {
    std::string reason;
    absl::Time at;
    uint64_t serial = 0;  // the order of EndGroup calls
  };

  mutable std::mutex mu_;
  std::condition_variable deadline_cv_;  // the earliest deadline changed, or stop_
  bool stop_ = false;
  std::map<std::string, std::shared_ptr<Entry>> entries_;
  std::map<uint32_t, size_t> opened_by_uid_;  // pending keys each uid's arrivals opened
  std::map<std::pair<absl::Time, uint64_t>, std::string> deadlines_;  // (deadline, serial) -> key
  std::map<uint64_t, Arrival> arrivals_;  // waiting arrivals by id
  std::map<std::string, Ended> ended_;    // EndGroup's prefixes
  uint64_t next_id_ = 1;
  size_t waiting_ = 0;
  std::thread deadline_thread_;
};

/// Most channels a daemon keeps to other daemons, and how long an unused one is kept.
inline constexpr size_t kMaxRendezvousChannels = 64;
inline constexpr absl::Duration kRendezvousChannelIdle = absl::Minutes(5);

/// The channels of a RendezvousClient, one per member address: at most `capacity`, the least
/// recently used one dropped for a new address, and any unused for `idle` dropped when the
/// cache is next used. A dropped channel stays alive while a call still holds it. Not
/// thread-safe (RendezvousClient locks around it).
class ChannelCache {
 public:
  explicit ChannelCache(size_t capacity = kMaxRendezvousChannels,
                        absl::Duration idle = kRendezvousChannelIdle)
      : capacity_(capacity < 1 ? 1 : capacity), idle_(idle) {}
  /// The channel to `address` (a GrpcTarget), made when there is none, used at `now`.
  std::shared_ptr<grpc::Channel> Get(const std::string& address, absl::Time now);
  size_t size() const { return entries_.size(); }
  bool contains(const std::string& address) const { return entries_.count(address) > 0; }
  /// Drops every channel (one a call still holds stays alive with it).
  void clear() { entries_.clear(); }

 private:
  struct Entry {
    std::shared_ptr<grpc::Channel> channel;
    absl::Time last_used;
  };
  size_t capacity_;
  absl::Duration idle_;
  std::map<std::string, Entry> entries_;
};

/// The verdict of this daemon's arrival at rank 0's table, as RendezvousClient delivers it.
using RendezvousDone = std::function<void(RendezvousTable::Verdict)>;

/// One arrival of this daemon at rank 0's table, in flight (RendezvousClient::Start). It holds
/// no thread while the ranks meet: its verdict comes on a gRPC callback thread.
class RendezvousCall : public std::enable_shared_from_this<RendezvousCall> {
 public:
  /// Longest wait for rank 0 to answer ClientGone's abort.
  static constexpr absl::Duration kAbortTimeout = absl::Seconds(5);

  /// The client whose request this step serves went away: aborts the key at rank 0 for every
  /// rank (Peer.AbortRendezvous), so the peers get ABORTED at once instead of waiting out the
  /// timeout. The verdict still comes to the done callback: ABORTED, or, where the step was
  /// decided before the abort came, that decision (success included), which the caller must
  /// undo for the peers. Only when rank 0 did not take the abort (unreachable, or no answer
  /// within kAbortTimeout) is this call cancelled. Thread-safe; only the first call acts, and
  /// none once the verdict came (the key may be another step's by then).
  void ClientGone();

 private:
  friend class RendezvousClient;
  void Finished(const grpc::Status& s);

  std::string address_;  // rank 0's member address
  std::string key_;
  int rank_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Peer::Stub> stub_;
  RendezvousDone done_;
  grpc::ClientContext ctx_;
  v1::RendezvousRequest req_;
  v1::RendezvousResponse resp_;
  std::atomic<bool> gone_{false};
  std::atomic<bool> finished_{false};
  grpc::ClientContext abort_ctx_;
  v1::AbortRendezvousRequest abort_req_;
  v1::AbortRendezvousResponse abort_resp_;
};

/// Client side: reaches rank 0's Peer service on the node socket of its member address
/// (NodeSocketAddress). Channels are cached per node socket, bounded (ChannelCache).
/// Thread-safe.
class RendezvousClient {
 public:
  RendezvousClient();
  /// Cancels the EndGroup calls still in flight and waits (at most kEndGroupDrain) for their
  /// callbacks, which log: none may run once the daemon is gone (at exit, the logger registry
  /// is destroyed under them). Then drops the channels under the lock every use of them
  /// takes: the last use was on a gRPC callback thread, which the destroying thread knows
  /// nothing else of.
  ~RendezvousClient();
  /// Longest the destructor waits for the callbacks of cancelled EndGroup calls.
  static constexpr absl::Duration kEndGroupDrain = absl::Seconds(2);

  /// Arrives under `key` at rank 0's table (`address`: rank 0's member address, its control
  /// socket) and returns at once; `done` gets the verdict, once, on a gRPC callback thread (it
  /// must not block). INVALID_ARGUMENT, nothing dialled and `done` never called, when `address`
  /// is not a unix socket address.
  absl::StatusOr<std::shared_ptr<RendezvousCall>> Start(const std::string& address,
                                                        const std::string& key, int world_size,
                                                        int rank, const std::string& agreement,
                                                        const std::string& payload,
                                                        absl::Duration timeout,
                                                        RendezvousDone done,
                                                        std::optional<uint32_t> client_uid =
                                                            std::nullopt);
  /// Start, then waits for the verdict.
  absl::StatusOr<std::vector<std::string>> Rendezvous(const std::string& address,
                                                      const std::string& key, int world_size,
                                                      int rank, const std::string& agreement,
                                                      const std::string& payload,
                                                      absl::Duration timeout);
  /// Fails `key` at rank 0's table (`address` as for Start) for every rank (AbortRendezvous).
  absl::Status Abort(const std::string& address, const std::string& key,
                     const std::string& reason);
  /// Ends the group instance whose step keys start with `prefix` at rank 0's table
  /// (RendezvousTable::EndGroup through AbortRendezvous with `prefix` set) and returns at once:
  /// the answer, logged when it is an error, comes on a gRPC callback thread within
  /// RendezvousCall::kAbortTimeout. INVALID_ARGUMENT when `address` is not a unix socket address.
  absl::Status EndGroup(const std::string& address, const std::string& prefix,
                        const std::string& reason);

 private:
  /// The channel to the node socket of member address `address`.
  absl::StatusOr<std::shared_ptr<grpc::Channel>> ChannelFor(const std::string& address);
  std::mutex mu_;
  ChannelCache channels_;
  /// EndGroup's calls until their callbacks ran; shared with those callbacks.
  struct EndGroupCalls;
  std::shared_ptr<EndGroupCalls> end_group_calls_;
};

/// Turns a member address ("unix:///p", "unix:/p", "/p" or "host:port") into a gRPC target.
std::string GrpcTarget(const std::string& address);

/// The node socket of the daemon whose control socket is the member address `address`
/// ("unix:///p", "unix:/p" or "/p"), in the same form: the path with kNodeSocketSuffix
/// appended ("unix:///p.node", ...). INVALID_ARGUMENT naming the address for any other form
/// (host:port): only a unix socket has a node socket.
absl::StatusOr<std::string> NodeSocketAddress(const std::string& address);

}  // namespace ulysses::daemon
