// Where ulyssesctl finds the daemon, and how it tells "the daemon is not there" from "the
// daemon answered with an error".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "grpc/grpc.h"
#include "grpcpp/support/status.h"

namespace ulysses::ctl {

/// Socket used when neither --socket nor $ULYSSES_SOCKET names one.
inline constexpr std::string_view kDefaultSocket = "/run/ulysses/gpu0.sock";

/// The daemon's address in the forms ulyssesctl needs.
struct DaemonAddress {
  /// gRPC target: "unix://" + absolute path, or a "unix:..." target exactly as given.
  std::string target;
  /// What messages call the daemon: the absolute socket path, or the target as given.
  std::string display;
  /// Filesystem path of the socket (may be relative for "unix:rel"); empty for abstract
  /// sockets.
  std::string path;
};

/// The socket to use: `flag` when non-empty, else `env` (the value of $ULYSSES_SOCKET, may be
/// null) when non-empty, else kDefaultSocket.
std::string ChooseSocket(std::string_view flag, const char* env);

/// Address of a socket given as a path (relative paths are made absolute against the current
/// directory) or as a gRPC "unix:" / "unix-abstract:" target (kept as given).
DaemonAddress ResolveSocket(std::string_view socket);

/// True when a failed call means the daemon could not be reached, rather than that it
/// answered with an error: every DEADLINE_EXCEEDED (no answer in time), and UNAVAILABLE when
/// the channel is not connected after the call (a draining daemon answers UNAVAILABLE over a
/// READY channel).
bool IsUnreachable(grpc::StatusCode code, grpc_connectivity_state state_after_call);

/// One-line reason for an unreachable daemon: the socket file's problem when it has one (e.g.
/// "No such file or directory", "not a socket"), "no answer within N ms" for a deadline, else
/// the transport's error text.
std::string UnreachableReason(const DaemonAddress& address, const grpc::Status& status,
                              std::int64_t timeout_ms);

}  // namespace ulysses::ctl
