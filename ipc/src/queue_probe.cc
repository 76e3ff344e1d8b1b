#include "ulysses/ipc/queue_probe.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <thread>

#include "absl/strings/str_cat.h"
#include "ulysses/common/status.h"

namespace ulysses::ipc {
namespace {

// Whether `word` reaches `mark` within `within`.
bool LandsWithin(const std::function<uint64_t()>& word, uint64_t mark,
                 std::chrono::steady_clock::duration within) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  for (;;) {
    if (word() >= mark) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// Whether stream j's word reaches `mark` within `within`.
bool LandsWithin(const QueueProbeTarget& target, int j, uint64_t mark,
                 std::chrono::steady_clock::duration within) {
  return LandsWithin([&] { return target.Word(j); }, mark, within);
}

}  // namespace

SettledWrites SettleWrites(const std::function<uint64_t(int)>& word,
                           const std::vector<int>& written, const std::vector<uint64_t>& want,
                           std::chrono::milliseconds settle) {
  // One settle time for them all: every write was enqueued before it started.
  const auto settled = std::chrono::steady_clock::now() + settle;
  std::vector<int> late;
  for (int j : written) {
    const auto left = std::max(std::chrono::steady_clock::duration::zero(),
                               settled - std::chrono::steady_clock::now());
    if (!LandsWithin([&] { return word(j); }, want[j], left)) late.push_back(j);
  }
  // Without the second look, a slow write would count as held: in the probe it would join its
  // stream to the held stream's class, and the rounds after would no longer hold it, so the
  // stream that really shares its queue could end up in another class.
  SettledWrites out;
  if (!late.empty()) std::this_thread::sleep_for(settle);
  for (int j : late) {
    if (word(j) >= want[j])
      ++out.slow;
    else
      out.held.push_back(j);
  }
  return out;
}

QueueClasses::QueueClasses(int streams) : parent_(static_cast<size_t>(streams)) {
  std::iota(parent_.begin(), parent_.end(), 0);
}

int QueueClasses::Root(int i) {
  while (parent_[i] != i) i = parent_[i] = parent_[parent_[i]];
  return i;
}

void QueueClasses::Join(int a, int b) {
  const int ra = Root(a), rb = Root(b);
  // The lower index is the root, so a class's root is its lowest stream.
  if (ra < rb)
    parent_[rb] = ra;
  else
    parent_[ra] = rb;
}

std::vector<std::vector<int>> QueueClasses::Classes() {
  std::vector<std::vector<int>> classes;
  std::vector<int> index_of(parent_.size(), -1);
  for (int i = 0; i < size(); ++i) {
    const int root = Root(i);
    if (index_of[root] < 0) {
      index_of[root] = static_cast<int>(classes.size());
      classes.emplace_back();
    }
    classes[index_of[root]].push_back(i);
  }
  return classes;
}

absl::StatusOr<QueueProbeResult> ProbeQueues(QueueProbeTarget& target,
                                             const QueueProbeOptions& options) {
  const int n = target.streams();
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t mark = 1;
  std::vector<uint64_t> want(n, mark);
  for (int j = 0; j < n; ++j) ULY_RETURN_IF_ERROR(target.Write(j, mark));
  for (int j = 0; j < n; ++j)
    if (!LandsWithin(target, j, mark, options.give_up))
      return absl::FailedPreconditionError(
          absl::StrCat("queue probe: stream ", j, " did not write its word within ",
                       options.give_up.count(), " ms"));
  QueueClasses classes(n);
  QueueProbeResult result;
  result.held_back.resize(n);
  uint64_t gate = 0;
  for (int i = 0; i < n; ++i) {
    // A stream already known to share its class's queue holds back what the class's lowest
    // stream held back.
    if (!options.every_stream && classes.Root(i) != i) continue;
    ++result.rounds;
    ULY_RETURN_IF_ERROR(target.Hold(i, ++gate));
    std::vector<int> written;
    absl::Status enqueued;
    for (int j = i + 1; j < n && enqueued.ok(); ++j) {
      // A stream already joined to an earlier class (held in an earlier round, which did not
      // hold i back) is on another queue than i.
      if (!options.every_stream && classes.Root(j) != j) continue;
      want[j] = ++mark;
      enqueued = target.Write(j, want[j]);
      if (enqueued.ok()) written.push_back(j);
    }
    const SettledWrites settled =
        SettleWrites([&](int j) { return target.Word(j); }, written, want, options.settle);
    result.slow_writes += settled.slow;
    for (int j : settled.held) {
      result.held_back[i].push_back(j);
      classes.Join(i, j);
    }
    target.Open(gate);
    ULY_RETURN_IF_ERROR(enqueued);
    for (int j : written)
      if (!LandsWithin(target, j, want[j], options.give_up))
        return absl::FailedPreconditionError(
            absl::StrCat("queue probe: stream ", j, " did not go on within ",
                         options.give_up.count(), " ms of stream ", i, "'s gate opening"));
  }
  // A last write per stream, landed: each stream is past its holds, and nothing enqueued by
  // the probe still reads or writes the target's words.
  ++mark;
  for (int j = 0; j < n; ++j) ULY_RETURN_IF_ERROR(target.Write(j, mark));
  for (int j = 0; j < n; ++j)
    if (!LandsWithin(target, j, mark, options.give_up))
      return absl::FailedPreconditionError(absl::StrCat(
          "queue probe: stream ", j, " did not write its last word within ",
          options.give_up.count(), " ms"));
  result.classes = classes.Classes();
  result.class_of.assign(n, -1);
  for (size_t c = 0; c < result.classes.size(); ++c)
    for (int s : result.classes[c]) result.class_of[s] = static_cast<int>(c);
  result.probe_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace ulysses::ipc
