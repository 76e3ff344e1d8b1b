// Matchers for absl::Status / absl::StatusOr in the common tests.
#pragma once

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"

namespace ulysses {

namespace testing_internal {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

class StatusIsMatcher {
 public:
  StatusIsMatcher(absl::StatusCode code, ::testing::Matcher<const std::string&> message)
      : code_(code), message_(std::move(message)) {}

  template <typename T>
  bool MatchAndExplain(const T& arg, ::testing::MatchResultListener* listener) const {
    const absl::Status& s = GetStatus(arg);
    const std::string message(s.message());
    *listener << "whose status is " << absl::StatusCodeToString(s.code()) << ": \"" << message
              << "\"";
    return s.code() == code_ && message_.Matches(message);
  }
  void DescribeTo(std::ostream* os) const {
    *os << "has status " << absl::StatusCodeToString(code_) << " with a message that ";
    message_.DescribeTo(os);
  }
  void DescribeNegationTo(std::ostream* os) const {
    *os << "does not have status " << absl::StatusCodeToString(code_)
        << " with a message that ";
    message_.DescribeTo(os);
  }

 private:
  absl::StatusCode code_;
  ::testing::Matcher<const std::string&> message_;
};

class IsOkMatcher {
 public:
  template <typename T>
  bool MatchAndExplain(const T& arg, ::testing::MatchResultListener* listener) const {
    const absl::Status& s = GetStatus(arg);
    *listener << "whose status is " << s.ToString();
    return s.ok();
  }
  void DescribeTo(std::ostream* os) const { *os << "is OK"; }
  void DescribeNegationTo(std::ostream* os) const { *os << "is not OK"; }
};

}  // namespace testing_internal

/// Matches a Status or StatusOr whose code is `code` and whose message matches `message`.
inline ::testing::PolymorphicMatcher<testing_internal::StatusIsMatcher> StatusIs(
    absl::StatusCode code, ::testing::Matcher<const std::string&> message) {
  return ::testing::MakePolymorphicMatcher(testing_internal::StatusIsMatcher(code, message));
}

/// Matches an OK Status or StatusOr.
inline ::testing::PolymorphicMatcher<testing_internal::IsOkMatcher> IsOk() {
  return ::testing::MakePolymorphicMatcher(testing_internal::IsOkMatcher());
}

/// Prints a StatusOr of a ulysses type by its status (found by argument-dependent lookup).
template <typename T>
void PrintTo(const absl::StatusOr<T>& s, std::ostream* os) {
  *os << (s.ok() ? std::string("OK (value)") : s.status().ToString());
}

}  // namespace ulysses
