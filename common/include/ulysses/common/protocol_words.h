// The protocol words of one receive slot of a stream-ordered session (docs/protocol.md
// section 9), as a call that timed out or was ended by a peer reports them: one format,
// written by the daemon and read back by tools (the GPU bench names a client that never
// wrote its `ready` word).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ulysses {

struct SlotWordsReport {
  int rank = 0;
  int slot = 0;
  uint64_t epoch = 0;  ///< the call's epoch
  uint64_t ready = 0, released = 0;  ///< the client's words
  uint64_t cancel = 0, done = 0;     ///< this rank's
  struct Peer {
    int rank = 0;
    uint64_t grant_from = 0, arrive_from = 0;  ///< the peer's words in this rank's slot
    uint64_t grant_to = 0, arrive_to = 0;      ///< this rank's in the peer's slot
    uint64_t peer_done = 0;                    ///< the peer's `done`, as mapped here
  };
  std::vector<Peer> peers;
};

/// "rank R slot S epoch E: ready ., released ., cancel ., done .; from rank J: grant .,
/// arrive .; to rank J: grant ., arrive ., its done ." (one from/to part per peer). A value at
/// or above kUnblockEpoch (a cancel's) reads "unblock".
std::string FormatSlotWords(const SlotWordsReport& report);

/// Where a peer rank of a session stood at a call's epoch, as its session segment tells
/// (any stream-ordered backend; on nccl, where no daemon maps a peer's words, the only
/// view of the peers).
struct PeerProgress {
  int rank = 0;
  bool took = false;        ///< its daemon took the epoch (its call signature is there)
  uint64_t completed = 0;   ///< the last epoch it completed
  uint64_t abort = 0;       ///< its abort word (kAbortClosed, ...; 0: none)
  bool daemon_gone = false; ///< its daemon is gone (its words can no longer change)
};

/// "peers at epoch E: rank J took it, completed C; rank K has not taken it, completed C,
/// closed" (the abort word, when set, as closed / client gone / call failed / abort N; then
/// "its daemon gone" when it is).
std::string FormatPeerProgress(uint64_t epoch, const std::vector<PeerProgress>& peers);

/// Whether `text` (a log line, an error message) holds a report whose client had not written
/// `ready` for the call's epoch ("epoch E: ready R" with R < E).
bool ReportsReadyNotWritten(std::string_view text);

}  // namespace ulysses
