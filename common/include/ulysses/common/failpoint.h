// Failpoints: named points in the daemon where a test can hold one process at an exact step
// (one rank stopped between two stores of a call, say), which no timing can arrange, or inject
// a condition no test can cause (a lost GPU). The environment variable ULYSSES_FAILPOINTS names
// them: "point=path[,point=path...]"; a thread that reaches `point` waits there until `path`
// exists (at most a minute), creating `path`.reached first so that the test knows it waits,
// and a fired point is one whose `path` exists. Unset, as in every
// deployment, a failpoint costs one load of a flag. docs/reliability.md lists the points.
#pragma once

#include <string_view>

namespace ulysses {

/// Holds the calling thread at `point` while ULYSSES_FAILPOINTS names it and its file does not
/// exist yet; returns at once otherwise.
void Failpoint(std::string_view point);

/// A condition a test injects: true once ULYSSES_FAILPOINTS names `point` and its file exists,
/// false otherwise (always where the variable is unset). Never waits.
bool FailpointFired(std::string_view point);

}  // namespace ulysses
