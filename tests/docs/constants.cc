// Prints, as one JSON object, the numbers the code defines and the docs repeat; the docs check
// (check_docs.py) compares every mention in docs/ with them.
#include <iostream>

#include "nlohmann/json.hpp"
#include "ulysses/common/config.h"
#include "ulysses/common/geometry.h"
#include "ulysses/common/session_layout.h"
#include "ulysses/ipc/client_segment.h"

int main() {
  const ulysses::DaemonConfig d;
  const nlohmann::json j = {
      {"client_segment_bytes", ulysses::ipc::ClientSegmentLayout::kTotal},
      {"client_segment_version", ulysses::ipc::kClientSegmentVersion},
      {"session_layout_version", ulysses::kSessionLayoutVersion},
      {"max_world_size", ulysses::kMaxWorldSize},
      {"max_slots", ulysses::kMaxSlots},
      {"config_defaults",
       {{"log_level", d.log_level},
        {"backend", d.backend},
        {"timeouts.call_ms", d.call_timeout_ms},
        {"timeouts.peer_ms", d.peer_timeout_ms},
        {"timeouts.drain_ms", d.drain_timeout_ms},
        {"slots.memory_budget_bytes", d.slot_memory_budget_bytes},
        {"flight_recorder_size", d.flight_recorder_size},
        {"timeouts.worker_stall_ms", d.worker_stall_ms},
        {"rings.worker_spin_us", d.ring_spin_us},
        {"queues.probe_streams", d.queue_probe_streams},
        {"queues.sharing", d.queue_sharing}}},
  };
  std::cout << j.dump() << "\n";
  return 0;
}
