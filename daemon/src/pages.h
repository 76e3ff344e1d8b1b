// Pages of the Admin listings. A listing is as long as what the clients hold (sessions, slots,
// groups), so it is answered a page at a time: the entries come in a fixed key order, and a
// page's token is the key of its last entry. Each page is built in memory of its own size,
// whatever the listing's length, from entries offered in any order.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace ulysses::daemon {

/// Where an entry stands in its listing's order (a second part, or 0, orders entries that
/// share the first).
using PageKey = std::pair<uint64_t, uint64_t>;

struct PageRequest {
  static constexpr int32_t kDefaultSize = 500;
  static constexpr int32_t kMaxSize = 1000;
  size_t size = kDefaultSize;
  bool from_start = true;
  PageKey after{0, 0};  // when not from_start: the previous page's last key
};

/// The page a request asks for. INVALID_ARGUMENT naming page_size when it is negative, or
/// page_token when it is not a token of ours.
absl::StatusOr<PageRequest> ParsePageRequest(int32_t page_size, std::string_view page_token);

/// The token of the page that follows the entry of `key`.
std::string PageToken(const PageKey& key);

/// Collects one page: the `size` smallest keys after the request's position, of those offered.
template <typename Entry>
class PageBuilder {
 public:
  explicit PageBuilder(const PageRequest& request) : request_(request) {
    heap_.reserve(request.size + 1);
  }

  /// Whether an entry of `key` may be on the page (so worth making).
  bool Wants(const PageKey& key) const {
    if (!request_.from_start && key <= request_.after) return false;
    return heap_.size() <= request_.size || key < heap_.front().first;
  }

  /// Offers an entry; kept only while it is among the page's `size` + 1 smallest (one more than
  /// the page, to know whether another page follows).
  void Offer(const PageKey& key, Entry entry) {
    if (!Wants(key)) return;
    heap_.emplace_back(key, std::move(entry));
    std::push_heap(heap_.begin(), heap_.end(), Less);
    if (heap_.size() > request_.size + 1) {
      std::pop_heap(heap_.begin(), heap_.end(), Less);
      heap_.pop_back();
    }
  }

  /// The page's entries in key order; `*next_token` is the next page's token, or empty when no
  /// entry was offered past this page. With `max_bytes` > 0 the page ends early, before the
  /// entry that would take it past `max_bytes` as `bytes(entry)` counts them (it keeps one
  /// entry at least), so that no answer outgrows what a client may receive.
  template <typename Bytes>
  std::vector<Entry> Take(std::string* next_token, Bytes bytes, size_t max_bytes) {
    std::sort_heap(heap_.begin(), heap_.end(), Less);
    bool more = heap_.size() > request_.size;
    if (more) heap_.pop_back();
    size_t keep = 0, total = 0;
    for (; keep < heap_.size(); ++keep) {
      const size_t b = max_bytes > 0 ? static_cast<size_t>(bytes(heap_[keep].second)) : 0;
      if (keep > 0 && max_bytes > 0 && total + b > max_bytes) break;
      total += b;
    }
    if (keep < heap_.size()) {
      heap_.resize(keep);
      more = true;
    }
    next_token->clear();
    if (more && !heap_.empty()) *next_token = PageToken(heap_.back().first);
    std::vector<Entry> out;
    out.reserve(heap_.size());
    for (auto& [key, entry] : heap_) out.push_back(std::move(entry));
    heap_.clear();
    return out;
  }
  std::vector<Entry> Take(std::string* next_token) {
    return Take(next_token, [](const Entry&) { return size_t{0}; }, 0);
  }

 private:
  static bool Less(const std::pair<PageKey, Entry>& a, const std::pair<PageKey, Entry>& b) {
    return a.first < b.first;
  }
  PageRequest request_;
  std::vector<std::pair<PageKey, Entry>> heap_;  // a max-heap on the key
};

}  // namespace ulysses::daemon
