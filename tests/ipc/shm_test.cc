#include "ulysses/ipc/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_util.h"
#include "ulysses/common/strings.h"

namespace ulysses::ipc {
namespace {

using ::testing::HasSubstr;

TEST(MemfdTest, WriteThroughOneMappingIsVisibleThroughAnother) {
  auto fd = CreateMemfd("shm-test", 8192);
  ASSERT_TRUE(fd.ok()) << fd.status();
  auto writer = Mapping::Map(fd->get(), 8192, /*writable=*/true);
  ASSERT_TRUE(writer.ok()) << writer.status();
  auto reader = Mapping::Map(fd->get(), 8192, /*writable=*/false);
  ASSERT_TRUE(reader.ok()) << reader.status();
  ASSERT_NE(writer->data(), reader->data());
  EXPECT_TRUE(writer->writable());
  EXPECT_FALSE(reader->writable());

  const auto* bytes = static_cast<const unsigned char*>(reader->data());
  EXPECT_EQ(bytes[0], 0);  // memfds start zero-filled
  std::memcpy(static_cast<char*>(writer->data()) + 4096, "ulysses", 8);
  EXPECT_STREQ(reinterpret_cast<const char*>(bytes + 4096), "ulysses");
}

TEST(MemfdTest, MappingSurvivesClosingTheFd) {
  Mapping mapping;
  {
    auto fd = CreateMemfd("shm-test", 4096);
    ASSERT_TRUE(fd.ok()) << fd.status();
    auto m = Mapping::Map(fd->get(), 4096, true);
    ASSERT_TRUE(m.ok()) << m.status();
    mapping = *std::move(m);
  }
  static_cast<char*>(mapping.data())[100] = 42;
  EXPECT_EQ(static_cast<char*>(mapping.data())[100], 42);
}

TEST(MemfdTest, MapAtPageOffset) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  auto fd = CreateMemfd("shm-test", 2 * page);
  ASSERT_TRUE(fd.ok()) << fd.status();
  auto whole = Mapping::Map(fd->get(), 2 * page, true);
  ASSERT_TRUE(whole.ok()) << whole.status();
  auto second_page = Mapping::Map(fd->get(), page, false, page);
  ASSERT_TRUE(second_page.ok()) << second_page.status();
  static_cast<char*>(whole->data())[page] = 'x';
  EXPECT_EQ(static_cast<const char*>(second_page->data())[0], 'x');
}

TEST(MemfdTest, SizeIsReported) {
  auto fd = CreateMemfd("shm-test", 12345);
  ASSERT_TRUE(fd.ok()) << fd.status();
  auto size = FdSize(fd->get());
  ASSERT_TRUE(size.ok()) << size.status();
  EXPECT_EQ(*size, 12345u);
  EXPECT_TRUE(::fcntl(fd->get(), F_GETFD) & FD_CLOEXEC);
}

TEST(MemfdTest, ZeroSizeIsInvalidArgument) {
  auto fd = CreateMemfd("shm-test", 0);
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(fd.status().message()), HasSubstr("size"));
}

TEST(MappingTest, RejectsBadArguments) {
  auto fd = CreateMemfd("shm-test", 4096);
  ASSERT_TRUE(fd.ok()) << fd.status();

  auto zero = Mapping::Map(fd->get(), 0, true);
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(zero.status().message()), HasSubstr("size"));

  auto past_end = Mapping::Map(fd->get(), 8192, true);
  EXPECT_EQ(past_end.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(past_end.status().message()), HasSubstr("past the end"));

  auto unaligned = Mapping::Map(fd->get(), 100, true, 1);
  EXPECT_EQ(unaligned.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(unaligned.status().message()), HasSubstr("offset"));

  auto bad_fd = Mapping::Map(-1, 4096, true);
  EXPECT_FALSE(bad_fd.ok());
  EXPECT_THAT(std::string(bad_fd.status().message()), HasSubstr("fd -1"));
}

TEST(MappingTest, MoveTransfersRegion) {
  auto fd = CreateMemfd("shm-test", 4096);
  ASSERT_TRUE(fd.ok()) << fd.status();
  auto m = Mapping::Map(fd->get(), 4096, true);
  ASSERT_TRUE(m.ok()) << m.status();
  void* data = m->data();
  Mapping moved(*std::move(m));
  EXPECT_EQ(moved.data(), data);
  EXPECT_EQ(moved.size(), 4096u);
  EXPECT_FALSE(m->valid());  // NOLINT(bugprone-use-after-move): moved-from state is specified
  EXPECT_EQ(m->size(), 0u);
}

// A hugetlbfs memfd is refused even when sealed: its owner could punch a hole in it while the
// free huge pages are used up, and the receiver's next touch would fault.
TEST(MemfdTest, AHugetlbMemfdIsRefusedEvenWhenSealed) {
  UniqueFd fd(::memfd_create("shm-test-huge", MFD_HUGETLB | MFD_ALLOW_SEALING | MFD_CLOEXEC));
  if (!fd.valid()) GTEST_SKIP() << "memfd_create(MFD_HUGETLB): " << std::strerror(errno);
  if (::ftruncate(fd.get(), 2 << 20) != 0 || !SealSize(fd.get()).ok())
    GTEST_SKIP() << "this kernel does not size or seal a hugetlbfs memfd";
  const absl::Status st = CheckSealedShmem(fd.get());
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("hugetlbfs"), std::string_view::npos) << st;
}

TEST(MemfdTest, SizeSealBlocksShrinking) {
  auto fd = CreateMemfd("shm-test", 4096);
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_EQ(CheckSealedShmem(fd->get()).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(SealSize(fd->get()).ok());
  EXPECT_TRUE(CheckSealedShmem(fd->get()).ok());
  EXPECT_NE(::ftruncate(fd->get(), 1024), 0);
  EXPECT_EQ(errno, EPERM);
  auto size = FdSize(fd->get());
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, 4096u);
}

class NamedSegmentTest : public ::testing::Test {
 protected:
  void SetUp() override { name_ = "/uly-" + testing::UniqueTestName(); }
  void TearDown() override { NamedSegment::UnlinkIfExists(name_); }

  bool NameExists() const {
    int fd = ::shm_open(name_.c_str(), O_RDONLY, 0);
    if (fd >= 0) ::close(fd);
    return fd >= 0;
  }

  std::string name_;
};

TEST_F(NamedSegmentTest, CreateThenOpenSharesMemory) {
  auto created = NamedSegment::Create(name_, 1 << 16);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->name(), name_);
  EXPECT_EQ(created->size(), 1u << 16);
  EXPECT_GE(created->fd(), 0);
  EXPECT_TRUE(created->owns_name());

  auto opened = NamedSegment::Open(name_, 1 << 16);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_FALSE(opened->owns_name());
  std::memcpy(static_cast<char*>(created->data()) + 777, "peer", 5);
  EXPECT_STREQ(static_cast<const char*>(opened->data()) + 777, "peer");
  static_cast<char*>(opened->data())[0] = 9;
  EXPECT_EQ(static_cast<const char*>(created->data())[0], 9);
}

TEST_F(NamedSegmentTest, CreateTwiceIsAlreadyExists) {
  auto first = NamedSegment::Create(name_, 4096);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = NamedSegment::Create(name_, 4096);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr(name_));
  // The failed Create must not have removed the first one's name.
  EXPECT_TRUE(NameExists());
}

TEST_F(NamedSegmentTest, OpenWithWrongSizeIsFailedPrecondition) {
  auto created = NamedSegment::Create(name_, 4096);
  ASSERT_TRUE(created.ok()) << created.status();
  auto opened = NamedSegment::Open(name_, 8192);
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(opened.status().message()), HasSubstr("4096"));
  EXPECT_THAT(std::string(opened.status().message()), HasSubstr("8192"));
}

TEST_F(NamedSegmentTest, OpenMissingIsNotFound) {
  auto opened = NamedSegment::Open(name_, 4096);
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(opened.status().message()), HasSubstr(name_));
}

TEST_F(NamedSegmentTest, CreatorUnlinksOnDestruction) {
  {
    auto created = NamedSegment::Create(name_, 4096);
    ASSERT_TRUE(created.ok()) << created.status();
    auto opened = NamedSegment::Open(name_, 4096);
    ASSERT_TRUE(opened.ok()) << opened.status();
  }
  EXPECT_FALSE(NameExists());
}

TEST_F(NamedSegmentTest, OpenerDoesNotUnlink) {
  auto created = NamedSegment::Create(name_, 4096);
  ASSERT_TRUE(created.ok()) << created.status();
  {
    auto opened = NamedSegment::Open(name_, 4096);
    ASSERT_TRUE(opened.ok());
  }
  EXPECT_TRUE(NameExists());
}

TEST_F(NamedSegmentTest, ReleasedNameOutlivesCreator) {
  {
    auto created = NamedSegment::Create(name_, 4096);
    ASSERT_TRUE(created.ok()) << created.status();
    created->ReleaseName();
    EXPECT_FALSE(created->owns_name());
  }
  EXPECT_TRUE(NameExists());
  auto opened = NamedSegment::Open(name_, 4096);
  EXPECT_TRUE(opened.ok()) << opened.status();
}

TEST_F(NamedSegmentTest, UnlinkIsIdempotentAndKeepsMapping) {
  auto created = NamedSegment::Create(name_, 4096);
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_TRUE(created->Unlink().ok());
  EXPECT_FALSE(NameExists());
  EXPECT_TRUE(created->Unlink().ok());
  static_cast<char*>(created->data())[1] = 1;  // still mapped

  // The name is free again, and the old object must not remove the new segment's name.
  auto again = NamedSegment::Create(name_, 4096);
  ASSERT_TRUE(again.ok()) << again.status();
  created = NamedSegment();
  EXPECT_TRUE(NameExists());
}

TEST_F(NamedSegmentTest, MovedFromDoesNotUnlink) {
  auto created = NamedSegment::Create(name_, 4096);
  ASSERT_TRUE(created.ok()) << created.status();
  NamedSegment moved(*std::move(created));
  { NamedSegment gone(std::move(*created)); }  // moved-from twice: owns nothing
  EXPECT_TRUE(NameExists());
  EXPECT_TRUE(moved.owns_name());
  EXPECT_EQ(moved.name(), name_);
}

TEST_F(NamedSegmentTest, InvalidNamesAreRejected) {
  const std::vector<std::string> bad_names = {"", "/", "noslash", "/a/b",
                                              "/" + std::string(250, 'x')};
  for (const std::string& bad : bad_names) {
    auto created = NamedSegment::Create(bad, 4096);
    EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(created.status().message()), HasSubstr("name")) << bad;
    auto opened = NamedSegment::Open(bad, 4096);
    EXPECT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  // 250 characters is the longest valid name.
  const std::string longest_name = name_ + std::string(250 - name_.size(), 'y');
  auto longest = NamedSegment::Create(longest_name, 4096);
  ASSERT_TRUE(longest.ok()) << longest.status();
  EXPECT_TRUE(longest->Unlink().ok());
}

TEST_F(NamedSegmentTest, ZeroSizeIsInvalidArgument) {
  auto created = NamedSegment::Create(name_, 0);
  EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(created.status().message()), HasSubstr("size"));
  EXPECT_FALSE(NameExists());
}

}  // namespace
}  // namespace ulysses::ipc

namespace ulysses::ipc {
namespace {

TEST(SharedSegmentTest, IsSealedOwnerOnlyAndItsReadOnlyFdCannotWriteOrResize) {
  auto seg = SharedSegment::Create("ulysses-test", 1 << 16);
  ASSERT_TRUE(seg.ok()) << seg.status();
  EXPECT_TRUE(CheckSealedShmem(seg->fd()).ok());
  struct stat st {};
  ASSERT_EQ(::fstat(seg->fd(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_NE(::ftruncate(seg->fd(), 0), 0) << "the creator's own descriptor could shrink it";
  static_cast<char*>(seg->data())[100] = 7;
  auto ro = seg->ReadOnlyFd();
  ASSERT_TRUE(ro.ok()) << ro.status();
  EXPECT_NE(::ftruncate(ro->get(), 0), 0);
  EXPECT_FALSE(Mapping::Map(ro->get(), 1 << 16, /*writable=*/true).ok());
  auto view = Mapping::Map(ro->get(), 1 << 16, /*writable=*/false);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(static_cast<const char*>(view->data())[100], 7);
}

TEST(SharedSegmentTest, AdoptChecksTheSealAndTheSize) {
  auto unsealed = CreateMemfd("unsealed", 4096);
  ASSERT_TRUE(unsealed.ok());
  EXPECT_EQ(SharedSegment::Adopt(std::move(*unsealed), 4096).status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto seg = SharedSegment::Create("sized", 8192);
  ASSERT_TRUE(seg.ok());
  const int dup = ::fcntl(seg->fd(), F_DUPFD_CLOEXEC, 0);
  ASSERT_GE(dup, 0);
  EXPECT_EQ(SharedSegment::Adopt(UniqueFd(dup), 4096).status().code(),
            absl::StatusCode::kFailedPrecondition);
  const int dup2 = ::fcntl(seg->fd(), F_DUPFD_CLOEXEC, 0);
  auto adopted = SharedSegment::Adopt(UniqueFd(dup2), 8192);
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  static_cast<char*>(adopted->data())[5] = 9;
  EXPECT_EQ(static_cast<char*>(seg->data())[5], 9);
}

// A filesystem too small for the reservation: refused up front, naming its size, instead of
// a SIGBUS at the first touch of a page it cannot hold.
TEST(ReserveMemoryTest, ASmallTmpfsIsResourceExhaustedNamingItsSize) {
  char dir[] = "/tmp/ulysses-reserve.XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  if (::mount("tmpfs", dir, "tmpfs", 0, "size=64k") != 0) {
    ::rmdir(dir);
    GTEST_SKIP() << "cannot mount a tmpfs here (needs root): " << std::strerror(errno);
  }
  {
    UniqueFd fd(::open(StrCat(dir, "/f").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    ASSERT_TRUE(fd.valid());
    absl::Status s = ReserveMemory(fd.get(), 1 << 20, "segment test");
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("65536 bytes"), std::string::npos) << s;
    EXPECT_TRUE(ReserveMemory(fd.get(), 16 << 10, "segment test").ok());
  }
  ::umount(dir);
  ::rmdir(dir);
}

}  // namespace
}  // namespace ulysses::ipc
