// The string helpers the daemon's checks rely on.
#include "ulysses/common/strings.h"

#include <string>

#include "gtest/gtest.h"

namespace ulysses {
namespace {

TEST(EqualInConstantTime, IsEqualityOfTheBytes) {
  EXPECT_TRUE(EqualInConstantTime("", ""));
  EXPECT_TRUE(EqualInConstantTime("0123456789abcdef0123", "0123456789abcdef0123"));
  EXPECT_FALSE(EqualInConstantTime("0123456789abcdef0123", "0123456789abcdef0124"));
  EXPECT_FALSE(EqualInConstantTime("x123456789abcdef0123", "0123456789abcdef0123"));
  EXPECT_FALSE(EqualInConstantTime("abc", "abcd"));
  EXPECT_FALSE(EqualInConstantTime("abcd", ""));
  // Bytes that differ only in the high bit, and embedded NULs.
  EXPECT_FALSE(EqualInConstantTime(std::string("a\x80", 2), std::string("a\x00", 2)));
  EXPECT_TRUE(EqualInConstantTime(std::string("a\0b", 3), std::string("a\0b", 3)));
  EXPECT_FALSE(EqualInConstantTime(std::string("a\0b", 3), std::string("a\0c", 3)));
}

}  // namespace
}  // namespace ulysses
