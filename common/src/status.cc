#include "ulysses/common/status.h"

#include <cstring>

namespace ulysses {

absl::Status ErrnoError(std::string_view what, int err) {
  std::string text = StrCat(what, ": ", std::strerror(err), " (errno ", err, ")");
  switch (err) {
    case ENOENT: return absl::NotFoundError(text);
    case EACCES:
    case EPERM: return absl::PermissionDeniedError(text);
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE: return absl::ResourceExhaustedError(text);
    case ETIMEDOUT: return absl::DeadlineExceededError(text);
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE: return absl::UnavailableError(text);
    default: return absl::InternalError(text);
  }
}

}  // namespace ulysses
