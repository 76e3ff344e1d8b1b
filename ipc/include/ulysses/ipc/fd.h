// Owning wrapper around a POSIX file descriptor.
#pragma once

namespace ulysses::ipc {

/// Owns one file descriptor and closes it on destruction.
///
/// Move-only: exactly one UniqueFd owns a given descriptor. A default-constructed or moved-from
/// UniqueFd holds -1 and owns nothing. Not thread-safe: one object must not be mutated (reset,
/// release, assignment) concurrently with any other use of it; get() on an unchanging object is
/// safe from any thread.
class UniqueFd {
 public:
  /// Owns nothing (get() == -1).
  UniqueFd() noexcept = default;
  /// Takes ownership of `fd`; a negative value means "owns nothing".
  explicit UniqueFd(int fd) noexcept : fd_(fd < 0 ? -1 : fd) {}
  /// Closes the owned descriptor, if any. close(2) errors are ignored (the descriptor is released
  /// either way on Linux).
  ~UniqueFd();

  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  /// Transfers ownership; `other` is left owning nothing.
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  /// Closes the currently owned descriptor, then takes ownership of `other`'s.
  UniqueFd& operator=(UniqueFd&& other) noexcept;

  /// The descriptor, or -1. Ownership is kept.
  [[nodiscard]] int get() const noexcept { return fd_; }
  /// True when a descriptor is owned.
  [[nodiscard]] bool valid() const noexcept { return fd_ >= 0; }
  /// Gives up ownership without closing; returns the descriptor (or -1). The caller must close it.
  [[nodiscard]] int release() noexcept;
  /// Closes the owned descriptor (if any) and takes ownership of `fd` (negative: owns nothing).
  /// Resetting to the descriptor already owned is a no-op.
  void reset(int fd = -1) noexcept;

 private:
  int fd_ = -1;
};

}  // namespace ulysses::ipc
