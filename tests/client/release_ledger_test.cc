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

// Calls submitted before the results of the slot's earlier calls are taken (num_slots = 1:
// calls 1, 2 and 3, then result 1 taken and dropped): call 2 went without result 1's release,
// and so did call 3 without result 2's; each release, coming later, is a word.
TEST(ReleaseLedger, ReleasesOfResultsTakenAfterLaterCallsAreWords) {
  ReleaseLedger l;
  ASSERT_EQ(l.OnCall(kSlot, 1, kStreamA), Carry::kNo);  // call 2
  ASSERT_EQ(l.OnCall(kSlot, 2, kStreamA), Carry::kNo);  // call 3
  EXPECT_EQ(l.OnRelease(kSlot, 1, /*marks=*/true), Give::kWord);
  l.Released(kSlot, 1, kStreamA, /*written=*/true);
  EXPECT_EQ(l.OnRelease(kSlot, 2, /*marks=*/true), Give::kWord);
  l.Released(kSlot, 2, kStreamA, /*written=*/true);
  // Result 3, whose next call is not made yet, is marked.
  EXPECT_EQ(l.OnRelease(kSlot, 3, /*marks=*/true), Give::kMark);
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
