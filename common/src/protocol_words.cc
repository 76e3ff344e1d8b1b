#include "ulysses/common/protocol_words.h"

#include <charconv>

#include "ulysses/common/session_layout.h"
#include "ulysses/common/strings.h"

namespace ulysses {
namespace {

std::string Word(uint64_t v) { return v >= kUnblockEpoch ? std::string("unblock") : StrCat(v); }

// The number at `at` in `text`, or false when there is none (a word that reads "unblock").
bool NumberAt(std::string_view text, size_t at, uint64_t* out) {
  if (at > text.size()) return false;
  return std::from_chars(text.data() + at, text.data() + text.size(), *out).ec == std::errc();
}

}  // namespace

std::string FormatSlotWords(const SlotWordsReport& r) {
  std::string out = StrCat("rank ", r.rank, " slot ", r.slot, " epoch ", r.epoch, ": ready ",
                           Word(r.ready), ", released ", Word(r.released), ", cancel ",
                           Word(r.cancel), ", done ", Word(r.done));
  for (const SlotWordsReport::Peer& p : r.peers)
    out += StrCat("; from rank ", p.rank, ": grant ", Word(p.grant_from), ", arrive ",
                  Word(p.arrive_from), "; to rank ", p.rank, ": grant ", Word(p.grant_to),
                  ", arrive ", Word(p.arrive_to), ", its done ", Word(p.peer_done));
  return out;
}

std::string FormatPeerProgress(uint64_t epoch, const std::vector<PeerProgress>& peers) {
  std::string out = StrCat("peers at epoch ", epoch, ":");
  const char* sep = " ";
  for (const PeerProgress& p : peers) {
    out += StrCat(sep, "rank ", p.rank, p.took ? " took it" : " has not taken it", ", completed ",
                  p.completed);
    switch (p.abort) {
      case 0: break;
      case kAbortClosed: out += ", closed"; break;
      case kAbortClientGone: out += ", client gone"; break;
      case kAbortCallFailed: out += ", call failed"; break;
      default: out += StrCat(", abort ", p.abort); break;
    }
    if (p.daemon_gone) out += ", its daemon gone";
    sep = "; ";
  }
  return out;
}

bool ReportsReadyNotWritten(std::string_view text) {
  constexpr std::string_view kReady = ": ready ";
  for (size_t ready = text.find(kReady); ready != std::string_view::npos;
       ready = text.find(kReady, ready + 1)) {
    // The epoch ends where ": ready " starts: "... epoch E: ready R, ...".
    const size_t epoch_at = text.rfind(" epoch ", ready);
    uint64_t epoch = 0, written = 0;
    if (epoch_at == std::string_view::npos || !NumberAt(text, epoch_at + 7, &epoch) ||
        !NumberAt(text, ready + kReady.size(), &written))
      continue;
    if (written < epoch) return true;
  }
  return false;
}

}  // namespace ulysses
