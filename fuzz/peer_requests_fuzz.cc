// Peer requests: the bytes of a Rendezvous or AbortRendezvous, parsed as its protobuf message
// and checked as PeerService checks it, then run against a real rendezvous table, with a
// deadline already passed so that the table answers every admitted arrival at once (its
// deadline thread, or the arrival itself when it completes the step). No arrival, admitted
// or refused, may leave an entry behind, and each admitted one is answered exactly once.
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>

#include "fuzz_util.h"
#include "proto_fuzz.h"
#include "rendezvous.h"
#include "requests.h"

using namespace ulysses;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static daemon::RendezvousTable* table = new daemon::RendezvousTable();
  FuzzedDataProvider in(data, size);
  const bool abort = in.ConsumeBool();
  const std::string bytes = in.ConsumeRemainingBytesAsString();
  if (abort) {
    v1::AbortRendezvousRequest req;
    if (req.ParseFromString(bytes)) (void)table->Abort(req.key(), req.reason());
  } else {
    v1::RendezvousRequest req;
    if (!req.ParseFromString(bytes)) return 0;
    absl::StatusOr<int64_t> ms = daemon::CheckRendezvousRequest(req, 30000);
    if (ms.ok() && (*ms <= 0 || *ms > daemon::kMaxRendezvousTimeoutMs))
      fuzz::Fail("an admitted rendezvous timeout out of its bounds");
    // Arrive checks the same fields again itself: refused, it is never answered.
    std::mutex mu;
    std::condition_variable cv;
    int answers = 0;
    std::optional<daemon::RendezvousTable::Verdict> out;
    absl::StatusOr<uint64_t> id = table->Arrive(
        req.key(), req.world_size(), req.rank(), req.agreement(), req.payload(), absl::Now(),
        [&](daemon::RendezvousTable::Verdict v) {
          std::lock_guard<std::mutex> lock(mu);
          ++answers;
          out = std::move(v);
          cv.notify_all();
        });
    std::unique_lock<std::mutex> lock(mu);
    if (id.ok() && !cv.wait_for(lock, std::chrono::seconds(10), [&] { return answers > 0; }))
      fuzz::Fail("an admitted rendezvous past its deadline was not answered");
    if (!id.ok() && answers != 0) fuzz::Fail("a refused rendezvous was answered");
    if (answers > 1) fuzz::Fail("a rendezvous was answered twice");
    if (out && out->ok() && (*out)->size() != static_cast<size_t>(req.world_size()))
      fuzz::Fail("a rendezvous answered with another number of payloads than ranks");
  }
  if (table->pending() != 0) fuzz::Fail("a rendezvous left an entry behind");
  return 0;
}
