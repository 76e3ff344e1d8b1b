#include "queue_lanes.h"

#include <algorithm>
#include <map>

#include "ulysses/common/strings.h"

namespace ulysses::daemon {

QueueLanes::QueueLanes(const std::vector<ProbedStream>& probed, int rescue_queue, bool sharing,
                       MakeStream make)
    : probed_(true), sharing_(sharing), make_(std::move(make)) {
  std::map<int, size_t> lane_of;  // queue class -> index into lanes_
  std::map<int, bool> seen{{rescue_queue, true}};
  for (const ProbedStream& s : probed) {
    seen[s.queue] = true;
    if (s.queue == rescue_queue) {
      surplus_.push_back(s.stream);
      continue;
    }
    auto [it, made] = lane_of.try_emplace(s.queue, lanes_.size());
    if (made) lanes_.emplace_back();
    Lane& lane = lanes_[it->second];
    void*& keep = s.greatest ? lane.greatest : lane.normal;
    if (keep == nullptr)
      keep = s.stream;
    else
      surplus_.push_back(s.stream);
  }
  queues_ = static_cast<int32_t>(seen.size());
}

QueueLanes::QueueLanes(MakeStream make) : make_(std::move(make)) {}

std::optional<void*> QueueLanes::TakeFreeLocked(StreamRole role) {
  const bool want_greatest = role == StreamRole::kSecond;
  // The free lane given back last (a lane never taken counts as given back first), preferring
  // one with a stream of the role's priority.
  Lane* best = nullptr;
  bool best_matches = false;
  for (Lane& lane : lanes_) {
    if (lane.in_use != nullptr) continue;
    const bool matches = (want_greatest ? lane.greatest : lane.normal) != nullptr;
    if (best == nullptr || (matches && !best_matches) ||
        (matches == best_matches && lane.given_back > best->given_back)) {
      best = &lane;
      best_matches = matches;
    }
  }
  if (best == nullptr) return std::nullopt;
  void* s = best_matches ? (want_greatest ? best->greatest : best->normal)
                         : (want_greatest ? best->normal : best->greatest);
  best->in_use = s;
  if (!best->used) {
    best->used = true;
    ++streams_used_;
  }
  return s;
}

std::optional<void*> QueueLanes::TakeFree(StreamRole role) {
  std::lock_guard<std::mutex> lock(mu_);
  return TakeFreeLocked(role);
}

absl::StatusOr<void*> QueueLanes::Take(StreamRole role) {
  const bool want_greatest = role == StreamRole::kSecond;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (std::optional<void*> s = TakeFreeLocked(role)) return *s;
    if (!sharing_) {
      ++refused_;
      return absl::ResourceExhaustedError(StrCat(
          "every hardware queue of the device serves a session stream (", lanes_.size(),
          " lanes) and queues.sharing is refuse: a stream on a shared queue would wait behind "
          "another session's waiting call; close a session, or run the daemon with more "
          "queues (CUDA_DEVICE_MAX_CONNECTIONS)"));
    }
    // One made earlier past the lanes, of the role's priority if one is free.
    auto it = std::find_if(extra_idle_.begin(), extra_idle_.end(),
                           [&](const auto& e) { return e.second == want_greatest; });
    if (it == extra_idle_.end() && !extra_idle_.empty()) it = extra_idle_.begin();
    if (it != extra_idle_.end()) {
      void* s = it->first;
      extra_idle_.erase(it);
      return s;
    }
  }
  absl::StatusOr<void*> made = make_(want_greatest);
  if (!made.ok()) return made.status();
  std::lock_guard<std::mutex> lock(mu_);
  extra_all_.emplace_back(*made, want_greatest);
  ++streams_used_;
  return *made;
}

void QueueLanes::Give(void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  for (Lane& lane : lanes_) {
    if (lane.in_use == stream) {
      lane.in_use = nullptr;
      lane.given_back = ++order_;
      return;
    }
  }
  for (const auto& [s, greatest] : extra_all_) {
    if (s == stream) {
      extra_idle_.emplace_back(s, greatest);
      return;
    }
  }
}

std::vector<void*> QueueLanes::AllStreams() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<void*> all;
  for (const Lane& lane : lanes_)
    for (void* s : {lane.normal, lane.greatest})
      if (s != nullptr) all.push_back(s);
  for (const auto& e : extra_all_) all.push_back(e.first);
  return all;
}

QueueLaneCounts QueueLanes::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  QueueLaneCounts c;
  c.probed = probed_;
  c.queues = queues_;
  c.lanes = static_cast<int32_t>(lanes_.size());
  for (const Lane& lane : lanes_) c.lanes_in_use += lane.in_use != nullptr ? 1 : 0;
  c.streams_used = streams_used_;
  c.shared_streams = extra_all_.size();
  c.refused = refused_;
  return c;
}

std::string QueueLanes::Describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!probed_) return "hardware queues not probed: session streams are made as sessions come";
  int normal = 0, greatest = 0;
  for (const Lane& lane : lanes_) {
    normal += lane.normal != nullptr ? 1 : 0;
    greatest += lane.greatest != nullptr ? 1 : 0;
  }
  return StrCat(queues_, " hardware queues found: one for the rescue stream, ", lanes_.size(),
                " for sessions (", normal, " with a default-priority stream, ", greatest,
                " with a greatest-priority one); past them ",
                sharing_ ? "streams are made that may share a queue (queues.sharing allow)"
                         : "sessions are refused (queues.sharing refuse)");
}

}  // namespace ulysses::daemon
