// Peer requests: the bytes of a Rendezvous or AbortRendezvous, parsed as its protobuf message
// and checked as PeerService checks it, then run against a real rendezvous table, with a
// deadline already passed so that no rank waits. No arrival, admitted or refused, may leave
// an entry behind.
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
    // Arrive checks the same fields again itself: refused or not, it must return at once.
    absl::StatusOr<std::vector<std::string>> out =
        table->Arrive(req.key(), req.world_size(), req.rank(), req.agreement(), req.payload(),
                      absl::Now());
    if (out.ok() && out->size() != static_cast<size_t>(req.world_size()))
      fuzz::Fail("a rendezvous answered with another number of payloads than ranks");
  }
  if (table->pending() != 0) fuzz::Fail("a rendezvous left an entry behind");
  return 0;
}
