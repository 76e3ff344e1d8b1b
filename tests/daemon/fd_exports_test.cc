// The peer fd socket (FdExports): what it lends and to whom, and that no connection holds its
// one thread. It used to read each request with a blocking wait of up to 2 s, one connection at
// a time, so a process of the daemons' uid that connected and sent nothing (or half a request)
// held every other daemon's fetch, and the watch that tells a session its peer died, for that
// long; twenty such connections outlasted a rendezvous.
#include "fd_exports.h"

#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/unix_socket.h"

namespace ulysses::daemon {
namespace {

class FdExportsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/uly-fdexp-XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    path_ = dir_ + "/d.sock.peer";
    ASSERT_TRUE(exports_.Start(path_).ok());
    ASSERT_TRUE(::pipe(pipe_) == 0);
  }
  void TearDown() override {
    exports_.Stop();
    ::close(pipe_[0]);
    ::close(pipe_[1]);
    ::unlink(path_.c_str());
    ::rmdir(dir_.c_str());
  }

  // The inode of `fd`, to tell that a fetched descriptor is the lent one.
  static ino_t Inode(int fd) {
    struct stat st {};
    EXPECT_EQ(::fstat(fd, &st), 0);
    return st.st_ino;
  }

  // A connection to the peer socket that has sent nothing.
  ipc::UniqueFd Connect() {
    absl::StatusOr<ipc::UniqueFd> c = ipc::ConnectUnix(path_);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : ipc::UniqueFd();
  }

  std::string dir_, path_;
  FdExports exports_;
  int pipe_[2] = {-1, -1};
};

TEST_F(FdExportsTest, AFetchWithTheTicketGetsTheLentDescriptor) {
  absl::StatusOr<ExportTicket> t = exports_.Lend(pipe_[0]);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->socket, path_);
  absl::StatusOr<ipc::UniqueFd> fd = FdExports::Fetch(*t, absl::Seconds(10));
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_EQ(Inode(fd->get()), Inode(pipe_[0]));
  // The ticket round-trips through its rendezvous text.
  absl::StatusOr<ExportTicket> back = DecodeTicket(EncodeTicket(*t));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->id, t->id);
  EXPECT_EQ(back->secret, t->secret);
  EXPECT_EQ(back->socket, t->socket);
}

TEST_F(FdExportsTest, AWrongSecretOrAWithdrawnExportGetsNoDescriptor) {
  absl::StatusOr<ExportTicket> t = exports_.Lend(pipe_[0]);
  ASSERT_TRUE(t.ok()) << t.status();
  ExportTicket forged = *t;
  forged.secret[0] = forged.secret[0] == '0' ? '1' : '0';
  absl::StatusOr<ipc::UniqueFd> fd = FdExports::Fetch(forged, absl::Seconds(10));
  ASSERT_FALSE(fd.ok());
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kFailedPrecondition) << fd.status();
  EXPECT_NE(std::string(fd.status().message()).find("no such export"), std::string::npos)
      << fd.status();
  exports_.Withdraw(t->id);
  EXPECT_EQ(exports_.size(), 0u);
  fd = FdExports::Fetch(*t, absl::Seconds(10));
  EXPECT_FALSE(fd.ok());
  // A malformed request is answered, not left hanging.
  ipc::UniqueFd raw = Connect();
  ASSERT_TRUE(ipc::SendMessage(raw.get(), R"({"id": "one"})").ok());
  absl::StatusOr<ipc::ReceivedMessage> m = ipc::RecvMessage(raw.get(), 512, 1);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_NE(m->payload.find("malformed request"), std::string::npos) << m->payload;
  EXPECT_TRUE(m->fds.empty());
}

// Twenty silent connections and twenty that sent half a request held the old loop for 2 s each
// (80 s): a fetch bounded by 10 s failed. Now each waits for its own bytes only.
TEST_F(FdExportsTest, SilentAndHalfSentConnectionsDoNotHoldAnotherFetch) {
  std::vector<ipc::UniqueFd> idle;
  for (int i = 0; i < 20; ++i) idle.push_back(Connect());
  for (int i = 0; i < 20; ++i) {
    ipc::UniqueFd c = Connect();
    const uint32_t len = 40;  // a frame header that promises bytes which never come
    ASSERT_EQ(::write(c.get(), &len, 2), 2);
    idle.push_back(std::move(c));
  }
  absl::StatusOr<ExportTicket> t = exports_.Lend(pipe_[0]);
  ASSERT_TRUE(t.ok()) << t.status();
  for (int k = 0; k < 3; ++k) {
    absl::StatusOr<ipc::UniqueFd> fd = FdExports::Fetch(*t, absl::Seconds(10));
    ASSERT_TRUE(fd.ok()) << "fetch " << k << ": " << fd.status();
    EXPECT_EQ(Inode(fd->get()), Inode(pipe_[0]));
  }
}

TEST_F(FdExportsTest, AConnectionThatNeverSendsItsRequestIsClosed) {
  ipc::UniqueFd c = Connect();
  // The server hangs up once its request time (2 s) has passed; wait well beyond it.
  pollfd p{c.get(), POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 60000), 1);
  char byte;
  EXPECT_EQ(::read(c.get(), &byte, 1), 0);  // end of stream: closed, nothing sent
}

TEST_F(FdExportsTest, ARequestOverTheSizeLimitIsRefusedByHangingUp) {
  ipc::UniqueFd c = Connect();
  ASSERT_TRUE(ipc::SendMessage(c.get(), std::string(4096, 'x')).ok());
  pollfd p{c.get(), POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 60000), 1);
  absl::StatusOr<ipc::ReceivedMessage> m = ipc::RecvMessage(c.get(), 512, 1);
  EXPECT_FALSE(m.ok());  // closed without an answer
}

TEST_F(FdExportsTest, AHeldFetchHangsUpWhenTheExportIsWithdrawn) {
  absl::StatusOr<ExportTicket> t = exports_.Lend(pipe_[0]);
  ASSERT_TRUE(t.ok()) << t.status();
  absl::StatusOr<FetchedExport> f = FdExports::FetchAndHold(*t, absl::Seconds(10));
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE(f->link.valid());
  EXPECT_EQ(Inode(f->fd.get()), Inode(pipe_[0]));
  pollfd p{f->link.get(), POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 0), 0);  // held open while lent
  exports_.Withdraw(t->id);
  ASSERT_EQ(::poll(&p, 1, 60000), 1);
  char byte;
  EXPECT_EQ(::read(f->link.get(), &byte, 1), 0);
}

TEST_F(FdExportsTest, AWatchedLinkThatHangsUpRunsItsCallbackOnceAndUnwatchIsIdempotent) {
  FdExports other;
  const std::string other_path = dir_ + "/e.sock.peer";
  ASSERT_TRUE(other.Start(other_path).ok());
  absl::StatusOr<ExportTicket> t = other.Lend(pipe_[1]);
  ASSERT_TRUE(t.ok()) << t.status();
  absl::StatusOr<FetchedExport> f = FdExports::FetchAndHold(*t, absl::Seconds(10));
  ASSERT_TRUE(f.ok()) << f.status();
  // Shared with the callback, so a late call after a failed wait touches nothing gone.
  struct Seen {
    std::atomic<int> lost{0};
    absl::Notification told;
  };
  auto seen = std::make_shared<Seen>();
  absl::StatusOr<uint64_t> w = exports_.Watch(std::move(f->link), [seen] {
    seen->lost.fetch_add(1);
    seen->told.Notify();
  });
  ASSERT_TRUE(w.ok()) << w.status();
  other.Stop();  // the exporting daemon goes: its held connections close
  ASSERT_TRUE(seen->told.WaitForNotificationWithTimeout(absl::Seconds(60)));
  exports_.Unwatch(*w);
  exports_.Unwatch(*w);
  EXPECT_EQ(seen->lost.load(), 1);
  ::unlink(other_path.c_str());
}

}  // namespace
}  // namespace ulysses::daemon
