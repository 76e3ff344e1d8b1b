// Shared memory: mappings, memfd buffers and named POSIX segments.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ulysses/ipc/fd.h"

namespace ulysses::ipc {

/// A shared (MAP_SHARED) memory mapping of a file descriptor, unmapped on destruction.
///
/// Move-only; a default-constructed or moved-from Mapping is empty (data() == nullptr,
/// size() == 0). The mapping stays valid after the descriptor it came from is closed. Accessors
/// are safe from any thread; the mapped bytes themselves are shared memory and need whatever
/// synchronisation the protocol stored in them defines.
class Mapping {
 public:
  /// Empty mapping.
  Mapping() noexcept = default;
  /// munmap(2)s the region, if any.
  ~Mapping();

  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  /// Transfers the region; `other` is left empty.
  Mapping(Mapping&& other) noexcept;
  /// Unmaps the current region, then takes `other`'s.
  Mapping& operator=(Mapping&& other) noexcept;

  /// Maps `size` bytes of `fd` starting at byte `offset`, shared, readable, and writable when
  /// `writable` (the descriptor must then be open O_RDWR). `fd` is not taken over.
  /// Errors: INVALID_ARGUMENT naming `size` (zero, or the range extends past the end of a
  /// regular file such as a memfd or shm object) or `offset` (not a multiple of the page size);
  /// otherwise the errno of fstat/mmap.
  static absl::StatusOr<Mapping> Map(int fd, size_t size, bool writable, size_t offset = 0);

  /// First mapped byte, or nullptr when empty.
  [[nodiscard]] void* data() const noexcept { return data_; }
  /// Mapped length in bytes (the `size` passed to Map), 0 when empty.
  [[nodiscard]] size_t size() const noexcept { return size_; }
  /// Whether the region was mapped writable.
  [[nodiscard]] bool writable() const noexcept { return writable_; }
  /// Whether a region is mapped.
  [[nodiscard]] bool valid() const noexcept { return data_ != nullptr; }

 private:
  Mapping(void* data, size_t size, bool writable) noexcept
      : data_(data), size_(size), writable_(writable) {}
  void Unmap() noexcept;

  void* data_ = nullptr;
  size_t size_ = 0;
  bool writable_ = false;
};

/// Creates an anonymous shared-memory file (memfd_create with MFD_CLOEXEC | MFD_ALLOW_SEALING)
/// of `size` bytes, zero-filled. `debug_name` only labels it in /proc (truncated to 249 bytes).
/// The returned descriptor is open read-write; it can be mapped with Mapping::Map and sent to
/// another process with SendMessage. Errors: INVALID_ARGUMENT naming `size` when it is zero;
/// the errno of memfd_create/ftruncate otherwise. Thread-safe.
absl::StatusOr<UniqueFd> CreateMemfd(std::string_view debug_name, size_t size);

/// Size in bytes of the file behind `fd` (fstat st_size). Thread-safe.
absl::StatusOr<size_t> FdSize(int fd);

/// Forbids any later change of the size of memfd `fd` (F_SEAL_SHRINK | F_SEAL_GROW). A process
/// that hands a memfd to another one seals it so the receiver's mappings can never be cut short
/// (an access past a shrunk end raises SIGBUS in the receiver). Thread-safe.
absl::Status SealSize(int fd);

/// FAILED_PRECONDITION unless memfd `fd` carries F_SEAL_SHRINK, i.e. nobody can shrink it under
/// a mapping, and is not on hugetlbfs (whose pages a hole punched by the owner can leave
/// unbacked: SIGBUS on the receiver's touch). Receivers of untrusted memfds check this before
/// mapping them. Thread-safe.
absl::Status CheckSealedShmem(int fd);

/// Reserves the memory behind the first `size` bytes of `fd` now (fallocate), so that touching
/// them later cannot fail for want of memory (a page of a full tmpfs or memfd raises SIGBUS in
/// whoever touches it). `what` names the memory in errors. RESOURCE_EXHAUSTED names the limit
/// that refused it: the size and free space of a sized filesystem (a /dev/shm mount), or the
/// memory of the process's cgroup and of the node for a memfd; another errno otherwise.
/// Thread-safe.
absl::Status ReserveMemory(int fd, size_t size, std::string_view what);

/// Shared memory that the daemons of one node map and that clients may read: a memfd, never a
/// name, so nothing in /dev/shm can collide with it or be unlinked under it, and it is gone when
/// its last descriptor and mapping are. Its memory is reserved when it is made, its size is
/// sealed (nobody can shrink or grow it, whoever holds a descriptor), and it has mode 0600, so
/// that a process of another uid holding a read-only descriptor cannot reopen it writable
/// through /proc. Mapped read-write here.
///
/// Move-only. Accessors are safe from any thread.
class SharedSegment {
 public:
  /// Empty segment.
  SharedSegment() noexcept = default;

  /// A fresh zero-filled segment of `size` bytes; `debug_name` labels it in /proc. Errors:
  /// INVALID_ARGUMENT naming `size` (zero); ReserveMemory's RESOURCE_EXHAUSTED; the errno of
  /// memfd_create/fchmod/fcntl/mmap otherwise. Nothing is left behind on failure.
  static absl::StatusOr<SharedSegment> Create(std::string_view debug_name, size_t size);

  /// Maps a segment another process made (a descriptor received over a socket) read-write,
  /// after checking that its size is sealed (CheckSealedShmem) and equals `expected_size`:
  /// FAILED_PRECONDITION naming both sizes otherwise.
  static absl::StatusOr<SharedSegment> Adopt(UniqueFd fd, size_t expected_size);

  /// A new descriptor of the same memory, open read-only: it cannot be written, resized or mapped
  /// writable (mmap PROT_WRITE fails with EACCES). For a process that only reads the segment.
  absl::StatusOr<UniqueFd> ReadOnlyFd() const;

  /// First byte of the read-write mapping, or nullptr when empty.
  [[nodiscard]] void* data() const noexcept { return mapping_.data(); }
  /// Size in bytes.
  [[nodiscard]] size_t size() const noexcept { return mapping_.size(); }
  /// The read-write descriptor (owned; -1 when empty). Lend it only to trusted processes.
  [[nodiscard]] int fd() const noexcept { return fd_.get(); }

 private:
  SharedSegment(UniqueFd fd, Mapping mapping) noexcept
      : fd_(std::move(fd)), mapping_(std::move(mapping)) {}
  UniqueFd fd_;
  Mapping mapping_;
};

/// A named POSIX shared-memory object (shm_open), mapped read-write, for segments shared between
/// daemons. The creator owns the name: it unlinks the name on destruction unless Unlink() or
/// ReleaseName() was called. An opener never unlinks on destruction. The mapping is unmapped on
/// destruction in either case.
///
/// Names start with '/', contain no other '/', and are 2..250 characters long.
///
/// Move-only. Accessors are safe from any thread; Unlink/ReleaseName/assignment are not safe
/// concurrently with other uses of the same object.
class NamedSegment {
 public:
  /// Empty segment (owns nothing).
  NamedSegment() noexcept = default;
  /// Unmaps; unlinks the name when this object created it and still owns it.
  ~NamedSegment();

  NamedSegment(const NamedSegment&) = delete;
  NamedSegment& operator=(const NamedSegment&) = delete;
  /// Transfers the mapping, descriptor and name ownership; `other` is left empty.
  NamedSegment(NamedSegment&& other) noexcept;
  /// Releases the current segment as the destructor would, then takes `other`'s.
  NamedSegment& operator=(NamedSegment&& other) noexcept;

  /// Creates `name` exclusively (O_CREAT | O_EXCL, mode 0600 before umask) with `size` bytes,
  /// zero-filled, and maps it read-write. Errors: INVALID_ARGUMENT naming `name` or `size`
  /// (zero); ALREADY_EXISTS when the name exists; the errno of shm_open/ftruncate/mmap otherwise
  /// (nothing is left behind on failure).
  static absl::StatusOr<NamedSegment> Create(std::string name, size_t size);

  /// Opens the existing segment `name` read-write and maps it. Errors: INVALID_ARGUMENT naming
  /// `name` or `expected_size` (zero); NOT_FOUND when it does not exist; FAILED_PRECONDITION
  /// when its size differs from `expected_size` (both sizes in the message).
  static absl::StatusOr<NamedSegment> Open(std::string name, size_t expected_size);

  /// First byte of the read-write mapping, or nullptr when empty.
  [[nodiscard]] void* data() const noexcept { return mapping_.data(); }
  /// Size in bytes.
  [[nodiscard]] size_t size() const noexcept { return mapping_.size(); }
  /// The shm descriptor (owned by this object; -1 when empty). Can be sent with SendMessage.
  [[nodiscard]] int fd() const noexcept { return fd_.get(); }
  /// The segment name, e.g. "/ulysses-gpu0-peer".
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// Whether this object will unlink the name on destruction.
  [[nodiscard]] bool owns_name() const noexcept { return owns_name_; }

  /// Removes the name now (existing mappings stay valid). Idempotent: OK when the name is
  /// already gone or was already unlinked by this object. Afterwards the destructor does not
  /// unlink. Callable by creators and openers alike.
  absl::Status Unlink();
  /// Keeps the name alive past this object's destruction (someone else will unlink it).
  void ReleaseName() noexcept { owns_name_ = false; }

  /// Removes `name` if it exists; ignores every error (invalid names included). For cleanup of
  /// segments left by a crashed process. Thread-safe.
  static void UnlinkIfExists(std::string_view name);

 private:
  NamedSegment(std::string name, UniqueFd fd, Mapping mapping, bool owns_name) noexcept
      : name_(std::move(name)),
        fd_(std::move(fd)),
        mapping_(std::move(mapping)),
        owns_name_(owns_name) {}

  std::string name_;
  UniqueFd fd_;
  Mapping mapping_;
  bool owns_name_ = false;
  bool unlinked_ = false;
};

}  // namespace ulysses::ipc
