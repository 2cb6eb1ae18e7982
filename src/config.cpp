#include "pounce/config.h"

#include <cmath>

#include "pounce/error.h"

namespace pounce {

void validate(const Config& config, const Shape& shape) {
  POUNCE_CHECK(config.forward_comm_sms >= 0 && config.forward_comm_sms < 1024,
               "config.forward_comm_sms = ", config.forward_comm_sms,
               " must be 0 (heuristic) or a positive SM count");
  POUNCE_CHECK(config.backward_comm_sms >= 0 && config.backward_comm_sms < 1024,
               "config.backward_comm_sms = ", config.backward_comm_sms,
               " must be 0 (heuristic) or a positive SM count");
  POUNCE_CHECK(config.minibatch_size >= 0 && config.minibatch_size % kBlockM == 0,
               "config.minibatch_size = ", config.minibatch_size,
               " must be 0 (heuristic) or a positive multiple of ", kBlockM);
  POUNCE_CHECK(config.macrobatch_size >= 0 && config.macrobatch_size % kBlockM == 0,
               "config.macrobatch_size = ", config.macrobatch_size,
               " must be 0 (worst case) or a positive multiple of ", kBlockM);
  const int64_t min_ring = (shape.num_ranks * shape.max_tokens + kBlockM - 1) / kBlockM * kBlockM;
  POUNCE_CHECK(config.macrobatch_size == 0 || config.macrobatch_size >= min_ring,
               "config.macrobatch_size = ", config.macrobatch_size,
               " is below the rows one expert can receive (num_ranks * max_tokens = ",
               shape.num_ranks * shape.max_tokens, ", rounded up to ", kBlockM, ": ", min_ring,
               "); raise it to at least ", min_ring, " or pass 0 (the worst case)");
  POUNCE_CHECK(config.deterministic, "config.deterministic = false is not offered: every Pounce path is ",
               "deterministic at full speed; leave it true");
  const Activation& act = config.activation;
  POUNCE_CHECK(!act.clamp_limit || (std::isfinite(*act.clamp_limit) && *act.clamp_limit > 0),
               "config.activation.clamp_limit = ", act.clamp_limit.value_or(0.0f),
               " must be a positive finite number, or unset for no clamp");
  POUNCE_CHECK(std::isfinite(act.alpha) && act.alpha > 0, "config.activation.alpha = ", act.alpha,
               " must be positive and finite (GPT-OSS uses 1.702)");
}

const char* to_string(Precision precision) {
  return precision == Precision::kBF16 ? "bf16" : "fp8";
}

const char* to_string(KernelPath path) {
  switch (path) {
    case KernelPath::kFused:
      return "fused";
    case KernelPath::kStaged:
      return "staged";
    case KernelPath::kAuto:
      return "auto";
  }
  return "?";
}

const char* to_string(CombineMode mode) {
  switch (mode) {
    case CombineMode::kAuto:
      return "auto";
    case CombineMode::kPush:
      return "push";
    case CombineMode::kScatter:
      return "scatter";
  }
  return "?";
}

const char* to_string(Backend backend) {
  switch (backend) {
    case Backend::kAuto:
      return "auto";
    case Backend::kCpu:
      return "cpu";
    case Backend::kGpu:
      return "gpu";
  }
  return "?";
}

const char* to_string(ActivationKind kind) {
  return kind == ActivationKind::kSwiGLU ? "swiglu" : "gpt-oss";
}

}  // namespace pounce
