// The discrete-event simulation of the hierarchical (internode) schedule (reference/internode_sim.h) on the
// CPU reference's schedules: no pair lost or sent twice, each token put at most once per node, every signal
// equal to its count, every partial once, on adversarial routing; each check fires on the fault it is meant
// for; and the cost model's overlap (cli/plan.h) holds against the simulated time within 10 %.
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <tuple>

#include "cli/plan.h"
#include "reference/internode_sim.h"
#include "reference_fixtures.h"

namespace pounce::reference {
namespace {

Problem small_problem(int64_t R, int64_t E, int64_t k) {
  Problem p;
  p.hidden = 256;
  p.intermediate = 128;
  p.num_experts = E;
  p.num_topk = k;
  p.num_ranks = R;
  p.block_m = 128;
  return p;
}

SimConfig small_config(int64_t gpus_per_node) {
  SimConfig c;
  c.gpus_per_node = gpus_per_node;
  c.compute_sms = 16;
  c.comm_sms = 2;
  c.in_tiles = 2;
  c.in_tile_us = 3;
  c.out_tiles = 1;
  c.out_tile_us = 2;
  c.minibatch_m_blocks = 2;
  c.in_row_bytes = c.out_row_bytes = c.nic_out_row_bytes = c.partial_row_bytes = 512;
  c.nic_in_row_bytes = 600;
  c.prologue_us = 5;
  c.epilogue_us = 5;
  return c;
}

// What the routing alone says: routed pairs, distinct (token, other node) puts, pairs on other nodes.
struct Expected {
  int64_t pairs = 0, puts = 0, remote_pairs = 0;
};
Expected expected_counts(const Problem& p, const std::vector<RankInputs>& ranks, int64_t G) {
  Expected e;
  const int64_t El = p.num_local_experts();
  for (int64_t s = 0; s < p.num_ranks; ++s) {
    for (int64_t t = 0; t < ranks[s].num_tokens; ++t) {
      std::set<int64_t> nodes;
      for (int64_t j = 0; j < p.num_topk; ++j) {
        const int32_t expert = ranks[s].topk_idx[t * p.num_topk + j];
        if (expert < 0) continue;
        ++e.pairs;
        const int64_t node = expert / El / G;
        if (node != s / G) {
          nodes.insert(node);
          ++e.remote_pairs;
        }
      }
      e.puts += static_cast<int64_t>(nodes.size());
    }
  }
  return e;
}

void expect_exact(const Problem& p, const std::vector<RankInputs>& ranks, const SimConfig& config,
                  const std::string& what) {
  const SimResult sim = simulate_pass(p, ranks, config);
  ASSERT_TRUE(sim.ok) << what << ": " << (sim.errors.empty() ? "" : sim.errors.front());
  const Expected e = expected_counts(p, ranks, std::min<int64_t>(config.gpus_per_node, p.num_ranks));
  EXPECT_EQ(sim.pairs, e.pairs) << what;
  EXPECT_EQ(sim.nic_puts, e.puts) << what << ": each token once per other node it needs";
  EXPECT_EQ(sim.nic_pairs_without_dedup, e.remote_pairs) << what;
  EXPECT_EQ(sim.partials, e.puts) << what << ": one partial back per put";
  int64_t pulled = 0, relayed = 0, sent = 0, received = 0;
  for (const SimRankStats& r : sim.ranks) {
    pulled += r.pulled_rows;
    relayed += r.relayed_rows;
    sent += r.nic_puts_sent;
    received += r.nic_puts_received;
  }
  EXPECT_EQ(pulled, e.pairs) << what << ": every pair pulled once";
  EXPECT_EQ(relayed, e.remote_pairs) << what << ": remote pairs come from a relay's landing rows";
  EXPECT_EQ(sent, received) << what;
  EXPECT_GT(sim.pass_us, config.prologue_us + config.epilogue_us) << what;
}

TEST(InternodeSim, EveryPairOnceOnRandomRouting) {
  // {ranks, GPUs per node}: one node, two, four, and nodes of 3 GPUs.
  const std::vector<std::pair<int64_t, int64_t>> topologies = {{4, 4}, {4, 8}, {8, 2},
                                                               {8, 4}, {6, 3}, {16, 8}};
  uint32_t seed = 7;
  for (const auto& [R, G] : topologies) {
    const Problem p = small_problem(R, 3 * R, 4);
    std::mt19937 rng(seed++);
    std::vector<RankInputs> ranks(R);
    for (int64_t r = 0; r < R; ++r) {
      ranks[r].num_tokens = r == 1 ? 0 : 37 * r + 11;  // unequal, one rank without tokens
      // Repeated experts and -1 slots: a token naming one expert twice is two pairs, and one put per node.
      ranks[r].topk_idx = testing::random_routing(rng, ranks[r].num_tokens, p.num_topk, p.num_experts, 0.1);
    }
    expect_exact(p, ranks, small_config(G), "R " + std::to_string(R) + ", G " + std::to_string(G));
  }
}

TEST(InternodeSim, EveryPairOnceOnAdversarialRouting) {
  const int64_t R = 8, G = 2, k = 2;
  const Problem p = small_problem(R, 16, k);
  const auto routing = [&](auto expert_of) {
    std::vector<RankInputs> ranks(R);
    for (int64_t r = 0; r < R; ++r) {
      ranks[r].num_tokens = 300;
      ranks[r].topk_idx.resize(300 * k);
      for (int64_t t = 0; t < 300; ++t)
        for (int64_t j = 0; j < k; ++j) ranks[r].topk_idx[t * k + j] = expert_of(r, t, j);
    }
    return ranks;
  };
  expect_exact(p, routing([](int64_t, int64_t, int64_t j) { return j == 0 ? 0 : -1; }), small_config(G),
               "every token to expert 0");
  expect_exact(p, routing([](int64_t, int64_t, int64_t) { return 15; }), small_config(G),
               "every slot to the last expert (duplicates)");
  expect_exact(
      p, routing([](int64_t r, int64_t t, int64_t j) { return r == 3 ? -1 : static_cast<int>((t + j) % 2); }),
      small_config(G), "two experts of node 0, one rank all -1");
  expect_exact(p, routing([](int64_t r, int64_t t, int64_t j) {
                 return static_cast<int>((r * 2 + 5 + t * k + j) % 16);
               }),
               small_config(G), "round-robin");
}

TEST(InternodeSim, EachCheckCatchesItsFault) {
  const int64_t R = 8, G = 4;
  const Problem p = small_problem(R, 16, 4);
  std::mt19937 rng(11);
  std::vector<RankInputs> ranks(R);
  for (int64_t r = 0; r < R; ++r) {
    ranks[r].num_tokens = 200;
    ranks[r].topk_idx = testing::random_routing(rng, 200, p.num_topk, p.num_experts, 0.0);
  }
  using F = SimConfig::Fault;
  const std::vector<std::tuple<F, std::string>> faults = {{F::kDropPut, "never put"},
                                                          {F::kDuplicatePut, "signal of source"},
                                                          {F::kSkipPull, "was pulled 0 times"},
                                                          {F::kDropPartial, "0 partials"}};
  for (const auto& [fault, words] : faults) {
    SimConfig config = small_config(G);
    config.fault = fault;
    const SimResult sim = simulate_pass(p, ranks, config);
    EXPECT_FALSE(sim.ok) << words;
    bool named = false;
    for (const std::string& error : sim.errors) named = named || error.find(words) != std::string::npos;
    EXPECT_TRUE(named) << "no error says '" << words
                       << "'; first: " << (sim.errors.empty() ? "" : sim.errors[0]);
  }
}

// ---- the model's overlap against the simulation -------------------------------------------------------

struct ModelCase {
  std::string preset;
  int ep, gpus_per_node;
  int64_t tokens;
  double nic_gbps = cli::kNicGbps;
  Precision precision = Precision::kBF16;
  int node_limit = 0;
};

cli::PlanProblem plan_of(const ModelCase& c) {
  cli::PlanProblem p;
  const Preset& preset = find_preset(c.preset);
  p.shape = preset.shape;
  p.shape.max_tokens = c.tokens;
  p.shape.num_ranks = c.ep;
  p.activation = preset.activation;
  p.gpus_per_node = c.gpus_per_node;
  p.nic_gbps = c.nic_gbps;
  p.precision = c.precision;
  p.node_limit = c.node_limit;
  return p;
}

// Stated tolerance: the simulated pass within 10 % of the model's prediction.
constexpr double kOverlapTolerance = 0.10;

TEST(InternodeSim, ModelOverlapHolds) {
  const std::vector<ModelCase> cases = {
      {"deepseek-v3", 16, 8, 1024},                       // two nodes, tensor-bound
      {"deepseek-v3", 32, 8, 512},                        // four nodes, NIC-bound forward
      {"deepseek-v3", 16, 8, 1024, 12.5},                 // a 100 Gb/s NIC: NIC-bound
      {"deepseek-v3", 16, 8, 1024, 50, Precision::kFP8},  // FP8 dispatch
      {"gpt-oss-120b", 16, 8, 1024},                      // no shared expert to cover the first rows
      {"qwen3-30b-a3b", 8, 8, 2048},                      // one node, push combine
      {"qwen3-30b-a3b", 2, 2, 4096},                      // the measured EP2 machine's shape
  };
  for (const ModelCase& c : cases) {
    const cli::PlanProblem problem = plan_of(c);
    const std::vector<RankInputs> routing = cli::plan_routing(problem, 2026);
    for (bool backward : {false, true}) {
      const int comm_sms = cli::suggest_comm_sms(problem, backward);
      const cli::PassPrediction model = backward
                                            ? cli::predict_backward(problem, comm_sms, cli::PlanPath::kFused)
                                            : cli::predict_forward(problem, comm_sms, cli::PlanPath::kFused);
      const SimResult sim =
          simulate_pass(cli::sim_problem(problem), routing, cli::sim_config(problem, backward, comm_sms));
      const std::string what = c.preset + " EP" + std::to_string(c.ep) +
                               (backward ? " backward" : " forward") + " (binds " +
                               cli::to_string(model.binding) + ")";
      ASSERT_TRUE(sim.ok) << what << ": " << sim.errors.front();
      const double ratio = sim.pass_us / (model.ms * 1e3);
      EXPECT_NEAR(ratio, 1.0, kOverlapTolerance)
          << what << ": simulated " << sim.pass_us / 1e3 << " ms, model " << model.ms << " ms";
      // The dedup the model counts in expectation is what the routing gives.
      if (problem.num_nodes() > 1) {
        const double per_rank = static_cast<double>(sim.nic_puts) / c.ep;
        EXPECT_NEAR(per_rank / cli::plan_traffic(problem).nic_tokens, 1.0, 0.02) << what;
      }
    }
  }
}

TEST(InternodeSim, PutsInNeedOrderHideTheNic) {
  // The relay's node consumes rows in schedule order; tokens put in token order arrive uniformly late for
  // every expert, so the first minibatches wait on the whole stream (docs/internode.md §3).
  const cli::PlanProblem problem = plan_of({"deepseek-v3", 16, 8, 1024});
  const std::vector<RankInputs> routing = cli::plan_routing(problem, 5);
  SimConfig config = cli::sim_config(problem, false, 6);
  const SimResult need = simulate_pass(cli::sim_problem(problem), routing, config);
  config.puts_in_token_order = true;
  const SimResult token = simulate_pass(cli::sim_problem(problem), routing, config);
  ASSERT_TRUE(need.ok && token.ok);
  EXPECT_LT(need.pass_us * 1.05, token.pass_us)
      << "need order " << need.pass_us << " us, token order " << token.pass_us << " us";
}

}  // namespace
}  // namespace pounce::reference
