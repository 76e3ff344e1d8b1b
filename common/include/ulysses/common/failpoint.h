// Failpoints: named points in the daemon where a test can hold one process at an exact step
// (one rank stopped between two stores of a call, say), which no timing can arrange. The
// environment variable ULYSSES_FAILPOINTS names them: "point=path[,point=path...]"; a thread
// that reaches `point` waits there until `path` exists (at most a minute). Unset, as in every
// deployment, a failpoint costs one load of a flag. docs/reliability.md lists the points.
#pragma once

#include <string_view>

namespace ulysses {

/// Holds the calling thread at `point` while ULYSSES_FAILPOINTS names it and its file does not
/// exist yet; returns at once otherwise.
void Failpoint(std::string_view point);

}  // namespace ulysses
