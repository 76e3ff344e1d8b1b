#include "telemetry.h"

#include <cstdio>

#include "ulysses/common/strings.h"

namespace ulysses::daemon {

void FlightRecorder::Add(CallRecord record) {
  std::lock_guard<std::mutex> lock(mu_);
  ring_[next_] = std::move(record);
  next_ = (next_ + 1) % ring_.size();
  if (count_ < ring_.size()) ++count_;
}

std::vector<CallRecord> FlightRecorder::Recent(size_t limit) const {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t n = limit == 0 ? count_ : std::min(limit, count_);
  std::vector<CallRecord> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.push_back(ring_[(next_ + ring_.size() - 1 - i) % ring_.size()]);
  return out;
}

void Metrics::RecordCall(OpKind op, absl::StatusCode code, absl::Duration elapsed,
                         uint64_t bytes_sent) {
  const int op_index = static_cast<int>(op);
  calls_by_op_[op_index >= 0 && op_index < kNumOpKinds ? op_index : 0].fetch_add(1, std::memory_order_relaxed);
  const int code_index = static_cast<int>(code);
  if (code != absl::StatusCode::kOk)
    errors_by_code_[code_index > 0 && code_index < 17 ? code_index : 2].fetch_add(1, std::memory_order_relaxed);
  bytes_sent_.fetch_add(bytes_sent, std::memory_order_relaxed);
  const double s = absl::ToDoubleSeconds(elapsed);
  size_t b = 0;
  while (b < kBuckets.size() && s > kBuckets[b]) ++b;
  buckets_[b].fetch_add(1, std::memory_order_relaxed);
  duration_ns_sum_.fetch_add(static_cast<uint64_t>(absl::ToInt64Nanoseconds(elapsed)),
                             std::memory_order_relaxed);
}

uint64_t Metrics::calls_total() const {
  uint64_t n = 0;
  for (auto& c : calls_by_op_) n += c.load(std::memory_order_relaxed);
  return n;
}

uint64_t Metrics::calls_failed() const {
  uint64_t n = 0;
  for (auto& c : errors_by_code_) n += c.load(std::memory_order_relaxed);
  return n;
}

namespace {

std::string Num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

// A label value escaped as the text format wants (backslash, quote, newline).
std::string LabelValue(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    if (c == '\\' || c == '"') out += '\\';
    out += c;
  }
  return out;
}

void Header(std::string& out, const char* name, const char* type, const char* help) {
  out += StrCat("# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

// A metric of one sample without labels.
void Single(std::string& out, const char* name, const char* type, const char* help,
            uint64_t value) {
  Header(out, name, type, help);
  out += StrCat(name, " ", value, "\n");
}

}  // namespace

std::string Metrics::Render(const std::string& version, int device, const std::string& backend,
                            const DeviceIdentity& identity, const GaugeSnapshot& g) const {
  std::string out;
  // UUID and pci_bus_id are spelled as NVIDIA's DCGM exporter spells them, so that a query can
  // join the two on them; an unknown value is empty.
  Header(out, "ulyssesd_info", "gauge",
         "Version, device, backend and GPU identity of this daemon (value 1).");
  out += StrCat("ulyssesd_info{version=\"", LabelValue(version), "\",device=\"", device,
                "\",backend=\"", LabelValue(backend), "\",UUID=\"", LabelValue(identity.uuid),
                "\",pci_bus_id=\"", LabelValue(identity.pci_bus_id), "\",numa_node=\"",
                identity.numa_node < 0 ? std::string() : StrCat(identity.numa_node), "\"} 1\n");
  Header(out, "ulyssesd_up", "gauge", "1 while the daemon serves.");
  out += "ulyssesd_up 1\n";
  Header(out, "ulyssesd_uptime_seconds", "gauge", "Seconds since the daemon started serving.");
  out += StrCat("ulyssesd_uptime_seconds ", Num(g.uptime_s), "\n");
  Header(out, "ulyssesd_calls_total", "counter", "Calls completed (successfully or not), by op.");
  for (int op = 1; op < kNumOpKinds; ++op)
    out += StrCat("ulyssesd_calls_total{op=\"", OpName(static_cast<OpKind>(op)), "\"} ",
                  calls_by_op_[op].load(std::memory_order_relaxed), "\n");
  Header(out, "ulyssesd_call_errors_total", "counter", "Calls that failed, by status code.");
  for (int code = 1; code < 17; ++code) {
    const uint64_t n = errors_by_code_[code].load(std::memory_order_relaxed);
    out += StrCat("ulyssesd_call_errors_total{code=\"",
                  absl::StatusCodeToString(static_cast<absl::StatusCode>(code)), "\"} ", n, "\n");
  }
  Header(out, "ulyssesd_bytes_sent_total", "counter",
         "Bytes this rank wrote into its peers' (and its own) receive slots.");
  out += StrCat("ulyssesd_bytes_sent_total ", bytes_sent_.load(std::memory_order_relaxed), "\n");
  Header(out, "ulyssesd_call_duration_seconds", "histogram",
         "Daemon-side duration of a call, from request to result.");
  uint64_t cumulative = 0;
  for (size_t b = 0; b < kBuckets.size(); ++b) {
    cumulative += buckets_[b].load(std::memory_order_relaxed);
    out += StrCat("ulyssesd_call_duration_seconds_bucket{le=\"", Num(kBuckets[b]), "\"} ",
                  cumulative, "\n");
  }
  cumulative += buckets_[kBuckets.size()].load(std::memory_order_relaxed);
  out += StrCat("ulyssesd_call_duration_seconds_bucket{le=\"+Inf\"} ", cumulative, "\n");
  out += StrCat("ulyssesd_call_duration_seconds_sum ",
                Num(static_cast<double>(duration_ns_sum_.load(std::memory_order_relaxed)) * 1e-9),
                "\n");
  out += StrCat("ulyssesd_call_duration_seconds_count ", cumulative, "\n");
  Header(out, "ulyssesd_slots", "gauge", "Receive slots by state.");
  const char* states[3] = {"free", "writing", "held"};
  for (int i = 0; i < 3; ++i)
    out += StrCat("ulyssesd_slots{state=\"", states[i], "\"} ", g.slots_by_state[i], "\n");
  Header(out, "ulyssesd_clients", "gauge", "Attached clients.");
  out += StrCat("ulyssesd_clients ", g.clients, "\n");
  Header(out, "ulyssesd_sessions", "gauge", "Open sessions.");
  out += StrCat("ulyssesd_sessions ", g.sessions, "\n");
  Header(out, "ulyssesd_active_calls", "gauge", "Calls running now.");
  out += StrCat("ulyssesd_active_calls ", g.active_calls, "\n");
  Header(out, "ulyssesd_draining", "gauge", "1 while the daemon drains (refuses new sessions).");
  out += StrCat("ulyssesd_draining ", g.draining ? 1 : 0, "\n");
  Header(out, "ulyssesd_limit", "gauge", "Configured limits (config object limits).");
  for (const GaugeSnapshot::LimitGauge& l : g.limits)
    out += StrCat("ulyssesd_limit{limit=\"", l.name, "\"} ", l.value, "\n");
  Header(out, "ulyssesd_limit_refusals_total", "counter", "Requests refused by a limit.");
  for (const GaugeSnapshot::LimitGauge& l : g.limits)
    out += StrCat("ulyssesd_limit_refusals_total{limit=\"", l.name, "\"} ", l.refusals, "\n");
  // What each uid holds, one gauge per kind.
  using Uid = GaugeSnapshot::UidGauge;
  const struct {
    const char* name;
    const char* help;
    int64_t (*value)(const Uid&);
  } per_uid[] = {
      {"ulyssesd_uid_clients", "Bound clients per uid.", [](const Uid& u) { return u.clients; }},
      {"ulyssesd_uid_buffer_bytes", "Bytes of the buffers the clients of a uid hold.",
       [](const Uid& u) { return static_cast<int64_t>(u.buffer_bytes); }},
      {"ulyssesd_uid_buffers", "Buffers the clients of a uid hold.",
       [](const Uid& u) -> int64_t { return u.buffers; }},
      {"ulyssesd_uid_sessions", "Sessions the clients of a uid have open or are creating.",
       [](const Uid& u) -> int64_t { return u.sessions; }},
      {"ulyssesd_uid_connections", "Connections of a uid to the control socket.",
       [](const Uid& u) -> int64_t { return u.connections; }},
      {"ulyssesd_uid_unbound_clients",
       "Clients attached on a uid's control connections that have not bound their fd socket.",
       [](const Uid& u) -> int64_t { return u.unbound; }},
      {"ulyssesd_uid_slot_bytes",
       "Receive-slot memory the sessions of a uid's clients hold, of the daemon's budget.",
       [](const Uid& u) { return static_cast<int64_t>(u.slot_bytes); }},
      {"ulyssesd_uid_pending_fds",
       "Descriptors the clients of a uid sent and no RegisterBuffer claimed yet.",
       [](const Uid& u) -> int64_t { return u.pending_fds; }},
  };
  for (const auto& gauge : per_uid) {
    Header(out, gauge.name, "gauge", gauge.help);
    for (const Uid& u : g.uids)
      out += StrCat(gauge.name, "{uid=\"", u.uid, "\"} ", gauge.value(u), "\n");
  }
  Single(out, "ulyssesd_mps_enabled", "gauge",
         "1 when the daemon and its clients share the GPU through MPS.",
         g.mps ? 1 : 0);
  Single(out, "ulyssesd_device_bytes", "gauge",
         "Device memory the daemon holds (receive slots, daemon-allocated buffers), in bytes.",
         g.device_bytes);
  Single(out, "ulyssesd_device_allocations_total", "counter",
         "Device allocations made or opened (VMM created or imported, CUDA IPC opened).",
         g.device_allocations);
  Single(out, "ulyssesd_call_path_host_allocations_total", "counter",
         "Host allocations the ring workers made taking, running and completing calls (the "
         "ulyssesd executable counts them; 0 in address, thread and memory sanitizer builds).",
         g.call_path_host_allocations);
  Single(out, "ulyssesd_grpc_call_host_allocations_total", "counter",
         "Host allocations the Control.Call handlers made (the gRPC call path; the request's "
         "metadata map and the response's shape field, which gRPC makes per call, included), "
         "counted as the ring path's are.",
         g.grpc_call_host_allocations);
  Single(out, "ulyssesd_device_streams_total", "counter",
         "Distinct streams handed to sessions on the device (a closed session's stream serves "
         "the next).",
         g.device_streams);
  Header(out, "ulyssesd_hardware_queues", "gauge",
         "Hardware queues the start-up probe found for sessions (the rescue stream's not "
         "counted; 0: not probed), and those serving a session or a fused plan now.");
  out += StrCat("ulyssesd_hardware_queues{state=\"total\"} ", g.hardware_queues, "\n");
  out += StrCat("ulyssesd_hardware_queues{state=\"in_use\"} ", g.hardware_queues_in_use, "\n");
  Single(out, "ulyssesd_queue_shared_streams_total", "counter",
         "Streams handed out when every probed hardware queue served a session: each shares a "
         "queue with another session's stream (queues.sharing allow).",
         g.queue_shared_streams);
  Single(out, "ulyssesd_queue_refusals_total", "counter",
         "Session streams refused: every probed hardware queue served one (queues.sharing "
         "refuse), or every probed stream did (queues.probe_streams).",
         g.queue_refusals);
  Single(out, "ulyssesd_sessions_undrained_total", "counter",
         "Sessions whose device work did not end within the drain limit of their cancel (30 s, "
         "or the call timeout and 5 s where longer); their device memory and streams are kept "
         "for the daemon's life.",
         g.sessions_undrained);
  Single(out, "ulyssesd_worker_stalls_total", "counter",
         "Ring-worker steps (executing or polling a client's calls) that ran longer than "
         "timeouts.call_ms + timeouts.worker_stall_ms.",
         g.worker_stalls);
  // The process's two bounds every client's state uses (headroom.h); not written when they
  // could not be read.
  const struct {
    const char* name;
    const char* help;
    int64_t value;
  } process[] = {
      {"process_open_fds", "Open descriptors of the daemon.", g.open_fds},
      {"process_max_fds", "The daemon's descriptor limit (RLIMIT_NOFILE, soft).", g.max_fds},
      {"ulyssesd_mappings", "Memory mappings of the daemon.", g.mappings},
      {"ulyssesd_mapping_limit", "Memory mappings a process may have (vm.max_map_count).",
       g.max_mappings},
  };
  for (const auto& p : process)
    if (p.value >= 0) Single(out, p.name, "gauge", p.help, static_cast<uint64_t>(p.value));
  Single(out, "ulyssesd_headroom_refusals_total", "counter",
         "Attach and CreateSession requests refused while the daemon had no more than an eighth "
         "of its descriptors or mappings left.",
         g.headroom_refusals);
  Single(out, "ulyssesd_log_lines_dropped_total", "counter",
         "Warnings a client or a socket caused past its budget of log lines (not written).",
         g.log_lines_dropped);
  return out;
}

}  // namespace ulysses::daemon
