// The headroom check on the daemon's descriptors and mappings (daemon/src/headroom.h): its
// verdicts on given counts, and the counts it reads from this process.
#include "headroom.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace ulysses::daemon {
namespace {

TEST(HeadroomTest, AnEighthOfEachBoundAtLeast64IsKeptFree) {
  EXPECT_EQ(Headroom(65536), 8192);
  EXPECT_EQ(Headroom(65530), 8191);
  EXPECT_EQ(Headroom(256), 64);
  EXPECT_EQ(Headroom(10), 64);
  ProcessUse use{.descriptors = 100, .descriptor_limit = 1024, .mappings = 500,
                 .mapping_limit = 65530};
  EXPECT_TRUE(CheckHeadroom(use, "Attach").ok());
  use.descriptors = 1024 - 128 - 1;  // one more than the headroom left
  EXPECT_TRUE(CheckHeadroom(use, "Attach").ok());
  use.descriptors = 1024 - 128;
  absl::Status s = CheckHeadroom(use, "CreateSession");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "CreateSession: the daemon holds 896 of its 1024 descriptors (RLIMIT_NOFILE); the "
            "last 128 are kept for the work it serves");
  use.descriptors = 100;
  use.mappings = 65530 - 8191;
  s = CheckHeadroom(use, "Attach");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("memory mappings (vm.max_map_count)"), std::string::npos) << s;
  use.mappings = 70000;  // past the bound (a lowered setting)
  EXPECT_EQ(CheckHeadroom(use, "Attach").code(), absl::StatusCode::kResourceExhausted);
  use.mapping_limit = -1;  // not read (a /proc/sys the daemon cannot see): not checked
  EXPECT_TRUE(CheckHeadroom(use, "Attach").ok());
  use.descriptors = 1024;  // none left to list them with (EMFILE): all used
  EXPECT_EQ(CheckHeadroom(use, "Attach").code(), absl::StatusCode::kResourceExhausted);
}

TEST(HeadroomTest, TheGuardCountsItsRefusals) {
  HeadroomGuard guard;
  ASSERT_TRUE(guard.Check("Attach").ok());  // a test process is far from its bounds
  EXPECT_EQ(guard.refusals(), 0u);
}

TEST(HeadroomTest, ReadsThisProcesssDescriptorsAndMappings) {
  const ProcessUse before = ReadProcessUse();
  EXPECT_GT(before.descriptors, 2);  // stdin, stdout, stderr
  EXPECT_GT(before.descriptor_limit, 0);
  EXPECT_GT(before.mappings, 0);
  EXPECT_GT(before.mapping_limit, 0);
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<int> fds;
  std::vector<void*> maps;
  for (int i = 0; i < 10; ++i) {
    fds.push_back(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    ASSERT_GE(fds.back(), 0);
    // Every other page unmapped between them, so that no two mappings merge.
    void* p = ::mmap(nullptr, 2 * page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(p, MAP_FAILED);
    ASSERT_EQ(::munmap(static_cast<char*>(p) + page, page), 0);
    maps.push_back(p);
  }
  const ProcessUse after = ReadProcessUse();
  EXPECT_EQ(after.descriptors, before.descriptors + 10);
  EXPECT_GE(after.mappings, before.mappings + 10);
  for (int fd : fds) ::close(fd);
  for (void* p : maps) ::munmap(p, page);
}

}  // namespace
}  // namespace ulysses::daemon
