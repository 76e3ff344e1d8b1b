// The frames a client sends on its fd socket (docs/protocol.md, "The fd socket"): the hello
// that binds the connection to an attached client, and the frames that carry a descriptor for
// RegisterBuffer. Their bytes come from any process that can reach the socket, so decoding is
// typed checks into a Status: no exception, no assumption about the JSON types.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace ulysses::ipc {

/// Most payload bytes of one frame a client sends on the fd socket; a longer frame is refused
/// before its payload is read.
inline constexpr size_t kMaxClientFrameBytes = 4096;
/// Most bytes of the token a hello may carry (the daemon's tokens have 32).
inline constexpr size_t kMaxTokenBytes = 64;

/// The first frame on a client's fd socket: which attached client this connection is.
struct HelloFrame {
  uint64_t client_id = 0;  ///< from AttachResponse.client_id, > 0
  std::string token;       ///< from AttachResponse.token, 1..kMaxTokenBytes bytes
};

/// A frame of a bound client that carries one descriptor, claimed by RegisterBuffer(tag).
struct FdFrame {
  uint64_t tag = 0;  ///< the client's name for the descriptor, unique among its pending ones
};

/// Decodes a hello: a JSON object with "client_id" (an integer in [1, 2^64)) and "token" (a
/// string of 1..kMaxTokenBytes bytes); other keys are ignored. INVALID_ARGUMENT naming the
/// field otherwise (not JSON, not an object, a key missing or of the wrong type or range).
/// Never throws. Thread-safe.
absl::StatusOr<HelloFrame> DecodeHello(std::string_view payload);

/// Decodes a descriptor frame: a JSON object with "tag" (an integer in [0, 2^64)); other keys
/// are ignored. INVALID_ARGUMENT naming the field otherwise. Never throws. Thread-safe.
absl::StatusOr<FdFrame> DecodeFdFrame(std::string_view payload);

/// The payload of `hello` as DecodeHello reads it.
std::string EncodeHello(const HelloFrame& hello);
/// The payload of `frame` as DecodeFdFrame reads it.
std::string EncodeFdFrame(const FdFrame& frame);

}  // namespace ulysses::ipc
