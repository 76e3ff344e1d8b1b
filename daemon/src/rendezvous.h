// Group rendezvous between daemons: an all-gather of one payload per rank under a key, with the
// same verdict (success, mismatch, timeout, abort) on every rank. Rank 0's daemon hosts the
// table; the others reach it through the Peer service at the group's member address, which is
// a unix socket on one node and may be a TCP address across nodes.
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "ulysses/v1/peer.grpc.pb.h"

namespace ulysses::daemon {

/// Server side: the meeting point of the ranks of one collective step. Thread-safe.
class RendezvousTable {
 public:
  /// Blocks until all `world_size` ranks arrived under `key`, the deadline passes, or the key
  /// is aborted. Returns every rank's payload in rank order. Agreement strings must be equal.
  absl::StatusOr<std::vector<std::string>> Arrive(const std::string& key, int world_size,
                                                  int rank, const std::string& agreement,
                                                  const std::string& payload,
                                                  absl::Time deadline);
  /// Fails the key for every waiting (and later arriving) rank with ABORTED.
  void Abort(const std::string& key, const std::string& reason);
  /// Number of keys with ranks waiting (for tests and state).
  size_t pending() const;

 private:
  struct Entry {
    int world_size = 0;
    std::vector<std::optional<std::string>> payloads;
    std::vector<std::string> agreements;
    int arrived = 0;
    int leaving = 0;  // ranks that have returned once the entry finished
    bool finished = false;
    absl::Status verdict;
  };
  void Finish(Entry& e, absl::Status verdict);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::shared_ptr<Entry>> entries_;
};

/// Client side: reaches rank 0's Peer service. Channels are cached per address. Thread-safe.
class RendezvousClient {
 public:
  absl::StatusOr<std::vector<std::string>> Rendezvous(const std::string& address,
                                                      const std::string& key, int world_size,
                                                      int rank, const std::string& agreement,
                                                      const std::string& payload,
                                                      absl::Duration timeout);

 private:
  std::shared_ptr<grpc::Channel> ChannelFor(const std::string& address);
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_;
};

/// Turns a member address ("unix:///p", "unix:/p", "/p" or "host:port") into a gRPC target.
std::string GrpcTarget(const std::string& address);

}  // namespace ulysses::daemon
