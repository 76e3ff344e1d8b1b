// Admin requests: the bytes of one request (the first byte picks which), parsed as its
// protobuf message, then used as AdminService uses it. Only ListRecentCalls (a limit, read
// from a flight recorder holding records) and GetSession (an id) carry fields; the others are
// empty messages, for which parsing is the whole decoder.
#include "fuzz_util.h"
#include "proto_fuzz.h"
#include "requests.h"
#include "telemetry.h"

using namespace ulysses;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const int which = in.ConsumeIntegralInRange<int>(0, 10);
  const std::string bytes = in.ConsumeRemainingBytesAsString();
  switch (which) {
    case 0: {
      v1::ListRecentCallsRequest req;
      if (!req.ParseFromString(bytes)) break;
      daemon::FlightRecorder recorder(16);
      for (int i = 0; i < 20; ++i) recorder.Add(daemon::CallRecord{});
      const size_t limit = daemon::RecentCallsLimit(req);
      const size_t got = recorder.Recent(limit).size();
      if (got > recorder.capacity() || (limit > 0 && got > limit))
        fuzz::Fail("more recent calls than asked for or held");
      break;
    }
    case 1: { v1::GetSessionRequest req; (void)req.ParseFromString(bytes); break; }
    case 2: { v1::GetStateRequest req; (void)req.ParseFromString(bytes); break; }
    case 3: { v1::ListClientsRequest req; (void)req.ParseFromString(bytes); break; }
    case 4: { v1::ListGroupsRequest req; (void)req.ParseFromString(bytes); break; }
    case 5: { v1::ListSessionsRequest req; (void)req.ParseFromString(bytes); break; }
    case 6: { v1::ListSlotsRequest req; (void)req.ParseFromString(bytes); break; }
    case 7: { v1::DrainRequest req; (void)req.ParseFromString(bytes); break; }
    case 8: { v1::UndrainRequest req; (void)req.ParseFromString(bytes); break; }
    default: { v1::GetMetricsRequest req; (void)req.ParseFromString(bytes); break; }
  }
  return 0;
}
