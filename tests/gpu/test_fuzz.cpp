// GpuFuzz: random layers through the GPU backend, the twin of the CPU backend's Fuzz
// (tests/cpu/test_fuzz.cpp). Each case draws ranks (1, or 2 when two GPUs are visible), a small shape (H, I
// in 64..256, E up to 16, top-k up to 8, with or without a shared expert), tokens per rank (0, 1, 127, 129,
// any up to 300: T is rarely a multiple of 128, and unequal per rank), one of the harness's routings
// (gpu_fixtures.h) edited here with duplicate ids in a token, -1 slots up to every slot, every token to one
// expert (so the others are empty), zero, negative and large top-k weights and x scaled up, both activations
// with and without clamps, both combines, minibatches of one m-block or the default, sometimes the smallest
// macrobatch ring, int32 or int64 ids. BF16 only: FP8 runs the staged chain whatever the kernel path says, so
// it has no fused path to compare. Every case, on its own data:
//   - forward (forward_harness.h, ForwardMode::kStagedVsFused): the staged chain then the fused kernel,
//     fused == staged bitwise, the receive schedule exactly the reference's, y and out within noise of
//     reference::forward, recompute_forward_context bitwise;
//   - backward (check_backward_on_data below): forward + backward twice on the staged chain and on the fused
//     kernel, each pair bitwise equal, fused == staged bitwise, d_x and d_topk_weights rows >= T untouched,
//     d_x, d_topk_weights and every weight gradient within noise of reference::backward (exact zeros for an
//     expert without rows, an exact 0 for an unused slot's router gradient);
// and on the harness's own data of the same call (make_rank_data: that routing, U(0, 1) weights), because
// check_backward draws its data from the call and cannot take the edits:
//   - backward_harness.h's check_backward on the staged chain and on the fused kernel (fp32, bf16 and
//     accumulated weight gradients, forward again, recompute_forward_context) and expect_same_backward.
// A failure names the case's seed (replay it: POUNCE_GPU_FUZZ_SEED=<seed> ./pounce_gpu_tests
// --gtest_filter=GpuFuzz.ReplayOneCase, on as many GPUs) and the case.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backward_harness.h"
#include "forward_harness.h"
#include "gpu_fixtures.h"
#include "pounce/pounce.h"
#include "reference/bf16.h"
#include "reference/reference.h"

namespace pounce::gpu_test {
namespace {

using reference::bf16_bits_to_float;
using reference::float_to_bf16_bits;

constexpr int kShards = 6;
constexpr int kCasesPerShard = 20;  // 120 cases
constexpr uint64_t kFirstSeed = 1;
constexpr int kMaxRanks = 2;

uint64_t case_seed(int shard, int n) {
  return kFirstSeed + static_cast<uint64_t>(shard) * kCasesPerShard + n;
}

int64_t round_up(int64_t n, int64_t to) {
  return (n + to - 1) / to * to;
}

template <typename T>
T pick(std::mt19937& rng, std::initializer_list<T> values) {
  return *(values.begin() + std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng));
}

// What the fuzz does to the harness's data of the case's call (make_rank_data), in this order.
struct Edits {
  int32_t one_expert = -1;     // >= 0: every used slot to this expert (only the first one without duplicates)
  double duplicate_share = 0;  // share of slots j > 0 given the expert of an earlier slot of their token
  bool drop_all = false;       // every slot -1: no routed work at all
  bool weight_corners = false;  // top-k weights also 0, negative and 3
  float x_scale = 1;            // a power of two: x stays bf16
};

struct FuzzCase {
  uint64_t seed = 0;
  Shape shape;
  Activation activation;
  Config tuning;  // combine, minibatch, macrobatch ring; the kernel paths are the test's
  Call call;      // tokens per rank, the harness's routing, int32 or int64 ids, the data's seed
  Edits edits;
  std::vector<RankData> data;  // [R] the harness's data of `call` after the edits
  std::string describe() const;
};

const char* routing_name(Routing routing) {
  switch (routing) {
    case Routing::kRandom:
      return "random";
    case Routing::kAllToOneExpert:
      return "all to one expert";
    case Routing::kFewExperts:
      return "few experts";
    case Routing::kSparse:
      return "sparse";
  }
  return "?";
}

std::string FuzzCase::describe() const {
  std::ostringstream out;
  const Shape& s = shape;
  out << "seed " << seed << ": R " << s.num_ranks << ", H " << s.hidden << ", I " << s.intermediate << ", E "
      << s.num_experts << ", k " << s.num_topk << ", Is " << s.shared_intermediate << ", max_tokens "
      << s.max_tokens << ", T [";
  for (size_t r = 0; r < call.num_tokens.size(); ++r) out << (r ? " " : "") << call.num_tokens[r];
  out << "], " << to_string(activation.kind) << " clamp ";
  if (activation.clamp_limit) {
    out << *activation.clamp_limit;
  } else {
    out << "none";
  }
  if (activation.kind == ActivationKind::kGptOss) out << " alpha " << activation.alpha;
  out << ", routing " << routing_name(call.routing) << (call.idx_int64 ? " int64" : " int32") << " ids";
  if (edits.one_expert >= 0) out << ", every token to expert " << edits.one_expert;
  if (edits.duplicate_share > 0) out << ", duplicates " << edits.duplicate_share;
  if (edits.drop_all) out << ", every slot -1";
  if (edits.weight_corners) out << ", weights 0 / negative / 3";
  if (edits.x_scale != 1) out << ", x * " << edits.x_scale;
  out << ", combine " << to_string(tuning.combine) << ", minibatch " << tuning.minibatch_size;
  if (tuning.macrobatch_size > 0) out << ", ring " << tuning.macrobatch_size;
  return out.str();
}

// ---- drawing ----

// Whether some token names one expert in two slots.
bool has_duplicates(const std::vector<RankData>& data, int64_t k) {
  for (const RankData& d : data) {
    for (size_t t = 0; t * k < d.topk_idx.size(); ++t) {
      for (int64_t j = 0; j < k; ++j) {
        for (int64_t i = 0; i < j; ++i) {
          const int32_t e = d.topk_idx[t * k + j];
          if (e >= 0 && d.topk_idx[t * k + i] == e) return true;
        }
      }
    }
  }
  return false;
}

// Why `data` would overflow the workspace of (s, tuning), "" when it fits: each rank's receive schedule
// (every expert's rows padded to kBlockM) against the rows distinct ids can need, round_up(R * max_tokens *
// min(k, El) + El * 127, 128), no more than the workspace's rows_capacity (kernels/layout/
// workspace_layout.cuh), and with a ring every expert's padded rows against the ring
// (kernels/sched/macrobatch_plan.cuh). Only duplicate ids in a token get past either bound, and a call
// beyond the workspace's fails (docs/reliability.md): no draw may.
std::string capacity_problem(const Shape& s, const Config& tuning, const std::vector<RankData>& data) {
  const int64_t El = s.num_local_experts();
  const int64_t rows_capacity =
      round_up(s.num_ranks * s.max_tokens * std::min(s.num_topk, El) + El * (kBlockM - 1), kBlockM);
  std::vector<int64_t> rows(s.num_experts, 0);
  for (const RankData& d : data) {
    for (int32_t e : d.topk_idx) {
      if (e >= 0) ++rows[e];
    }
  }
  for (int64_t r = 0; r < s.num_ranks; ++r) {
    int64_t padded = 0;
    for (int64_t e = r * El; e < (r + 1) * El; ++e) {
      padded += round_up(rows[e], kBlockM);
      if (tuning.macrobatch_size > 0 && round_up(rows[e], kBlockM) > tuning.macrobatch_size)
        return "expert " + std::to_string(e) + " receives " + std::to_string(rows[e]) +
               " rows, beyond the ring";
    }
    if (padded > rows_capacity)
      return "rank " + std::to_string(r) + " receives " + std::to_string(padded) +
             " padded rows, beyond rows_capacity " + std::to_string(rows_capacity);
  }
  return "";
}

void apply_edits(const Edits& e, const Shape& s, bool may_duplicate, uint32_t seed, RankData& d) {
  std::mt19937 rng(seed);
  const int64_t k = s.num_topk, T = static_cast<int64_t>(d.topk_idx.size()) / k;
  for (int64_t t = 0; t < T; ++t) {
    int32_t* slots = d.topk_idx.data() + t * k;
    if (e.one_expert >= 0) {
      bool first = true;
      for (int64_t j = 0; j < k; ++j) {
        if (slots[j] < 0) continue;
        slots[j] = first || may_duplicate ? e.one_expert : -1;
        first = false;
      }
    }
    for (int64_t j = 1; j < k; ++j) {
      if (!std::bernoulli_distribution(e.duplicate_share)(rng)) continue;
      const int32_t earlier = slots[std::uniform_int_distribution<int64_t>(0, j - 1)(rng)];
      if (earlier >= 0) slots[j] = earlier;
    }
    if (e.drop_all) std::fill_n(slots, k, -1);
  }
  if (e.weight_corners) {
    for (float& w : d.topk_weights) {
      const int kind = pick(rng, {0, 1, 2, 2, 2, 3});
      w = kind == 0   ? 0.0f
          : kind == 1 ? -std::uniform_real_distribution<float>(0.0f, 1.0f)(rng)
          : kind == 3 ? 3.0f
                      : w;
    }
  }
  if (e.x_scale != 1) {
    for (uint16_t& x : d.x) x = float_to_bf16_bits(bf16_bits_to_float(x) * e.x_scale);
  }
}

// Case `seed` on a machine with `max_ranks` GPUs for it (1 or 2). Every choice is drawn whatever max_ranks
// is, so one seed gives the same activation, routing and tuning on one GPU and on two; R, max_tokens and the
// duplicates that fit follow the rank count.
FuzzCase draw_case(uint64_t seed, int max_ranks) {
  std::mt19937 rng(static_cast<uint32_t>(seed * 2654435761u + 4242));
  auto chance = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  FuzzCase c;
  c.seed = seed;
  const bool two_ranks = chance(0.5);
  const int64_t R = two_ranks && max_ranks >= 2 ? 2 : 1;
  const int64_t E = pick<int64_t>(rng, {2, 4, 8, 8, 16});  // even: every draw splits over two ranks
  const int64_t k = std::uniform_int_distribution<int64_t>(1, std::min<int64_t>(E, 8))(rng);
  const int64_t H = pick<int64_t>(rng, {64, 128, 128, 256}), I = pick<int64_t>(rng, {64, 128, 192, 256}),
                Is = pick<int64_t>(rng, {0, 0, 64, 128});
  std::vector<int64_t> tokens(kMaxRanks);
  for (int64_t& t : tokens)
    t = chance(0.3) ? pick<int64_t>(rng, {0, 1, 127, 129})
                    : std::uniform_int_distribution<int64_t>(0, 300)(rng);
  if (chance(0.03)) std::fill(tokens.begin(), tokens.end(), 0);
  tokens.resize(R);
  const int64_t max_tokens =
      *std::max_element(tokens.begin(), tokens.end()) + pick<int64_t>(rng, {0, 0, 1, 37});
  c.shape = make_shape(max_tokens, H, I, E, k, Is, R);

  c.activation = chance(0.5) ? Activation::swiglu() : Activation::gpt_oss();
  if (chance(0.6)) {
    c.activation = clamped(c.activation, 0.25f * static_cast<float>(pick(rng, {2, 4, 6, 8})));  // |g| ~ 0.7
  } else {
    c.activation.clamp_limit.reset();
  }
  if (c.activation.kind == ActivationKind::kGptOss && chance(0.3)) c.activation.alpha = 0.5f;
  c.tuning.combine = pick(rng, {CombineMode::kAuto, CombineMode::kPush, CombineMode::kScatter});
  c.tuning.minibatch_size = pick<int64_t>(rng, {0, kBlockM});
  const bool ring = chance(0.15);

  // few_experts sends slots 0 and 1 to experts 1 and E - 1: one expert twice when E = 2.
  using MakeCall = Call (*)(std::vector<int64_t>, uint32_t);
  MakeCall make_call = pick<MakeCall>(
      rng, {random_routing, random_routing, random_routing, sparse_routing, few_experts, all_to_one_expert});
  if (E == 2 && make_call == few_experts) make_call = random_routing;
  c.call = make_call(tokens, static_cast<uint32_t>(seed * 7919 + 11));
  if (chance(0.3)) c.call = with_int64_idx(c.call);

  // Duplicates only where every pattern fits what distinct ids need (capacity_problem): a token sends a
  // rank at most min(k, El) rows by distinct ids, up to k by duplicates. With El >= k (always at R = 1,
  // where El = E >= k) the two agree; at R = 2 with El < k the draw keeps its ids distinct.
  const bool may_duplicate = c.shape.num_local_experts() >= k;
  Edits& e = c.edits;
  if (chance(0.12))
    e.one_expert = std::uniform_int_distribution<int32_t>(0, static_cast<int32_t>(E - 1))(rng);
  if (may_duplicate && k > 1 && chance(0.4)) e.duplicate_share = pick(rng, {0.2, 0.5, 1.0});
  e.drop_all = chance(0.04);
  e.weight_corners = chance(0.6);
  e.x_scale = static_cast<float>(pick(rng, {1, 1, 4}));

  c.data = make_call_data(c.shape, {c.call})[0];
  const bool harness_duplicates = has_duplicates(c.data, k);
  for (int64_t r = 0; r < R; ++r)
    apply_edits(e, c.shape, may_duplicate, static_cast<uint32_t>(seed * 104729 + r), c.data[r]);
  // The smallest ring holds one expert's rows of distinct ids: no duplicates in either data set.
  if (ring && !harness_duplicates && !has_duplicates(c.data, k))
    c.tuning.macrobatch_size = smallest_ring(c.shape);
  return c;
}

// ---- backward on the fuzz's data ----

Config path_config(const FuzzCase& c, KernelPath path) {
  Config config = c.tuning;
  config.kernel_path = config.backward_kernel_path = path;
  if (path == KernelPath::kStaged)
    config.combine = CombineMode::kAuto;  // the staged chain has none to choose
  return config;
}

// One rank's fp32 gradients of one path: forward, then backward twice on the same context.
struct PathRuns {
  std::string error;  // the first failing step ("" = none)
  Snapshot runs[2];
};

// Every rank runs every step, failed or not, so that all issue the same collective calls.
void run_backward_path(const FuzzCase& c, const Model& m, KernelPath path, const Group& group, int rank,
                       PathRuns& result) {
  const Shape& s = m.shape;
  const RankData& d = c.data[rank];
  const int64_t T = c.call.num_tokens[rank];
  Config config = path_config(c, path);
  config.activation = m.activation;
  Workspace workspace(group, s, config);
  DeviceWeights weights(m, rank, rank);
  DeviceInputs in(s);
  DeviceBackward grads(s, rank);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  in.upload(s, d, c.call.idx_int64, stream);
  grads.upload_d_out(d.d_out, stream);
  ForwardArgs fwd = in.args(s, T, c.call.idx_int64, rank);
  fwd.routed = weights.routed;
  fwd.shared = weights.shared;
  auto step = [&](const std::string& what, const std::function<void()>& launch) {
    try {
      launch();
      check_errors(workspace, stream, true);
    } catch (const std::exception& error) {
      cudaStreamSynchronize(stream);
      if (result.error.empty()) result.error = what + ": " + error.what();
    }
  };
  step("forward", [&] {
    in.out.poison(stream);
    forward(workspace, fwd, stream);
  });
  for (int run = 0; run < 2; ++run) {
    step("backward " + std::to_string(run), [&] {
      grads.prepare(GradMode::kStoreF32, {}, stream);
      backward(workspace, grads.args(fwd, T, GradMode::kStoreF32), stream);
    });
    result.runs[run] = grads.read(GradMode::kStoreF32, T);
  }
  CUDA_OK(cudaStreamDestroy(stream));
}

std::vector<double> snapshot_values(const Snapshot& snap, int output) {
  const std::vector<uint8_t>& raw = snap.outputs[output];
  if (snap.element_bytes[output] == 2) {
    std::vector<uint16_t> bits(raw.size() / 2);
    std::memcpy(bits.data(), raw.data(), bits.size() * 2);
    return reference::bf16_to_double(bits);
  }
  std::vector<float> values(raw.size() / 4);
  std::memcpy(values.data(), raw.data(), values.size() * 4);
  return std::vector<double>(values.begin(), values.end());
}

const std::vector<double>& reference_output(const reference::RankGradients& g, int output) {
  const std::vector<double>* tensors[kNumOutputs] = {&g.d_x,         &g.d_topk_weights, &g.d_routed.gate,
                                                     &g.d_routed.up, &g.d_routed.down,  &g.d_shared.gate,
                                                     &g.d_shared.up, &g.d_shared.down};
  return *tensors[output];
}

// "" when `values` are all exactly 0, else the first other one.
std::string nonzero(const std::string& name, const std::vector<int64_t>& dims,
                    const std::vector<double>& values, const std::string& why) {
  const auto bad = std::find_if(values.begin(), values.end(), [](double v) { return v != 0.0; });
  if (bad == values.end()) return "";
  std::ostringstream out;
  out << name << coordinate(dims, bad - values.begin()) << " = " << *bad << " but " << why;
  return out.str();
}

// The file comment's backward checks of one case, from the runs of every rank on both paths.
void check_backward_on_data(const FuzzCase& c, const Model& m, const std::vector<PathRuns>& staged,
                            const std::vector<PathRuns>& fused, const std::string& label) {
  const Shape& s = m.shape;
  const int64_t R = s.num_ranks, El = s.num_local_experts(), H = s.hidden, I = s.intermediate, k = s.num_topk,
                Is = s.shared_intermediate;
  reference::testing::Case ref_case = make_reference_case(m, c.data);
  const auto ref = reference::backward(ref_case.problem, ref_case.ranks, ref_case.routed, ref_case.shared);
  ref_case.problem.numerics = reference::Numerics::kFp64;
  const auto ref64 = reference::backward(ref_case.problem, ref_case.ranks, ref_case.routed, ref_case.shared);
  std::vector<int64_t> expert_rows(s.num_experts, 0);  // pairs per global expert over the group
  for (const RankData& d : c.data) {
    for (int32_t e : d.topk_idx) {
      if (e >= 0) ++expert_rows[e];
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const std::string where = label + " rank " + std::to_string(r);
    const int64_t T = c.call.num_tokens[r];
    ASSERT_EQ(staged[r].error, "") << where << ", staged";
    ASSERT_EQ(fused[r].error, "") << where << ", fused";
    for (const PathRuns* path : {&staged[r], &fused[r]}) {
      const char* name = path == &staged[r] ? "staged" : "fused";
      EXPECT_EQ(snapshot_difference(path->runs[0], path->runs[1]), "")
          << where << ": the " << name << " backward's two runs differ";
      EXPECT_TRUE(path->runs[0].tail_poisoned && path->runs[1].tail_poisoned)
          << where << ": the " << name << " backward wrote d_x or d_topk_weights rows >= T";
    }
    EXPECT_EQ(snapshot_difference(staged[r].runs[0], fused[r].runs[0]), "") << where << ": fused != staged";

    const Snapshot& got = fused[r].runs[0];
    const std::vector<std::vector<int64_t>> dims = {{T, H}, {T, k},  {I, H},  {I, H},
                                                    {H, I}, {Is, H}, {Is, H}, {H, Is}};
    for (int o = 0; o < kFirstWeightGrad; ++o) {
      EXPECT_EQ(compare_close(where + " " + kOutputNames[o], dims[o], snapshot_values(got, o),
                              reference_output(ref[r], o), reference_output(ref64[r], o)),
                "");
    }
    const std::vector<double> d_topk = snapshot_values(got, 1);
    for (int64_t i = 0; i < T * k; ++i) {
      if (c.data[r].topk_idx[i] < 0 && d_topk[i] != 0.0) {
        ADD_FAILURE() << where << " d_topk_weights" << coordinate(dims[1], i) << " = " << d_topk[i]
                      << " for an unused slot";
        break;
      }
    }
    // Weight gradients one expert at a time (rows: its pairs from the whole group); shared per rank.
    for (int o = kFirstWeightGrad; o < kNumOutputs; ++o) {
      const bool routed = o < kFirstWeightGrad + 3;
      if (!routed && Is == 0) continue;
      const std::vector<double> all = snapshot_values(got, o);
      const int64_t slices = routed ? El : 1, per_slice = dims[o][0] * dims[o][1];
      ASSERT_EQ(static_cast<int64_t>(all.size()), slices * per_slice) << where << " " << kOutputNames[o];
      for (int64_t e = 0; e < slices; ++e) {
        const std::string name =
            where + " " + kOutputNames[o] + (routed ? "[expert " + std::to_string(e) + "]" : "");
        auto slice = [&](const std::vector<double>& v) {
          return std::vector<double>(v.begin() + e * per_slice, v.begin() + (e + 1) * per_slice);
        };
        const int64_t rows = routed ? expert_rows[r * El + e] : T;
        if (rows == 0) {
          EXPECT_EQ(nonzero(name, dims[o], slice(all), "it had no rows"), "");
          continue;
        }
        EXPECT_EQ(compare_close(name, dims[o], slice(all), slice(reference_output(ref[r], o)),
                                slice(reference_output(ref64[r], o))),
                  "");
      }
    }
  }
}

// ---- one case ----

void run_case(const FuzzCase& c) {
  const std::string name = c.describe();
  ASSERT_EQ(capacity_problem(c.shape, c.tuning, c.data), "") << name;
  ASSERT_EQ(capacity_problem(c.shape, c.tuning, make_call_data(c.shape, {c.call})[0]), "") << name;
  const Model m = make_model(c.shape, c.activation, static_cast<uint32_t>(c.seed * 31 + 7));
  const int R = static_cast<int>(c.shape.num_ranks);
  const std::vector<Call> calls = {c.call};
  const std::vector<std::vector<RankData>> data = {c.data};
  ForwardResults forward_results(1, std::vector<ForwardResult>(R));
  std::vector<PathRuns> staged(R), fused(R);
  // One group for the forward harness's rank driver and both backward paths.
  run_ranks(R, [&](const Group& group, int rank) {
    run_forward_rank(m, data, calls, ForwardMode::kStagedVsFused, group, rank, rank, forward_results,
                     c.tuning);
    run_backward_path(c, m, KernelPath::kStaged, group, rank, staged[rank]);
    run_backward_path(c, m, KernelPath::kFused, group, rank, fused[rank]);
  });
  check_forward_call(m, c.call, c.data, forward_results[0], name + ", forward staged then fused");
  check_backward_on_data(c, m, staged, fused, name + ", backward");

  const BackwardResults a = check_backward(m, calls, false, name + ", staged backward of the harness's data",
                                           path_config(c, KernelPath::kStaged));
  const BackwardResults b = check_backward(m, calls, false, name + ", fused backward of the harness's data",
                                           path_config(c, KernelPath::kFused));
  expect_same_backward(a, b, name + ", backward of the harness's data, fused vs staged");
}

void run_seed(uint64_t seed, int max_ranks) {
  const FuzzCase c = draw_case(seed, max_ranks);
  SCOPED_TRACE("replay: POUNCE_GPU_FUZZ_SEED=" + std::to_string(seed) +
               " ./pounce_gpu_tests --gtest_filter=GpuFuzz.ReplayOneCase with " + std::to_string(max_ranks) +
               " GPU(s) visible (CUDA_VISIBLE_DEVICES=0: one)");
  try {
    run_case(c);
  } catch (const std::exception& error) {
    ADD_FAILURE() << c.describe() << ": " << error.what();
  }
}

int fuzz_ranks() {
  return std::min(visible_gpus(), kMaxRanks);
}

class GpuFuzz : public ::testing::TestWithParam<int> {};

TEST_P(GpuFuzz, FusedEqualsStagedAndReference) {
  SKIP_UNLESS_GPUS(1);
  for (int n = 0; n < kCasesPerShard; ++n) {
    run_seed(case_seed(GetParam(), n), fuzz_ranks());
    if (HasFailure()) return;  // the first failing case is the one to replay
  }
}
INSTANTIATE_TEST_SUITE_P(Shards, GpuFuzz, ::testing::Range(0, kShards));

TEST(GpuFuzz, ReplayOneCase) {
  const char* seed = std::getenv("POUNCE_GPU_FUZZ_SEED");
  if (seed == nullptr) GTEST_SKIP() << "set POUNCE_GPU_FUZZ_SEED=<seed> to replay one GPU fuzz case";
  SKIP_UNLESS_GPUS(1);
  const uint64_t value = std::strtoull(seed, nullptr, 10);
  std::printf("%s\n", draw_case(value, fuzz_ranks()).describe().c_str());
  run_seed(value, fuzz_ranks());
}

// The draws cover what the fuzz promises (so a change to draw_case cannot quietly narrow it), on one GPU and
// on two, and every draw fits its workspace. Draws only: no GPU needed.
TEST(GpuFuzz, CasesCoverTheCorners) {
  for (int max_ranks = 1; max_ranks <= kMaxRanks; ++max_ranks) {
    int two_ranks = 0, zero_tokens = 0, odd_tokens = 0, duplicates = 0, unused = 0, one_expert = 0,
        empty_expert = 0, zero_w = 0, negative_w = 0, large_w = 0, swiglu = 0, gpt_oss = 0, clamped_act = 0,
        unclamped = 0, shared = 0, routed_only = 0, ring = 0, push = 0, scatter = 0, int64_ids = 0,
        two_rank_duplicates = 0;
    for (int shard = 0; shard < kShards; ++shard) {
      for (int n = 0; n < kCasesPerShard; ++n) {
        const FuzzCase c = draw_case(case_seed(shard, n), max_ranks);
        const Shape& s = c.shape;
        EXPECT_EQ(capacity_problem(s, c.tuning, c.data), "") << c.describe();
        EXPECT_EQ(capacity_problem(s, c.tuning, make_call_data(s, {c.call})[0]), "") << c.describe();
        Config config = c.tuning;
        config.activation = c.activation;
        EXPECT_NO_THROW(validate(s)) << c.describe();
        EXPECT_NO_THROW(validate(config, s)) << c.describe();
        two_ranks += s.num_ranks == 2;
        swiglu += c.activation.kind == ActivationKind::kSwiGLU;
        gpt_oss += c.activation.kind == ActivationKind::kGptOss;
        clamped_act += c.activation.clamp_limit.has_value();
        unclamped += !c.activation.clamp_limit.has_value();
        shared += s.has_shared_expert();
        routed_only += !s.has_shared_expert();
        ring += c.tuning.macrobatch_size > 0;
        push += c.tuning.combine == CombineMode::kPush;
        scatter += c.tuning.combine == CombineMode::kScatter;
        int64_ids += c.call.idx_int64;
        duplicates += has_duplicates(c.data, s.num_topk);
        two_rank_duplicates += s.num_ranks == 2 && has_duplicates(c.data, s.num_topk);
        bool no_tokens = false, odd = false, minus = false, zero = false, negative = false, large = false;
        std::vector<int64_t> rows(s.num_experts, 0);
        for (const RankData& d : c.data) {
          const int64_t T = static_cast<int64_t>(d.x.size()) / s.hidden;
          no_tokens |= T == 0;
          odd |= T % kBlockM != 0;
          for (size_t i = 0; i < d.topk_idx.size(); ++i) {
            const int32_t e = d.topk_idx[i];
            const float w = d.topk_weights[i];
            minus |= e < 0;
            if (e < 0) continue;
            ++rows[e];
            zero |= w == 0.0f;
            negative |= w < 0.0f;
            large |= w > 1.0f;
          }
        }
        const int64_t used = std::count_if(rows.begin(), rows.end(), [](int64_t n) { return n > 0; });
        zero_tokens += no_tokens;
        odd_tokens += odd;
        unused += minus;
        zero_w += zero;
        negative_w += negative;
        large_w += large;
        one_expert += used == 1;
        empty_expert += used > 0 && used < s.num_experts;
      }
    }
    const std::string on = " (drawn for " + std::to_string(max_ranks) + " GPU(s))";
    if (max_ranks == 1) {
      EXPECT_EQ(two_ranks, 0) << "cases with two ranks" << on;
    } else {
      EXPECT_GE(two_ranks, 40) << "cases with two ranks" << on;
      EXPECT_GE(two_rank_duplicates, 3) << "cases with two ranks and duplicate ids" << on;
    }
    const std::pair<const char*, int> counts[] = {{"T = 0 on a rank", zero_tokens},
                                                  {"T not a multiple of 128", odd_tokens},
                                                  {"duplicate ids", duplicates},
                                                  {"-1 slots", unused},
                                                  {"all to one expert", one_expert},
                                                  {"an empty expert", empty_expert},
                                                  {"zero weights on used slots", zero_w},
                                                  {"negative weights on used slots", negative_w},
                                                  {"weights > 1 on used slots", large_w},
                                                  {"SwiGLU", swiglu},
                                                  {"GPT-OSS", gpt_oss},
                                                  {"clamped", clamped_act},
                                                  {"no clamp", unclamped},
                                                  {"shared expert", shared},
                                                  {"routed only", routed_only},
                                                  {"macrobatch ring", ring},
                                                  {"push combine", push},
                                                  {"scatter combine", scatter},
                                                  {"int64 ids", int64_ids}};
    for (const auto& [what, count] : counts) EXPECT_GE(count, 8) << what << on;
  }
}

}  // namespace
}  // namespace pounce::gpu_test
