#include "ulysses/proto/fused_spec.h"

#include <algorithm>

namespace ulysses {
namespace {

FusedTensorRef WeightFromProto(const v1::WeightRef& w) {
  FusedTensorRef t;
  t.buffer_id = w.buffer_id();
  t.offset_bytes = w.offset_bytes();
  t.dtype = static_cast<DType>(w.dtype());
  t.rank = w.shape_size();
  for (int i = 0; i < std::min(t.rank, 4); ++i) t.shape[i] = w.shape(i);
  return t;
}

void WeightToProto(const FusedTensorRef& t, v1::WeightRef* w) {
  w->set_buffer_id(t.buffer_id);
  w->set_offset_bytes(t.offset_bytes);
  w->set_dtype(static_cast<v1::DType>(t.dtype));
  for (int i = 0; i < std::clamp(t.rank, 0, 4); ++i) w->add_shape(t.shape[i]);
}

}  // namespace

FusedSessionArgs FusedSessionFromProto(const v1::FusedSessionSpec& spec, int32_t world_size,
                                       int32_t rank) {
  FusedSessionArgs a;
  FusedGeometry& g = a.geometry;
  g.world_size = world_size;
  g.rank = rank;
  g.hidden = spec.hidden();
  g.num_heads = spec.num_heads();
  g.head_dim = spec.head_dim();
  g.dtype = spec.dtype() == v1::DTYPE_UNSPECIFIED ? DType::kBFloat16
                                                  : static_cast<DType>(spec.dtype());
  g.layout = static_cast<QkvLayout>(spec.layout());
  g.max_tokens = spec.max_tokens();
  g.num_slots = spec.num_slots() == 0 ? 2 : spec.num_slots();
  g.max_pos = spec.max_pos();
  a.path = static_cast<FusedPath>(spec.path());
  a.weights.w_qkv = WeightFromProto(spec.w_qkv());
  a.weights.q_norm = WeightFromProto(spec.q_norm());
  a.weights.k_norm = WeightFromProto(spec.k_norm());
  a.weights.cos_sin = WeightFromProto(spec.cos_sin());
  return a;
}

void FusedSessionToProto(const FusedSessionArgs& a, v1::FusedSessionSpec* spec) {
  const FusedGeometry& g = a.geometry;
  spec->set_hidden(g.hidden);
  spec->set_num_heads(g.num_heads);
  spec->set_head_dim(g.head_dim);
  spec->set_dtype(static_cast<v1::DType>(g.dtype));
  spec->set_layout(static_cast<v1::QkvLayout>(g.layout));
  spec->set_max_tokens(g.max_tokens);
  spec->set_num_slots(g.num_slots);
  spec->set_max_pos(g.max_pos);
  spec->set_path(static_cast<v1::FusedPath>(a.path));
  WeightToProto(a.weights.w_qkv, spec->mutable_w_qkv());
  WeightToProto(a.weights.q_norm, spec->mutable_q_norm());
  WeightToProto(a.weights.k_norm, spec->mutable_k_norm());
  WeightToProto(a.weights.cos_sin, spec->mutable_cos_sin());
}

}  // namespace ulysses
