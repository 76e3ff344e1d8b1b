#include "ulysses/ipc/ring.h"

#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_util.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/client_segment.h"
#include "ulysses/ipc/eventfd.h"
#include "ulysses/ipc/shm.h"

namespace ulysses::ipc {
namespace {

using ::testing::HasSubstr;

// A call-descriptor-sized record: a sequence number, a payload derived from it, and a checksum
// of the payload, so a consumer can tell lost, duplicated, reordered and torn records apart.
struct TestRecord {
  uint64_t seq;
  uint64_t payload[6];
  uint64_t checksum;
};

constexpr uint32_t kSmallCapacity = 64;
using TestRing = SpscRing<TestRecord, kSmallCapacity>;
constexpr uint64_t kStreamRecords = 100'000;

// Layout is part of the shared-memory contract (mscclpp *_device.hpp style).
static_assert(sizeof(TestRecord) == 64);
static_assert(offsetof(TestRing, head) == 0);
static_assert(offsetof(TestRing, tail) == 64);
static_assert(offsetof(TestRing, records) == 128);
static_assert(sizeof(TestRing) == 128 + 64 * kSmallCapacity);
static_assert(alignof(TestRing) == 64);
static_assert(std::is_standard_layout_v<TestRing>);
struct OddRecord {
  uint32_t a;
  uint8_t b[20];
};
using OddRing = SpscRing<OddRecord, 4>;
static_assert(sizeof(OddRing) == 128 + 128);  // 4 * 24 = 96 record bytes, padded to 128

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t Checksum(const TestRecord& r) {
  uint64_t sum = Mix(r.seq);
  for (uint64_t word : r.payload) sum = Mix(sum ^ word);
  return sum;
}

TestRecord MakeRecord(uint64_t seq) {
  TestRecord r{};
  r.seq = seq;
  for (uint64_t i = 0; i < 6; ++i) r.payload[i] = Mix(seq * 6 + i);
  r.checksum = Checksum(r);
  return r;
}

// OK when `r` is intact and is record `expected` of the stream.
absl::Status CheckRecord(const TestRecord& r, uint64_t expected) {
  if (r.checksum != Checksum(r)) {
    return absl::DataLossError(ulysses::StrCat("record ", expected, ": bad checksum"));
  }
  if (r.seq != expected) {
    return absl::DataLossError(ulysses::StrCat("expected record ", expected, ", got ", r.seq));
  }
  for (uint64_t i = 0; i < 6; ++i) {
    if (r.payload[i] != Mix(expected * 6 + i)) {
      return absl::DataLossError(ulysses::StrCat("record ", expected, ": bad payload word ", i));
    }
  }
  return absl::OkStatus();
}

// Producer half of the doorbell protocol: pushes records 0..n-1, ringing `bell` after each push,
// yielding while the ring is full. DEADLINE_EXCEEDED when the consumer stops draining.
absl::Status Produce(TestRing& ring, EventFd& bell, uint64_t n, absl::Time deadline) {
  for (uint64_t seq = 0; seq < n; ++seq) {
    const TestRecord record = MakeRecord(seq);
    for (;;) {
      absl::StatusOr<bool> pushed = ring.TryPush(record);
      if (!pushed.ok()) return pushed.status();
      if (*pushed) break;
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(ulysses::StrCat("ring full at record ", seq));
      }
      std::this_thread::yield();
    }
    if (absl::Status rung = bell.Signal(); !rung.ok()) return rung;
  }
  return absl::OkStatus();
}

// Consumer half: takes n records with PopWait and checks each one.
absl::Status Consume(TestRing& ring, EventFd& bell, uint64_t n, absl::Time deadline) {
  for (uint64_t expected = 0; expected < n; ++expected) {
    TestRecord r{};
    absl::StatusOr<bool> popped = PopWait(ring, &r, bell, deadline);
    if (!popped.ok()) return popped.status();
    if (!*popped) {
      return absl::DeadlineExceededError(ulysses::StrCat("no record ", expected, " by deadline"));
    }
    if (absl::Status ok = CheckRecord(r, expected); !ok.ok()) return ok;
  }
  return absl::OkStatus();
}

std::unique_ptr<TestRing> NewRing() { return std::make_unique<TestRing>(); }  // zeroed

TEST(SpscRingTest, PushPopKeepsOrder) {
  auto ring = NewRing();
  EXPECT_TRUE(ring->empty());
  EXPECT_EQ(TestRing::capacity(), kSmallCapacity);
  for (uint64_t i = 0; i < 10; ++i) {
    auto pushed = ring->TryPush(MakeRecord(i));
    ASSERT_TRUE(pushed.ok()) << pushed.status();
    ASSERT_TRUE(*pushed);
  }
  EXPECT_EQ(ring->size(), 10u);
  for (uint64_t i = 0; i < 10; ++i) {
    TestRecord r{};
    auto popped = ring->TryPop(&r);
    ASSERT_TRUE(popped.ok()) << popped.status();
    ASSERT_TRUE(*popped);
    EXPECT_TRUE(CheckRecord(r, i).ok()) << CheckRecord(r, i);
  }
  EXPECT_TRUE(ring->empty());
  EXPECT_EQ(ring->head.load(), 10u);
  EXPECT_EQ(ring->tail.load(), 10u);
}

TEST(SpscRingTest, FullRingRefusesPush) {
  auto ring = NewRing();
  // Go around the index space several times: full and empty are told apart by the positions.
  uint64_t next_push = 0;
  uint64_t next_pop = 0;
  for (int round = 0; round < 3; ++round) {
    while (ring->size() < kSmallCapacity) {
      auto pushed = ring->TryPush(MakeRecord(next_push));
      ASSERT_TRUE(pushed.ok() && *pushed);
      ++next_push;
    }
    auto refused = ring->TryPush(MakeRecord(next_push));
    ASSERT_TRUE(refused.ok()) << refused.status();
    EXPECT_FALSE(*refused);
    EXPECT_EQ(ring->size(), kSmallCapacity);
    // One pop frees exactly one slot.
    TestRecord r{};
    ASSERT_TRUE(ring->TryPop(&r).value());
    EXPECT_TRUE(CheckRecord(r, next_pop++).ok());
    auto again = ring->TryPush(MakeRecord(next_push));
    ASSERT_TRUE(again.ok() && *again);
    ++next_push;
    while (ring->size() > 0) {
      ASSERT_TRUE(ring->TryPop(&r).value());
      ASSERT_TRUE(CheckRecord(r, next_pop++).ok()) << CheckRecord(r, next_pop - 1);
    }
  }
  EXPECT_EQ(next_pop, next_push);
}

TEST(SpscRingTest, EmptyPopReturnsFalseAndLeavesOutAlone) {
  auto ring = NewRing();
  TestRecord r{};
  r.seq = 12345;
  auto popped = ring->TryPop(&r);
  ASSERT_TRUE(popped.ok()) << popped.status();
  EXPECT_FALSE(*popped);
  EXPECT_EQ(r.seq, 12345u);
  EXPECT_EQ(ring->head.load(), 0u);
}

TEST(SpscRingTest, PositionsNearTwoToThe64Work) {
  auto ring = NewRing();
  const uint64_t start = std::numeric_limits<uint64_t>::max() - 5;
  ring->head.store(start);
  ring->tail.store(start);
  for (uint64_t i = 0; i < 3 * kSmallCapacity; ++i) {
    auto pushed = ring->TryPush(MakeRecord(i));
    ASSERT_TRUE(pushed.ok()) << pushed.status();
    ASSERT_TRUE(*pushed);
    TestRecord r{};
    auto popped = ring->TryPop(&r);
    ASSERT_TRUE(popped.ok()) << popped.status();
    ASSERT_TRUE(*popped);
    ASSERT_TRUE(CheckRecord(r, i).ok());
  }
  EXPECT_TRUE(ring->empty());
}

TEST(SpscRingTest, ForgedTailIsDataLossWithoutRead) {
  auto ring = NewRing();
  ASSERT_TRUE(ring->TryPush(MakeRecord(0)).value());
  TestRecord r{};
  ASSERT_TRUE(ring->TryPop(&r).value());
  const uint64_t head = ring->head.load();
  ring->tail.store(head + kSmallCapacity + 1);  // one more record than the ring can hold

  TestRecord out{};
  out.seq = 777;
  auto popped = ring->TryPop(&out);
  EXPECT_EQ(popped.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(popped.status().message()), HasSubstr("corrupted"));
  EXPECT_EQ(out.seq, 777u);  // nothing was copied out
  EXPECT_EQ(ring->head.load(), head);

  // A tail behind the head is just as impossible.
  ring->tail.store(head - 1);
  EXPECT_EQ(ring->TryPop(&out).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(out.seq, 777u);

  // Exactly full is legitimate.
  ring->tail.store(head + kSmallCapacity);
  EXPECT_TRUE(ring->TryPop(&out).ok());
}

TEST(SpscRingTest, ForgedHeadIsDataLossForProducer) {
  auto ring = NewRing();
  ASSERT_TRUE(ring->TryPush(MakeRecord(0)).value());
  std::memset(&ring->records[1], 0xab, sizeof(TestRecord));
  ring->head.store(ring->tail.load() + 1);  // consumer claims to be past the producer

  auto pushed = ring->TryPush(MakeRecord(1));
  EXPECT_EQ(pushed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(pushed.status().message()), HasSubstr("producer"));
  EXPECT_EQ(ring->tail.load(), 1u);
  EXPECT_EQ(ring->records[1].seq, 0xababababababababull);  // nothing written
}

TEST(SpscRingTest, CreateAndAttachShareOneRingThroughTwoMappings) {
  const size_t bytes = 2 * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  ASSERT_GE(bytes, sizeof(TestRing));
  auto fd = CreateMemfd("ring-test", bytes);
  ASSERT_TRUE(fd.ok()) << fd.status();
  auto mine = Mapping::Map(fd->get(), bytes, true);
  ASSERT_TRUE(mine.ok()) << mine.status();
  auto theirs = Mapping::Map(fd->get(), bytes, true);
  ASSERT_TRUE(theirs.ok()) << theirs.status();

  // A fresh memfd is already an empty ring; Create does not need zeroed memory.
  auto zeroed = TestRing::Attach(theirs->data(), bytes);
  ASSERT_TRUE(zeroed.ok()) << zeroed.status();
  EXPECT_TRUE((*zeroed)->empty());
  std::memset(mine->data(), 0xff, bytes);
  auto producer = TestRing::Create(mine->data(), bytes);
  ASSERT_TRUE(producer.ok()) << producer.status();
  auto consumer = TestRing::Attach(theirs->data(), bytes);
  ASSERT_TRUE(consumer.ok()) << consumer.status();
  ASSERT_NE(static_cast<void*>(*producer), static_cast<void*>(*consumer));
  EXPECT_TRUE((*consumer)->empty());

  ASSERT_TRUE((*producer)->TryPush(MakeRecord(0)).value());
  ASSERT_TRUE((*producer)->TryPush(MakeRecord(1)).value());
  EXPECT_EQ((*consumer)->size(), 2u);
  TestRecord r{};
  ASSERT_TRUE((*consumer)->TryPop(&r).value());
  EXPECT_TRUE(CheckRecord(r, 0).ok());
  EXPECT_EQ((*producer)->size(), 1u);
}

TEST(SpscRingTest, CreateRejectsBadMemory) {
  alignas(64) static unsigned char storage[sizeof(TestRing) + 64];
  auto misaligned = TestRing::Create(storage + 8, sizeof(TestRing));
  EXPECT_EQ(misaligned.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(misaligned.status().message()), HasSubstr("memory"));
  auto null = TestRing::Attach(nullptr, sizeof(TestRing));
  EXPECT_EQ(null.status().code(), absl::StatusCode::kInvalidArgument);
  auto short_size = TestRing::Attach(storage, sizeof(TestRing) - 1);
  EXPECT_EQ(short_size.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(short_size.status().message()), HasSubstr("size"));
  EXPECT_TRUE(TestRing::Create(storage, sizeof(TestRing)).ok());
}

TEST(SpscRingTest, StreamBetweenTwoThreadsLosesNothing) {
  auto ring = NewRing();
  auto bell = EventFd::Create();
  ASSERT_TRUE(bell.ok()) << bell.status();
  const absl::Time deadline = absl::Now() + absl::Minutes(2);
  absl::Status produced;
  std::thread producer([&] { produced = Produce(*ring, *bell, kStreamRecords, deadline); });
  const absl::Status consumed = Consume(*ring, *bell, kStreamRecords, deadline);
  producer.join();
  EXPECT_TRUE(produced.ok()) << produced;
  EXPECT_TRUE(consumed.ok()) << consumed;
  EXPECT_TRUE(ring->empty());
  EXPECT_EQ(ring->tail.load(), kStreamRecords);
}

// The ring alone, without the doorbell: both sides poll. Under -fsanitize=thread this checks the
// ring's own acquire/release pairs (the eventfd's read/write would otherwise order the threads).
TEST(SpscRingTest, PollingStreamBetweenTwoThreadsLosesNothing) {
  auto ring = NewRing();
  const absl::Time deadline = absl::Now() + absl::Minutes(2);
  absl::Status produced;
  std::thread producer([&] {
    for (uint64_t seq = 0; seq < kStreamRecords && produced.ok(); ++seq) {
      const TestRecord record = MakeRecord(seq);
      for (;;) {
        absl::StatusOr<bool> pushed = ring->TryPush(record);
        if (!pushed.ok() || *pushed) {
          produced = pushed.status();
          break;
        }
        if (absl::Now() >= deadline) {
          produced = absl::DeadlineExceededError("ring stayed full");
          break;
        }
        std::this_thread::yield();
      }
    }
  });
  absl::Status consumed;
  for (uint64_t expected = 0; expected < kStreamRecords && consumed.ok();) {
    TestRecord r{};
    absl::StatusOr<bool> popped = ring->TryPop(&r);
    if (!popped.ok()) {
      consumed = popped.status();
    } else if (*popped) {
      consumed = CheckRecord(r, expected++);
    } else if (absl::Now() >= deadline) {
      consumed = absl::DeadlineExceededError("ring stayed empty");
    } else {
      std::this_thread::yield();
    }
  }
  producer.join();
  EXPECT_TRUE(produced.ok()) << produced;
  EXPECT_TRUE(consumed.ok()) << consumed;
  EXPECT_TRUE(ring->empty());
}

// Kills and reaps a child that is still running when the test returns early.
class ChildGuard {
 public:
  explicit ChildGuard(pid_t pid) : pid_(pid) {}
  ~ChildGuard() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      testing::WaitChild(pid_);
    }
  }
  ChildGuard(const ChildGuard&) = delete;
  ChildGuard& operator=(const ChildGuard&) = delete;
  int Wait() { return testing::WaitChild(std::exchange(pid_, -1)); }

 private:
  pid_t pid_;
};

TEST(SpscRingTest, StreamBetweenTwoProcessesLosesNothing) {
  const size_t bytes = 2 * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  auto fd = CreateMemfd("ring-test", bytes);
  ASSERT_TRUE(fd.ok()) << fd.status();
  auto mapping = Mapping::Map(fd->get(), bytes, true);
  ASSERT_TRUE(mapping.ok()) << mapping.status();
  auto ring = TestRing::Create(mapping->data(), bytes);
  ASSERT_TRUE(ring.ok()) << ring.status();
  auto bell = EventFd::Create();
  ASSERT_TRUE(bell.ok()) << bell.status();
  const absl::Time deadline = absl::Now() + absl::Minutes(2);

  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Child: the producer. Maps the memfd itself (as a peer that received the fd would), and
    // leaves with _exit so nothing of the test framework runs twice.
    auto own = Mapping::Map(fd->get(), bytes, true);
    if (!own.ok()) ::_exit(1);
    auto peer_ring = TestRing::Attach(own->data(), bytes);
    if (!peer_ring.ok()) ::_exit(2);
    ::_exit(Produce(**peer_ring, *bell, kStreamRecords, deadline).ok() ? 0 : 3);
  }
  ChildGuard child(pid);
  const absl::Status consumed = Consume(**ring, *bell, kStreamRecords, deadline);
  EXPECT_TRUE(consumed.ok()) << consumed;
  if (!consumed.ok()) return;  // the guard kills the producer
  EXPECT_EQ(child.Wait(), 0);
  EXPECT_TRUE((*ring)->empty());
  EXPECT_EQ((*ring)->tail.load(), kStreamRecords);
}

TEST(SpscRingTest, PopWaitReturnsFalseAtDeadline) {
  auto ring = NewRing();
  auto bell = EventFd::Create();
  ASSERT_TRUE(bell.ok()) << bell.status();
  TestRecord r{};
  auto soon = PopWait(*ring, &r, *bell, absl::Now() + absl::Milliseconds(20));
  ASSERT_TRUE(soon.ok()) << soon.status();
  EXPECT_FALSE(*soon);
  auto past = PopWait(*ring, &r, *bell, absl::InfinitePast());
  ASSERT_TRUE(past.ok()) << past.status();
  EXPECT_FALSE(*past);

  // A queued record wins over an elapsed deadline (a past deadline still checks once).
  ASSERT_TRUE(ring->TryPush(MakeRecord(0)).value());
  auto queued = PopWait(*ring, &r, *bell, absl::InfinitePast());
  ASSERT_TRUE(queued.ok()) << queued.status();
  EXPECT_TRUE(*queued);
  EXPECT_TRUE(CheckRecord(r, 0).ok());
}

TEST(SpscRingTest, PopWaitIsAbortedFromAnotherThread) {
  auto ring = NewRing();
  auto bell = EventFd::Create();
  ASSERT_TRUE(bell.ok()) << bell.status();
  std::atomic<uint64_t> abort{0};
  absl::Status rung;
  std::thread aborter([&] {
    abort.store(7, std::memory_order_release);
    rung = bell->Signal();
  });
  TestRecord r{};
  auto popped = PopWait(*ring, &r, *bell, absl::InfiniteFuture(), &abort);
  aborter.join();
  ASSERT_TRUE(rung.ok()) << rung;
  EXPECT_EQ(popped.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(popped.status().message()), HasSubstr("code 7"));
}

TEST(SpscRingTest, PopWaitSeesAnAbortNobodyRang) {
  auto ring = NewRing();
  auto bell = EventFd::Create();
  ASSERT_TRUE(bell.ok()) << bell.status();
  std::atomic<uint64_t> abort{0};
  std::thread aborter([&] { abort.store(3, std::memory_order_release); });
  TestRecord r{};
  auto popped = PopWait(*ring, &r, *bell, absl::InfiniteFuture(), &abort);
  aborter.join();
  EXPECT_EQ(popped.status().code(), absl::StatusCode::kAborted);
}

TEST(SpscRingTest, PopWaitAbortWinsOverQueuedRecords) {
  auto ring = NewRing();
  auto bell = EventFd::Create();
  ASSERT_TRUE(bell.ok()) << bell.status();
  ASSERT_TRUE(ring->TryPush(MakeRecord(0)).value());
  std::atomic<uint64_t> abort{1};
  TestRecord r{};
  auto popped = PopWait(*ring, &r, *bell, absl::InfiniteFuture(), &abort);
  EXPECT_EQ(popped.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(ring->size(), 1u);
}

TEST(SpscRingTest, PopWaitReportsCorruptedRing) {
  auto ring = NewRing();
  auto bell = EventFd::Create();
  ASSERT_TRUE(bell.ok()) << bell.status();
  ring->tail.store(kSmallCapacity + 1);
  TestRecord r{};
  auto popped = PopWait(*ring, &r, *bell, absl::InfiniteFuture());
  EXPECT_EQ(popped.status().code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace ulysses::ipc

namespace ulysses::ipc {
namespace {

TEST(PushBackoffTest, DelaysDoubleFromTheMinimumToTheCap) {
  EXPECT_EQ(PushBackoffDelay(0), kPushBackoffMin);
  EXPECT_EQ(PushBackoffDelay(1), 2 * kPushBackoffMin);
  EXPECT_EQ(PushBackoffDelay(3), 8 * kPushBackoffMin);
  EXPECT_EQ(PushBackoffDelay(1000), kPushBackoffMax);
  for (int a = 1; a < 64; ++a) {
    EXPECT_GE(PushBackoffDelay(a), PushBackoffDelay(a - 1));
    EXPECT_LE(PushBackoffDelay(a), kPushBackoffMax);
  }
}

TEST(PushBackoffTest, PushesAtOnceWhenThereIsRoom) {
  auto ring = NewRing();
  std::atomic<uint64_t> waits{0};
  ASSERT_TRUE(PushBackoff(*ring, MakeRecord(0), nullptr, &waits).ok());
  EXPECT_EQ(waits.load(), 0u);
  EXPECT_EQ(ring->size(), 1u);
}

TEST(PushBackoffTest, AFullRingCostsFewWakeUpsUntilTheConsumerDrains) {
  auto ring = NewRing();
  for (uint32_t i = 0; i < TestRing::capacity(); ++i) ASSERT_TRUE(ring->TryPush(MakeRecord(i)).value());
  std::atomic<uint64_t> waits{0};
  absl::Status pushed;
  std::thread producer([&] { pushed = PushBackoff(*ring, MakeRecord(99), nullptr, &waits); });
  // Whatever the wall time, the producer slept with growing delays: from the 10th sleep on it
  // waits kPushBackoffMax each time. Drain once it has slept that often.
  while (waits.load() < 12) absl::SleepFor(absl::Milliseconds(1));
  TestRecord r{};
  ASSERT_TRUE(ring->TryPop(&r).value());
  producer.join();
  ASSERT_TRUE(pushed.ok()) << pushed;
  EXPECT_EQ(ring->size(), TestRing::capacity());
}

TEST(PushBackoffTest, AbortEndsTheWait) {
  auto ring = NewRing();
  for (uint32_t i = 0; i < TestRing::capacity(); ++i) ASSERT_TRUE(ring->TryPush(MakeRecord(i)).value());
  std::atomic<uint64_t> abort{0};
  absl::Status pushed;
  std::thread producer([&] { pushed = PushBackoff(*ring, MakeRecord(99), &abort); });
  abort.store(3, std::memory_order_release);
  producer.join();
  EXPECT_EQ(pushed.code(), absl::StatusCode::kAborted) << pushed;
}

}  // namespace
}  // namespace ulysses::ipc

namespace ulysses::ipc {
namespace {

CallDescriptor ValidDescriptor() {
  CallDescriptor d{};
  d.session_id = 7;
  d.epoch = 1;
  d.op = static_cast<uint32_t>(OpKind::kScatterHeads);
  d.num_inputs = 1;
  d.batch = 2;
  d.seq = 3;
  d.inputs[0].buffer_id = 11;
  d.inputs[0].offset_bytes = 64;
  d.inputs[0].strides[2] = 5;
  d.inputs[1].buffer_id = 12;  // past num_inputs: ignored
  d.out.buffer_id = 13;
  return d;
}

TEST(CallDescriptorTest, ConvertsTheFieldsItNames) {
  absl::StatusOr<CallArgs> a = CallArgsFromDescriptor(ValidDescriptor());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->op, OpKind::kScatterHeads);
  EXPECT_EQ(a->batch, 2);
  EXPECT_EQ(a->seq, 3);
  EXPECT_EQ(a->inputs[0].buffer_id, 11u);
  EXPECT_EQ(a->inputs[0].offset_bytes, 64u);
  EXPECT_EQ(a->inputs[0].strides[2], 5);
  EXPECT_FALSE(a->inputs[1].present());
  EXPECT_EQ(a->out.buffer_id, 13u);
}

TEST(CallDescriptorTest, EpochZeroOpAndInputCountAreRefusedByName) {
  CallDescriptor d = ValidDescriptor();
  d.epoch = 0;
  EXPECT_THAT(std::string(CallArgsFromDescriptor(d).status().message()), HasSubstr("epoch"));
  d = ValidDescriptor();
  d.op = 0;
  EXPECT_THAT(std::string(CallArgsFromDescriptor(d).status().message()), HasSubstr("op"));
  d.op = 1000;
  EXPECT_EQ(CallArgsFromDescriptor(d).status().code(), absl::StatusCode::kInvalidArgument);
  d = ValidDescriptor();
  d.num_inputs = 4;
  EXPECT_THAT(std::string(CallArgsFromDescriptor(d).status().message()), HasSubstr("num_inputs"));
}

TEST(CallDescriptorTest, FlagsAreKnownBitsAndReleasedInOrderNeedsStreamOrder) {
  CallDescriptor d = ValidDescriptor();
  d.flags = kDescriptorStreamOrdered | kDescriptorReleasedInOrder;
  EXPECT_TRUE(CallArgsFromDescriptor(d).ok());
  d.flags = kDescriptorReleasedInOrder;
  absl::Status st = CallArgsFromDescriptor(d).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("flags: released-in-order"));
  d.flags = 4;
  EXPECT_THAT(std::string(CallArgsFromDescriptor(d).status().message()),
              HasSubstr("flags: unknown bits 0x4"));
}

}  // namespace
}  // namespace ulysses::ipc
