// What a reclaimed client held (its sessions, buffers and groups) is let go on a thread of its
// own. Letting a GPU session go drains its stream, which may wait for as long as the drain
// limit of its cancel; the fd thread, which finds most dead clients, serves every client's
// fd socket and must not wait that long.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

namespace ulysses::daemon {

class Reaper {
 public:
  Reaper() = default;
  ~Reaper() { Stop(); }
  Reaper(const Reaper&) = delete;
  Reaper& operator=(const Reaper&) = delete;

  /// Starts the thread (its owner's start: the thread exists before any Post, and a failure
  /// to make it comes out there). Once.
  void Start() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!thread_.joinable() && !stopped_) thread_ = std::thread([this] { Run(); });
  }

  /// Drops `held` on the reaper's thread, after what was posted before it; without a thread
  /// (not started, or stopped), on the calling thread, at once.
  void Post(std::shared_ptr<void> held) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (thread_.joinable() && !stopped_) {
        queue_.push_back(std::move(held));
        cv_.notify_one();
        return;
      }
    }
    held.reset();
  }

  /// Drops everything posted, then ends the thread. Idempotent.
  void Stop() {
    std::thread thread;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
      cv_.notify_one();
      thread.swap(thread_);
    }
    if (thread.joinable()) thread.join();
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stopped_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopped, and nothing left
      std::shared_ptr<void> held = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      held.reset();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<void>> queue_;
  bool stopped_ = false;
  std::thread thread_;
};

}  // namespace ulysses::daemon
