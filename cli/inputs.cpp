#include "cli/inputs.h"

#include <atomic>
#include <cmath>
#include <mutex>
#include <numbers>
#include <random>

#include "reference/bf16.h"
#include "cli/parallel.h"

namespace pounce::cli {
namespace {

constexpr int64_t kChunk = int64_t{1} << 18;  // elements per independently seeded generator

// Which tensor a chunk belongs to, folded into its seed.
enum class Stream : uint64_t {
  kX = 1,
  kDOut,
  kRouting,
  kGate,
  kUp,
  kDown,
  kSharedGate,
  kSharedUp,
  kSharedDown,
  kBiasGate,
  kBiasUp,
  kBiasDown
};

uint64_t splitmix64(uint64_t value) {
  value += 0x9e3779b97f4a7c15ull;
  value = (value ^ (value >> 30)) * 0xbf58476d1ce4e5b9ull;
  value = (value ^ (value >> 27)) * 0x94d049bb133111ebull;
  return value ^ (value >> 31);
}

uint64_t stream_seed(uint64_t seed, int64_t rank, Stream stream, int64_t chunk) {
  uint64_t h = splitmix64(seed);
  h = splitmix64(h ^ static_cast<uint64_t>(rank));
  h = splitmix64(h ^ static_cast<uint64_t>(stream));
  return splitmix64(h ^ static_cast<uint64_t>(chunk));
}

// Standard normal pairs by Box-Muller on 2 x 32 bits of one mt19937_64 draw: portable, unlike
// std::normal_distribution, whose algorithm is up to the standard library.
class Normal {
 public:
  explicit Normal(uint64_t seed) : engine_(seed) {}
  double operator()() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const uint64_t bits = engine_();
    const double u1 = (static_cast<double>(bits >> 32) + 1.0) / 4294967297.0;  // (0, 1)
    const double u2 = static_cast<double>(bits & 0xffffffffu) / 4294967296.0;  // [0, 1)
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * std::numbers::pi * u2;
    spare_ = radius * std::sin(angle);
    has_spare_ = true;
    return radius * std::cos(angle);
  }
  std::mt19937_64& engine() { return engine_; }

 private:
  std::mt19937_64 engine_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

// bf16 N(0, stddev^2) values; a value that rounds to +-0 is drawn again so no input is ever zero.
void fill_bf16_normal(Normal& normal, double stddev, uint16_t* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    uint16_t bits;
    do {
      bits = reference::float_to_bf16_bits(static_cast<float>(normal() * stddev));
    } while ((bits & 0x7fffu) == 0);
    out[i] = bits;
  }
}

struct FillJob {
  std::vector<uint16_t>* tensor;
  int64_t rank;
  Stream stream;
  double stddev;
};

// k distinct experts per token (partial Fisher-Yates over a permutation that is never reset: every
// prefix is still a uniform draw) and softmax weights over k N(0, 1) logits.
void fill_routing(const Shape& shape, uint64_t seed, int64_t rank, HostRank& out) {
  const int64_t k = shape.num_topk, num_experts = shape.num_experts;
  Normal normal(stream_seed(seed, rank, Stream::kRouting, 0));
  std::vector<int32_t> perm(num_experts);
  for (int64_t e = 0; e < num_experts; ++e) perm[e] = static_cast<int32_t>(e);
  std::vector<double> logits(k);
  out.topk_idx.resize(out.num_tokens * k);
  out.topk_weights.resize(out.num_tokens * k);
  for (int64_t t = 0; t < out.num_tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      // Modulo bias is below (E / 2^64): irrelevant here, and unlike std::uniform_int_distribution the
      // draw is the same with every standard library.
      const int64_t pick =
          j + static_cast<int64_t>(normal.engine()() % static_cast<uint64_t>(num_experts - j));
      std::swap(perm[j], perm[pick]);
      out.topk_idx[t * k + j] = perm[j];
    }
    double max_logit = -INFINITY, total = 0.0;
    for (int64_t j = 0; j < k; ++j) max_logit = std::max(max_logit, logits[j] = normal());
    for (int64_t j = 0; j < k; ++j) total += logits[j] = std::exp(logits[j] - max_logit);
    for (int64_t j = 0; j < k; ++j) out.topk_weights[t * k + j] = static_cast<float>(logits[j] / total);
  }
}

}  // namespace

HostProblem generate_problem(const Shape& shape, const Activation& activation, uint64_t seed, int num_threads,
                             const GenerationProgress& on_progress, bool biases) {
  validate(shape);
  const int64_t R = shape.num_ranks, T = shape.max_tokens, H = shape.hidden, I = shape.intermediate;
  const int64_t El = shape.num_local_experts(), Is = shape.shared_intermediate;
  HostProblem problem;
  problem.shape = shape;
  problem.activation = activation;
  problem.ranks.resize(R);

  std::vector<FillJob> jobs;
  for (int64_t r = 0; r < R; ++r) {
    HostRank& rank = problem.ranks[r];
    rank.num_tokens = T;
    rank.x.resize(T * H);
    rank.d_out.resize(T * H);
    rank.routed.gate.resize(El * I * H);
    rank.routed.up.resize(El * I * H);
    rank.routed.down.resize(El * H * I);
    jobs.push_back({&rank.x, r, Stream::kX, 1.0});
    jobs.push_back({&rank.d_out, r, Stream::kDOut, 1.0});
    jobs.push_back({&rank.routed.gate, r, Stream::kGate, 1.0 / std::sqrt(static_cast<double>(H))});
    jobs.push_back({&rank.routed.up, r, Stream::kUp, 1.0 / std::sqrt(static_cast<double>(H))});
    jobs.push_back({&rank.routed.down, r, Stream::kDown, 1.0 / std::sqrt(static_cast<double>(I))});
    if (!biases) continue;
    rank.routed.b_gate.resize(El * I);
    rank.routed.b_up.resize(El * I);
    rank.routed.b_down.resize(El * H);
    jobs.push_back({&rank.routed.b_gate, r, Stream::kBiasGate, 0.5});
    jobs.push_back({&rank.routed.b_up, r, Stream::kBiasUp, 0.5});
    jobs.push_back({&rank.routed.b_down, r, Stream::kBiasDown, 0.5});
  }
  if (Is > 0) {
    problem.shared.gate.resize(Is * H);
    problem.shared.up.resize(Is * H);
    problem.shared.down.resize(H * Is);
    jobs.push_back({&problem.shared.gate, 0, Stream::kSharedGate, 1.0 / std::sqrt(static_cast<double>(H))});
    jobs.push_back({&problem.shared.up, 0, Stream::kSharedUp, 1.0 / std::sqrt(static_cast<double>(H))});
    jobs.push_back({&problem.shared.down, 0, Stream::kSharedDown, 1.0 / std::sqrt(static_cast<double>(Is))});
  }

  // One task per (tensor, chunk), plus one routing task per rank.
  std::vector<std::pair<size_t, int64_t>> tasks;
  for (size_t job = 0; job < jobs.size(); ++job) {
    const int64_t size = static_cast<int64_t>(jobs[job].tensor->size());
    for (int64_t chunk = 0; chunk * kChunk < size; ++chunk) tasks.emplace_back(job, chunk);
  }
  const int64_t num_fill_tasks = static_cast<int64_t>(tasks.size());
  const int64_t num_tasks = num_fill_tasks + R;
  std::atomic<int64_t> tasks_done{0};
  std::mutex progress_mutex;
  int steps_reported = 0;  // guarded by progress_mutex
  auto report = [&] {
    const int64_t done = tasks_done.fetch_add(1) + 1;
    if (!on_progress) return;
    const int step = static_cast<int>(done * kProgressSteps / num_tasks);
    std::lock_guard<std::mutex> lock(progress_mutex);
    if (step <= steps_reported) return;
    steps_reported = step;
    on_progress(static_cast<double>(step) / kProgressSteps);
  };
  parallel_for(num_tasks, num_threads, [&](int64_t task) {
    if (task >= num_fill_tasks) {
      fill_routing(shape, seed, task - num_fill_tasks, problem.ranks[task - num_fill_tasks]);
      report();
      return;
    }
    const auto [job_idx, chunk] = tasks[task];
    const FillJob& job = jobs[job_idx];
    const int64_t begin = chunk * kChunk;
    const int64_t count = std::min<int64_t>(kChunk, static_cast<int64_t>(job.tensor->size()) - begin);
    Normal normal(stream_seed(seed, job.rank, job.stream, chunk));
    fill_bf16_normal(normal, job.stddev, job.tensor->data() + begin, count);
    report();
  });
  return problem;
}

int64_t count_routed_pairs(const HostProblem& problem) {
  int64_t pairs = 0;
  for (const HostRank& rank : problem.ranks)
    for (int32_t expert : rank.topk_idx) pairs += expert >= 0;
  return pairs;
}

double forward_flops_per_rank(int64_t routed_pairs, int64_t total_tokens, int64_t hidden,
                              int64_t intermediate, int64_t shared_intermediate, int64_t num_ranks) {
  const double routed = 6.0 * static_cast<double>(routed_pairs) * static_cast<double>(hidden) *
                        static_cast<double>(intermediate);
  const double shared = 6.0 * static_cast<double>(total_tokens) * static_cast<double>(hidden) *
                        static_cast<double>(shared_intermediate);
  return (routed + shared) / static_cast<double>(num_ranks);
}

double forward_flops_per_rank(const HostProblem& problem) {
  int64_t total_tokens = 0;
  for (const HostRank& rank : problem.ranks) total_tokens += rank.num_tokens;
  const Shape& s = problem.shape;
  return forward_flops_per_rank(count_routed_pairs(problem), total_tokens, s.hidden, s.intermediate,
                                s.shared_intermediate, s.num_ranks);
}

double tflops(double flops, double milliseconds) {
  return milliseconds > 0.0 ? flops / (milliseconds * 1e-3) / 1e12 : 0.0;
}

}  // namespace pounce::cli
