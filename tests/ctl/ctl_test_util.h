// Admin messages with every field set, shared by the formatting tests and the fake daemon.
#pragma once

#include <cstdint>
#include <string>

#include "ulysses/v1/admin.pb.h"

namespace ulysses::ctl::testing {

/// Unix time (ms) the sample clients are rendered against.
inline constexpr std::int64_t kNowUnixMs = 1'700'000'000'000;

inline v1::DaemonState SampleState() {
  v1::DaemonState s;
  s.set_version("0.1.0");
  s.set_device(3);
  s.set_backend("host");
  s.set_pid(4242);
  s.set_uptime_s(3725.0);
  s.set_draining(true);
  s.set_health("SERVING");
  s.set_num_clients(2);
  s.set_num_groups(1);
  s.set_num_sessions(1);
  s.set_socket("/run/ulysses/gpu3.sock");
  s.set_calls_total(9'000'000'000ULL);  // above 2^32: 64-bit values must survive
  s.set_calls_failed(7);
  s.set_mps_mode("no-mps");
  s.set_active_calls(2);
  s.set_idle(false);
  s.set_metrics_address("127.0.0.1:9464");
  s.set_device_uuid("GPU-8f6c1b2e-0c3d-4a5b-9e7f-112233445566");
  s.set_device_pci_bus_id("0000:18:00.0");
  s.set_device_numa_node(1);
  return s;
}

inline v1::ListClientsResponse SampleClients() {
  v1::ListClientsResponse r;
  auto* a = r.add_clients();
  a->set_client_id(1);
  a->set_name("trainer-rank0");
  a->set_pid(1001);
  a->set_reported_pid(1001);
  a->set_uid(1000);
  a->set_since_unix_ms(kNowUnixMs - 3200);
  a->set_num_buffers(4);
  a->set_buffer_bytes(13107200);  // 12.5 MiB
  a->set_num_sessions(1);
  a->set_calls(123);
  auto* b = r.add_clients();
  b->set_client_id(22);
  b->set_name("x");
  b->set_pid(0);  // in another PID namespace: only its own report is known
  b->set_reported_pid(777);
  b->set_uid(0);
  b->set_since_unix_ms(kNowUnixMs - 90'000);
  b->set_num_buffers(0);
  b->set_buffer_bytes(0);
  b->set_num_sessions(0);
  b->set_calls(18'446'744'073'709'551'615ULL);
  return r;
}

inline v1::ListGroupsResponse SampleGroups() {
  v1::ListGroupsResponse r;
  auto* g = r.add_groups();
  auto* i = g->mutable_info();
  i->set_group_id(7);
  i->set_name("tp0");
  i->set_world_size(2);
  i->set_rank(1);
  i->set_backend("host");
  i->set_backend_reason("no CUDA device");
  i->add_members("unix:///run/ulysses/gpu0.sock");
  i->add_members("unix:///run/ulysses/gpu1.sock");
  g->add_client_ids(1);
  g->add_client_ids(22);
  return r;
}

inline v1::ListSessionsResponse SampleSessions() {
  v1::ListSessionsResponse r;
  auto* s = r.add_sessions();
  auto* i = s->mutable_info();
  i->set_session_id(5);
  i->set_group_id(7);
  auto* spec = i->mutable_spec();
  spec->set_num_heads(32);
  spec->set_head_dim(128);
  spec->set_dtype(v1::DTYPE_BFLOAT16);
  spec->set_max_tokens(8192);
  spec->set_num_slots(2);
  spec->add_schedule(7);
  spec->add_schedule(9);
  i->set_world_size(2);
  i->set_rank(1);
  i->set_slot_bytes(33554432);  // 32.0 MiB
  i->set_slot_stride_bytes(33558528);
  i->set_slot_offset_bytes(4096);
  i->set_segment_bytes(67121152);
  i->set_backend("host");
  i->set_backend_reason("no CUDA device");
  s->set_owner_client_id(1);
  s->set_kind("head_exchange");
  s->set_calls(40);
  s->set_last_epoch(41);
  return r;
}

inline v1::ListSlotsResponse SampleSlots() {
  v1::ListSlotsResponse r;
  auto* a = r.add_slots();
  a->set_session_id(5);
  a->set_slot(0);
  a->set_state("ready");
  a->set_owner_client_id(1);
  a->set_epoch(41);
  a->set_age_ms(3200);
  auto* b = r.add_slots();
  b->set_session_id(5);
  b->set_slot(1);
  b->set_state("free");
  b->set_owner_client_id(0);
  b->set_epoch(40);
  b->set_age_ms(250);
  return r;
}

/// Unix time (us) of the newest sample call: 2023-11-14T22:13:20.123456Z.
inline constexpr std::int64_t kCallUnixUs = 1'700'000'000'123'456;

inline v1::ListRecentCallsResponse SampleRecentCalls() {
  v1::ListRecentCallsResponse r;
  r.set_capacity(256);
  auto* a = r.add_calls();  // newest first
  a->set_client_id(1);
  a->set_session_id(5);
  a->set_epoch(41);
  a->set_op("scatter_heads");
  a->set_batch(2);
  a->set_seq(8192);
  a->set_queued_unix_us(kCallUnixUs);
  a->set_started_unix_us(kCallUnixUs + 40);
  a->set_enqueued_unix_us(kCallUnixUs + 90);
  a->set_done_unix_us(kCallUnixUs + 850);  // 850us
  a->set_status("OK");
  a->set_message("");
  a->set_sent_bytes(16'777'216);
  auto* b = r.add_calls();
  b->set_client_id(22);
  b->set_session_id(6);
  b->set_epoch(7);
  b->set_op("scatter_qkv_head_chunk");
  b->set_batch(1);
  b->set_seq(9'000'000'000LL);  // above 2^32
  b->set_queued_unix_us(kCallUnixUs - 1'500'000);
  b->set_started_unix_us(kCallUnixUs - 1'499'000);
  b->set_done_unix_us(kCallUnixUs - 1'488'000);  // 12ms
  b->set_status("OK");
  b->set_message("");
  b->set_sent_bytes(5'000'000'000ULL);
  auto* c = r.add_calls();
  c->set_client_id(1);
  c->set_session_id(5);
  c->set_epoch(40);
  c->set_op("gather_heads");
  c->set_batch(2);
  c->set_seq(8192);
  c->set_queued_unix_us(kCallUnixUs - 5'000'000);
  c->set_started_unix_us(kCallUnixUs - 4'999'900);
  c->set_done_unix_us(kCallUnixUs - 1'800'000);  // 3.2s
  c->set_status("DEADLINE_EXCEEDED");
  c->set_message("peer rank 0 did not answer");
  c->set_sent_bytes(0);
  return r;
}

/// An exposition with HELP/TYPE comments, labels, a histogram, a timestamp and escapes.
inline const char* SampleMetricsText() {
  return "# HELP ulysses_calls_total Calls completed.\n"
         "# TYPE ulysses_calls_total counter\n"
         "ulysses_calls_total{op=\"scatter_heads\",status=\"OK\"} 40\n"
         "ulysses_calls_total{op=\"gather_heads\",status=\"DEADLINE_EXCEEDED\"} 1\n"
         "# HELP ulysses_call_seconds Call latency, queued to done.\n"
         "# TYPE ulysses_call_seconds histogram\n"
         "ulysses_call_seconds_bucket{op=\"scatter_heads\",le=\"0.001\"} 30\n"
         "ulysses_call_seconds_bucket{op=\"scatter_heads\",le=\"0.01\"} 39\n"
         "ulysses_call_seconds_bucket{op=\"scatter_heads\",le=\"+Inf\"} 40\n"
         "ulysses_call_seconds_sum{op=\"scatter_heads\"} 0.123\n"
         "ulysses_call_seconds_count{op=\"scatter_heads\"} 40\n"
         "\n"
         "# HELP ulysses_draining 1 while the daemon drains.\n"
         "# TYPE ulysses_draining gauge\n"
         "ulysses_draining 1\n"
         "ulysses_last_call_unix_seconds 1.7e9 1700000000123\n"
         "ulysses_client_info{name=\"say \\\"hi\\\"\",path=\"C:\\\\tmp\",note=\"a\\nb\"} 1\n";
}

}  // namespace ulysses::ctl::testing
