// Pages of the Admin listings: the order, the tokens, and what a request may ask.
#include "pages.h"

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace ulysses::daemon {
namespace {

// Every page of `keys` (offered in the given order each time) at `size` a page.
std::vector<std::vector<PageKey>> AllPages(const std::vector<PageKey>& keys, int32_t size) {
  std::vector<std::vector<PageKey>> pages;
  std::string token;
  do {
    absl::StatusOr<PageRequest> r = ParsePageRequest(size, token);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) break;
    PageBuilder<PageKey> page(*r);
    for (const PageKey& k : keys) page.Offer(k, k);
    pages.push_back(page.Take(&token));
  } while (!token.empty() && pages.size() <= keys.size());
  return pages;
}

TEST(PageBuilder, PagesListEveryKeyOnceInOrderWhateverTheOrderOffered) {
  std::vector<PageKey> keys;
  for (uint64_t s = 1; s <= 9; ++s)
    for (uint64_t slot = 0; slot < 3; ++slot) keys.push_back({s * 7, slot});
  std::vector<PageKey> shuffled = keys;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(42));
  for (int32_t size : {1, 2, 4, 26, 27, 28, 1000}) {
    const auto pages = AllPages(shuffled, size);
    std::vector<PageKey> seen;
    for (size_t p = 0; p < pages.size(); ++p) {
      // Every page is full but the last, which is not empty.
      if (p + 1 < pages.size()) {
        EXPECT_EQ(pages[p].size(), static_cast<size_t>(size)) << size;
      } else {
        EXPECT_FALSE(pages[p].empty()) << size;
      }
      seen.insert(seen.end(), pages[p].begin(), pages[p].end());
    }
    EXPECT_EQ(seen, keys) << size;
  }
}

TEST(PageBuilder, AnEmptyListingIsOneEmptyPageWithoutToken) {
  const auto pages = AllPages({}, 5);
  ASSERT_EQ(pages.size(), 1u);
  EXPECT_TRUE(pages[0].empty());
}

TEST(PageBuilder, AKeyThatGoesBetweenPagesIsNotListedTwice) {
  absl::StatusOr<PageRequest> first = ParsePageRequest(2, "");
  ASSERT_TRUE(first.ok());
  PageBuilder<PageKey> p1(*first);
  for (uint64_t k : {5, 1, 3}) p1.Offer({k, 0}, {k, 0});
  std::string token;
  EXPECT_EQ(p1.Take(&token), (std::vector<PageKey>{{1, 0}, {3, 0}}));
  ASSERT_EQ(token, "3.0");
  // Key 1 went and key 2 came before the next page: neither is on it.
  absl::StatusOr<PageRequest> second = ParsePageRequest(2, token);
  ASSERT_TRUE(second.ok());
  PageBuilder<PageKey> p2(*second);
  EXPECT_FALSE(p2.Wants({2, 0}));
  EXPECT_FALSE(p2.Wants({3, 0}));
  for (uint64_t k : {2, 3, 5}) p2.Offer({k, 0}, {k, 0});
  EXPECT_EQ(p2.Take(&token), (std::vector<PageKey>{{5, 0}}));
  EXPECT_EQ(token, "");
}

TEST(PageBuilder, ItHoldsNoMoreThanOneEntryPastItsPage) {
  absl::StatusOr<PageRequest> r = ParsePageRequest(3, "");
  ASSERT_TRUE(r.ok());
  PageBuilder<PageKey> page(*r);
  for (uint64_t k = 100; k > 0; --k) page.Offer({k, 0}, {k, 0});
  // Once four entries are held, a larger key is not worth making.
  EXPECT_FALSE(page.Wants({50, 0}));
  EXPECT_TRUE(page.Wants({0, 0}));
  std::string token;
  EXPECT_EQ(page.Take(&token), (std::vector<PageKey>{{1, 0}, {2, 0}, {3, 0}}));
  EXPECT_EQ(token, "3.0");
}

TEST(PageBuilder, APageEndsBeforeItsBytesPassTheBound) {
  // Entries of 10 "bytes" each, 25 a page at most 45 bytes: 4 a page, never an empty one.
  auto ten = [](const PageKey&) { return size_t{10}; };
  std::vector<PageKey> seen;
  std::string token;
  int pages = 0;
  do {
    absl::StatusOr<PageRequest> r = ParsePageRequest(25, token);
    ASSERT_TRUE(r.ok());
    PageBuilder<PageKey> page(*r);
    for (uint64_t k = 0; k < 10; ++k) page.Offer({k, 0}, {k, 0});
    const std::vector<PageKey> got = page.Take(&token, ten, 45);
    EXPECT_EQ(got.size(), token.empty() ? 2u : 4u);
    seen.insert(seen.end(), got.begin(), got.end());
    ASSERT_LT(++pages, 10);
  } while (!token.empty());
  EXPECT_EQ(pages, 3);
  ASSERT_EQ(seen.size(), 10u);
  for (uint64_t k = 0; k < 10; ++k) EXPECT_EQ(seen[k], (PageKey{k, 0}));
  // An entry larger than the bound alone still makes a page.
  absl::StatusOr<PageRequest> r = ParsePageRequest(5, "");
  ASSERT_TRUE(r.ok());
  PageBuilder<PageKey> page(*r);
  page.Offer({1, 0}, {1, 0});
  page.Offer({2, 0}, {2, 0});
  EXPECT_EQ(page.Take(&token, ten, 5), (std::vector<PageKey>{{1, 0}}));
  EXPECT_EQ(token, "1.0");
}

TEST(ParsePageRequest, SizesAreDefaultedAndCapped) {
  EXPECT_EQ(ParsePageRequest(0, "")->size, static_cast<size_t>(PageRequest::kDefaultSize));
  EXPECT_EQ(ParsePageRequest(7, "")->size, 7u);
  EXPECT_EQ(ParsePageRequest(1 << 30, "")->size, static_cast<size_t>(PageRequest::kMaxSize));
  absl::StatusOr<PageRequest> negative = ParsePageRequest(-1, "");
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(negative.status().message().find("page_size"), std::string::npos);
}

TEST(ParsePageRequest, OnlyTokensOfOursAreTaken) {
  absl::StatusOr<PageRequest> ok = ParsePageRequest(0, "18446744073709551615.3");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_FALSE(ok->from_start);
  EXPECT_EQ(ok->after, (PageKey{18446744073709551615ull, 3}));
  EXPECT_EQ(PageToken(ok->after), "18446744073709551615.3");
  for (const char* bad : {"x", "3", ".3", "3.", "3.x", "+3.0", " 3.0", "3.0.0", "-1.0",
                          "18446744073709551616.0", "1.99999999999999999999999"}) {
    absl::StatusOr<PageRequest> r = ParsePageRequest(0, bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("page_token"), std::string::npos) << bad;
  }
}

}  // namespace
}  // namespace ulysses::daemon
