// Status helpers shared by every target. Fallible functions return absl::Status or
// absl::StatusOr<T>; no exception crosses a target boundary.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ulysses/common/strings.h"

#define ULY_CONCAT_INNER_(a, b) a##b
#define ULY_CONCAT_(a, b) ULY_CONCAT_INNER_(a, b)

/// Returns the status of `expr` from the enclosing function when it is not OK.
#define ULY_RETURN_IF_ERROR(expr)                         \
  do {                                                    \
    ::absl::Status uly_status_ = (expr);                  \
    if (!uly_status_.ok()) return uly_status_;            \
  } while (0)

#define ULY_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return std::move(tmp).status();   \
  lhs = std::move(tmp).value()

/// `ULY_ASSIGN_OR_RETURN(auto x, F())`: assigns the value of a StatusOr or returns its error.
#define ULY_ASSIGN_OR_RETURN(lhs, expr) \
  ULY_ASSIGN_OR_RETURN_IMPL_(ULY_CONCAT_(uly_statusor_, __COUNTER__), lhs, expr)

namespace ulysses {

/// Builds an INTERNAL status from errno for the failed system call `what`.
absl::Status ErrnoError(std::string_view what, int err);

}  // namespace ulysses
