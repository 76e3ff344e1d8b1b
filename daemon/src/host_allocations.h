// Host allocations made on the daemon's call path. The ulyssesd executable replaces the global
// operator new (operator_new.cc) with one that counts the allocations a thread makes while a
// CallPathScope is open on it; the ring worker opens one around each call it takes from a
// client's ring and each poll of the calls in flight. Elsewhere (processes that link the daemon
// library without that file, and address, thread and memory sanitizer builds, whose runtimes
// own operator new) nothing is counted, and Counting() says so.
#pragma once

#include <atomic>
#include <cstdint>

namespace ulysses::daemon::host_allocations {

/// Whether this thread is on the call path now (read by the counting operator new).
inline thread_local bool t_on_call_path = false;

/// Allocations counted since start.
inline std::atomic<uint64_t> g_counted{0};

/// Set once, before main, by the executable whose operator new counts.
inline std::atomic<bool> g_counting{false};

/// Whether this process counts its call path's allocations.
inline bool Counting() { return g_counting.load(std::memory_order_relaxed); }

/// Allocations made on the call path since start (0 where Counting() is false).
inline uint64_t Counted() { return g_counted.load(std::memory_order_relaxed); }

/// Marks the calling thread as on the call path while it lives. Nests.
class CallPathScope {
 public:
  CallPathScope() : outer_(t_on_call_path) { t_on_call_path = true; }
  ~CallPathScope() { t_on_call_path = outer_; }
  CallPathScope(const CallPathScope&) = delete;
  CallPathScope& operator=(const CallPathScope&) = delete;

 private:
  bool outer_;
};

}  // namespace ulysses::daemon::host_allocations
