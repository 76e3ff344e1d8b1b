// Conversion between absl::Status and grpc::Status at the service edge. Codes map one to one.
#pragma once

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace ulysses {

/// absl::Status -> grpc::Status (same code, same message).
grpc::Status ToGrpcStatus(const absl::Status& s);
/// grpc::Status -> absl::Status (same code, same message).
absl::Status FromGrpcStatus(const grpc::Status& s);

}  // namespace ulysses
