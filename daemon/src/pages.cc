#include "pages.h"

#include <charconv>

#include "ulysses/common/strings.h"

namespace ulysses::daemon {
namespace {

// One part of a token: decimal digits only, within uint64_t.
bool ParsePart(std::string_view text, uint64_t* out) {
  if (text.empty() || text.size() > 20) return false;
  for (char ch : text)
    if (ch < '0' || ch > '9') return false;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size();
}

}  // namespace

absl::StatusOr<PageRequest> ParsePageRequest(int32_t page_size, std::string_view page_token) {
  if (page_size < 0)
    return absl::InvalidArgumentError(StrCat("page_size: ", page_size, " is negative"));
  PageRequest r;
  r.size = page_size == 0 ? PageRequest::kDefaultSize
                          : std::min(page_size, PageRequest::kMaxSize);
  if (page_token.empty()) return r;
  const size_t dot = page_token.find('.');
  if (dot == std::string_view::npos || !ParsePart(page_token.substr(0, dot), &r.after.first) ||
      !ParsePart(page_token.substr(dot + 1), &r.after.second))
    return absl::InvalidArgumentError(
        StrCat("page_token: '", page_token.substr(0, 64),
               "' is not a listing's next_page_token (leave it empty for the first page)"));
  r.from_start = false;
  return r;
}

std::string PageToken(const PageKey& key) { return StrCat(key.first, ".", key.second); }

}  // namespace ulysses::daemon
