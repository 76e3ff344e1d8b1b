#include "ulysses/client/client.h"

#include <fcntl.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <mutex>
#include <string_view>
#include <thread>

#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "release_ledger.h"
#include "ulysses/common/session_layout.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/client_segment.h"
#include "ulysses/ipc/cuda_memory.h"
#include "ulysses/ipc/doorbell.h"
#include "ulysses/ipc/fd.h"
#include "ulysses/ipc/shm.h"
#include "ulysses/ipc/unix_socket.h"
#include "ulysses/proto/fused_spec.h"
#include "ulysses/proto/grpc_status.h"
#include "ulysses/v1/control.grpc.pb.h"

namespace ulysses::client {

using internal::ReleaseLedger;

// How long Session::Close waits for the calls pushed before it (stream-ordered sessions).
constexpr absl::Duration kCloseDrain = absl::Seconds(10);

// How many new streams write the done words when the daemon died (WriteFromNewStreams): twice
// the hardware queues a context spreads its streams over (CUDA_DEVICE_MAX_CONNECTIONS, 8 by
// default), so that some land on queues no wait holds, unless waits hold all of them.
int UnblockStreams() {
  const char* v = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const int queues = v != nullptr ? std::atoi(v) : 0;
  return 2 * std::clamp(queues, 8, 32);
}

// Keeps `p` until the process ends: mappings that streams may still name.
void KeepForProcessLife(std::shared_ptr<void> p) {
  static std::mutex kept_mu;
  static auto* kept = new std::vector<std::shared_ptr<void>>();
  std::lock_guard<std::mutex> lock(kept_mu);
  kept->push_back(std::move(p));
}

// A stream-ordered session's done words (ResultWords), in a second mapping of its slot
// allocation, writable (the slots' own mapping is read-only). Only the daemon
// writes them, unless it dies before it could cancel the session: then this client writes past
// every epoch into them, so that no stream of this process waits for them forever.
struct DoneWords {
  int device = 0;
  int num_slots = 0;
  ipc::cuda::VmmMapping mapping;
  ResultWords* words() { return static_cast<ResultWords*>(mapping.data()); }
};

class ClientImpl : public BufferResolver {
 public:
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Control::Stub> stub;
  uint64_t client_id = 0;
  std::string token;
  std::string backend;
  std::string mps_mode;
  ipc::UniqueFd fd_socket;
  std::mutex fd_mu;  // an RPC that answers with an fd frame and the read of that frame
  mutable std::mutex buf_mu;
  std::map<uint64_t, std::pair<Buffer, std::shared_ptr<void>>> buffers;
  uint64_t next_tag = 1;
  grpc::ClientContext watch_ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::WatchRequest, v1::WatchEvent>> watch;
  std::thread watch_thread;
  std::atomic<bool> closed{false};  // read by SlotHold::Release on any thread
  std::atomic<bool> daemon_gone{false};  // the daemon died (LetStreamsGoIfTheDaemonDied)
  std::atomic<bool> rescue_started{false};
  mutable std::mutex rescue_mu;
  std::string rescue_failure;  // why the done words may not have been written, if they were not
  std::mutex done_words_mu;
  std::vector<std::weak_ptr<DoneWords>> done_words;  // of the stream-ordered sessions

  // The call fast path (absent when the daemon offered none or the caller opted out).
  std::shared_ptr<ipc::Mapping> segment;  // shared with stream-ordered releases in flight
  ipc::ClientSegmentHeader* header = nullptr;
  ipc::SubmitRing* submit = nullptr;
  ipc::CompletionRing* complete = nullptr;
  ipc::Doorbell submit_bell, complete_bell;  // this client's ends: it rings one, waits on one
  std::mutex submit_mu, complete_mu;
  std::map<std::pair<uint64_t, uint64_t>, ipc::Completion> pending;  // (session, epoch)
  std::set<std::pair<uint64_t, uint64_t>> raised;  // failed completions raised at a Submit
  // Stream-ordered calls nobody waits for: a success is dropped when it arrives, a failure
  // stays in `pending` until raised at the session's next call or Synchronize.
  std::set<std::pair<uint64_t, uint64_t>> detached;
  std::set<std::pair<uint64_t, uint64_t>> detached_failed;  // arrived, in `pending`, not raised

  bool has_rings() const { return submit != nullptr; }

  absl::Status AttachRings(ipc::ReceivedMessage& ack) {
    if (ack.fds.size() != 3) return absl::OkStatus();  // the daemon offers no rings
    ULY_ASSIGN_OR_RETURN(ipc::Mapping m, ipc::Mapping::Map(ack.fds[0].get(),
                                                           ipc::ClientSegmentLayout::kTotal, true));
    segment = std::make_shared<ipc::Mapping>(std::move(m));
    auto* base = static_cast<uint8_t*>(segment->data());
    header = reinterpret_cast<ipc::ClientSegmentHeader*>(base);
    if (header->magic != ipc::kClientSegmentMagic || header->version != ipc::kClientSegmentVersion)
      return absl::FailedPreconditionError("client segment: layout version mismatch with the daemon");
    ULY_ASSIGN_OR_RETURN(submit, ipc::SubmitRing::Attach(base + ipc::ClientSegmentLayout::kSubmit,
                                                         sizeof(ipc::SubmitRing)));
    ULY_ASSIGN_OR_RETURN(complete,
                         ipc::CompletionRing::Attach(base + ipc::ClientSegmentLayout::kComplete,
                                                     sizeof(ipc::CompletionRing)));
    ULY_ASSIGN_OR_RETURN(submit_bell, ipc::Doorbell::Adopt(std::move(ack.fds[1])));
    ULY_ASSIGN_OR_RETURN(complete_bell, ipc::Doorbell::Adopt(std::move(ack.fds[2])));
    return absl::OkStatus();
  }

  // Moves every posted completion into `pending`. Caller holds complete_mu.
  absl::Status DrainCompletions() {
    for (;;) {
      ipc::Completion c;
      ULY_ASSIGN_OR_RETURN(bool got, complete->TryPop(&c));
      if (!got) return absl::OkStatus();
      const std::pair<uint64_t, uint64_t> key{c.session_id, c.epoch};
      const bool was_detached = detached.erase(key) != 0;
      if (was_detached && c.code == 0) continue;
      if (was_detached) detached_failed.insert(key);
      pending[key] = c;
    }
  }

  absl::Status Push(const ipc::CallDescriptor& d, absl::Time deadline) {
    std::lock_guard<std::mutex> lock(submit_mu);
    for (;;) {
      ULY_ASSIGN_OR_RETURN(bool pushed, submit->TryPush(d));
      if (pushed) break;
      // Full: the daemon may be waiting for room on the completion ring; make some.
      {
        std::lock_guard<std::mutex> clock(complete_mu);
        ULY_RETURN_IF_ERROR(DrainCompletions());
      }
      if (header->abort.load(std::memory_order_acquire) != 0)
        return absl::AbortedError("the daemon dropped this client");
      ULY_RETURN_IF_ERROR(CheckDaemonAlive());
      if (absl::Now() > deadline) return absl::DeadlineExceededError("submit ring: full");
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    const absl::Status rung = submit_bell.Signal();
    // The daemon's end closed: say why (dropped, or gone) where that is known.
    if (!rung.ok()) ULY_RETURN_IF_ERROR(CheckDaemonAlive());
    return rung;
  }

  void AddDoneWords(const std::shared_ptr<DoneWords>& words) {
    std::lock_guard<std::mutex> lock(done_words_mu);
    std::erase_if(done_words, [](const std::weak_ptr<DoneWords>& w) { return w.expired(); });
    done_words.push_back(words);
  }

  // Once the daemon's end of the fd socket closed: unless the daemon set the abort word first
  // (it dropped this client and cancelled its sessions itself; it sets that word before it
  // closes the socket), it died, and every stream of this process that waits on one of its
  // done words is let go (docs/protocol.md section 9.4). Called by the watch thread, or by a
  // Detach whose RPC failed (the watch thread leaves a closing client's socket to it).
  void LetStreamsGoIfTheDaemonDied() {
    absl::StatusOr<bool> gone = ipc::HungUp(fd_socket.get());
    if (!gone.ok() || !*gone || rescue_started.exchange(true)) return;
    if (header == nullptr || header->abort.load(std::memory_order_acquire) != 0) return;
    daemon_gone.store(true, std::memory_order_release);
    std::map<int, std::vector<uint64_t*>> by_device;
    std::vector<std::shared_ptr<DoneWords>> live;
    {
      std::lock_guard<std::mutex> lock(done_words_mu);
      for (const std::weak_ptr<DoneWords>& w : done_words)
        if (std::shared_ptr<DoneWords> d = w.lock()) live.push_back(std::move(d));
    }
    for (const std::shared_ptr<DoneWords>& d : live)
      for (int slot = 0; slot < d->num_slots; ++slot)
        by_device[d->device].push_back(&d->words()->done[slot]);
    absl::Status written;
    for (auto& [device, words] : by_device)
      written.Update(ipc::cuda::WriteFromNewStreams(device, words, kUnblockEpoch, UnblockStreams(),
                                                    absl::Seconds(10)));
    if (written.ok()) return;
    // Writes still queued name the mappings: keep them.
    for (std::shared_ptr<DoneWords>& d : live) KeepForProcessLife(std::move(d));
    std::lock_guard<std::mutex> lock(rescue_mu);
    rescue_failure = std::string(written.message());
  }

  // Without a system call: ABORTED once the daemon dropped this client (the abort word),
  // UNAVAILABLE once it died (daemon_gone); else OK.
  absl::Status Dropped() const {
    if (header != nullptr && header->abort.load(std::memory_order_acquire) != 0)
      return absl::AbortedError("the daemon dropped this client");
    if (daemon_gone.load(std::memory_order_acquire)) return DaemonGone();
    return absl::OkStatus();
  }

  // UNAVAILABLE: the daemon died; with why its streams may still wait, if that is so.
  absl::Status DaemonGone() const {
    std::lock_guard<std::mutex> lock(rescue_mu);
    return absl::UnavailableError(StrCat(
        "the daemon is gone (its fd socket closed)",
        rescue_failure.empty() ? "" : StrCat("; its calls' done words: ", rescue_failure)));
  }

  // UNAVAILABLE once the daemon's end of the fd socket closed: a daemon that died (SIGKILL
  // included) can never post the completion, nor set the abort word.
  absl::Status CheckDaemonAlive() const {
    ULY_RETURN_IF_ERROR(Dropped());
    absl::StatusOr<bool> gone = ipc::HungUp(fd_socket.get());
    if (gone.ok() && !*gone) return absl::OkStatus();
    return DaemonGone();
  }

  // The first failed completion of `session` not raised yet; it stays pending for its Wait.
  absl::StatusOr<std::optional<ipc::Completion>> TakeUnraisedError(uint64_t session) {
    std::lock_guard<std::mutex> lock(complete_mu);
    ULY_RETURN_IF_ERROR(DrainCompletions());
    for (auto it = pending.begin(); it != pending.end(); ++it) {
      const auto key = it->first;
      if (key.first != session || it->second.code == 0 || raised.count(key)) continue;
      const ipc::Completion c = it->second;
      if (detached_failed.erase(key) != 0) pending.erase(it);  // nobody waits: raised once
      else raised.insert(key);
      return std::optional<ipc::Completion>(c);
    }
    return std::optional<ipc::Completion>();
  }

  // Whether `session` has calls still without their completion: stream-ordered ones nobody
  // waits for, or any of the `submitted` epochs (whose completions nobody took yet).
  absl::StatusOr<bool> Unfinished(uint64_t session, const std::map<uint64_t, bool>& submitted) {
    ULY_ASSIGN_OR_RETURN(bool outstanding, DetachedOutstanding(session));
    if (outstanding) return true;
    std::lock_guard<std::mutex> lock(complete_mu);
    for (const auto& [epoch, with_out] : submitted)
      if (pending.count({session, epoch}) == 0) return true;
    return false;
  }

  // Whether stream-ordered calls of `session` are still without their completion.
  absl::StatusOr<bool> DetachedOutstanding(uint64_t session) {
    std::lock_guard<std::mutex> lock(complete_mu);
    ULY_RETURN_IF_ERROR(DrainCompletions());
    auto it = detached.lower_bound({session, 0});
    return it != detached.end() && it->first == session;
  }

  absl::StatusOr<ipc::Completion> Await(uint64_t session, uint64_t epoch, absl::Time deadline) {
    bool spun = false;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(complete_mu);
        ULY_RETURN_IF_ERROR(DrainCompletions());
        auto it = pending.find({session, epoch});
        if (it != pending.end()) {
          ipc::Completion c = it->second;
          pending.erase(it);
          raised.erase({session, epoch});
          return c;
        }
      }
      if (header->abort.load(std::memory_order_acquire) != 0)
        return absl::AbortedError("the daemon dropped this client");
      if (!spun) {
        // Poll the completion ring briefly before sleeping on the doorbell (ipc::kRingSpin).
        spun = true;
        ipc::SpinFor(ipc::kRingSpin, [&] {
          return !complete->empty() || header->abort.load(std::memory_order_acquire) != 0;
        });
        continue;
      }
      const absl::Time now = absl::Now();
      if (now >= deadline)
        return absl::DeadlineExceededError(StrCat("no completion for session ", session,
                                                  " epoch ", epoch));
      const int ms = static_cast<int>(std::min<int64_t>(20, absl::ToInt64Milliseconds(deadline - now) + 1));
      const absl::Status waited = complete_bell.Wait(ms).status();
      // Checked first, so that a bell whose daemon end closed says why (dropped, or gone).
      ULY_RETURN_IF_ERROR(CheckDaemonAlive());
      ULY_RETURN_IF_ERROR(waited);
    }
  }

  void Prepare(grpc::ClientContext* ctx, absl::Duration timeout = absl::Minutes(10)) const {
    ctx->AddMetadata("ulysses-client-id", std::to_string(client_id));
    ctx->AddMetadata("ulysses-token", token);
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }

  // Reads the frame the daemon sent with `fds` descriptors, checking that it carries `key` == `id`.
  absl::StatusOr<std::vector<ipc::UniqueFd>> ReadFdFrames(const char* key, uint64_t id, size_t fds) {
    ULY_ASSIGN_OR_RETURN(bool ready, ipc::WaitReadable(fd_socket.get(), 10000));
    if (!ready) return absl::DeadlineExceededError(StrCat("fd socket: no frame for ", key, " ", id));
    ULY_ASSIGN_OR_RETURN(ipc::ReceivedMessage m, ipc::RecvMessage(fd_socket.get()));
    nlohmann::json j = nlohmann::json::parse(m.payload, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains(key) || !j[key].is_number_unsigned() ||
        j[key].get<uint64_t>() != id || m.fds.size() != fds)
      return absl::InternalError(StrCat("fd socket: unexpected frame '", m.payload, "' for ", key,
                                        " ", id));
    return std::move(m.fds);
  }
  absl::StatusOr<ipc::UniqueFd> ReadFdFrame(const char* key, uint64_t id) {
    ULY_ASSIGN_OR_RETURN(std::vector<ipc::UniqueFd> fds, ReadFdFrames(key, id, 1));
    return std::move(fds[0]);
  }

  // Registered device memory, keyed by a CUDA buffer id: an allocation registered through its
  // IPC handle (its id), or CUDA VMM mappings registered through their fds (the first one's).
  struct DeviceRegistration {
    uint64_t buffer_id = 0;  // the daemon's id
    void* base = nullptr;
    uint64_t size = 0;
    std::vector<ipc::cuda::VmmRegion> mappings;  // VMM: the mappings, in address order
  };
  std::map<uint64_t, DeviceRegistration> device_regs;  // guarded by buf_mu

  // The VMM registration whose first mappings are `regions` (same addresses, sizes and buffer
  // ids), or null. Caller holds buf_mu.
  const DeviceRegistration* FindVmm(const std::vector<ipc::cuda::VmmRegion>& regions) const {
    auto it = device_regs.find(regions.front().buffer_id);
    if (it == device_regs.end() || it->second.mappings.size() < regions.size()) return nullptr;
    for (size_t i = 0; i < regions.size(); ++i) {
      const ipc::cuda::VmmRegion& have = it->second.mappings[i];
      if (have.base != regions[i].base || have.size != regions[i].size ||
          have.buffer_id != regions[i].buffer_id)
        return nullptr;
    }
    return &it->second;
  }

  // Takes out of device_regs the registrations that a new one of [base, base + size) (`key`;
  // `regions` its VMM mappings, empty for an IPC allocation) makes stale, and returns their
  // ids to free: one under the same key (the new one covers it), an IPC allocation overlapping
  // the range (freed since: live allocations do not overlap), and VMM mappings overlapping it
  // that are no longer the ones mapped there. Caller holds buf_mu.
  std::vector<uint64_t> TakeStale(uint64_t key, void* base, uint64_t size,
                                  const std::vector<ipc::cuda::VmmRegion>& regions) {
    const auto* lo = static_cast<uint8_t*>(base);
    auto mapped_now = [&](const ipc::cuda::VmmRegion& m) {
      const auto* at = static_cast<uint8_t*>(m.base);
      if (at + m.size <= lo || at >= lo + size) return true;  // outside the range: unknown here
      for (const ipc::cuda::VmmRegion& r : regions)
        if (r.base == m.base) return r.size == m.size && r.buffer_id == m.buffer_id;
      return false;
    };
    std::vector<uint64_t> stale;
    for (auto it = device_regs.begin(); it != device_regs.end();) {
      const DeviceRegistration& r = it->second;
      const auto* rlo = static_cast<uint8_t*>(r.base);
      const bool overlaps = rlo < lo + size && lo < rlo + r.size;
      bool gone = it->first == key;
      if (!gone && overlaps)
        gone = regions.empty() || r.mappings.empty() ||
               !std::all_of(r.mappings.begin(), r.mappings.end(), mapped_now);
      if (gone) {
        stale.push_back(r.buffer_id);
        it = device_regs.erase(it);
      } else {
        ++it;
      }
    }
    return stale;
  }

  absl::StatusOr<BufferInfo> Resolve(uint64_t id) const override {
    std::lock_guard<std::mutex> lock(buf_mu);
    auto it = buffers.find(id);
    if (it == buffers.end())
      return absl::InvalidArgumentError(StrCat("buffer ", id, " is not registered"));
    const Buffer& b = it->second.first;
    return BufferInfo{b.size, b.device ? nullptr : b.data};
  }

  // Where byte `offset_bytes` of registered buffer `id` lies in this process (host memory or a
  // device pointer), or null for an unknown id.
  const uint8_t* Address(uint64_t id, uint64_t offset_bytes) const {
    std::lock_guard<std::mutex> lock(buf_mu);
    auto it = buffers.find(id);
    if (it == buffers.end() || it->second.first.data == nullptr) return nullptr;
    return static_cast<const uint8_t*>(it->second.first.data) + offset_bytes;
  }

  absl::Status AddBuffer(const v1::BufferInfo& info, ipc::UniqueFd fd, Buffer* out) {
    std::shared_ptr<void> keep;
    if (info.device()) {
      // Daemon-allocated device memory: a VMM handle, mapped on this process's current device.
      ULY_ASSIGN_OR_RETURN(int device, ipc::cuda::CurrentDevice());
      ULY_ASSIGN_OR_RETURN(uint64_t g, ipc::cuda::VmmMapping::Granularity(device));
      ULY_ASSIGN_OR_RETURN(ipc::cuda::VmmMapping m,
                           ipc::cuda::VmmMapping::Import(device, fd.get(),
                                                         AlignUp(info.size_bytes(), g), true));
      auto vmm = std::make_shared<ipc::cuda::VmmMapping>(std::move(m));
      out->data = vmm->data();
      keep = vmm;
    } else {
      ULY_ASSIGN_OR_RETURN(ipc::Mapping m, ipc::Mapping::Map(fd.get(), info.size_bytes(), true));
      auto mapping = std::make_shared<ipc::Mapping>(std::move(m));
      out->data = mapping->data();
      keep = mapping;
    }
    out->id = info.buffer_id();
    out->size = info.size_bytes();
    out->device = info.device();
    std::lock_guard<std::mutex> lock(buf_mu);
    buffers[out->id] = {*out, keep};
    return absl::OkStatus();
  }

  absl::Status Detach() {
    if (closed) return absl::OkStatus();
    closed = true;
    v1::DetachRequest req;
    v1::DetachResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx, absl::Seconds(10));
    grpc::Status s = stub->Detach(&ctx, req, &resp);
    watch_ctx.TryCancel();
    if (watch_thread.joinable()) watch_thread.join();
    if (!s.ok()) LetStreamsGoIfTheDaemonDied();  // a daemon that died before it could answer
    fd_socket.reset();
    std::lock_guard<std::mutex> lock(buf_mu);
    buffers.clear();
    device_regs.clear();
    return FromGrpcStatus(s);
  }
};

// Whether the environment variable `name` is set to exactly `value` (its callers keep the
// answer).
bool EnvIs(const char* name, std::string_view value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string_view(v) == value;
}

// ULYSSES_RELEASE_IN_ORDER=0 never claims a release implied by the ready word, so the daemon's
// stream always waits for the release word: the baseline the benchmark compares with.
bool ReleaseInOrderEnabled() {
  static const bool enabled = !EnvIs("ULYSSES_RELEASE_IN_ORDER", "0");
  return enabled;
}

// Whether a stream release is carried by the slot's next ready word (the default) instead of
// written as a word of its own: ULYSSES_RELEASE_WORD=1 writes it (the benchmark's A/B), as
// does ULYSSES_RELEASE_IN_ORDER=0.
bool ReleaseCarriedEnabled() {
  static const bool enabled = ReleaseInOrderEnabled() && !EnvIs("ULYSSES_RELEASE_WORD", "1");
  return enabled;
}

// The client side of one session's stream-ordered protocol (docs/protocol.md section 9): this
// client's device words (ready and released, written only by its streams) and, per stream that
// named them, a mark after the last such work. Shared by the session and the results it
// handed out, whose releases may come from any thread, also after the session closed.
class StreamWords {
 public:
  // `words_mapping` holds `words`; `slots_mapping` (the done words and the slots) is named by
  // the done waits; `done_words` (DoneWords) is their writable mapping for when the daemon
  // dies. All stay mapped until every marked stream passed its mark.
  StreamWords(std::shared_ptr<void> words_mapping, ClientDeviceWords* words,
              std::shared_ptr<void> slots_mapping, std::shared_ptr<void> done_words)
      : words_mapping_(std::move(words_mapping)), slots_mapping_(std::move(slots_mapping)),
        done_words_(std::move(done_words)), words_(words) {}
  ~StreamWords() { Close(); }
  StreamWords(const StreamWords&) = delete;
  StreamWords& operator=(const StreamWords&) = delete;

  // Enqueues ready[slot] = epoch on `stream`: the daemon's stream starts the call after it.
  absl::Status Ready(void* stream, int slot, uint64_t epoch) {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return absl::FailedPreconditionError("the session is closed");
    return ipc::cuda::StreamWrite64(stream, &words_->ready[slot], epoch);
  }
  // Gives slot `slot`'s result of `epoch` back after the work enqueued on `stream` so far (the
  // work that reads it). By default nothing is written: an event marks that point, and the
  // slot's next call carries the release (CarryRelease), whose ready word the daemon's stream
  // waits for anyway. The stream writes released[slot] = epoch instead, which the daemon's
  // stream waits for unless a ready word on the same stream implies it, with
  // ULYSSES_RELEASE_WORD=1 (or ULYSSES_RELEASE_IN_ORDER=0), when the mark cannot be recorded,
  // and when the slot's next call already went without carrying it (ReleaseLedger). False
  // when the session closed (its slots are gone: nothing to release).
  absl::StatusOr<bool> Release(void* stream, int slot, uint64_t epoch) {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return false;
    // The stream by its id, not its handle: a handle can name another stream later (made at
    // the address of a destroyed one, or the per-thread default stream of another thread).
    // No id: no later ready word on "the same stream" is taken to imply this release.
    absl::StatusOr<uint64_t> id = ipc::cuda::StreamId(stream);
    const uint64_t stream_id = id.ok() ? *id : 0;
    if (ledger_.OnRelease(slot, epoch, ReleaseCarriedEnabled()) == ReleaseLedger::Give::kMark) {
      std::unique_ptr<ipc::cuda::StreamMark>& mark = release_marks_[slot];
      if (!mark) mark = std::make_unique<ipc::cuda::StreamMark>();
      if (mark->Record(stream).ok()) {
        ledger_.Released(slot, epoch, stream_id, /*written=*/false);
        return true;
      }
    }
    ULY_RETURN_IF_ERROR(ipc::cuda::StreamWrite64(stream, &words_->released[slot], epoch));
    ULY_RETURN_IF_ERROR(MarkLocked(stream));
    ledger_.Released(slot, epoch, stream_id, /*written=*/true);
    return true;
  }
  // Before a call's ready word on `stream` (id `stream_id`): whether that ready word implies
  // the release of `slot`'s result of `epoch`, so the daemon's stream need not wait for the
  // release word. True when the release was on the same stream, or when it was marked (not
  // written) on another one: then `stream` is first made to wait for that mark, so its ready
  // word still comes after the work that read the result.
  absl::StatusOr<bool> CarryRelease(void* stream, int slot, uint64_t epoch, uint64_t stream_id) {
    std::lock_guard<std::mutex> lock(mu_);
    switch (ledger_.OnCall(slot, epoch, stream_id)) {
      case ReleaseLedger::Carry::kNo:
        return false;
      case ReleaseLedger::Carry::kSameStream:
        return true;
      case ReleaseLedger::Carry::kAfterMark:
        ULY_RETURN_IF_ERROR(release_marks_[slot]->OrderBefore(stream));
        return true;
    }
    return false;
  }
  // Marks `stream` after work enqueued on it that names these mappings.
  absl::Status Mark(void* stream) {
    std::lock_guard<std::mutex> lock(mu_);
    return MarkLocked(stream);
  }
  // No later release writes the words. The mappings go once every marked stream passed its
  // mark (the daemon's close cancelled the session, so its waits pass); a stream that has not
  // within 10 s (its daemon died before it could cancel) would fault on an unmapped word, so
  // then they stay mapped for the life of the process.
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    bool passed = true;
    for (auto& [stream, mark] : marks_) {
      for (;;) {
        absl::StatusOr<bool> p = mark->Passed();
        if (!p.ok() || *p) break;  // an error: the context is gone, nothing runs any more
        if (absl::Now() >= give_up) {
          passed = false;
          break;
        }
        absl::SleepFor(absl::Microseconds(200));
      }
    }
    marks_.clear();
    if (passed) return;
    KeepForProcessLife(words_mapping_);
    KeepForProcessLife(slots_mapping_);
    KeepForProcessLife(done_words_);  // still to be let go if the daemon dies
  }

 private:
  absl::Status MarkLocked(void* stream) {
    std::unique_ptr<ipc::cuda::StreamMark>& mark = marks_[stream];
    if (!mark) mark = std::make_unique<ipc::cuda::StreamMark>();
    return mark->Record(stream);
  }
  std::mutex mu_;
  bool closed_ = false;
  std::shared_ptr<void> words_mapping_, slots_mapping_;
  std::shared_ptr<void> done_words_;  // DoneWords, in the client's list while held
  ClientDeviceWords* const words_;
  std::map<void*, std::unique_ptr<ipc::cuda::StreamMark>> marks_;
  ReleaseLedger ledger_;  // how each slot's results were given back
  std::map<int, std::unique_ptr<ipc::cuda::StreamMark>> release_marks_;  // per slot
};

// Stores `epoch` into a host release word unless a later one is there (this client is the
// word's only writer; the epochs of a slot only grow).
void StoreReleased(std::atomic<uint64_t>* word, uint64_t epoch) {
  if (word->load(std::memory_order_relaxed) < epoch) word->store(epoch, std::memory_order_release);
}

// Holds a receive slot for the result of one epoch; the last copy's destruction releases it.
class SlotHold {
 public:
  // `word`: this slot's release word in the client segment, or null (release by RPC).
  // `stream` (device sessions): the release is ordered after the work enqueued on it so far
  // (the work that reads the view). With `stream_words` (a stream-ordered call) the release is
  // marked on the stream and carried by the slot's next call (StreamWords::Release); the host
  // word then only tells the daemon's bookkeeping (Admin) that the result was given back.
  // Without them a host function on the stream stores the host word.
  SlotHold(std::shared_ptr<ClientImpl> client, uint64_t session, uint64_t epoch, int32_t slot,
           std::atomic<uint64_t>* word, bool device = false, void* stream = nullptr,
           std::shared_ptr<StreamWords> stream_words = nullptr)
      : client_(std::move(client)), session_(session), epoch_(epoch), slot_(slot), word_(word),
        device_(device), stream_(stream), stream_words_(std::move(stream_words)) {}
  ~SlotHold() { (void)Release(); }
  bool released() {
    std::lock_guard<std::mutex> lock(mu_);
    return released_;
  }
  uint64_t epoch() const { return epoch_; }
  absl::Status Release() {
    std::lock_guard<std::mutex> lock(mu_);
    if (released_) return absl::OkStatus();
    released_ = true;
    if (client_->closed) return absl::OkStatus();  // Detach released everything
    if (stream_words_) {
      ULY_ASSIGN_OR_RETURN(const bool enqueued, stream_words_->Release(stream_, slot_, epoch_));
      if (enqueued && word_ != nullptr) StoreReleased(word_, epoch_);
      return absl::OkStatus();
    }
    if (word_ != nullptr && device_) {
      auto* at = new StreamRelease{client_->segment, word_, epoch_};
      if (ipc::cuda::LaunchHostFunc(stream_, &StreamRelease::Run, at).ok()) return absl::OkStatus();
      delete at;  // no stream to order on (the context is gone): release now
    }
    if (word_ != nullptr) {
      // The fast path: one store in shared memory, read by the daemon before it reuses the
      // slot. This client is the word's only writer; epochs of a slot only grow.
      StoreReleased(word_, epoch_);
      return absl::OkStatus();
    }
    v1::ReleaseRequest req;
    req.set_session_id(session_);
    req.set_epoch(epoch_);
    v1::ReleaseResponse resp;
    grpc::ClientContext ctx;
    client_->Prepare(&ctx, absl::Seconds(30));
    absl::Status s = FromGrpcStatus(client_->stub->Release(&ctx, req, &resp));
    // A closed session has no slots left to release.
    if (s.code() == absl::StatusCode::kNotFound) return absl::OkStatus();
    return s;
  }

 private:
  // A release word store that runs on a CUDA host-function thread: it keeps the client
  // segment mapped and calls nothing of CUDA.
  struct StreamRelease {
    std::shared_ptr<ipc::Mapping> keep;
    std::atomic<uint64_t>* word;
    uint64_t epoch;
    static void Run(void* p) {
      std::unique_ptr<StreamRelease> r(static_cast<StreamRelease*>(p));
      StoreReleased(r->word, r->epoch);
    }
  };
  std::shared_ptr<ClientImpl> client_;
  const uint64_t session_;
  const uint64_t epoch_;
  const int32_t slot_;
  std::atomic<uint64_t>* const word_;
  const bool device_;
  void* const stream_;
  const std::shared_ptr<StreamWords> stream_words_;
  std::mutex mu_;
  bool released_ = false;
};

absl::Status Result::Release() {
  if (!hold_) return absl::OkStatus();
  absl::Status s = hold_->Release();
  hold_.reset();
  data = nullptr;
  return s;
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ConnectOptions& options) {
  if (options.socket.empty()) return absl::InvalidArgumentError("socket: must not be empty");
  auto impl = std::make_shared<ClientImpl>();
  const std::string target =
      options.socket.rfind("unix:", 0) == 0 ? options.socket : "unix://" + options.socket;
  impl->channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  if (!impl->channel->WaitForConnected(absl::ToChronoTime(absl::Now() + options.connect_timeout)))
    return absl::UnavailableError(StrCat("socket: no ulyssesd answers at ", options.socket));
  impl->stub = v1::Control::NewStub(impl->channel);
  v1::AttachRequest req;
  req.set_client_name(options.name);
  req.set_reported_pid(::getpid());  // shown to operators beside the pid the daemon sees
  v1::AttachResponse resp;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options.connect_timeout));
    ULY_RETURN_IF_ERROR(FromGrpcStatus(impl->stub->Attach(&ctx, req, &resp)));
  }
  impl->client_id = resp.client_id();
  impl->token = resp.token();
  impl->backend = resp.backend();
  impl->mps_mode = resp.mps_mode();
  ULY_ASSIGN_OR_RETURN(impl->fd_socket, ipc::ConnectUnix(resp.fd_socket()));
  nlohmann::json hello = {{"client_id", impl->client_id}, {"token", impl->token}};
  ULY_RETURN_IF_ERROR(ipc::SendMessage(impl->fd_socket.get(), hello.dump()));
  ULY_ASSIGN_OR_RETURN(bool ready, ipc::WaitReadable(impl->fd_socket.get(), 10000));
  if (!ready) return absl::DeadlineExceededError("fd socket: the daemon did not acknowledge");
  ULY_ASSIGN_OR_RETURN(ipc::ReceivedMessage ack, ipc::RecvMessage(impl->fd_socket.get()));
  nlohmann::json a = nlohmann::json::parse(ack.payload, nullptr, false);
  if (a.is_discarded() || !a.value("ok", false))
    return absl::PermissionDeniedError(StrCat("fd socket: refused: ", ack.payload));
  if (options.use_rings) ULY_RETURN_IF_ERROR(impl->AttachRings(ack));
  // Liveness: the stream stays open while this process lives; the daemon reclaims on its end.
  impl->Prepare(&impl->watch_ctx, absl::Hours(24 * 365));
  impl->watch = impl->stub->Watch(&impl->watch_ctx);
  ClientImpl* raw = impl.get();
  impl->watch_thread = std::thread([raw] {
    v1::WatchEvent ev;
    while (raw->watch->Read(&ev)) {
    }
    (void)raw->watch->Finish();
    // The stream also ends when this client closes (Detach looks then) or breaks while the
    // daemon lives (its fd socket stays open). An error (the socket is not there to watch)
    // leaves it to the calls, which find the socket closed.
    absl::StatusOr<bool> gone = ipc::WaitHungUp(raw->fd_socket.get(), raw->closed, 20);
    if (gone.ok() && *gone && !raw->closed.load()) raw->LetStreamsGoIfTheDaemonDied();
  });
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Client::~Client() { (void)Close(); }

absl::Status Client::Close() { return impl_->Detach(); }

uint64_t Client::client_id() const { return impl_->client_id; }
bool Client::uses_rings() const { return impl_->has_rings(); }
const std::string& Client::daemon_backend() const { return impl_->backend; }
const std::string& Client::daemon_mps_mode() const { return impl_->mps_mode; }

absl::StatusOr<Buffer> Client::AllocBuffer(uint64_t size_bytes, const std::string& name) {
  if (size_bytes == 0) return absl::InvalidArgumentError("size_bytes: must be > 0");
  v1::AllocBufferRequest req;
  req.set_size_bytes(size_bytes);
  req.set_name(name);
  v1::BufferInfo info;
  std::lock_guard<std::mutex> lock(impl_->fd_mu);
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  ULY_RETURN_IF_ERROR(FromGrpcStatus(impl_->stub->AllocBuffer(&ctx, req, &info)));
  ULY_ASSIGN_OR_RETURN(ipc::UniqueFd fd, impl_->ReadFdFrame("buffer_id", info.buffer_id()));
  Buffer b;
  ULY_RETURN_IF_ERROR(impl_->AddBuffer(info, std::move(fd), &b));
  return b;
}

absl::StatusOr<Buffer> Client::RegisterBuffer(int memfd, const std::string& name) {
  if (memfd < 0) return absl::InvalidArgumentError("memfd: not a valid descriptor");
  uint64_t tag;
  {
    std::lock_guard<std::mutex> lock(impl_->fd_mu);
    tag = impl_->next_tag++;
    int fds[1] = {memfd};
    ULY_RETURN_IF_ERROR(ipc::SendMessage(impl_->fd_socket.get(), StrCat("{\"tag\": ", tag, "}"),
                                         std::span<const int>(fds, 1)));
  }
  v1::RegisterBufferRequest req;
  req.set_tag(tag);
  req.set_name(name);
  v1::BufferInfo info;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  ULY_RETURN_IF_ERROR(FromGrpcStatus(impl_->stub->RegisterBuffer(&ctx, req, &info)));
  int dup_fd = ::fcntl(memfd, F_DUPFD_CLOEXEC, 0);
  if (dup_fd < 0) return ErrnoError("fcntl(F_DUPFD_CLOEXEC)", errno);
  Buffer b;
  ULY_RETURN_IF_ERROR(impl_->AddBuffer(info, ipc::UniqueFd(dup_fd), &b));
  return b;
}

absl::Status Client::FreeBuffer(uint64_t buffer_id) {
  v1::FreeBufferRequest req;
  req.set_buffer_id(buffer_id);
  v1::FreeBufferResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  ULY_RETURN_IF_ERROR(FromGrpcStatus(impl_->stub->FreeBuffer(&ctx, req, &resp)));
  std::lock_guard<std::mutex> lock(impl_->buf_mu);
  impl_->buffers.erase(buffer_id);
  for (auto it = impl_->device_regs.begin(); it != impl_->device_regs.end();)
    it = it->second.buffer_id == buffer_id ? impl_->device_regs.erase(it) : std::next(it);
  return absl::OkStatus();
}

absl::StatusOr<Buffer> Client::RegisterDeviceBuffer(void* ptr, uint64_t bytes,
                                                    const std::string& name, int device) {
  if (bytes == 0) return absl::InvalidArgumentError("bytes: must be > 0");
  ULY_ASSIGN_OR_RETURN(ipc::cuda::AllocationInfo a, ipc::cuda::QueryAllocation(ptr));
  if (device >= 0 && a.device != device)
    return absl::InvalidArgumentError(
        StrCat("ptr: memory of device ", a.device, ", not of device ", device));
  if (a.vmm) return RegisterVmmBuffer(ptr, bytes, name, a.device);
  const uint64_t offset = static_cast<uint64_t>(static_cast<uint8_t*>(ptr) - static_cast<uint8_t*>(a.base));
  if (offset + bytes > a.size)
    return absl::InvalidArgumentError(StrCat("bytes: ", bytes, " at offset ", offset,
                                             " run past the end of the ", a.size,
                                             "-byte allocation"));
  Buffer b;
  b.data = ptr;
  b.size = bytes;
  b.device = true;
  b.base_offset = offset;
  b.device_index = a.device;
  b.registration_size = a.size;
  {
    std::lock_guard<std::mutex> lock(impl_->buf_mu);
    auto it = impl_->device_regs.find(a.buffer_id);
    if (it != impl_->device_regs.end()) {
      b.id = it->second.buffer_id;
      return b;
    }
  }
  // An allocation at the same base made earlier and since freed: its registration is stale.
  std::vector<uint64_t> stale;
  {
    std::lock_guard<std::mutex> lock(impl_->buf_mu);
    stale = impl_->TakeStale(a.buffer_id, a.base, a.size, {});
  }
  for (uint64_t id : stale) (void)FreeBuffer(id);
  ULY_ASSIGN_OR_RETURN(std::string handle, ipc::cuda::IpcHandle(a.base));
  v1::RegisterBufferRequest req;
  req.set_name(name);
  req.set_cuda_ipc_handle(handle);
  req.set_size_bytes(a.size);
  req.set_allocation_id(a.buffer_id);
  v1::BufferInfo info;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  ULY_RETURN_IF_ERROR(FromGrpcStatus(impl_->stub->RegisterBuffer(&ctx, req, &info)));
  b.id = info.buffer_id();
  Buffer whole;
  whole.id = info.buffer_id();
  whole.data = a.base;
  whole.size = info.size_bytes();
  whole.device = true;
  std::lock_guard<std::mutex> lock(impl_->buf_mu);
  impl_->buffers[whole.id] = {whole, nullptr};
  impl_->device_regs[a.buffer_id] = ClientImpl::DeviceRegistration{whole.id, a.base, a.size, {}};
  return b;
}

absl::StatusOr<Buffer> Client::RegisterVmmBuffer(void* ptr, uint64_t bytes,
                                                 const std::string& name, int device) {
  ULY_ASSIGN_OR_RETURN(std::vector<ipc::cuda::VmmRegion> regions,
                       ipc::cuda::VmmRegions(ptr, bytes, ipc::cuda::kMaxVmmMappings));
  void* base = regions.front().base;
  const uint64_t span = static_cast<uint64_t>(static_cast<uint8_t*>(regions.back().base) -
                                              static_cast<uint8_t*>(base)) +
                        regions.back().size;
  Buffer b;
  b.data = ptr;
  b.size = bytes;
  b.device = true;
  b.base_offset = static_cast<uint64_t>(static_cast<uint8_t*>(ptr) - static_cast<uint8_t*>(base));
  b.device_index = device;
  const uint64_t key = regions.front().buffer_id;
  std::vector<uint64_t> stale;
  {
    std::lock_guard<std::mutex> lock(impl_->buf_mu);
    if (const ClientImpl::DeviceRegistration* r = impl_->FindVmm(regions)) {
      b.id = r->buffer_id;
      b.registration_size = r->size;
      return b;
    }
    stale = impl_->TakeStale(key, base, span, regions);
  }
  for (uint64_t id : stale) (void)FreeBuffer(id);
  // Every mapping's fd first: one that cannot be shared fails the call before anything is sent.
  std::vector<ipc::UniqueFd> fds;
  for (const ipc::cuda::VmmRegion& r : regions) {
    ULY_ASSIGN_OR_RETURN(ipc::UniqueFd fd, ipc::cuda::ExportMapped(r.base));
    fds.push_back(std::move(fd));
  }
  v1::RegisterBufferRequest req;
  req.set_name(name);
  req.set_size_bytes(span);
  req.set_allocation_id(key);
  {
    std::lock_guard<std::mutex> lock(impl_->fd_mu);
    for (size_t i = 0; i < regions.size(); ++i) {
      const uint64_t tag = impl_->next_tag++;
      const int one[1] = {fds[i].get()};
      ULY_RETURN_IF_ERROR(ipc::SendMessage(impl_->fd_socket.get(), StrCat("{\"tag\": ", tag, "}"),
                                           std::span<const int>(one, 1)));
      v1::VmmMapping* m = req.add_vmm_mappings();
      m->set_tag(tag);
      m->set_size_bytes(regions[i].size);
    }
  }
  fds.clear();
  v1::BufferInfo info;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  ULY_RETURN_IF_ERROR(FromGrpcStatus(impl_->stub->RegisterBuffer(&ctx, req, &info)));
  b.id = info.buffer_id();
  b.registration_size = info.size_bytes();
  Buffer whole;
  whole.id = info.buffer_id();
  whole.data = base;
  whole.size = info.size_bytes();
  whole.device = true;
  std::lock_guard<std::mutex> lock(impl_->buf_mu);
  impl_->buffers[whole.id] = {whole, nullptr};
  impl_->device_regs[key] =
      ClientImpl::DeviceRegistration{whole.id, base, whole.size, std::move(regions)};
  return b;
}

bool Client::HoldsBuffer(uint64_t buffer_id) const {
  std::lock_guard<std::mutex> lock(impl_->buf_mu);
  return impl_->buffers.count(buffer_id) > 0;
}

absl::StatusOr<Group> Client::JoinGroup(const GroupSpec& spec) {
  v1::JoinGroupRequest req;
  req.set_name(spec.name);
  req.set_world_size(spec.world_size);
  req.set_rank(spec.rank);
  for (const auto& m : spec.members) req.add_members(m);
  req.set_backend(spec.backend);
  req.set_timeout_ms(spec.timeout_ms);
  v1::GroupInfo info;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  ULY_RETURN_IF_ERROR(FromGrpcStatus(impl_->stub->JoinGroup(&ctx, req, &info)));
  return Group{info.group_id(), info.name(), info.world_size(), info.rank(), info.backend(),
               info.backend_reason()};
}

absl::Status Client::LeaveGroup(const Group& group) {
  v1::LeaveGroupRequest req;
  req.set_group_id(group.id);
  v1::LeaveGroupResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  return FromGrpcStatus(impl_->stub->LeaveGroup(&ctx, req, &resp));
}

absl::StatusOr<std::unique_ptr<Session>> Client::CreateSession(const Group& group,
                                                               const SessionSpec& spec) {
  SessionGeometry g;
  g.world_size = group.world_size;
  g.rank = group.rank;
  g.num_heads = spec.num_heads;
  g.head_dim = spec.head_dim;
  g.dtype = spec.dtype;
  g.max_tokens = spec.max_tokens;
  g.num_slots = spec.num_slots;
  g.schedule = spec.schedule;
  ULY_RETURN_IF_ERROR(ValidateSessionGeometry(g));
  v1::CreateSessionRequest req;
  req.set_group_id(group.id);
  v1::SessionSpec* s = req.mutable_spec();
  s->set_num_heads(g.num_heads);
  s->set_head_dim(g.head_dim);
  s->set_dtype(static_cast<v1::DType>(g.dtype));
  s->set_max_tokens(g.max_tokens);
  s->set_num_slots(g.num_slots);
  for (int32_t c : g.schedule) s->add_schedule(c);
  req.set_timeout_ms(spec.timeout_ms);
  return OpenSession(req, g);
}

absl::StatusOr<std::unique_ptr<Session>> Client::CreateFusedSession(const Group& group,
                                                                    const FusedSessionSpec& spec) {
  FusedSessionArgs args;
  FusedGeometry& f = args.geometry;
  f.world_size = group.world_size;
  f.rank = group.rank;
  f.hidden = spec.hidden;
  f.num_heads = spec.num_heads;
  f.head_dim = spec.head_dim;
  f.dtype = spec.dtype;
  f.layout = spec.layout;
  f.max_tokens = spec.max_tokens;
  f.num_slots = spec.num_slots;
  f.max_pos = spec.max_pos;
  args.path = spec.path;
  args.weights = spec.weights;
  // The daemon's GPU kernels take head_dim 128; the host backend's reference any even one.
  ULY_RETURN_IF_ERROR(ValidateFusedGeometry(
      f, impl_->backend == "host" ? FusedImpl::kReference : FusedImpl::kCuda));
  ULY_RETURN_IF_ERROR(ValidateFusedWeights(f, spec.weights, *impl_));
  v1::CreateSessionRequest req;
  req.set_group_id(group.id);
  req.set_kind(v1::SESSION_KIND_QKV_NORM_ROPE_EXCHANGE);
  FusedSessionToProto(args, req.mutable_fused());
  req.set_timeout_ms(spec.timeout_ms);
  ULY_ASSIGN_OR_RETURN(std::unique_ptr<Session> session, OpenSession(req, SlotGeometry(f)));
  session->fused_ = f;
  session->fused_weights_ = spec.weights;
  return session;
}

absl::StatusOr<std::unique_ptr<Session>> Client::OpenSession(const v1::CreateSessionRequest& req,
                                                             const SessionGeometry& g) {
  v1::SessionInfo info;
  std::lock_guard<std::mutex> lock(impl_->fd_mu);
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  ULY_RETURN_IF_ERROR(FromGrpcStatus(impl_->stub->CreateSession(&ctx, req, &info)));
  const bool device = info.device_slots_bytes() > 0;
  const bool words = device && info.device_words_bytes() > 0;
  ULY_ASSIGN_OR_RETURN(std::vector<ipc::UniqueFd> fds,
                       impl_->ReadFdFrames("session_id", info.session_id(),
                                           device ? (words ? 3 : 2) : 1));
  ULY_ASSIGN_OR_RETURN(ipc::Mapping m, ipc::Mapping::Map(fds[0].get(), info.segment_bytes(), false));
  auto mapping = std::make_shared<ipc::Mapping>(std::move(m));
  std::unique_ptr<Session> session(new Session());
  session->client_ = impl_;
  session->id_ = info.session_id();
  session->geometry_ = g;
  session->backend_ = info.backend();
  session->base_ = static_cast<const uint8_t*>(mapping->data());
  session->segment_ = mapping;
  if (device) {
    // The receive slots: device memory of the daemon, mapped read-only here (zero-copy results).
    ULY_ASSIGN_OR_RETURN(int dev, ipc::cuda::CurrentDevice());
    ULY_ASSIGN_OR_RETURN(ipc::cuda::VmmMapping slots,
                         ipc::cuda::VmmMapping::Import(dev, fds[1].get(), info.device_slots_bytes(),
                                                       /*writable=*/false));
    auto vmm = std::make_shared<ipc::cuda::VmmMapping>(std::move(slots));
    session->base_ = static_cast<const uint8_t*>(vmm->data());
    session->device_slots_ = vmm;
    session->device_ = true;
    if (words) {
      // The stream-ordered protocol: the done words (ResultWords) lead the slots mapping; the
      // ready words are this client's to write (docs/protocol.md section 9).
      ULY_ASSIGN_OR_RETURN(ipc::cuda::VmmMapping w,
                           ipc::cuda::VmmMapping::Import(dev, fds[2].get(), info.device_words_bytes(),
                                                         /*writable=*/true));
      auto words_mapping = std::make_shared<ipc::cuda::VmmMapping>(std::move(w));
      auto* words_at = static_cast<ClientDeviceWords*>(words_mapping->data());
      // The done words again, writable, for when the daemon dies (DoneWords): the whole
      // allocation, since the driver maps no part of one. Streams wait on them only when the
      // client has its rings.
      std::shared_ptr<DoneWords> done;
      if (impl_->has_rings()) {
        done = std::make_shared<DoneWords>();
        done->device = dev;
        done->num_slots = g.num_slots;
        ULY_ASSIGN_OR_RETURN(done->mapping,
                             ipc::cuda::VmmMapping::Import(dev, fds[1].get(),
                                                           info.device_slots_bytes(),
                                                           /*writable=*/true));
        impl_->AddDoneWords(done);
      }
      session->stream_words_ =
          std::make_shared<StreamWords>(words_mapping, words_at, vmm, std::move(done));
      session->device_words_ = vmm->data();
      session->slot_offset_ = info.slot_offset_bytes();
      session->slot_stride_ = info.slot_stride_bytes();
      session->holds_.resize(g.num_slots);
    }
  }
  session->release_index_ = info.release_index();
  return session;
}

Session::~Session() { (void)Close(); }

absl::Status Session::Close() {
  if (closed_) return absl::OkStatus();
  closed_ = true;
  absl::Status st;
  if (!client_->closed && stream_protocol()) {
    // Calls pushed before the close run to their end first: their results stay readable after
    // it (uly_session_close), and a client stream that waits for one of them passes with its
    // data, not with the close's cancel. Bounded: past it the daemon's close aborts them.
    const absl::Time give_up = absl::Now() + kCloseDrain;
    for (;;) {
      absl::StatusOr<bool> unfinished = client_->Unfinished(id_, has_out_);
      if (!unfinished.ok() || !*unfinished || absl::Now() >= give_up) break;
      if (!client_->CheckDaemonAlive().ok()) break;
      (void)client_->complete_bell.Wait(1);
    }
  }
  if (!client_->closed) {
    v1::CloseSessionRequest req;
    req.set_session_id(id_);
    v1::CloseSessionResponse resp;
    grpc::ClientContext ctx;
    client_->Prepare(&ctx, absl::Seconds(30));
    st = FromGrpcStatus(client_->stub->CloseSession(&ctx, req, &resp));
  }
  // The daemon's close cancelled the session (every done word passed), so the streams drain.
  if (stream_words_) stream_words_->Close();
  return st;
}

std::atomic<uint64_t>* Session::ReleaseWord(int32_t slot) const {
  if (!client_->has_rings() || release_index_ < 0 ||
      release_index_ >= static_cast<int32_t>(ipc::kMaxReleaseSessions) || slot < 0 ||
      slot >= static_cast<int32_t>(ipc::kMaxReleaseSlots))
    return nullptr;
  return &client_->header->released[release_index_][slot];
}

absl::StatusOr<std::string> Session::Describe() {
  if (closed_) return absl::FailedPreconditionError(StrCat("session ", id_, " is closed"));
  v1::DescribeSessionRequest req;
  req.set_session_id(id_);
  v1::SessionInfo info;
  grpc::ClientContext ctx;
  client_->Prepare(&ctx, absl::Seconds(30));
  ULY_RETURN_IF_ERROR(FromGrpcStatus(client_->stub->DescribeSession(&ctx, req, &info)));
  return info.plan();
}

absl::StatusOr<CallPlan> Session::Plan(const CallArgs& args) const {
  if (fused_) return PlanQkvCall(*fused_, args, *client_, &fused_weights_);
  return PlanCall(geometry_, args, *client_);
}

absl::StatusOr<CallArgs> Session::FusedCallArgs(const OperandRef& x, const OperandRef& positions,
                                                int64_t batch, int64_t seq_local,
                                                const OperandRef& out) const {
  if (!fused_)
    return absl::InvalidArgumentError(
        StrCat("op: session ", id_, " is a head_exchange session; qkv_norm_rope_exchange needs a "
               "qkv_norm_rope_exchange session (Client::CreateFusedSession)"));
  CallArgs a;
  a.op = OpKind::kQkvNormRopeExchange;
  a.batch = batch;
  a.seq = seq_local;
  a.inputs[0] = x;
  a.inputs[1] = positions;
  a.out = out;
  return a;
}

// A fused call's whole result as the views the caller gets: q, k, v (bshd) or the one band.
absl::StatusOr<std::vector<Result>> Session::FusedViews(Result whole, const OperandRef& out) const {
  if (out.present()) {
    // The copy is the result: point the views at it.
    const uint8_t* at = client_->Address(out.buffer_id, out.offset_bytes);
    if (at == nullptr) return absl::InternalError("out: buffer vanished during the call");
    whole.data = at;
  }
  if (fused_->layout == QkvLayout::kFused) return std::vector<Result>{whole};
  // bshd: q, k, v planes one after the other; the three views share the slot's hold.
  std::vector<Result> views(3, whole);
  const uint64_t plane = whole.bytes / 3;
  for (int i = 0; i < 3; ++i) {
    views[i].data = static_cast<const uint8_t*>(whole.data) + i * plane;
    views[i].bytes = plane;
  }
  return views;
}

absl::StatusOr<std::vector<Result>> Session::QkvNormRopeExchange(const OperandRef& x,
                                                                 const OperandRef& positions,
                                                                 int64_t batch, int64_t seq_local,
                                                                 const OperandRef& out) {
  ULY_ASSIGN_OR_RETURN(CallArgs a, FusedCallArgs(x, positions, batch, seq_local, out));
  ULY_ASSIGN_OR_RETURN(Result whole, Call(a));
  ULY_ASSIGN_OR_RETURN(std::vector<Result> views, FusedViews(std::move(whole), out));
  Remember(views.data(), views.size());
  return views;
}

absl::StatusOr<uint64_t> Session::SubmitQkvNormRopeExchange(const OperandRef& x,
                                                            const OperandRef& positions,
                                                            int64_t batch, int64_t seq_local,
                                                            const OperandRef& out) {
  ULY_ASSIGN_OR_RETURN(CallArgs a, FusedCallArgs(x, positions, batch, seq_local, out));
  ULY_ASSIGN_OR_RETURN(uint64_t epoch, Submit(a));
  if (out.present()) fused_out_[epoch] = out;
  return epoch;
}

absl::StatusOr<std::vector<Result>> Session::WaitQkvNormRopeExchange(uint64_t epoch,
                                                                     absl::Duration timeout) {
  if (!fused_)
    return absl::InvalidArgumentError(StrCat("epoch: session ", id_,
                                             " is a head_exchange session; use Wait"));
  OperandRef out;
  if (auto it = fused_out_.find(epoch); it != fused_out_.end()) {
    out = it->second;
    fused_out_.erase(it);
  }
  ULY_ASSIGN_OR_RETURN(Result whole, Wait(epoch, timeout));
  ULY_ASSIGN_OR_RETURN(std::vector<Result> views, FusedViews(std::move(whole), out));
  Remember(views.data(), views.size());
  return views;
}

absl::StatusOr<int> Session::PoisonSlots() {
  if (closed_) return absl::FailedPreconditionError(StrCat("session ", id_, " is closed"));
  v1::PoisonSlotsRequest req;
  req.set_session_id(id_);
  v1::PoisonSlotsResponse resp;
  grpc::ClientContext ctx;
  client_->Prepare(&ctx, absl::Seconds(30));
  ULY_RETURN_IF_ERROR(FromGrpcStatus(client_->stub->PoisonSlots(&ctx, req, &resp)));
  return resp.poisoned();
}

// A call without the stream-ordered protocol (the Call RPC): the daemon reads the inputs from
// its own stream, so the work this process enqueued before the call must be complete first.
absl::Status Session::OrderAfterStream() const {
  if (!device_) return absl::OkStatus();
  return ipc::cuda::SyncStream(stream_);
}

bool Session::stream_protocol() const { return stream_words_ != nullptr && client_->has_rings(); }

absl::StatusOr<uint64_t> Session::Submit(const CallArgs& args) {
  CallPlan plan;
  return SubmitPlanned(args, &plan);
}

absl::StatusOr<uint64_t> Session::SubmitPlanned(const CallArgs& args, CallPlan* plan) {
  if (closed_) return absl::FailedPreconditionError(StrCat("session ", id_, " is closed"));
  if (!client_->has_rings())
    return absl::UnimplementedError("Submit needs the call rings (ConnectOptions::use_rings)");
  ULY_RETURN_IF_ERROR(client_->Dropped());
  // The same verdict the daemon reaches, before anything leaves this process.
  ULY_ASSIGN_OR_RETURN(*plan, Plan(args));
  ipc::CallDescriptor d{};
  d.session_id = id_;
  d.op = static_cast<uint32_t>(args.op);
  d.head_offset = args.head_offset;
  d.head_count = args.head_count;
  d.batch = args.batch;
  d.seq = args.seq;
  auto put = [](const OperandRef& r, ipc::OperandDescriptor* o) {
    o->buffer_id = r.buffer_id;
    o->offset_bytes = r.offset_bytes;
    for (int i = 0; i < 4; ++i) o->strides[i] = r.strides[i];
  };
  for (int i = 0; i < 3 && args.inputs[i].present(); ++i) {
    put(args.inputs[i], &d.inputs[i]);
    d.num_inputs = i + 1;
  }
  put(args.out, &d.out);
  // An error the daemon found on an earlier submitted call that nobody waited for yet is
  // raised here, at the next call, like CUDA's asynchronous errors (Wait still reports it).
  ULY_ASSIGN_OR_RETURN(std::optional<ipc::Completion> failed, client_->TakeUnraisedError(id_));
  if (failed) {
    if (failed->next_epoch != 0) next_epoch_ = failed->next_epoch;
    return absl::Status(static_cast<absl::StatusCode>(failed->code),
                        StrCat("an earlier call (epoch ", failed->epoch, ") failed: ", failed->message));
  }
  d.epoch = next_epoch_;
  const int slot = static_cast<int>((d.epoch - 1) % geometry_.num_slots);
  if (stream_protocol()) {
    // A result of this session still viewed in the slot this call needs: the daemon would wait
    // for a release that only this thread can give.
    if (std::shared_ptr<SlotHold> h = holds_[slot].lock(); h && !h->released())
      return absl::DeadlineExceededError(StrCat(
          "session ", id_, ": receive slot ", slot, " still holds the result of epoch ",
          h->epoch(), "; release it before the call that needs the slot"));
    // Stream order instead of a host wait: the daemon's stream starts once this stream wrote
    // the ready word, and this stream's later work waits for the done word.
    // The slot's previous result given back on this stream: this ready word implies it, and
    // the daemon's stream skips its wait for the release word.
    const uint64_t previous = d.epoch > static_cast<uint64_t>(geometry_.num_slots)
                                  ? d.epoch - static_cast<uint64_t>(geometry_.num_slots)
                                  : 0;
    if (previous != 0 && ReleaseInOrderEnabled()) {
      absl::StatusOr<uint64_t> id = ipc::cuda::StreamId(stream_);
      ULY_ASSIGN_OR_RETURN(const bool carried,
                           stream_words_->CarryRelease(stream_, slot, previous, id.ok() ? *id : 0));
      if (carried) d.flags |= ipc::kDescriptorReleasedInOrder;
    }
    ULY_RETURN_IF_ERROR(stream_words_->Ready(stream_, slot, d.epoch));
    d.flags |= ipc::kDescriptorStreamOrdered;
  } else {
    ULY_RETURN_IF_ERROR(OrderAfterStream());
  }
  has_out_[d.epoch] = args.out.present();
  ULY_RETURN_IF_ERROR(client_->Push(d, absl::Now() + absl::Minutes(1)));
  if (stream_protocol() && stream_ordered_) {
    // Work enqueued on the stream from now on follows the call. (A caller that waits on the
    // host needs no device wait; leaving it out also lets several ranks of one process share
    // a stream when they wait on the host.)
    const auto* words = static_cast<const ResultWords*>(device_words_);
    ULY_RETURN_IF_ERROR(ipc::cuda::StreamWait64(stream_, &words->done[slot], d.epoch));
  }
  // The stream's work now names this session's device words: they stay mapped until it
  // passed this point (StreamWords::Close).
  if (stream_protocol()) ULY_RETURN_IF_ERROR(stream_words_->Mark(stream_));
  return next_epoch_++;
}

absl::Status Session::Synchronize(absl::Duration timeout) {
  if (!client_->has_rings()) return absl::OkStatus();  // every RPC call returned finished
  ULY_RETURN_IF_ERROR(client_->Dropped());
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    ULY_ASSIGN_OR_RETURN(bool outstanding, client_->DetachedOutstanding(id_));
    if (!outstanding) break;
    ULY_RETURN_IF_ERROR(client_->CheckDaemonAlive());
    if (absl::Now() >= deadline)
      return absl::DeadlineExceededError(StrCat("session ", id_, ": calls still unfinished after ",
                                                absl::FormatDuration(timeout)));
    (void)client_->complete_bell.Wait(1);
  }
  if (device_) ULY_RETURN_IF_ERROR(ipc::cuda::SyncStream(stream_));
  ULY_ASSIGN_OR_RETURN(std::optional<ipc::Completion> failed, client_->TakeUnraisedError(id_));
  if (failed) {
    if (failed->next_epoch != 0) next_epoch_ = failed->next_epoch;
    return absl::Status(static_cast<absl::StatusCode>(failed->code),
                        StrCat("a call (epoch ", failed->epoch, ") failed: ", failed->message));
  }
  return absl::OkStatus();
}

absl::StatusOr<Result> Session::Wait(uint64_t epoch, absl::Duration timeout) {
  absl::StatusOr<Result> r = WaitImpl(epoch, timeout);
  if (r.ok()) Remember(&*r, 1);
  return r;
}

absl::StatusOr<Result> Session::WaitImpl(uint64_t epoch, absl::Duration timeout) {
  if (!client_->has_rings())
    return absl::UnimplementedError("Wait needs the call rings (ConnectOptions::use_rings)");
  ULY_ASSIGN_OR_RETURN(ipc::Completion c, client_->Await(id_, epoch, absl::Now() + timeout));
  auto out_it = has_out_.find(epoch);
  const bool copied_out = out_it != has_out_.end() && out_it->second;
  if (out_it != has_out_.end()) has_out_.erase(out_it);
  if (c.code != 0) {
    // A refused call may not have consumed its epoch: continue from the daemon's count.
    if (c.next_epoch != 0) next_epoch_ = c.next_epoch;
    return absl::Status(static_cast<absl::StatusCode>(c.code), c.message);
  }
  Result r;
  r.epoch = c.epoch;
  r.slot = c.slot;
  for (int i = 0; i < 4; ++i) r.shape[i] = c.out_shape[i];
  r.data = base_ + c.slot_offset_bytes;
  r.device = device_;
  r.bytes = c.result_bytes;
  r.daemon_us = c.elapsed_us;
  if (!copied_out) r.hold_ = NewHold(r.epoch, r.slot);
  return r;
}

std::shared_ptr<SlotHold> Session::NewHold(uint64_t epoch, int32_t slot) {
  auto hold = std::make_shared<SlotHold>(client_, id_, epoch, slot, ReleaseWord(slot), device_,
                                         stream_, stream_protocol() ? stream_words_ : nullptr);
  if (slot >= 0 && slot < static_cast<int32_t>(holds_.size())) holds_[slot] = hold;
  return hold;
}

absl::StatusOr<Result> Session::Call(const CallArgs& args) {
  absl::StatusOr<Result> r = CallImpl(args);
  if (r.ok()) Remember(&*r, 1);
  return r;
}

void Session::Remember(const Result* views, size_t count) {
  last_.assign(views, views + count);  // reuses the record's storage: no allocation
  last_hold_ = count == 0 ? nullptr : views[0].hold_;
  last_held_ = last_hold_.lock() != nullptr;
  for (Result& v : last_) v.hold_.reset();  // the session's copy never holds the slot
}

absl::StatusOr<std::vector<Result>> Session::LastOutputs() const {
  if (last_.empty())
    return absl::FailedPreconditionError(StrCat("session ", id_, ": no call has returned yet"));
  std::shared_ptr<SlotHold> hold;
  if (last_held_) {
    hold = last_hold_.lock();
    if (hold == nullptr || hold->released())
      return absl::FailedPreconditionError(StrCat(
          "session ", id_, ": the result of epoch ", last_[0].epoch,
          " was given back (every view of it dropped, or one released), so its slot may be "
          "reused; keep a Result of it, or call with out="));
  }
  std::vector<Result> views = last_;
  for (Result& v : views) v.hold_ = hold;
  return views;
}

absl::StatusOr<Result> Session::CallImpl(const CallArgs& args) {
  if (client_->has_rings() && stream_protocol() && stream_ordered_) {
    // Stream-ordered: the result is known now and valid in the stream's order; the daemon's
    // completion only matters when it reports an error (raised at the next call or Synchronize).
    CallPlan plan;
    ULY_ASSIGN_OR_RETURN(uint64_t epoch, SubmitPlanned(args, &plan));
    has_out_.erase(epoch);
    {
      std::lock_guard<std::mutex> lock(client_->complete_mu);
      client_->detached.insert({id_, epoch});
    }
    Result r;
    r.epoch = epoch;
    r.slot = static_cast<int32_t>((epoch - 1) % geometry_.num_slots);
    r.shape = plan.out_shape;
    r.data = base_ + slot_offset_ + slot_stride_ * static_cast<uint64_t>(r.slot);
    r.device = true;
    r.bytes = static_cast<uint64_t>(plan.slot_elems) * geometry_.itemsize();
    if (!args.out.present()) r.hold_ = NewHold(r.epoch, r.slot);
    return r;
  }
  if (client_->has_rings()) {
    ULY_ASSIGN_OR_RETURN(uint64_t epoch, Submit(args));
    return WaitImpl(epoch, absl::Minutes(5));
  }
  if (closed_) return absl::FailedPreconditionError(StrCat("session ", id_, " is closed"));
  // The same verdict the daemon reaches, before anything leaves this process.
  ULY_RETURN_IF_ERROR(Plan(args).status());
  v1::CallRequest req;
  req.set_session_id(id_);
  req.set_op(static_cast<v1::OpKind>(args.op));
  req.set_batch(args.batch);
  req.set_seq(args.seq);
  req.set_head_offset(args.head_offset);
  req.set_head_count(args.head_count);
  auto to_ref = [](const OperandRef& r, v1::TensorRef* t) {
    t->set_buffer_id(r.buffer_id);
    t->set_offset_bytes(r.offset_bytes);
    if (r.strides != std::array<int64_t, 4>{})
      for (int64_t s : r.strides) t->add_strides(s);
  };
  for (const OperandRef& in : args.inputs) {
    if (!in.present()) break;
    to_ref(in, req.add_inputs());
  }
  if (args.out.present()) to_ref(args.out, req.mutable_out());
  ULY_RETURN_IF_ERROR(OrderAfterStream());
  v1::CallResponse resp;
  grpc::ClientContext ctx;
  client_->Prepare(&ctx);
  ULY_RETURN_IF_ERROR(FromGrpcStatus(client_->stub->Call(&ctx, req, &resp)));
  Result r;
  r.epoch = resp.epoch();
  r.slot = resp.slot();
  for (int i = 0; i < 4 && i < resp.out_shape_size(); ++i) r.shape[i] = resp.out_shape(i);
  r.data = base_ + resp.slot_offset_bytes();
  r.device = device_;
  r.bytes = resp.result_bytes();
  r.daemon_us = resp.elapsed_us();
  if (!args.out.present()) r.hold_ = NewHold(r.epoch, r.slot);
  return r;
}

absl::StatusOr<Result> Session::ScatterHeads(const OperandRef& x, int64_t batch,
                                             int64_t seq_local, const OperandRef& out) {
  CallArgs a;
  a.op = OpKind::kScatterHeads;
  a.batch = batch;
  a.seq = seq_local;
  a.inputs[0] = x;
  a.out = out;
  return Call(a);
}

absl::StatusOr<Result> Session::GatherHeads(const OperandRef& y, int64_t batch,
                                            int64_t seq_global, const OperandRef& out) {
  CallArgs a;
  a.op = OpKind::kGatherHeads;
  a.batch = batch;
  a.seq = seq_global;
  a.inputs[0] = y;
  a.out = out;
  return Call(a);
}

absl::StatusOr<Result> Session::ScatterQkvHeadChunk(const OperandRef& q, const OperandRef& k,
                                                    const OperandRef& v, int64_t batch,
                                                    int64_t seq_local, int32_t head_offset,
                                                    int32_t head_count, const OperandRef& out) {
  CallArgs a;
  a.op = OpKind::kScatterQkvHeadChunk;
  a.batch = batch;
  a.seq = seq_local;
  a.head_offset = head_offset;
  a.head_count = head_count;
  a.inputs = {q, k, v};
  a.out = out;
  return Call(a);
}

absl::StatusOr<Result> Session::GatherOutputHeadChunk(const OperandRef& x, int64_t batch,
                                                      int64_t seq_global, int32_t head_offset,
                                                      int32_t head_count, const OperandRef& out) {
  CallArgs a;
  a.op = OpKind::kGatherOutputHeadChunk;
  a.batch = batch;
  a.seq = seq_global;
  a.head_offset = head_offset;
  a.head_count = head_count;
  a.inputs[0] = x;
  a.out = out;
  return Call(a);
}

}  // namespace ulysses::client
