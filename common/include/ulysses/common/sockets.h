// The sockets a daemon serves beside its control socket, named by suffix.
#pragma once

#include <string_view>

namespace ulysses {

/// The operator socket, `<socket>.admin`, mode 0600 (the daemon's uid, and root): Admin with
/// the calls that change the daemon's state (Drain, Undrain), which the control socket
/// refuses with PERMISSION_DENIED. The read-only Admin calls are served on both.
inline constexpr std::string_view kOperatorSocketSuffix = ".admin";

}  // namespace ulysses
