// Shape validation and the model presets of docs/design.md §5.
#include "pounce/shape.h"

#include <cmath>

#include "pounce/config.h"
#include "pounce/error.h"

namespace pounce {

void validate(const Shape& shape) {
  POUNCE_CHECK(shape.max_tokens >= 0, "shape.max_tokens = ", shape.max_tokens,
               " is negative; pass the largest T per rank");
  POUNCE_CHECK(shape.hidden > 0 && shape.hidden % 64 == 0, "shape.hidden = ", shape.hidden,
               " must be a positive multiple of 64 (the GEMM K step and 16-byte row alignment)");
  POUNCE_CHECK(shape.intermediate > 0 && shape.intermediate % 64 == 0,
               "shape.intermediate = ", shape.intermediate,
               " must be a positive multiple of 64 (the GEMM K step of the down projection)");
  POUNCE_CHECK(shape.num_ranks >= 1, "shape.num_ranks = ", shape.num_ranks, " must be at least 1");
  POUNCE_CHECK(shape.num_experts >= 1, "shape.num_experts = ", shape.num_experts, " must be at least 1");
  POUNCE_CHECK(shape.num_experts % shape.num_ranks == 0, "shape.num_experts = ", shape.num_experts,
               " is not divisible by shape.num_ranks = ", shape.num_ranks,
               "; every rank holds num_experts / num_ranks experts");
  POUNCE_CHECK(shape.num_topk >= 1 && shape.num_topk <= shape.num_experts,
               "shape.num_topk = ", shape.num_topk, " must be in [1, num_experts = ", shape.num_experts, "]");
  POUNCE_CHECK(shape.shared_intermediate >= 0 && shape.shared_intermediate % 64 == 0,
               "shape.shared_intermediate = ", shape.shared_intermediate,
               " must be 0 (no shared expert) or a positive multiple of 64");
  POUNCE_CHECK(shape.max_tokens <= (int64_t{1} << 24), "shape.max_tokens = ", shape.max_tokens,
               " exceeds 16777216 tokens per rank; split the batch");
}

const std::vector<Preset>& presets() {
  static const std::vector<Preset> kPresets = {
      {"qwen3-30b-a3b", {0, 2048, 768, 128, 8, 0, 1}, Activation::swiglu()},
      {"deepseek-v3", {0, 7168, 2048, 256, 8, 2048, 1}, Activation::swiglu()},
      {"gpt-oss-120b", {0, 2880, 2880, 128, 4, 0, 1}, Activation::gpt_oss()},
      {"mixtral-8x7b", {0, 4096, 14336, 8, 2, 0, 1}, Activation::swiglu()},
  };
  return kPresets;
}

const Preset& find_preset(const std::string& name) {
  std::string known;
  for (const Preset& preset : presets()) {
    if (preset.name == name) return preset;
    known += (known.empty() ? "" : ", ") + preset.name;
  }
  detail::fail("preset '", name, "' is unknown; choose one of: ", known, " (or give a custom shape)");
}

}  // namespace pounce
