// Host allocations made on the daemon's call paths. The ulyssesd executable replaces the global
// operator new (operator_new.cc) with one that counts the allocations a thread makes while a
// CallPathScope is open on it, in the scope's counter: the ring worker opens one around each
// call it takes from a client's ring and each poll of the calls in flight (g_counted), the
// Control.Call handler one around its whole work (g_grpc_counted). Elsewhere (processes that
// link the daemon library without that file, and address, thread and memory sanitizer builds,
// whose runtimes own operator new) nothing is counted, and Counting() says so.
#pragma once

#include <atomic>
#include <cstdint>

namespace ulysses::daemon::host_allocations {

/// Allocations counted on the ring path since start.
inline std::atomic<uint64_t> g_counted{0};

/// Allocations counted in Control.Call handlers since start.
inline std::atomic<uint64_t> g_grpc_counted{0};

/// The counter of the call path this thread is on now; null when on none (read by the
/// counting operator new).
inline thread_local std::atomic<uint64_t>* t_on_call_path = nullptr;

/// Set once, before main, by the executable whose operator new counts.
inline std::atomic<bool> g_counting{false};

/// Whether this process counts its call path's allocations.
inline bool Counting() { return g_counting.load(std::memory_order_relaxed); }

/// Allocations made on the ring path since start (0 where Counting() is false).
inline uint64_t Counted() { return g_counted.load(std::memory_order_relaxed); }

/// Allocations made in Control.Call handlers since start (0 where Counting() is false).
inline uint64_t GrpcCounted() { return g_grpc_counted.load(std::memory_order_relaxed); }

/// Marks the calling thread as on a call path while it lives, counting into `counter` (the
/// ring path's by default). Nests.
class CallPathScope {
 public:
  explicit CallPathScope(std::atomic<uint64_t>& counter = g_counted) : outer_(t_on_call_path) {
    t_on_call_path = &counter;
  }
  ~CallPathScope() { t_on_call_path = outer_; }
  CallPathScope(const CallPathScope&) = delete;
  CallPathScope& operator=(const CallPathScope&) = delete;

 private:
  std::atomic<uint64_t>* outer_;
};

}  // namespace ulysses::daemon::host_allocations
