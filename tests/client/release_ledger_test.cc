// The client's bookkeeping of stream releases (client/src/release_ledger.h): which ready word
// carries which release, and when a release must be a word after all.
#include "release_ledger.h"

#include "gtest/gtest.h"

namespace ulysses::client::internal {
namespace {

using Carry = ReleaseLedger::Carry;
using Give = ReleaseLedger::Give;

constexpr int kSlot = 1;
constexpr uint64_t kStreamA = 11, kStreamB = 22;

TEST(ReleaseLedger, AMarkOnTheSameStreamIsCarriedByItsOrder) {
  ReleaseLedger l;
  ASSERT_EQ(l.OnRelease(kSlot, 3, /*marks=*/true), Give::kMark);
  l.Released(kSlot, 3, kStreamA, /*written=*/false);
  EXPECT_EQ(l.OnCall(kSlot, 3, kStreamA), Carry::kSameStream);
}

TEST(ReleaseLedger, AMarkOnAnotherStreamIsCarriedAfterAWaitForIt) {
  ReleaseLedger l;
  l.Released(kSlot, 3, kStreamA, /*written=*/false);
  EXPECT_EQ(l.OnCall(kSlot, 3, kStreamB), Carry::kAfterMark);
}

TEST(ReleaseLedger, AnUnknownStreamIsNeverTakenForTheSameOne) {
  ReleaseLedger l;
  l.Released(kSlot, 3, /*stream_id=*/0, /*written=*/false);
  EXPECT_EQ(l.OnCall(kSlot, 3, /*stream_id=*/0), Carry::kAfterMark);
  l.Released(kSlot, 5, /*stream_id=*/0, /*written=*/true);
  EXPECT_EQ(l.OnCall(kSlot, 5, /*stream_id=*/0), Carry::kNo);
}

TEST(ReleaseLedger, AWordOnAnotherStreamIsWaitedForByTheDaemon) {
  ReleaseLedger l;
  l.Released(kSlot, 3, kStreamA, /*written=*/true);
  EXPECT_EQ(l.OnCall(kSlot, 3, kStreamA), Carry::kSameStream);
  EXPECT_EQ(l.OnCall(kSlot, 3, kStreamB), Carry::kNo);
}

TEST(ReleaseLedger, WithoutMarksEveryReleaseIsAWord) {
  ReleaseLedger l;
  EXPECT_EQ(l.OnRelease(kSlot, 3, /*marks=*/false), Give::kWord);
}

// The result dropped on another thread while the slot's next call is made: the call finds no
// release to carry, so its daemon waits for the word, and the release, coming after, writes it.
TEST(ReleaseLedger, AReleaseThatComesAfterTheNextCallIsAWord) {
  ReleaseLedger l;
  ASSERT_EQ(l.OnCall(kSlot, 3, kStreamA), Carry::kNo);
  EXPECT_EQ(l.OnRelease(kSlot, 3, /*marks=*/true), Give::kWord);
  l.Released(kSlot, 3, kStreamA, /*written=*/true);
  // The slot's later results are marked again.
  EXPECT_EQ(l.OnRelease(kSlot, 5, /*marks=*/true), Give::kMark);
  // Another slot is not affected.
  EXPECT_EQ(l.OnRelease(kSlot + 1, 3, /*marks=*/true), Give::kMark);
}

// A previous result that was never given back on a stream (copied to out=, say): nothing to
// carry, and the slot's next held result is marked as usual.
TEST(ReleaseLedger, AResultNeverReleasedOnAStreamLeavesLaterReleasesMarked) {
  ReleaseLedger l;
  l.Released(kSlot, 1, kStreamA, /*written=*/false);
  ASSERT_EQ(l.OnCall(kSlot, 3, kStreamA), Carry::kNo);  // epoch 3 went to out=
  EXPECT_EQ(l.OnRelease(kSlot, 5, /*marks=*/true), Give::kMark);
  l.Released(kSlot, 5, kStreamA, /*written=*/false);
  EXPECT_EQ(l.OnCall(kSlot, 5, kStreamA), Carry::kSameStream);
  // A stale claim for an older epoch carries nothing.
  EXPECT_EQ(l.OnCall(kSlot, 1, kStreamA), Carry::kNo);
}

}  // namespace
}  // namespace ulysses::client::internal
