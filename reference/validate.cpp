// Input validation for the reference: every check runs before any compute and throws pounce::Error
// naming the argument, the value it had and the fix.
#include <cmath>
#include <sstream>
#include <string>
#include <utility>

#include "pounce/error.h"
#include "reference/detail.h"

namespace pounce::reference::detail {
namespace {

// "[2, 0, 5]" for the flat index of an element of a tensor of the given shape.
std::string coordinates(int64_t flat_index, const std::vector<int64_t>& shape) {
  std::vector<int64_t> coords(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    coords[d] = flat_index % shape[d];
    flat_index /= shape[d];
  }
  std::ostringstream out;
  out << "[";
  for (size_t d = 0; d < coords.size(); ++d) out << (d ? ", " : "") << coords[d];
  out << "]";
  return out.str();
}

std::string shape_string(const std::vector<int64_t>& shape, const char* names) {
  std::ostringstream out;
  out << names << " = [";
  for (size_t d = 0; d < shape.size(); ++d) out << (d ? ", " : "") << shape[d];
  out << "]";
  return out.str();
}

int64_t num_elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t extent : shape) n *= extent;
  return n;
}

void check_size(const std::string& name, size_t size, const std::vector<int64_t>& shape, const char* names) {
  POUNCE_CHECK(static_cast<int64_t>(size) == num_elements(shape), name, " has ", size, " elements, expected ",
               num_elements(shape), ": size it as ", shape_string(shape, names));
}

// kBf16 emulation reads inputs as exact bf16 (or fp32) values; anything else would be rounded silently.
void check_representable(const std::string& name, const std::vector<double>& values,
                         const std::vector<int64_t>& shape, bool bf16) {
  for (size_t n = 0; n < values.size(); ++n) {
    const double v = values[n];
    const float as_float = static_cast<float>(v);
    const bool exact =
        bf16 ? static_cast<double>(round_bf16(as_float)) == v : static_cast<double>(as_float) == v;
    POUNCE_CHECK(exact || std::isnan(v), name, coordinates(static_cast<int64_t>(n), shape), " = ", v,
                 " is not a", bf16 ? " bf16" : "n fp32",
                 " value: Numerics::kBf16 emulates the device dtypes, so round inputs first (",
                 bf16 ? "round_bf16" : "static_cast<float>", ") or use Numerics::kFp64");
  }
}

void check_weights(const std::string& name, const Weights& w, int64_t count, int64_t H, int64_t I,
                   bool bf16) {
  // count = 0 means a 2-d shared tensor, otherwise [count, ...] routed.
  auto shape = [&](int64_t rows, int64_t cols) {
    return count ? std::vector<int64_t>{count, rows, cols} : std::vector<int64_t>{rows, cols};
  };
  const char* names_in =
      count ? "[num_local_experts, intermediate, hidden]" : "[shared_intermediate, hidden]";
  const char* names_out =
      count ? "[num_local_experts, hidden, intermediate]" : "[hidden, shared_intermediate]";
  check_size(name + ".gate", w.gate.size(), shape(I, H), names_in);
  check_size(name + ".up", w.up.size(), shape(I, H), names_in);
  check_size(name + ".down", w.down.size(), shape(H, I), names_out);
  if (bf16) {
    check_representable(name + ".gate", w.gate, shape(I, H), true);
    check_representable(name + ".up", w.up, shape(I, H), true);
    check_representable(name + ".down", w.down, shape(H, I), true);
  }
}

}  // namespace

void validate_problem(const Problem& p) {
  POUNCE_CHECK(p.hidden > 0, "problem.hidden = ", p.hidden, " must be positive");
  POUNCE_CHECK(p.intermediate > 0, "problem.intermediate = ", p.intermediate, " must be positive");
  POUNCE_CHECK(p.num_experts > 0, "problem.num_experts = ", p.num_experts, " must be positive");
  POUNCE_CHECK(p.num_ranks > 0, "problem.num_ranks = ", p.num_ranks, " must be positive");
  POUNCE_CHECK(p.num_experts % p.num_ranks == 0, "problem.num_experts = ", p.num_experts,
               " is not a multiple of problem.num_ranks = ", p.num_ranks,
               ": every rank holds num_experts / num_ranks experts, pick num_ranks dividing num_experts");
  POUNCE_CHECK(p.num_topk >= 1 && p.num_topk <= p.num_experts, "problem.num_topk = ", p.num_topk,
               " is out of range [1, num_experts = ", p.num_experts,
               "]: top-k picks k of the num_experts experts");
  POUNCE_CHECK(p.shared_intermediate >= 0, "problem.shared_intermediate = ", p.shared_intermediate,
               " is negative: use 0 for no shared expert");
  POUNCE_CHECK(p.block_m > 0, "problem.block_m = ", p.block_m, " must be positive (the GEMM tile height)");
  POUNCE_CHECK(p.precision == Precision::kBF16 || p.block_m % kFp8Block == 0, "problem.block_m = ", p.block_m,
               " with precision fp8: the token-axis quantization blocks (128 rows) must not straddle expert ",
               "segments; use a multiple of ", kFp8Block, " (the GPU's kBlockM = ", kBlockM, ")");
  POUNCE_CHECK(p.num_threads >= 0, "problem.num_threads = ", p.num_threads,
               " is negative: use 0 for hardware concurrency");
  if (p.activation.clamp_limit) {
    const float limit = *p.activation.clamp_limit;
    POUNCE_CHECK(limit > 0 && std::isfinite(limit), "problem.activation.clamp_limit = ", limit,
                 " must be positive and finite: leave it unset for no clamp");
  }
}

void validate_routing(const Problem& p, const std::vector<RankInputs>& ranks) {
  validate_problem(p);
  POUNCE_CHECK(static_cast<int64_t>(ranks.size()) == p.num_ranks, "ranks has ", ranks.size(),
               " entries but problem.num_ranks = ", p.num_ranks, ": pass one RankInputs per rank");
  for (size_t r = 0; r < ranks.size(); ++r) {
    const RankInputs& in = ranks[r];
    const std::string rank = "[rank " + std::to_string(r) + "]";
    POUNCE_CHECK(in.num_tokens >= 0, "num_tokens", rank, " = ", in.num_tokens, " is negative");
    check_size("topk_idx" + rank, in.topk_idx.size(), {in.num_tokens, p.num_topk}, "[num_tokens, num_topk]");
    for (size_t n = 0; n < in.topk_idx.size(); ++n) {
      const int32_t e = in.topk_idx[n];
      POUNCE_CHECK(e >= -1 && e < p.num_experts, "topk_idx", rank,
                   coordinates(static_cast<int64_t>(n), {in.num_tokens, p.num_topk}), " = ", e,
                   " is out of range [-1, ", p.num_experts,
                   "): expert ids must be global ids below num_experts or -1");
    }
  }
}

void validate_inputs(const Problem& p, const std::vector<RankInputs>& ranks,
                     const std::vector<Weights>& routed_per_rank, const Weights& shared, bool need_d_out) {
  validate_routing(p, ranks);
  const bool bf16 = p.numerics == Numerics::kBf16;
  const int64_t H = p.hidden;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const RankInputs& in = ranks[r];
    const std::string rank = "[rank " + std::to_string(r) + "]";
    check_size("x" + rank, in.x.size(), {in.num_tokens, H}, "[num_tokens, hidden]");
    check_size("topk_weights" + rank, in.topk_weights.size(), {in.num_tokens, p.num_topk},
               "[num_tokens, num_topk]");
    if (need_d_out) check_size("d_out" + rank, in.d_out.size(), {in.num_tokens, H}, "[num_tokens, hidden]");
    if (bf16) {
      check_representable("x" + rank, in.x, {in.num_tokens, H}, true);
      check_representable("topk_weights" + rank, in.topk_weights, {in.num_tokens, p.num_topk}, false);
      if (need_d_out) check_representable("d_out" + rank, in.d_out, {in.num_tokens, H}, true);
    }
  }
  POUNCE_CHECK(static_cast<int64_t>(routed_per_rank.size()) == p.num_ranks, "routed_per_rank has ",
               routed_per_rank.size(), " entries but problem.num_ranks = ", p.num_ranks,
               ": pass each rank's local experts");
  for (size_t r = 0; r < routed_per_rank.size(); ++r) {
    const std::string name = "routed_per_rank[" + std::to_string(r) + "]";
    const Weights& w = routed_per_rank[r];
    check_weights(name, w, p.num_local_experts(), H, p.intermediate, bf16);
    const int64_t El = p.num_local_experts(), I = p.intermediate;
    const std::pair<const char*, const std::vector<double>*> biases[] = {
        {".b_gate", &w.b_gate}, {".b_up", &w.b_up}, {".b_down", &w.b_down}};
    for (const auto& [part, bias] : biases) {
      if (bias->empty()) continue;
      const int64_t cols = bias == &w.b_down ? H : I;
      check_size(name + part, bias->size(), {El, cols},
                 bias == &w.b_down ? "[num_local_experts, hidden] (or empty: no bias)"
                                   : "[num_local_experts, intermediate] (or empty: no bias)");
      if (bf16) check_representable(name + part, *bias, {El, cols}, true);
    }
    POUNCE_CHECK(!w.has_biases() || p.precision == Precision::kBF16, name,
                 " has expert biases but problem.precision is fp8, which does not support them yet; ",
                 "run with precision bf16 or pass no biases");
  }
  POUNCE_CHECK(!shared.has_biases(),
               "shared has biases but the shared expert has none (only routed experts do); pass empty "
               "shared.b_gate, b_up, b_down");
  if (p.shared_intermediate > 0) {
    check_weights("shared", shared, 0, H, p.shared_intermediate, bf16);
  } else {
    POUNCE_CHECK(shared.gate.empty() && shared.up.empty() && shared.down.empty(),
                 "shared weights are given but problem.shared_intermediate = 0: set shared_intermediate or "
                 "pass empty shared weights");
  }
}

}  // namespace pounce::reference::detail
