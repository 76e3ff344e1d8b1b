// Per receive slot of a stream-ordered session: how its results were given back on streams,
// and whether a call's ready word carries the release of the slot's previous result
// (docs/protocol.md section 9.4). Bookkeeping only: the caller holds the lock, records the
// marks and writes the words.
#pragma once

#include <cstdint>
#include <map>

namespace ulysses::client::internal {

class ReleaseLedger {
 public:
  /// How a release is given back: a mark on the stream, carried by the slot's next ready word,
  /// or a release word the stream writes (which the daemon's stream waits for).
  enum class Give { kMark, kWord };
  /// What a call's ready word says of the release of its slot's previous result.
  enum class Carry {
    kNo,          ///< nothing: the daemon's stream waits for the release word if it needs one
    kSameStream,  ///< the release went on this stream before: the ready word follows it
    kAfterMark,   ///< marked on another stream: order this stream after the mark first
  };

  /// How to give back `slot`'s result of `epoch`. kWord when `marks` is off, or when the slot's
  /// next call already went without carrying this release: that call was made while the
  /// release was still on its way (the result dropped on another thread), and its daemon
  /// waits for the word.
  Give OnRelease(int slot, uint64_t epoch, bool marks) const {
    if (!marks) return Give::kWord;
    auto u = uncarried_.find(slot);
    return u != uncarried_.end() && u->second == epoch ? Give::kWord : Give::kMark;
  }

  /// Records the release of `slot`'s result of `epoch` on the stream with id `stream_id`
  /// (0: unknown), given back as a word (`written`) or a mark.
  void Released(int slot, uint64_t epoch, uint64_t stream_id, bool written) {
    last_[slot] = Last{epoch, stream_id, written};
    auto u = uncarried_.find(slot);
    if (u != uncarried_.end() && u->second == epoch) uncarried_.erase(u);
  }

  /// Before the ready word of a call on the stream with id `stream_id` (0: unknown) whose slot
  /// held the result of `previous` last. A release not recorded yet is remembered as not
  /// carried, so that it is written as a word when it comes (OnRelease).
  Carry OnCall(int slot, uint64_t previous, uint64_t stream_id) {
    auto it = last_.find(slot);
    if (it == last_.end() || it->second.epoch != previous) {
      uncarried_[slot] = previous;
      return Carry::kNo;
    }
    if (stream_id != 0 && it->second.stream_id == stream_id) return Carry::kSameStream;
    return it->second.written ? Carry::kNo : Carry::kAfterMark;
  }

 private:
  struct Last {
    uint64_t epoch = 0;
    uint64_t stream_id = 0;  // 0: unknown
    bool written = false;    // given back as a release word; else only marked
  };
  std::map<int, Last> last_;          // per slot, the last release on a stream
  std::map<int, uint64_t> uncarried_;  // per slot, a previous result a call went without
};

}  // namespace ulysses::client::internal
