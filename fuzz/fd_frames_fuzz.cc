// The fd socket: bytes a client writes, delivered in pieces of sizes drawn from the input,
// through the daemon's frame reader (ipc::FrameReader over a real socket pair, the daemon's
// limits) and decoded as the daemon decodes them: the first frame as the hello, every later
// one as a descriptor frame. A decoded frame must encode back to itself.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <string>

#include "fuzz_util.h"
#include "ulysses/ipc/frames.h"
#include "ulysses/ipc/unix_socket.h"

using namespace ulysses;

namespace {

void CheckFrame(const std::string& payload, bool first) {
  if (first) {
    absl::StatusOr<ipc::HelloFrame> hello = ipc::DecodeHello(payload);
    if (!hello.ok()) return;
    absl::StatusOr<ipc::HelloFrame> again = ipc::DecodeHello(ipc::EncodeHello(*hello));
    if (!again.ok() || again->client_id != hello->client_id || again->token != hello->token)
      fuzz::Fail("a decoded hello does not encode back to itself");
  } else {
    absl::StatusOr<ipc::FdFrame> frame = ipc::DecodeFdFrame(payload);
    if (!frame.ok()) return;
    absl::StatusOr<ipc::FdFrame> again = ipc::DecodeFdFrame(ipc::EncodeFdFrame(*frame));
    if (!again.ok() || again->tag != frame->tag)
      fuzz::Fail("a decoded fd frame does not encode back to itself");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  // Half the inputs are one whole payload with a correct length prefix, so that the decoders
  // see well-framed JSON often; the others are raw stream bytes, prefixes included.
  const bool framed = in.ConsumeBool();
  const bool first_is_hello = in.ConsumeBool();
  std::string stream;
  if (framed) {
    const std::string payload = in.ConsumeRemainingBytesAsString();
    const uint32_t n = static_cast<uint32_t>(payload.size());
    stream.append(reinterpret_cast<const char*>(&n), sizeof n);
    stream += payload;
  } else {
    stream = in.ConsumeRemainingBytesAsString();
  }
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return 0;
  ipc::FrameReader reader(ipc::kMaxClientFrameBytes, /*max_fds=*/0);
  bool first = first_is_hello;
  // Pieces of 1..511 bytes, each sized by a byte of the stream itself.
  size_t at = 0;
  bool stop = false;
  for (size_t k = 0; at < stream.size() && !stop; ++k) {
    const size_t want = 1 + 2 * static_cast<uint8_t>(stream[k % stream.size()]);
    const size_t n = std::min(stream.size() - at, want);
    if (::write(sv[0], stream.data() + at, n) != static_cast<ssize_t>(n)) break;
    at += n;
    for (;;) {
      absl::StatusOr<bool> got = reader.Read(sv[1]);
      if (!got.ok()) {
        stop = true;  // an oversized frame: the daemon closes such a connection
        break;
      }
      if (!*got) break;
      ipc::ReceivedMessage m = reader.Take();
      if (!m.fds.empty()) fuzz::Fail("descriptors from a stream that carried none");
      CheckFrame(m.payload, first);
      first = false;
    }
  }
  ::close(sv[0]);
  ::close(sv[1]);
  return 0;
}
