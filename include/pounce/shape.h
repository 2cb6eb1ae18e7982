// The shape of one MoE layer on one expert-parallel group (docs/design.md §1) and the model presets (§5).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pounce {

struct Shape {
  int64_t max_tokens = 0;           // tokens per rank, upper bound fixed at workspace creation
  int64_t hidden = 0;               // H
  int64_t intermediate = 0;         // I, routed experts
  int64_t num_experts = 0;          // E, over the whole group
  int64_t num_topk = 0;             // k
  int64_t shared_intermediate = 0;  // Is, 0 = no shared expert
  int64_t num_ranks = 1;            // R, expert-parallel ranks

  int64_t num_local_experts() const { return num_experts / num_ranks; }
  bool has_shared_expert() const { return shared_intermediate > 0; }
  bool operator==(const Shape&) const = default;
};

// Throws pounce::Error naming the first field that is out of range and how to fix it.
void validate(const Shape& shape);

enum class ActivationKind { kSwiGLU, kGptOss };

struct Activation {
  ActivationKind kind = ActivationKind::kSwiGLU;
  // SwiGLU: silu(min(g, limit)) * clamp(u, -limit, limit) when clamp is set.
  // GPT-OSS: (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'), g' = min(g, limit).
  std::optional<float> clamp_limit;
  float alpha = 1.702f;  // GPT-OSS only

  static Activation swiglu() { return {}; }
  static Activation gpt_oss() { return {ActivationKind::kGptOss, 7.0f, 1.702f}; }
  bool operator==(const Activation&) const = default;
};

struct Preset {
  std::string name;
  Shape shape;  // max_tokens and num_ranks left for the caller
  Activation activation;
};

const std::vector<Preset>& presets();
// Throws pounce::Error listing the known names when `name` is unknown.
const Preset& find_preset(const std::string& name);

}  // namespace pounce
