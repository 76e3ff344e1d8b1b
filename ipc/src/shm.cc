#include "ulysses/ipc/shm.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "errno_status.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"

namespace ulysses::ipc {
namespace {

// memfd_create rejects names longer than 249 bytes (NAME_MAX minus the "memfd:" prefix).
constexpr size_t kMaxMemfdName = 249;
constexpr size_t kMaxSegmentName = 250;

absl::Status ValidateSegmentName(std::string_view name) {
  if (name.size() < 2 || name.front() != '/' || name.size() > kMaxSegmentName ||
      name.find('/', 1) != std::string_view::npos || name.find('\0') != std::string_view::npos) {
    return absl::InvalidArgumentError(ulysses::StrCat(
        "name: shared-memory segment name '", name,
        "' must start with '/', contain no other '/' or NUL, and be 2..250 characters long"));
  }
  return absl::OkStatus();
}

}  // namespace

Mapping::~Mapping() { Unmap(); }

Mapping::Mapping(Mapping&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      writable_(std::exchange(other.writable_, false)) {}

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    Unmap();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    writable_ = std::exchange(other.writable_, false);
  }
  return *this;
}

void Mapping::Unmap() noexcept {
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
  writable_ = false;
}

absl::StatusOr<Mapping> Mapping::Map(int fd, size_t size, bool writable, size_t offset) {
  if (size == 0) {
    return absl::InvalidArgumentError(ulysses::StrCat("size: cannot map 0 bytes of fd ", fd));
  }
  const long page = ::sysconf(_SC_PAGESIZE);
  if (page > 0 && offset % static_cast<size_t>(page) != 0) {
    return absl::InvalidArgumentError(ulysses::StrCat(
        "offset: ", offset, " is not a multiple of the page size ", page, " (fd ", fd, ")"));
  }
  if (offset > static_cast<size_t>(std::numeric_limits<off_t>::max()) ||
      size > std::numeric_limits<size_t>::max() - offset) {
    return absl::InvalidArgumentError(
        ulysses::StrCat("size: range [", offset, ", +", size, ") overflows (fd ", fd, ")"));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return LastError("fstat(fd ", fd, ")");
  }
  // Touching a page past the end of a file raises SIGBUS; refuse such a mapping up front.
  if (S_ISREG(st.st_mode) && offset + size > static_cast<size_t>(st.st_size)) {
    return absl::InvalidArgumentError(ulysses::StrCat("size: range [", offset, ", ", offset + size,
                                                      ") extends past the end of fd ", fd, " (",
                                                      st.st_size, " bytes)"));
  }
  const int prot = writable ? (PROT_READ | PROT_WRITE) : PROT_READ;
  void* data = ::mmap(nullptr, size, prot, MAP_SHARED, fd, static_cast<off_t>(offset));
  if (data == MAP_FAILED) {
    return LastError("mmap(fd ", fd, ", ", size, " bytes at offset ", offset,
                     writable ? ", read-write)" : ", read-only)");
  }
  return Mapping(data, size, writable);
}

absl::StatusOr<UniqueFd> CreateMemfd(std::string_view debug_name, size_t size) {
  if (size == 0) {
    return absl::InvalidArgumentError(
        ulysses::StrCat("size: memfd '", debug_name, "' must have a non-zero size"));
  }
  if (size > static_cast<size_t>(std::numeric_limits<off_t>::max())) {
    return absl::InvalidArgumentError(
        ulysses::StrCat("size: ", size, " bytes is too large for memfd '", debug_name, "'"));
  }
  std::string name(debug_name.substr(0, kMaxMemfdName));
  for (char& c : name) {
    if (c == '\0' || c == '/') c = '_';
  }
  UniqueFd fd(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) {
    return LastError("memfd_create(", name, ")");
  }
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
    return LastError("ftruncate(memfd ", name, ", ", size, ")");
  }
  return fd;
}

absl::StatusOr<size_t> FdSize(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return LastError("fstat(fd ", fd, ")");
  }
  return static_cast<size_t>(st.st_size);
}

absl::Status SealSize(int fd) {
  if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return LastError("fcntl(fd ", fd, ", F_ADD_SEALS, SHRINK|GROW)");
  }
  return absl::OkStatus();
}

absl::Status CheckSealedShmem(int fd) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    // EINVAL: not a file that supports seals (only memfds and a few others do).
    if (errno == EINVAL) {
      return absl::FailedPreconditionError(
          ulysses::StrCat("fcntl(fd ", fd, ", F_GET_SEALS): fd does not support seals"));
    }
    return LastError("fcntl(fd ", fd, ", F_GET_SEALS)");
  }
  if ((seals & F_SEAL_SHRINK) == 0) {
    return absl::FailedPreconditionError(
        ulysses::StrCat("fd ", fd, " is not sealed against shrinking (F_SEAL_SHRINK missing)"));
  }
  // A hugetlbfs memfd can be sealed too, but its owner can still punch a hole in it and use up
  // the free huge pages: the receiver's next touch of that page is then a SIGBUS.
  struct statfs fs {};
  if (::fstatfs(fd, &fs) != 0) return LastError("fstatfs(fd ", fd, ")");
  if (fs.f_type == HUGETLBFS_MAGIC) {
    return absl::FailedPreconditionError(ulysses::StrCat(
        "fd ", fd, " is a hugetlbfs memfd (MFD_HUGETLB), whose pages can fail under a mapping; "
        "use an ordinary memfd"));
  }
  return absl::OkStatus();
}

absl::Status ReserveMemory(int fd, size_t size, std::string_view what) {
  if (size == 0) return absl::OkStatus();
  // fallocate reports its error as the return value, not in errno.
  int err = ::posix_fallocate(fd, 0, static_cast<off_t>(size));
  while (err == EINTR) err = ::posix_fallocate(fd, 0, static_cast<off_t>(size));
  if (err == 0) return absl::OkStatus();
  if (err != ENOSPC && err != ENOMEM && err != EFBIG) {
    return ErrnoError(ulysses::StrCat(what, ": fallocate(", size, " bytes)"), err);
  }
  struct statfs fs {};
  std::string limit;
  if (::fstatfs(fd, &fs) == 0 && fs.f_blocks > 0) {
    limit = ulysses::StrCat("the filesystem holding it has ",
                            static_cast<uint64_t>(fs.f_blocks) * fs.f_bsize, " bytes, ",
                            static_cast<uint64_t>(fs.f_bavail) * fs.f_bsize,
                            " free (for /dev/shm: its mount's size= option)");
  } else {
    limit = "shared memory is limited by the memory of the daemon's cgroup (memory.max) and "
            "of the node";
  }
  return absl::ResourceExhaustedError(ulysses::StrCat(what, ": cannot reserve ", size,
                                                      " bytes of shared memory (",
                                                      std::strerror(err), "); ", limit));
}

absl::StatusOr<SharedSegment> SharedSegment::Create(std::string_view debug_name, size_t size) {
  ULY_ASSIGN_OR_RETURN(UniqueFd fd, CreateMemfd(debug_name, size));
  // Owner-only: a client given a read-only descriptor cannot reopen /proc/self/fd/N writable.
  if (::fchmod(fd.get(), 0600) != 0) return LastError("fchmod(memfd ", debug_name, ", 0600)");
  ULY_RETURN_IF_ERROR(ReserveMemory(fd.get(), size, ulysses::StrCat("segment ", debug_name)));
  ULY_RETURN_IF_ERROR(SealSize(fd.get()));
  ULY_ASSIGN_OR_RETURN(Mapping m, Mapping::Map(fd.get(), size, /*writable=*/true));
  return SharedSegment(std::move(fd), std::move(m));
}

absl::StatusOr<SharedSegment> SharedSegment::Adopt(UniqueFd fd, size_t expected_size) {
  ULY_RETURN_IF_ERROR(CheckSealedShmem(fd.get()));
  ULY_ASSIGN_OR_RETURN(size_t size, FdSize(fd.get()));
  if (size != expected_size) {
    return absl::FailedPreconditionError(ulysses::StrCat(
        "segment: ", size, " bytes, expected ", expected_size));
  }
  ULY_ASSIGN_OR_RETURN(Mapping m, Mapping::Map(fd.get(), size, /*writable=*/true));
  return SharedSegment(std::move(fd), std::move(m));
}

absl::StatusOr<UniqueFd> SharedSegment::ReadOnlyFd() const {
  // A fresh open file description of the same memfd, read-only; the original stays read-write.
  const std::string path = ulysses::StrCat("/proc/self/fd/", fd_.get());
  UniqueFd ro(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!ro.valid()) return LastError("open(", path, ", O_RDONLY)");
  return ro;
}

NamedSegment::~NamedSegment() {
  if (owns_name_ && !unlinked_) ::shm_unlink(name_.c_str());
}

NamedSegment::NamedSegment(NamedSegment&& other) noexcept
    : name_(std::move(other.name_)),
      fd_(std::move(other.fd_)),
      mapping_(std::move(other.mapping_)),
      owns_name_(std::exchange(other.owns_name_, false)),
      unlinked_(std::exchange(other.unlinked_, false)) {
  other.name_.clear();
}

NamedSegment& NamedSegment::operator=(NamedSegment&& other) noexcept {
  if (this != &other) {
    if (owns_name_ && !unlinked_) ::shm_unlink(name_.c_str());
    name_ = std::move(other.name_);
    other.name_.clear();
    fd_ = std::move(other.fd_);
    mapping_ = std::move(other.mapping_);
    owns_name_ = std::exchange(other.owns_name_, false);
    unlinked_ = std::exchange(other.unlinked_, false);
  }
  return *this;
}

absl::StatusOr<NamedSegment> NamedSegment::Create(std::string name, size_t size) {
  ULY_RETURN_IF_ERROR(ValidateSegmentName(name));
  if (size == 0) {
    return absl::InvalidArgumentError(
        ulysses::StrCat("size: segment ", name, " must have a non-zero size"));
  }
  if (size > static_cast<size_t>(std::numeric_limits<off_t>::max())) {
    return absl::InvalidArgumentError(
        ulysses::StrCat("size: ", size, " bytes is too large for segment ", name));
  }
  UniqueFd fd(::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd.valid()) {
    const int err = errno;
    if (err == EEXIST) {
      return absl::AlreadyExistsError(
          ulysses::StrCat("shm_open(", name, ", O_CREAT|O_EXCL): segment already exists"));
    }
    return ErrnoError(ulysses::StrCat("shm_open(", name, ", O_CREAT|O_EXCL)"), err);
  }
  // From here on the name is ours: own it before anything else can fail so that it is removed
  // again on every error path.
  NamedSegment segment(std::move(name), std::move(fd), Mapping(), /*owns_name=*/true);
  if (::ftruncate(segment.fd(), static_cast<off_t>(size)) != 0) {
    return LastError("ftruncate(", segment.name_, ", ", size, ")");
  }
  auto mapping = Mapping::Map(segment.fd(), size, /*writable=*/true);
  if (!mapping.ok()) {
    return absl::Status(mapping.status().code(), ulysses::StrCat("segment ", segment.name_, ": ",
                                                                 mapping.status().message()));
  }
  segment.mapping_ = *std::move(mapping);
  return segment;
}

absl::StatusOr<NamedSegment> NamedSegment::Open(std::string name, size_t expected_size) {
  ULY_RETURN_IF_ERROR(ValidateSegmentName(name));
  if (expected_size == 0) {
    return absl::InvalidArgumentError(
        ulysses::StrCat("expected_size: segment ", name, " must have a non-zero size"));
  }
  UniqueFd fd(::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0));
  if (!fd.valid()) {
    return LastError("shm_open(", name, ")");
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    return LastError("fstat(", name, ")");
  }
  if (static_cast<size_t>(st.st_size) != expected_size) {
    return absl::FailedPreconditionError(
        ulysses::StrCat("segment ", name, " has ", st.st_size, " bytes, expected ", expected_size));
  }
  auto mapping = Mapping::Map(fd.get(), expected_size, /*writable=*/true);
  if (!mapping.ok()) {
    return absl::Status(mapping.status().code(),
                        ulysses::StrCat("segment ", name, ": ", mapping.status().message()));
  }
  return NamedSegment(std::move(name), std::move(fd), *std::move(mapping), /*owns_name=*/false);
}

absl::Status NamedSegment::Unlink() {
  if (unlinked_ || name_.empty()) return absl::OkStatus();
  // Whatever happens next, this object must never unlink the name later: by then it may name
  // somebody else's segment.
  unlinked_ = true;
  owns_name_ = false;
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) {
    return LastError("shm_unlink(", name_, ")");
  }
  return absl::OkStatus();
}

void NamedSegment::UnlinkIfExists(std::string_view name) {
  if (!ValidateSegmentName(name).ok()) return;
  ::shm_unlink(std::string(name).c_str());
}

}  // namespace ulysses::ipc
