// Peer.Rendezvous takes its fields from whoever reaches the control socket: each is bounded
// and checked before the daemon allocates anything, and no error leaves a partial entry.
#include <string>

#include "hostile_client.h"
#include "ulysses/v1/peer.grpc.pb.h"

namespace ulysses::security {
namespace {

class PeerTest : public DaemonTest {
 protected:
  void SetUp() override {
    DaemonTest::SetUp();
    peer_ = v1::Peer::NewStub(channel_);
  }

  grpc::Status Rendezvous(const std::string& key, int32_t world_size, int32_t rank,
                          const std::string& agreement = "a", const std::string& payload = "p",
                          int64_t timeout_ms = 2000) {
    v1::RendezvousRequest req;
    req.set_key(key);
    req.set_world_size(world_size);
    req.set_rank(rank);
    req.set_agreement(agreement);
    req.set_payload(payload);
    req.set_timeout_ms(timeout_ms);
    v1::RendezvousResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    return peer_->Rendezvous(&ctx, req, &resp);
  }

  // The key still works for an honest one-rank rendezvous: no half-built entry sits on it.
  void ExpectKeyUsable(const std::string& key) {
    grpc::Status s = Rendezvous(key, 1, 0);
    EXPECT_TRUE(s.ok()) << key << ": " << s.error_message();
  }

  std::unique_ptr<v1::Peer::Stub> peer_;
};

struct BadArrival {
  const char* name;
  int32_t world_size;
  int32_t rank;
  size_t agreement_bytes;
  size_t payload_bytes;
  int64_t timeout_ms;
  const char* field;
};

TEST_F(PeerTest, OutOfBoundFieldsAreInvalidArgumentAndLeaveNothingBehind) {
  const BadArrival cases[] = {
      {"ws-max", 2147483647, 0, 1, 1, 2000, "world_size"},
      {"ws-2^24", 1 << 24, 0, 1, 1, 2000, "world_size"},
      {"ws-65", 65, 0, 1, 1, 2000, "world_size"},
      {"ws-0", 0, 0, 1, 1, 2000, "world_size"},
      {"ws-neg", -4, 0, 1, 1, 2000, "world_size"},
      {"rank-neg", 2, -1, 1, 1, 2000, "rank"},
      {"rank-ws", 2, 2, 1, 1, 2000, "rank"},
      {"agreement", 2, 0, (64 << 10) + 1, 1, 2000, "agreement"},
      {"payload", 2, 0, 1, (64 << 10) + 1, 2000, "payload"},
      {"timeout", 2, 0, 1, 1, int64_t{1} << 62, "timeout_ms"},
  };
  for (const BadArrival& c : cases) {
    // Twice on one key: the second arrival must find the table as the first one left it.
    for (int round = 0; round < 2; ++round) {
      grpc::Status s = Rendezvous(c.name, c.world_size, c.rank, std::string(c.agreement_bytes, 'a'),
                                  std::string(c.payload_bytes, 'p'), c.timeout_ms);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.name;
      EXPECT_NE(s.error_message().find(c.field), std::string::npos)
          << c.name << ": " << s.error_message();
      ASSERT_TRUE(Serving()) << "daemon died on " << c.name;
    }
    ExpectKeyUsable(c.name);
  }
}

TEST_F(PeerTest, KeyAndReasonLengthsAreBounded) {
  grpc::Status s = Rendezvous(std::string(1025, 'k'), 1, 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("key"), std::string::npos) << s.error_message();
  EXPECT_EQ(Rendezvous("", 1, 0).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  v1::AbortRendezvousRequest req;
  req.set_key("k");
  req.set_reason(std::string(4097, 'r'));
  v1::AbortRendezvousResponse resp;
  grpc::ClientContext ctx;
  s = peer_->AbortRendezvous(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("reason"), std::string::npos) << s.error_message();
  ExpectKeyUsable(std::string(1024, 'k'));
}

TEST_F(PeerTest, AMismatchedWorldSizeFailsTheKeyForBothRanksWithoutIndexingPastIt) {
  // Rank 0 waits under a two-rank key; a rank claiming a 64-rank group at rank 63 arrives.
  std::thread first([&] {
    grpc::Status s = Rendezvous("mismatch", 2, 0, "a", "p", 10000);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  });
  grpc::Status s;
  // Retry until rank 0 is waiting (a lone rank 63 of 64 times out; the loop sees the verdict).
  ASSERT_TRUE(Eventually([&] {
    s = Rendezvous("mismatch", 64, 63, "a", "p", 200);
    return s.error_code() == grpc::StatusCode::INVALID_ARGUMENT;
  })) << s.error_message();
  EXPECT_NE(s.error_message().find("world_size mismatch"), std::string::npos) << s.error_message();
  first.join();
  ASSERT_TRUE(Serving());
}

}  // namespace
}  // namespace ulysses::security
