/* consumer_c SOCKET: the C ABI from C. A group of one, scatter_heads of a buffer (which a
 * group of one returns unchanged), a fused session whose V projection is the identity (so v
 * is x and q, k are zero), and the refusals a caller must get. Exit 0 when all hold. */
#include <stdint.h>
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

  /* The fused session (ABI 1.2): H = 4, D = 16, hidden 64, one weights buffer. */
  enum { kH = 4, kD = 16, kHidden = kH * kD, kS = 2, kMaxPos = 8 };
  const uint64_t w_bytes = 3 * kHidden * kHidden * 2, qn_off = w_bytes, kn_off = w_bytes + 32,
                 cs_off = w_bytes + 64, total = cs_off + kMaxPos * kD * 4;
  uly_buffer* wb = NULL;
  uly_buffer* xb = NULL;
  EXPECT(uly_buffer_alloc(client, total, "weights", &wb) == ULY_OK, "weights buffer");
  EXPECT(uly_buffer_alloc(client, 4096, "x", &xb) == ULY_OK, "x buffer");
  if (failures) return 1;
  uint8_t* wp = (uint8_t*)uly_buffer_data(wb);
  uint16_t* w = (uint16_t*)wp;
  for (int i = 0; i < kHidden; ++i) w[(2 * kHidden + i) * kHidden + i] = 0x3f80; /* V = I */
  for (int i = 0; i < kD; ++i) {
    ((uint16_t*)(wp + qn_off))[i] = 0x3f80;
    ((uint16_t*)(wp + kn_off))[i] = 0x3f80;
  }
  for (int p = 0; p < kMaxPos; ++p)
    for (int i = 0; i < kD / 2; ++i) ((float*)(wp + cs_off))[p * kD + i] = 1.0f;
  uint16_t* xs = (uint16_t*)uly_buffer_data(xb);
  for (int i = 0; i < kS * kHidden; ++i) xs[i] = (uint16_t)(0x3c00 + i);  /* small, exact */
  int32_t* pos = (int32_t*)((uint8_t*)uly_buffer_data(xb) + 1024);
  pos[0] = 0; pos[1] = 5;

  uly_tensor wt[4];
  const int64_t wshape[4][2] = {{3 * kHidden, kHidden}, {kD, 0}, {kD, 0}, {kMaxPos, kD}};
  const uint64_t woff[4] = {0, qn_off, kn_off, cs_off};
  for (int i = 0; i < 4; ++i) {
    memset(&wt[i], 0, sizeof wt[i]);
    wt[i].struct_size = sizeof wt[i];
    wt[i].device_kind = ULY_DEVICE_HOST;
    wt[i].dtype = i == 3 ? ULY_DTYPE_FLOAT32 : ULY_DTYPE_BFLOAT16;
    wt[i].ndim = wshape[i][1] ? 2 : 1;
    wt[i].buffer_id = uly_buffer_id(wb);
    wt[i].byte_offset = woff[i];
    wt[i].shape[0] = wshape[i][0];
    wt[i].shape[1] = wshape[i][1];
  }
  uly_fused_session_spec fs;
  memset(&fs, 0, sizeof fs);
  fs.struct_size = sizeof fs;
  fs.hidden = kHidden;
  fs.num_heads = kH;
  fs.head_dim = kD;
  fs.layout = ULY_QKV_LAYOUT_BSHD;
  fs.max_tokens = kS;
  fs.max_pos = kMaxPos;
  fs.w_qkv = &wt[0];
  fs.q_norm = &wt[1];
  fs.k_norm = &wt[2];
  fs.cos_sin = &wt[3];
  uly_session* fused = NULL;
  fs.layout = 0;
  EXPECT(uly_session_create_fused(client, group, &fs, &fused) == ULY_INVALID_ARGUMENT &&
             strncmp(uly_last_error(), "layout: ", 8) == 0, "a fused session needs a layout");
  fs.layout = ULY_QKV_LAYOUT_BSHD;
  EXPECT(uly_session_create_fused(client, group, &fs, &fused) == ULY_OK, "create_fused");

  uly_tensor xt, pt;
  memset(&xt, 0, sizeof xt);
  xt.struct_size = sizeof xt;
  xt.device_kind = ULY_DEVICE_HOST;
  xt.dtype = ULY_DTYPE_BFLOAT16;
  xt.ndim = 3;
  xt.data = xs;
  xt.shape[0] = 1; xt.shape[1] = kS; xt.shape[2] = kHidden;
  pt = xt;
  pt.dtype = ULY_DTYPE_INT32;
  pt.ndim = 2;
  pt.data = pos;
  pt.shape[2] = 0;
  uly_fused_call_args fa;
  memset(&fa, 0, sizeof fa);
  fa.struct_size = sizeof fa;
  fa.x = &xt;
  fa.positions = &pt;
  uly_result* qkv[ULY_MAX_FUSED_RESULTS] = {NULL, NULL, NULL};
  int32_t n = 0;
  EXPECT(uly_session_qkv_norm_rope_exchange(fused, &fa, qkv, &n) == ULY_OK && n == 3,
         "qkv_norm_rope_exchange gives q, k, v");
  uly_result_info qi, vi;
  memset(&qi, 0, sizeof qi);
  qi.struct_size = sizeof qi;
  vi = qi;
  EXPECT(n == 3 && uly_result_get_info(qkv[0], &qi) == ULY_OK &&
             uly_result_get_info(qkv[2], &vi) == ULY_OK, "fused result info");
  EXPECT(vi.shape[0] == 1 && vi.shape[1] == kS && vi.shape[2] == kH && vi.shape[3] == kD &&
             vi.bytes == kS * kHidden * 2 && vi.held == 1, "v is [1, S, H, D] and held");
  EXPECT(vi.data != NULL && memcmp(vi.data, xs, kS * kHidden * 2) == 0, "v = x (V = I)");
  int zero = qi.data != NULL;
  for (int i = 0; zero && i < kS * kHidden; ++i) zero = ((const uint16_t*)qi.data)[i] == 0;
  EXPECT(zero, "q = 0 (Q = 0)");
  uly_result_free(qkv[0]);  /* the others still hold the slot */
  EXPECT(uly_result_get_info(qkv[2], &vi) == ULY_OK && vi.held == 1, "v holds after q's free");
  EXPECT(uly_result_release(qkv[1]) == ULY_OK, "release k");
  EXPECT(uly_result_get_info(qkv[2], &vi) == ULY_OK && vi.held == 0 && vi.data == NULL,
         "releasing k released v");
  uly_result_free(qkv[1]);
  uly_result_free(qkv[2]);
  pt.dtype = ULY_DTYPE_FLOAT32;
  EXPECT(uly_session_qkv_norm_rope_exchange(fused, &fa, qkv, &n) == ULY_INVALID_ARGUMENT &&
             strncmp(uly_last_error(), "positions: dtype", 16) == 0, "positions must be int32");
  pt.dtype = ULY_DTYPE_INT32;
  EXPECT(uly_session_qkv_norm_rope_exchange(session, &fa, qkv, &n) == ULY_INVALID_ARGUMENT,
         "a head-exchange session has no fused call");
  const char* text = NULL;
  EXPECT(uly_session_describe(fused, &text) == ULY_OK && text != NULL && text[0] != '\0',
         "describe");
  uly_session_free(fused);
  uly_buffer_free(xb);
  uly_buffer_free(wb);

  uly_session_free(session);
  uly_buffer_free(buf);
  uly_group_free(group);
  EXPECT(uly_client_close(client) == ULY_OK, "close");
  uly_client_free(client);
  if (failures) return 1;
  printf("consumer_c: ok\n");
  return 0;
}
