// Fields that set a wait or are kept by the daemon are bounded before anything waits or is
// kept: a JoinGroup or CreateSession could ask for a rendezvous wait of 2^62 ms, and a member
// address of any length (up to the 4 MiB request) was stored and listed.
#include <cstdint>
#include <cstdio>
#include <string>

#include "hostile_client.h"

namespace ulysses::security {
namespace {

class RequestTest : public DaemonTest {
 protected:
  grpc::Status Join(const Attached& a, v1::JoinGroupRequest req, v1::GroupInfo* out) {
    grpc::ClientContext ctx;
    Authenticate(&ctx, a);
    return control_->JoinGroup(&ctx, req, out);
  }
  v1::JoinGroupRequest OneRank(const std::string& name) {
    v1::JoinGroupRequest req;
    req.set_name(name);
    req.set_world_size(1);
    req.set_rank(0);
    req.add_members(daemon_.socket());
    return req;
  }
};

TEST_F(RequestTest, RendezvousWaitsOverAnHourAreInvalidArgumentAndNothingWaits) {
  absl::StatusOr<Attached> a = Attach();
  ASSERT_TRUE(a.ok()) << a.status();
  v1::GroupInfo group;
  // Rank 1 of a group whose rank 0 nobody serves: the daemon would dial it and wait for it
  // to come up for as long as asked (before: past the client's 30 s deadline).
  for (int64_t ms : {int64_t{1} << 62, int64_t{3600} * 1000 + 1}) {
    v1::JoinGroupRequest req;
    req.set_name("g2");
    req.set_world_size(2);
    req.set_rank(1);
    req.add_members(dir_ + "/nobody.sock");
    req.add_members(daemon_.socket());
    req.set_timeout_ms(ms);
    const grpc::Status s = Join(*a, req, &group);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << ms << ": " << s.error_message();
    EXPECT_NE(s.error_message().find("timeout_ms"), std::string::npos) << s.error_message();
  }
  // An hour exactly is allowed; a one-rank group forms at once.
  v1::JoinGroupRequest ok = OneRank("g");
  ok.set_timeout_ms(int64_t{3600} * 1000);
  ASSERT_TRUE(Join(*a, ok, &group).ok());

  v1::CreateSessionRequest cs;
  cs.set_group_id(group.group_id());
  cs.mutable_spec()->set_num_heads(4);
  cs.mutable_spec()->set_head_dim(8);
  cs.mutable_spec()->set_dtype(v1::DTYPE_FLOAT16);
  cs.mutable_spec()->set_max_tokens(8);
  cs.set_timeout_ms(int64_t{1} << 62);
  grpc::ClientContext ctx;
  Authenticate(&ctx, *a);
  v1::SessionInfo info;
  const grpc::Status s = control_->CreateSession(&ctx, cs, &info);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("timeout_ms"), std::string::npos) << s.error_message();
  EXPECT_TRUE(Serving());
}

TEST_F(RequestTest, AMemberAddressLongerThanANameIsInvalidArgument) {
  absl::StatusOr<Attached> a = Attach();
  ASSERT_TRUE(a.ok()) << a.status();
  v1::JoinGroupRequest req;
  req.set_name("g");
  req.set_world_size(2);
  req.set_rank(1);
  req.add_members(daemon_.socket());
  req.add_members(std::string(1 << 20, 'm'));
  v1::GroupInfo group;
  const grpc::Status s = Join(*a, req, &group);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("members[1]"), std::string::npos) << s.error_message();
  EXPECT_TRUE(Serving());
}

// A client named any address as rank 0's, and the daemon dialled it: a listener on
// 127.0.0.1 received the HTTP/2 preface.
TEST_F(RequestTest, MembersAreNodeLocalDaemonSocketsOnly) {
  absl::StatusOr<Attached> a = Attach();
  ASSERT_TRUE(a.ok()) << a.status();
  for (const std::string& bad : {std::string("127.0.0.1:9"), std::string("dns:///example.org:80"),
                                 std::string("unix:relative.sock")}) {
    v1::JoinGroupRequest req;
    req.set_name("g3");
    req.set_world_size(2);
    req.set_rank(1);
    req.add_members(bad);
    req.add_members(daemon_.socket());
    v1::GroupInfo group;
    const grpc::Status s = Join(*a, req, &group);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad << ": " << s.error_message();
    EXPECT_NE(s.error_message().find("members[0]"), std::string::npos) << s.error_message();
  }
  // With a node config, only its daemons' sockets: restart with devices[] naming this one.
  const std::string config = dir_ + "/node.json";
  {
    std::FILE* f = std::fopen(config.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fprintf(f, "{\"devices\": [{\"index\": 0, \"socket\": \"%s\"}]}\n",
                 daemon_.socket().c_str());
    std::fclose(f);
  }
  const std::string socket = daemon_.socket();
  StartDaemon({"--config", config});
  ASSERT_EQ(daemon_.socket(), socket);
  a = Attach();
  ASSERT_TRUE(a.ok()) << a.status();
  v1::JoinGroupRequest other;
  other.set_name("g4");
  other.set_world_size(2);
  other.set_rank(1);
  other.add_members(dir_ + "/not-listed.sock");
  other.add_members(socket);
  v1::GroupInfo group;
  const grpc::Status s = Join(*a, other, &group);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("devices[]"), std::string::npos) << s.error_message();
  v1::JoinGroupRequest listed = OneRank("g5");
  listed.set_members(0, "unix://" + socket);
  EXPECT_TRUE(Join(*a, listed, &group).ok());
}

}  // namespace
}  // namespace ulysses::security
