/* consumer_c SOCKET: the C ABI from C. A group of one, scatter_heads of a buffer (which a
 * group of one returns unchanged), and the refusals a caller must get. Exit 0 when all hold. */
#include <stdio.h>
#include <string.h>

#include "ulysses/c_api.h"

static int failures = 0;
#define EXPECT(cond, what)                                              \
  do {                                                                  \
    if (!(cond)) {                                                      \
      fprintf(stderr, "FAIL %s (last error: %s)\n", what, uly_last_error()); \
      ++failures;                                                       \
    }                                                                   \
  } while (0)

static void Describe(uly_tensor* t, void* data) {
  memset(t, 0, sizeof *t);
  t->struct_size = sizeof *t;
  t->device_kind = ULY_DEVICE_HOST;
  t->dtype = ULY_DTYPE_FLOAT32;
  t->ndim = 4;
  t->data = data;
  t->shape[0] = 2; t->shape[1] = 3; t->shape[2] = 4; t->shape[3] = 5;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s SOCKET\n", argv[0]);
    return 64;
  }
  EXPECT(uly_abi_version() == ULY_ABI_VERSION, "abi version");

  uly_connect_options o;
  memset(&o, 0, sizeof o);
  o.struct_size = sizeof o;
  o.abi_version = (ULY_ABI_VERSION_MAJOR + 1) << 16;
  o.socket = argv[1];
  o.name = "consumer_c";
  uly_client* client = NULL;
  EXPECT(uly_connect(&o, &client) == ULY_FAILED_PRECONDITION, "another ABI major is refused");
  EXPECT(strstr(uly_last_error(), "abi_version") != NULL, "the refusal names abi_version");
  o.abi_version = ULY_ABI_VERSION;
  if (uly_connect(&o, &client) != ULY_OK) {
    fprintf(stderr, "FAIL connect: %s\n", uly_last_error());
    return 1;
  }

  const char* members[1] = {argv[1]};
  uly_group_spec gs;
  memset(&gs, 0, sizeof gs);
  gs.struct_size = sizeof gs;
  gs.world_size = 1;
  gs.num_members = 1;
  gs.name = "consumer";
  gs.members = members;
  uly_group* group = NULL;
  EXPECT(uly_join_group(client, &gs, &group) == ULY_OK, "join_group");

  uly_session_spec ss;
  memset(&ss, 0, sizeof ss);
  ss.struct_size = sizeof ss;
  ss.num_heads = 4;
  ss.head_dim = 5;
  ss.dtype = ULY_DTYPE_FLOAT32;
  ss.max_tokens = 6;
  uly_session* session = NULL;
  EXPECT(uly_session_create(client, group, &ss, &session) == ULY_OK, "session_create");

  uly_buffer* buf = NULL;
  EXPECT(uly_buffer_alloc(client, 120 * sizeof(float), "x", &buf) == ULY_OK, "buffer_alloc");
  if (failures) return 1;
  float* x = (float*)uly_buffer_data(buf);
  for (int i = 0; i < 120; ++i) x[i] = (float)i * 0.5f - 7.0f;

  uly_tensor t;
  Describe(&t, x);
  uly_call_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.op = ULY_OP_SCATTER_HEADS;
  a.inputs[0] = &t;
  uly_result* r = NULL;
  EXPECT(uly_session_call(session, &a, &r) == ULY_OK, "scatter_heads");
  uly_result_info info;
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  EXPECT(r != NULL && uly_result_get_info(r, &info) == ULY_OK, "result info");
  EXPECT(info.held == 1 && info.epoch == 1 && info.bytes == 120 * sizeof(float), "result holds");
  EXPECT(info.data != NULL && memcmp(info.data, x, 120 * sizeof(float)) == 0,
         "a group of one returns x");
  EXPECT(uly_result_release(r) == ULY_OK, "release");
  uly_result_free(r);

  /* A host-backend session takes neither CUDA tensors nor streams (a library without CUDA
   * refuses them as such); refused before anything is sent. */
  const uly_status no_device =
      uly_cuda_built() ? ULY_INVALID_ARGUMENT : ULY_FAILED_PRECONDITION;
  t.device_kind = ULY_DEVICE_CUDA;
  EXPECT(uly_session_call(session, &a, &r) == no_device, "CUDA tensors on the host backend");
  EXPECT(strncmp(uly_last_error(), "x: ", 3) == 0, "the refusal names x");
  EXPECT(strstr(uly_last_error(), uly_cuda_built() ? "host backend" : "without CUDA") != NULL,
         "the refusal says why");
  Describe(&t, x);
  a.stream = &t;
  EXPECT(uly_session_call(session, &a, &r) == no_device, "a stream on the host backend");
  EXPECT(strncmp(uly_last_error(), "stream: ", 8) == 0, "the refusal names stream");
  a.stream = NULL;
  t.shape[2] = 3;
  EXPECT(uly_session_call(session, &a, &r) == ULY_INVALID_ARGUMENT, "wrong shape");

  uly_session_free(session);
  uly_buffer_free(buf);
  uly_group_free(group);
  EXPECT(uly_client_close(client) == ULY_OK, "close");
  uly_client_free(client);
  if (failures) return 1;
  printf("consumer_c: ok\n");
  return 0;
}
