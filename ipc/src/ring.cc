#include "ulysses/ipc/ring.h"

#include <cstdint>
#include <limits>

#include "ulysses/common/strings.h"

namespace ulysses::ipc::ring_internal {

absl::Status CorruptPositions(const char* side, uint64_t head, uint64_t tail, uint64_t capacity) {
  return absl::DataLossError(ulysses::StrCat("ring: ", side, " found corrupted positions head ",
                                             head, " tail ", tail, " (capacity ", capacity, ")"));
}

absl::Status CheckRingMemory(const void* memory, size_t size, size_t need) {
  if (memory == nullptr || reinterpret_cast<uintptr_t>(memory) % kRingLineBytes != 0) {
    return absl::InvalidArgumentError(ulysses::StrCat(
        "memory: ring at ", memory, " must be non-null and ", kRingLineBytes, "-byte aligned"));
  }
  if (size < need) {
    return absl::InvalidArgumentError(
        ulysses::StrCat("size: ", size, " bytes cannot hold a ring of ", need, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status Aborted(uint64_t code) {
  return absl::AbortedError(ulysses::StrCat("ring: aborted (code ", code, ")"));
}

int DoorbellWaitMs(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  // Rounded up: a wait rounded down to 0 ms near the deadline would spin instead of sleeping.
  const int64_t ms = absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1)));
  return ms > kMaxDoorbellWaitMs ? kMaxDoorbellWaitMs : static_cast<int>(ms);
}

}  // namespace ulysses::ipc::ring_internal
