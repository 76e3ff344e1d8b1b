// consumer_cpp SOCKET: the C++ API from an installed tree. A group of one and scatter_heads,
// which a group of one returns unchanged. Exit 0 when it holds.
#include <cstdio>
#include <cstring>

#include "ulysses/client/client.h"

namespace uc = ulysses::client;

int main(int argc, char** argv) {
  if (argc != 2) return 64;
  auto client = uc::Client::Connect({argv[1], "consumer_cpp"});
  if (!client.ok()) {
    std::fprintf(stderr, "FAIL connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  auto group = (*client)->JoinGroup({"consumer-cpp", 1, 0, {argv[1]}, "auto", 0});
  if (!group.ok()) return 1;
  auto session = (*client)->CreateSession(*group, {4, 5, ulysses::DType::kFloat32, 6, 2, {}, 0});
  auto buf = (*client)->AllocBuffer(120 * sizeof(float), "x");
  if (!session.ok() || !buf.ok()) return 1;
  auto* x = static_cast<float*>(buf->data);
  for (int i = 0; i < 120; ++i) x[i] = static_cast<float>(i) - 3.0f;
  auto r = (*session)->ScatterHeads(buf->Ref(), 2, 3);
  if (!r.ok() || r->bytes != 120 * sizeof(float) || std::memcmp(r->data, x, r->bytes) != 0) {
    std::fprintf(stderr, "FAIL scatter_heads: %s\n", r.status().ToString().c_str());
    return 1;
  }
  if (!r->Release().ok() || !(*client)->Close().ok()) return 1;
  std::printf("consumer_cpp: ok\n");
  return 0;
}
