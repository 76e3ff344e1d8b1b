// The sockets a daemon serves beside its control socket, named by suffix.
#pragma once

#include <string_view>

namespace ulysses {

/// The operator socket, `<socket>.admin`, mode 0600 (the daemon's uid, and root): Admin with
/// the calls that change the daemon's state (Drain, Undrain), which the control socket
/// refuses with PERMISSION_DENIED. The read-only Admin calls are served on both.
inline constexpr std::string_view kOperatorSocketSuffix = ".admin";

/// The node socket, `<socket>.node`, mode 0600 (the daemon's uid, and root): the Peer service,
/// which the node's daemons call on each other to form groups and sessions (a member address
/// names a daemon's control socket; its Peer is that path with this suffix). The control
/// socket refuses every Peer call with PERMISSION_DENIED.
inline constexpr std::string_view kNodeSocketSuffix = ".node";

}  // namespace ulysses
