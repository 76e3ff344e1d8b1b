#include "ulysses/ipc/wait.h"

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <new>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_util.h"
#include "ulysses/ipc/shm.h"
#include "ulysses/ipc/unix_socket.h"

namespace ulysses::ipc {
namespace {

using ::testing::HasSubstr;

// Generous: these tests assert outcomes, not durations; the deadline only bounds a failure.
absl::Time FarDeadline() { return absl::Now() + absl::Seconds(60); }

TEST(WaitAtLeastTest, AlreadySatisfiedIsOk) {
  std::atomic<uint64_t> word{5};
  EXPECT_TRUE(WaitAtLeast(word, 5, absl::InfinitePast()).ok());
  EXPECT_TRUE(WaitAtLeast(word, 3, absl::InfinitePast()).ok());
}

TEST(WaitAtLeastTest, OkWhenAnotherThreadStoresTarget) {
  std::atomic<uint64_t> word{0};
  std::atomic<uint64_t> abort_word{0};
  uint64_t payload = 0;
  std::thread writer([&] {
    payload = 1234;  // published by the release store below
    word.store(7, std::memory_order_release);
  });
  absl::Status status = WaitAtLeast(word, 7, FarDeadline(), &abort_word, "slot 0 ready");
  writer.join();
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(payload, 1234u);
}

TEST(WaitAtLeastTest, AbortedWhenAbortWordIsSet) {
  std::atomic<uint64_t> word{1};
  std::atomic<uint64_t> abort_word{0};
  std::thread aborter([&] { abort_word.store(7, std::memory_order_release); });
  absl::Status status = WaitAtLeast(word, 2, FarDeadline(), &abort_word, "peer barrier");
  aborter.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
  EXPECT_EQ(status.message(), "peer barrier: aborted (code 7)");
}

TEST(WaitAtLeastTest, SatisfiedWordWinsOverAbort) {
  std::atomic<uint64_t> word{9};
  std::atomic<uint64_t> abort_word{1};
  EXPECT_TRUE(WaitAtLeast(word, 9, FarDeadline(), &abort_word).ok());
  EXPECT_EQ(WaitAtLeast(word, 10, FarDeadline(), &abort_word).code(), absl::StatusCode::kAborted);
}

TEST(WaitAtLeastTest, DeadlineExceededWithShortDeadline) {
  std::atomic<uint64_t> word{3};
  absl::Status status =
      WaitAtLeast(word, 4, absl::Now() + absl::Milliseconds(20), nullptr, "slot 2 done");
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_EQ(status.message(), "slot 2 done: timed out waiting for epoch 4 (have 3)");

  absl::Status unnamed = WaitAtLeast(word, 4, absl::InfinitePast());
  EXPECT_EQ(unnamed.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(unnamed.message()), HasSubstr("wait: timed out"));
}

// WaitFor ends as WaitAtLeast does, with the values it saw instead of a message.
TEST(WaitForTest, OutcomesCarryWhatTheWaitSaw) {
  std::atomic<uint64_t> word{6};
  std::atomic<uint64_t> abort_word{0};
  WaitOutcome w = WaitFor(word, 6, absl::InfinitePast(), &abort_word);
  EXPECT_EQ(w.end, WaitOutcome::kReached);
  EXPECT_EQ(w.have, 6u);
  w = WaitFor(word, 8, absl::Now() + absl::Milliseconds(5), &abort_word);
  EXPECT_EQ(w.end, WaitOutcome::kDeadline);
  EXPECT_EQ(w.have, 6u);
  abort_word.store(3);
  w = WaitFor(word, 8, FarDeadline(), &abort_word);
  EXPECT_EQ(w.end, WaitOutcome::kAborted);
  EXPECT_EQ(w.abort_code, 3u);
  EXPECT_EQ(w.have, 6u);
  // A satisfied word wins over the abort.
  EXPECT_EQ(WaitFor(word, 5, FarDeadline(), &abort_word).end, WaitOutcome::kReached);
}

// The word lives in a memfd shared with a forked child, as it would between daemon and client.
TEST(WaitAtLeastTest, WordInSharedMemoryWrittenByAnotherProcess) {
  auto fd = CreateMemfd("wait-test", 4096);
  ASSERT_TRUE(fd.ok()) << fd.status();
  auto mapping = Mapping::Map(fd->get(), 4096, true);
  ASSERT_TRUE(mapping.ok()) << mapping.status();
  auto* words = new (mapping->data()) std::atomic<uint64_t>[2] {};
  std::atomic<uint64_t>& ready = words[0];
  std::atomic<uint64_t>& abort_word = words[1];

  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ready.store(1ull << 40, std::memory_order_release);
    ::_exit(0);
  }
  absl::Status status = WaitAtLeast(ready, 1ull << 40, FarDeadline(), &abort_word, "ready");
  EXPECT_EQ(testing::WaitChild(pid), 0);
  EXPECT_TRUE(status.ok()) << status;
}

}  // namespace
}  // namespace ulysses::ipc
