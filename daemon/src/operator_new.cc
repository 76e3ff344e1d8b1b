// The ulyssesd executable's global operator new: malloc (aligned_alloc for over-aligned types),
// as the C++ runtime's own, and one relaxed increment of the path's counter when the allocating
// thread is on a call path (host_allocations.h). Only the executable has it, so the client
// library and the processes that load it keep their own allocator. Address, thread and memory
// sanitizer builds keep the sanitizer's operator new, and count nothing.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "host_allocations.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define ULYSSES_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define ULYSSES_SANITIZED 1
#endif

#ifndef ULYSSES_SANITIZED

namespace {

namespace ha = ulysses::daemon::host_allocations;

// Counting is on before main, before any thread can open a scope.
[[maybe_unused]] const bool kCounting = (ha::g_counting.store(true), true);

// Asks the new handler for memory until it has none to give, as the runtime's own does: null
// when there is no handler; a handler's bad_alloc goes to the caller (the nothrow forms below
// turn it into null).
template <typename Get>
void* Retry(Get get) {
  if (std::atomic<uint64_t>* counter = ha::t_on_call_path)
    counter->fetch_add(1, std::memory_order_relaxed);
  for (;;) {
    if (void* p = get()) return p;
    std::new_handler h = std::get_new_handler();
    if (h == nullptr) return nullptr;
    h();
  }
}

void* Allocate(std::size_t n) {
  return Retry([n] { return std::malloc(n == 0 ? 1 : n); });
}

// aligned_alloc wants a size that is a multiple of the alignment; a size that cannot be
// rounded up without wrapping cannot be allocated.
void* AllocateAligned(std::size_t n, std::align_val_t a) {
  const std::size_t align = static_cast<std::size_t>(a);
  if (n > SIZE_MAX - align) return nullptr;
  const std::size_t size = n == 0 ? align : (n + align - 1) / align * align;
  return Retry([=] { return std::aligned_alloc(align, size); });
}

template <typename F>
void* NoThrow(F allocate) noexcept {
  try {
    return allocate();
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}

}  // namespace

void* operator new(std::size_t n) {
  if (void* p = Allocate(n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
  if (void* p = Allocate(n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  return NoThrow([n] { return Allocate(n); });
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return NoThrow([n] { return Allocate(n); });
}
void* operator new(std::size_t n, std::align_val_t a) {
  if (void* p = AllocateAligned(n, a)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) {
  if (void* p = AllocateAligned(n, a)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return NoThrow([=] { return AllocateAligned(n, a); });
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return NoThrow([=] { return AllocateAligned(n, a); });
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }

#endif  // ULYSSES_SANITIZED
