// Orderings that a library makes where ThreadSanitizer cannot see them. The distribution's gRPC
// is not instrumented: how it hands a call from one of its threads to another (completion
// queues, its own mutexes and atomics) is invisible, so the orderings its callback API promises
// look like races in the code that relies on them. Where the daemon relies on one, it says so
// with a HappensBefore / HappensAfter pair on the object the ordering is about.
#pragma once

#include "absl/base/config.h"

#ifdef ABSL_HAVE_THREAD_SANITIZER
#include <sanitizer/tsan_interface.h>
#endif

namespace ulysses {

/// What this thread did so far happens before whatever follows a later HappensAfter(`key`) on
/// any thread. Call it just before handing `key` to the library (starting a call, Finish,
/// StartRead, returning a reactor): never after, when `key` may already be gone. A no-op
/// outside ThreadSanitizer builds.
inline void HappensBefore(const void* key) {
#ifdef ABSL_HAVE_THREAD_SANITIZER
  __tsan_release(const_cast<void*>(key));
#else
  (void)key;
#endif
}

/// Pairs with every earlier HappensBefore(`key`): call it first thing where the library hands
/// `key` back (a reaction, a completion callback). A no-op outside ThreadSanitizer builds.
inline void HappensAfter(const void* key) {
#ifdef ABSL_HAVE_THREAD_SANITIZER
  __tsan_acquire(const_cast<void*>(key));
#else
  (void)key;
#endif
}

}  // namespace ulysses
