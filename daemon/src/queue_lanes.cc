#include "queue_lanes.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "ulysses/common/strings.h"

namespace ulysses::daemon {

QueueLanes::QueueLanes(const std::vector<ProbedStream>& probed, int rescue_queue, bool sharing,
                       MakeStream make)
    : probed_(true), sharing_(sharing), make_(std::move(make)) {
  std::map<int, size_t> lane_of;  // queue class -> index into lanes_
  std::set<int> seen{rescue_queue};
  for (const ProbedStream& s : probed) {
    seen.insert(s.queue);
    if (s.queue == rescue_queue) {
      surplus_.push_back(s.stream);
      continue;
    }
    auto [it, added] = lane_of.try_emplace(s.queue, lanes_.size());
    if (added) lanes_.emplace_back();
    lanes_[it->second].members.push_back(Member{s.stream, s.greatest});
  }
  queues_ = static_cast<int32_t>(seen.size());
}

QueueLanes::QueueLanes(MakeStream make) : make_(std::move(make)) {}

QueueLanes::Member* QueueLanes::Lane::Idle(bool greatest, bool any) {
  Member* other = nullptr;
  for (Member& m : members) {
    if (m.in_use) continue;
    if (m.greatest == greatest) return &m;
    if (other == nullptr) other = &m;
  }
  return any ? other : nullptr;
}

bool QueueLanes::Lane::InSetup() const {
  return std::any_of(members.begin(), members.end(), [](const Member& m) { return m.in_setup; });
}

QueueLanes::Member* QueueLanes::Hand(Member* m, bool in_lane) {
  m->in_use = true;
  m->in_setup = in_lane;
  if (!m->used) {
    m->used = true;
    ++streams_used_;
  }
  return m;
}

std::optional<void*> QueueLanes::TakeFreeLocked(StreamRole role) {
  const bool want_greatest = role == StreamRole::kSecond;
  if (!probed_) {
    // Made streams of the role's priority, the one given back last first (Give puts it in
    // front).
    Member* m = made_.Idle(want_greatest, false);
    if (m == nullptr) return std::nullopt;
    return Hand(m, false)->stream;
  }
  // The free lane given back last (a lane never taken counts as given back first), preferring
  // one with a stream of the role's priority.
  Lane* best = nullptr;
  bool best_matches = false;
  for (Lane& lane : lanes_) {
    if (lane.in_use > 0 || lane.retired) continue;
    const bool matches = lane.Idle(want_greatest, false) != nullptr;
    if (best == nullptr || (matches && !best_matches) ||
        (matches == best_matches && lane.given_back > best->given_back)) {
      best = &lane;
      best_matches = matches;
    }
  }
  if (best == nullptr) return std::nullopt;
  ++best->in_use;
  return Hand(best->Idle(want_greatest, true), true)->stream;
}

std::optional<void*> QueueLanes::TakeFree(StreamRole role) {
  std::lock_guard<std::mutex> lock(mu_);
  return TakeFreeLocked(role);
}

absl::StatusOr<void*> QueueLanes::Take(StreamRole role, void* apart) {
  const bool want_greatest = role == StreamRole::kSecond;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (std::optional<void*> s = TakeFreeLocked(role)) return *s;
    if (probed_) {
      if (!sharing_) {
        ++refused_;
        return absl::ResourceExhaustedError(StrCat(
            "every hardware queue the daemon found for sessions (", lanes_.size(),
            ") serves a session stream and queues.sharing is refuse: a stream on a shared "
            "queue would wait behind another session's waiting call; close a session, or "
            "start the daemon with more queues (queues.probe_streams probes that many streams; "
            "CUDA_DEVICE_MAX_CONNECTIONS sets how many queues the device gives them)"));
      }
      // A spare stream of the least used lane: it shares that lane's queue, never the rescue
      // stream's, nor `apart`'s; a lane with a session in its setup only when every other is.
      Lane* least = nullptr;
      auto before = [](const Lane& a, const Lane& b) {
        return std::make_pair(a.InSetup(), a.in_use) < std::make_pair(b.InSetup(), b.in_use);
      };
      for (Lane& lane : lanes_) {
        if (lane.retired || lane.Idle(want_greatest, true) == nullptr) continue;
        const bool holds_apart =
            apart != nullptr && std::any_of(lane.members.begin(), lane.members.end(),
                                            [&](const Member& m) { return m.stream == apart; });
        if (!holds_apart && (least == nullptr || before(lane, *least))) least = &lane;
      }
      if (least == nullptr) {
        ++refused_;
        return absl::ResourceExhaustedError(StrCat(
            "no stream the daemon probed at start is free for a ",
            role == StreamRole::kSecond ? "fused plan's second stream apart from its session's "
                                          "queue"
                                        : "session",
            " (queues.probe_streams sets how many are probed); a stream made now might share "
            "the rescue stream's hardware queue and hold back every cancel: close a session, "
            "or start the daemon with more probed streams"));
      }
      ++least->in_use;
      ++shared_;
      return Hand(least->Idle(want_greatest, true), true)->stream;
    }
  }
  absl::StatusOr<void*> made = make_(want_greatest);
  if (!made.ok()) return made.status();
  std::lock_guard<std::mutex> lock(mu_);
  made_.members.insert(made_.members.begin(), Member{*made, want_greatest});
  return Hand(&made_.members.front(), false)->stream;
}

std::pair<QueueLanes::Lane*, QueueLanes::Member*> QueueLanes::HandedLocked(void* stream) {
  for (Lane& lane : lanes_)
    for (Member& m : lane.members)
      if (m.stream == stream && m.in_use) return {&lane, &m};
  return {nullptr, nullptr};
}

void QueueLanes::Give(void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto [lane, m] = HandedLocked(stream); m != nullptr) {
    m->in_use = false;
    m->in_setup = false;
    if (--lane->in_use == 0) lane->given_back = ++order_;
    return;
  }
  for (auto it = made_.members.begin(); it != made_.members.end(); ++it) {
    if (it->stream != stream || !it->in_use) continue;
    // To the front: the one given back last serves the next take.
    Member m = *it;
    m.in_use = false;
    made_.members.erase(it);
    made_.members.insert(made_.members.begin(), m);
    return;
  }
}

void QueueLanes::SetupDone(void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Member* m = HandedLocked(stream).second) m->in_setup = false;
}

bool QueueLanes::Retire(void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto [lane, m] = HandedLocked(stream);
  if (m == nullptr) return false;
  m->in_setup = false;
  lane->retired = true;
  return true;
}

std::vector<void*> QueueLanes::AllStreams() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<void*> all;
  for (const Lane& lane : lanes_)
    for (const Member& m : lane.members) all.push_back(m.stream);
  for (const Member& m : made_.members) all.push_back(m.stream);
  return all;
}

QueueLaneCounts QueueLanes::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  QueueLaneCounts c;
  c.probed = probed_;
  c.queues = queues_;
  c.lanes = static_cast<int32_t>(lanes_.size());
  for (const Lane& lane : lanes_) c.lanes_in_use += lane.in_use > 0 ? 1 : 0;
  c.streams_used = streams_used_;
  c.shared_streams = shared_;
  c.refused = refused_;
  return c;
}

bool QueueLanes::Shared(void* stream) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Lane& lane : lanes_)
    for (const Member& m : lane.members)
      if (m.stream == stream) return lane.in_use - (m.in_use ? 1 : 0) > 0 || lane.retired;
  return true;
}

std::string QueueLanes::Where(void* stream) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < lanes_.size(); ++i) {
    for (const Member& m : lanes_[i].members) {
      if (m.stream != stream) continue;
      const int others = lanes_[i].in_use - (m.in_use ? 1 : 0);
      return StrCat("hardware queue ", i + 1, " of the ", lanes_.size(), " for sessions",
                    others == 0 ? ", its own"
                                : StrCat(", shared with ", others, " more stream",
                                         others == 1 ? "" : "s"));
    }
  }
  return "a stream made without the hardware queue probe";
}

std::string QueueLanes::Describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!probed_) return "hardware queues not probed: session streams are made as sessions come";
  int greatest = 0;
  for (const Lane& lane : lanes_)
    for (const Member& m : lane.members)
      if (m.greatest) {
        ++greatest;
        break;
      }
  return StrCat(queues_, " hardware queues found: one for the rescue stream, ", lanes_.size(),
                " for sessions (", greatest, " with a greatest-priority stream); past them ",
                sharing_ ? "a session shares the least used one (queues.sharing allow)"
                         : "sessions are refused (queues.sharing refuse)");
}

}  // namespace ulysses::daemon
