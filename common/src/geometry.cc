#include "ulysses/common/geometry.h"

#include <numeric>

#include <cctype>
#include "ulysses/common/strings.h"


namespace ulysses {
namespace {

std::string JoinInts(const std::vector<int32_t>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + std::to_string(v[i]);
  return out;
}

}  // namespace

int32_t ItemSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat32: return 4;
    default: return 0;
  }
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    default: return "unspecified";
  }
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  std::string n(name);
  for (char& ch : n) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (n == "float16" || n == "fp16" || n == "half") return DType::kFloat16;
  if (n == "bfloat16" || n == "bf16") return DType::kBFloat16;
  if (n == "float32" || n == "fp32" || n == "float") return DType::kFloat32;
  return absl::InvalidArgumentError(
      StrCat("dtype: '", name, "' is not one of float16, bfloat16, float32"));
}

namespace {

// The op set, indexed by OpKind value. docs/api.md section 2 gives each op's semantics.
constexpr OpTraits kOps[kNumOpKinds] = {
    {},
    {.op = OpKind::kScatterHeads, .name = "scatter_heads", .inputs = {"x"}, .num_inputs = 1},
    {.op = OpKind::kGatherHeads, .name = "gather_heads", .inputs = {"y"}, .num_inputs = 1,
     .input_global = true},
    {.op = OpKind::kScatterQkvHeadChunk, .name = "scatter_qkv_head_chunk",
     .inputs = {"q", "k", "v"}, .num_inputs = 3, .head_chunk = true, .width = 3},
    {.op = OpKind::kGatherOutputHeadChunk, .name = "gather_output_head_chunk", .inputs = {"x"},
     .num_inputs = 1, .head_chunk = true, .input_global = true, .merges_into_out = true},
    {.op = OpKind::kQkvNormRopeExchange, .name = "qkv_norm_rope_exchange",
     .inputs = {"x", "positions"}, .num_inputs = 2, .fused = true},
};

}  // namespace

const OpTraits& Traits(OpKind op) {
  const auto i = static_cast<int32_t>(op);
  return i > 0 && i < kNumOpKinds ? kOps[i] : kOps[0];
}

bool IsHeadExchangeOp(OpKind op) {
  const OpTraits& t = Traits(op);
  return t.op != OpKind::kUnspecified && !t.fused;
}

std::string_view OpName(OpKind op) { return Traits(op).name; }

std::string_view SessionKindName(SessionKind kind) {
  return kind == SessionKind::kQkvNormRopeExchange ? "qkv_norm_rope_exchange" : "head_exchange";
}

int64_t SessionGeometry::SlotElems() const {
  // Largest result: scatter_qkv_head_chunk with the whole band, [B, W*S_l, H_l, 3D], which is
  // 3 * (B*S_l) * H * D; every other op's result (or staging) fits in a third of it.
  return 3 * max_tokens * static_cast<int64_t>(num_heads) * head_dim;
}

std::vector<int32_t> SessionGeometry::ScheduleOffsets() const {
  std::vector<int32_t> offsets(schedule.size());
  int32_t acc = 0;
  for (size_t i = 0; i < schedule.size(); ++i) {
    offsets[i] = acc;
    acc += schedule[i];
  }
  return offsets;
}

absl::Status ValidateSessionGeometry(const SessionGeometry& g) {
  if (g.world_size < 1 || g.world_size > kMaxWorldSize)
    return absl::InvalidArgumentError(
        StrCat("world_size: ", g.world_size, " is not in [1, ", kMaxWorldSize, "]"));
  if (g.rank < 0 || g.rank >= g.world_size)
    return absl::InvalidArgumentError(
        StrCat("rank: ", g.rank, " is not in [0, world_size=", g.world_size, ")"));
  if (g.num_heads <= 0)
    return absl::InvalidArgumentError(StrCat("num_heads: must be > 0, got ", g.num_heads));
  if (g.num_heads % g.world_size != 0)
    return absl::InvalidArgumentError(StrCat("num_heads: H=", g.num_heads,
                                                   " must be divisible by world_size W=",
                                                   g.world_size));
  if (g.head_dim <= 0)
    return absl::InvalidArgumentError(StrCat("head_dim: must be > 0, got ", g.head_dim));
  if (ItemSize(g.dtype) == 0)
    return absl::InvalidArgumentError("dtype: must be float16, bfloat16 or float32");
  if (g.max_tokens <= 0)
    return absl::InvalidArgumentError(
        StrCat("max_tokens: must be > 0, got ", g.max_tokens));
  if (g.num_slots < 1 || g.num_slots > kMaxSlots)
    return absl::InvalidArgumentError(
        StrCat("num_slots: ", g.num_slots, " is not in [1, ", kMaxSlots, "]"));
  if (!g.schedule.empty()) {
    int64_t sum = 0;
    for (size_t i = 0; i < g.schedule.size(); ++i) {
      if (g.schedule[i] <= 0)
        return absl::InvalidArgumentError(StrCat(
            "schedule: head counts must be positive, schedule[", i, "] = ", g.schedule[i]));
      sum += g.schedule[i];
    }
    if (sum != g.local_heads())
      return absl::InvalidArgumentError(
          StrCat("schedule: (", JoinInts(g.schedule), ") sums to ", sum,
                       ", must equal local_heads H/W=", g.local_heads()));
  }
  // The slot is addressed with 32-bit element indices by the kernels.
  const int64_t hd = static_cast<int64_t>(g.num_heads) * g.head_dim;
  if (g.max_tokens > kInt32Max / 3 / hd)
    return absl::InvalidArgumentError(StrCat(
        "max_tokens: ", g.max_tokens, " makes a receive slot of 3*max_tokens*H*D elements, over ",
        "the int32 limit ", kInt32Max));
  return absl::OkStatus();
}

std::vector<std::string_view> InputNames(OpKind op) {
  const OpTraits& t = Traits(op);
  return {t.inputs.begin(), t.inputs.begin() + t.num_inputs};
}

}  // namespace ulysses
