// ProbeQueues against a model of hardware queues: each stream maps to a queue, each queue runs
// its operations in the order they were enqueued, and a wait blocks its queue until the gate
// reaches it.
#include "ulysses/ipc/queue_probe.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <deque>
#include <map>
#include <set>

namespace ulysses::ipc {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class ModelQueues final : public QueueProbeTarget {
 public:
  // queue_of[s]: the queue of stream s; a queue index in `dead` never runs anything.
  explicit ModelQueues(std::vector<int> queue_of, std::set<int> dead = {})
      : queue_of_(std::move(queue_of)), dead_(std::move(dead)), words_(queue_of_.size(), 0) {}

  int streams() const override { return static_cast<int>(queue_of_.size()); }
  absl::Status Hold(int i, uint64_t gate) override { return Enqueue(i, true, gate); }
  absl::Status Write(int j, uint64_t mark) override {
    // The warm-up writes (mark 1) pass: the failure comes in a round, with a stream held.
    if (j == failing_write_ && mark > 1) return absl::InternalError("write refused");
    return Enqueue(j, false, mark);
  }
  uint64_t Word(int j) const override {
    Pump();
    return words_[j];
  }
  void Open(uint64_t gate) override {
    gate_ = gate;
    Pump();
  }

  int failing_write_ = -1;
  // Stream slow_write_'s write of mark slow_mark_ takes slow_by_ to land once its queue reaches
  // it (a busy device), holding its queue meanwhile.
  int slow_write_ = -1;
  uint64_t slow_mark_ = 0;
  std::chrono::milliseconds slow_by_{0};
  // Whether every queue ran everything enqueued on it.
  bool Drained() const {
    Pump();
    for (const auto& [q, ops] : queues_)
      if (!ops.empty()) return false;
    return true;
  }

 private:
  struct Op {
    int stream;
    bool wait;
    uint64_t value;
    std::chrono::steady_clock::time_point lands{};
  };
  absl::Status Enqueue(int s, bool wait, uint64_t value) {
    Op op{s, wait, value};
    if (!wait && s == slow_write_ && value == slow_mark_)
      op.lands = std::chrono::steady_clock::now() + slow_by_;
    queues_[queue_of_[s]].push_back(op);
    Pump();
    return absl::OkStatus();
  }
  void Pump() const {
    for (auto& [q, ops] : queues_) {
      if (dead_.count(q)) continue;
      while (!ops.empty()) {
        const Op& op = ops.front();
        if (op.wait && gate_ < op.value) break;
        if (!op.wait && std::chrono::steady_clock::now() < op.lands) break;
        if (!op.wait) words_[op.stream] = op.value;
        ops.pop_front();
      }
    }
  }

  std::vector<int> queue_of_;
  std::set<int> dead_;
  mutable std::vector<uint64_t> words_;
  mutable std::map<int, std::deque<Op>> queues_;
  uint64_t gate_ = 0;
};

QueueProbeOptions Fast() {
  QueueProbeOptions o;
  o.settle = std::chrono::milliseconds(2);
  o.give_up = std::chrono::milliseconds(50);
  return o;
}

TEST(QueueClassesTest, JoinsTransitivelyAndRootsAtTheLowestStream) {
  QueueClasses c(6);
  c.Join(4, 2);
  c.Join(5, 4);
  c.Join(3, 1);
  EXPECT_EQ(c.Root(5), 2);
  EXPECT_EQ(c.Root(3), 1);
  EXPECT_EQ(c.Root(0), 0);
  EXPECT_THAT(c.Classes(), ElementsAre(ElementsAre(0), ElementsAre(1, 3), ElementsAre(2, 4, 5)));
}

TEST(QueueProbeTest, FindsTheStreamsThatShareAQueue) {
  // Eight streams over three queues, as a driver handing queues out in turn would.
  ModelQueues model({0, 1, 2, 0, 1, 2, 0, 1});
  auto r = ProbeQueues(model, Fast());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->classes,
              ElementsAre(ElementsAre(0, 3, 6), ElementsAre(1, 4, 7), ElementsAre(2, 5)));
  EXPECT_THAT(r->class_of, ElementsAre(0, 1, 2, 0, 1, 2, 0, 1));
  // Only each class's lowest stream is held: as many rounds as queues.
  EXPECT_EQ(r->rounds, 3);
  EXPECT_THAT(r->held_back[0], ElementsAre(3, 6));
  EXPECT_TRUE(model.Drained()) << "the probe left work on a queue";
}

TEST(QueueProbeTest, EveryStreamModeReportsEveryPair) {
  ModelQueues model({0, 1, 0, 1, 0});
  QueueProbeOptions o = Fast();
  o.every_stream = true;
  auto r = ProbeQueues(model, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rounds, 5);
  EXPECT_THAT(r->held_back[0], ElementsAre(2, 4));
  EXPECT_THAT(r->held_back[1], ElementsAre(3));
  EXPECT_THAT(r->held_back[2], ElementsAre(4));
  EXPECT_TRUE(r->held_back[4].empty());
  EXPECT_THAT(r->classes, ElementsAre(ElementsAre(0, 2, 4), ElementsAre(1, 3)));
}

TEST(QueueProbeTest, ASlowWriteDoesNotJoinItsStreamToTheHeldOne) {
  // Streams 2 and 3 share a queue. In round 0 (stream 0 held), stream 3's write is slow: it
  // misses the settle time but lands before the gate opens. Were it taken as held, stream 3
  // would join stream 0's class and never be held again, and stream 2 would stay apart from it.
  // The slow write lands 60 ms after it is enqueued: 20 ms past the 40 ms settle time, and
  // 20 ms before the second look (margins for a loaded machine).
  ModelQueues model({0, 1, 2, 2});
  model.slow_write_ = 3;
  model.slow_mark_ = 4;  // the warm-up writes are mark 1; round 0 writes 2, 3, 4 to streams 1-3
  model.slow_by_ = std::chrono::milliseconds(60);
  QueueProbeOptions o = Fast();
  o.settle = std::chrono::milliseconds(40);
  o.give_up = std::chrono::milliseconds(500);
  auto r = ProbeQueues(model, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->classes, ElementsAre(ElementsAre(0), ElementsAre(1), ElementsAre(2, 3)));
  EXPECT_TRUE(r->held_back[0].empty());
  EXPECT_EQ(r->slow_writes, 1);
  EXPECT_TRUE(model.Drained());
}

TEST(QueueProbeTest, DistinctQueuesStayApart) {
  ModelQueues model({0, 1, 2, 3});
  auto r = ProbeQueues(model, Fast());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->classes.size(), 4u);
  EXPECT_EQ(r->rounds, 4);
}

TEST(QueueProbeTest, AStreamThatNeverRunsFailsTheProbeNamingIt) {
  ModelQueues model({0, 1, 2}, /*dead=*/{2});
  auto r = ProbeQueues(model, Fast());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("stream 2"));
}

TEST(QueueProbeTest, AFailedWriteStillOpensTheGate) {
  ModelQueues model({0, 0, 1});
  model.failing_write_ = 2;
  auto r = ProbeQueues(model, Fast());
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("write refused"));
  EXPECT_TRUE(model.Drained()) << "a held stream was left at its wait";
}

}  // namespace
}  // namespace ulysses::ipc
