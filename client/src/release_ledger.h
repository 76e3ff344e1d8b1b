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

  /// How to give back `slot`'s result of `epoch`. kWord when `marks` is off, or when the call
  /// that needed the slot after this result was already made: it went without carrying this
  /// release (a carried release is recorded before its call), so its daemon waits for the
  /// word. That happens when results are taken after later calls were submitted, or dropped
  /// on another thread while the next call is made.
  Give OnRelease(int slot, uint64_t epoch, bool marks) const {
    if (!marks) return Give::kWord;
    auto c = called_.find(slot);
    return c != called_.end() && epoch <= c->second ? Give::kWord : Give::kMark;
  }

  /// Records the release of `slot`'s result of `epoch` on the stream with id `stream_id`
  /// (0: unknown), given back as a word (`written`) or a mark.
  void Released(int slot, uint64_t epoch, uint64_t stream_id, bool written) {
    last_[slot] = Last{epoch, stream_id, written};
  }

  /// Before the ready word of a call on the stream with id `stream_id` (0: unknown) whose slot
  /// held the result of `previous` last. Remembers that the slot's calls reached past
  /// `previous`: a release of it or of an earlier result that comes later is a word
  /// (OnRelease).
  Carry OnCall(int slot, uint64_t previous, uint64_t stream_id) {
    uint64_t& called = called_[slot];
    if (previous > called) called = previous;
    auto it = last_.find(slot);
    if (it == last_.end() || it->second.epoch != previous) return Carry::kNo;
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
  std::map<int, uint64_t> called_;    // per slot, the latest `previous` a call was made after
};

}  // namespace ulysses::client::internal
