// Conversion between the wire form of a fused session (ulysses.v1.FusedSessionSpec) and the
// common types its validation takes, shared by the client library and the daemon.
#pragma once

#include "ulysses/common/fused.h"
#include "ulysses/v1/types.pb.h"

namespace ulysses {

/// A fused session as the common validation sees it.
struct FusedSessionArgs {
  FusedGeometry geometry;  ///< world_size and rank come from the group, not the wire
  FusedPath path = FusedPath::kAuto;
  FusedWeightsArgs weights;
};

/// Reads `spec` for rank `rank` of a group of `world_size`. Total: values are checked later by
/// ValidateFusedGeometry and ValidateFusedWeights (a weight of more than 4 dimensions keeps its
/// rank and fails the shape check). num_slots 0 means 2, dtype UNSPECIFIED means bfloat16.
FusedSessionArgs FusedSessionFromProto(const v1::FusedSessionSpec& spec, int32_t world_size,
                                       int32_t rank);
/// Writes `args` into `spec` (every field, weights included).
void FusedSessionToProto(const FusedSessionArgs& args, v1::FusedSessionSpec* spec);

}  // namespace ulysses
