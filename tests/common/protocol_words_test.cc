// The protocol-word report of a stream-ordered call that did not finish (docs/protocol.md
// section 9.3): its format, and the check tools make of it.
#include "ulysses/common/protocol_words.h"

#include "gtest/gtest.h"
#include "ulysses/common/session_layout.h"

namespace ulysses {
namespace {

TEST(ProtocolWords, TheReportNamesEveryWordAndEveryPeer) {
  SlotWordsReport r{1, 0, 1, 0, 0, 0, 0, {}};
  r.peers.push_back({0, 1, 0, 0, 0, 0});
  EXPECT_EQ(FormatSlotWords(r),
            "rank 1 slot 0 epoch 1: ready 0, released 0, cancel 0, done 0; from rank 0: grant 1, "
            "arrive 0; to rank 0: grant 0, arrive 0, its done 0");
  SlotWordsReport three{0, 3, 7, 7, 3, kUnblockEpoch, kUnblockEpoch + 5, {}};
  three.peers.push_back({1, 7, 7, 7, kUnblockEpoch, 7});
  three.peers.push_back({2, 6, 0, 7, 0, 6});
  EXPECT_EQ(FormatSlotWords(three),
            "rank 0 slot 3 epoch 7: ready 7, released 3, cancel unblock, done unblock; from rank "
            "1: grant 7, arrive 7; to rank 1: grant 7, arrive unblock, its done 7; from rank 2: "
            "grant 6, arrive 0; to rank 2: grant 7, arrive 0, its done 6");
}

TEST(ProtocolWords, ThePeersReportSaysWhoTookTheEpochAndWhyOneLeft) {
  EXPECT_EQ(FormatPeerProgress(5, {{1, true, 4, 0}}),
            "peers at epoch 5: rank 1 took it, completed 4");
  EXPECT_EQ(FormatPeerProgress(3, {{0, false, 2, 0},
                                   {2, true, 3, kAbortClosed},
                                   {3, false, 0, kAbortClientGone},
                                   {4, true, 2, kAbortCallFailed},
                                   {5, false, 1, 9},
                                   {6, false, 1, 0, true}}),
            "peers at epoch 3: rank 0 has not taken it, completed 2; rank 2 took it, completed 3, "
            "closed; rank 3 has not taken it, completed 0, client gone; rank 4 took it, completed "
            "2, call failed; rank 5 has not taken it, completed 1, abort 9; rank 6 has not taken "
            "it, completed 1, its daemon gone");
  EXPECT_EQ(FormatPeerProgress(1, {}), "peers at epoch 1:");
}

TEST(ProtocolWords, AReadyBelowTheEpochIsAClientThatNeverGotThere) {
  SlotWordsReport never{1, 0, 1, 0, 0, 0, 0, {}};
  SlotWordsReport behind{1, 0, 3, 1, 1, 0, 1, {}};  // wrote epoch 1's, not epoch 3's
  SlotWordsReport there{0, 0, 3, 3, 1, 0, 1, {}};
  SlotWordsReport cancelled{0, 0, 2, kUnblockEpoch, 0, 1, 0, {}};
  const std::string log = "2026-12-03T22:12:33.239 W [exec] pid=6882 session 14 epoch 1 slot 0 "
                          "did not finish; its protocol words: ";
  EXPECT_TRUE(ReportsReadyNotWritten(log + FormatSlotWords(never)));
  EXPECT_TRUE(ReportsReadyNotWritten(FormatSlotWords(behind)));
  EXPECT_FALSE(ReportsReadyNotWritten(log + FormatSlotWords(there)));
  EXPECT_FALSE(ReportsReadyNotWritten(FormatSlotWords(cancelled)));
  // Not a report at all, or a cut one.
  EXPECT_FALSE(ReportsReadyNotWritten("session 14 epoch 1 slot 0 did not finish"));
  EXPECT_FALSE(ReportsReadyNotWritten("rank 0 slot 0 epoch : ready 0,"));
  EXPECT_FALSE(ReportsReadyNotWritten(""));
}

}  // namespace
}  // namespace ulysses
