#include "ulysses/ipc/client_segment.h"

#include "absl/strings/str_cat.h"
#include "ulysses/common/strings.h"

namespace ulysses::ipc {
namespace {

OperandRef FromDescriptor(const OperandDescriptor& d) {
  OperandRef r;
  r.buffer_id = d.buffer_id;
  r.offset_bytes = d.offset_bytes;
  for (int i = 0; i < 4; ++i) r.strides[i] = d.strides[i];
  return r;
}

}  // namespace

absl::StatusOr<CallArgs> CallArgsFromDescriptor(const CallDescriptor& d) {
  if (d.epoch == 0)
    return absl::InvalidArgumentError(
        "epoch: 0 names no call (a session's first call is epoch 1)");
  if (d.op == 0 || d.op >= static_cast<uint32_t>(kNumOpKinds))
    return absl::InvalidArgumentError(StrCat("op: ", d.op, " is not an operation"));
  if (d.num_inputs > 3)
    return absl::InvalidArgumentError(StrCat("num_inputs: ", d.num_inputs, " exceeds 3"));
  if ((d.flags & ~(kDescriptorStreamOrdered | kDescriptorReleasedInOrder)) != 0)
    return absl::InvalidArgumentError(absl::StrCat("flags: unknown bits 0x", absl::Hex(d.flags)));
  if ((d.flags & kDescriptorReleasedInOrder) != 0 && (d.flags & kDescriptorStreamOrdered) == 0)
    return absl::InvalidArgumentError(
        "flags: released-in-order (2) needs stream-ordered (1): only a ready word on the stream "
        "can imply the release");
  CallArgs args;
  args.op = static_cast<OpKind>(d.op);
  args.batch = d.batch;
  args.seq = d.seq;
  args.head_offset = d.head_offset;
  args.head_count = d.head_count;
  for (uint32_t i = 0; i < d.num_inputs; ++i) args.inputs[i] = FromDescriptor(d.inputs[i]);
  args.out = FromDescriptor(d.out);
  return args;
}

}  // namespace ulysses::ipc
