// `pounce bench`'s method (cli/bench.h) and the runner's rotation and rank alignment
// (cli/runner.h), without a GPU: passes, useful flops, input sets, records, same-run speed-ups, where the
// records go and how recording merges them, the baseline's command line, and a whole measurement on the CPU
// reference backend.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "pounce/error.h"
#include "cli/bench.h"
#include "cli/inputs.h"
#include "cli/progress.h"
#include "cli/runner.h"
#include "cli/telemetry.h"

namespace pounce::cli {
namespace {

using nlohmann::json;

Shape tiny_shape() {
  Shape shape;
  shape.max_tokens = 12;
  shape.hidden = 128;
  shape.intermediate = 64;
  shape.num_experts = 4;
  shape.num_topk = 2;
  shape.shared_intermediate = 64;
  shape.num_ranks = 2;
  return shape;
}

bool throws_with(const std::function<void()>& call, const std::string& words) {
  try {
    call();
  } catch (const Error& error) {
    return std::string(error.what()).find(words) != std::string::npos;
  }
  return false;
}

TEST(CliBench, ParsesPasses) {
  using P = BenchPass;
  EXPECT_EQ(parse_passes({"all"}), (std::vector<P>{P::kForward, P::kForwardBackward}));
  EXPECT_EQ(parse_passes({"forward_backward", "forward", "forward"}),
            (std::vector<P>{P::kForward, P::kForwardBackward}));
  EXPECT_EQ(parse_passes({"backward", "all"}),
            (std::vector<P>{P::kForward, P::kBackward, P::kForwardBackward}));
  EXPECT_FALSE(needs_backward(parse_passes({"forward"})));
  EXPECT_TRUE(needs_backward(parse_passes({"backward"})));
  EXPECT_TRUE(needs_backward(parse_passes({"all"})));
  EXPECT_STREQ(to_string(P::kForwardBackward), "forward_backward");
  EXPECT_TRUE(throws_with([] { parse_passes({"fwd"}); }, "--pass fwd is unknown"));
  EXPECT_THROW(parse_passes({}), Error);
}

TEST(CliBench, CountsUsefulFlopsAsDesignSection7) {
  // Staged forward records measured on 2 x H200 (2026-11-29): EP2, 8192 tokens per rank, k distinct experts
  // per token, so pairs = R * T * k.
  const double qwen3 = forward_flops_per_rank(2 * 8192 * 8, 2 * 8192, 2048, 768, 0, 2);
  EXPECT_DOUBLE_EQ(qwen3, 6.0 * 8192 * 8 * 2048 * 768);
  EXPECT_NEAR(tflops(qwen3, 2.03057599067688), 304.58120920549004, 1e-9);
  const double deepseek = forward_flops_per_rank(2 * 8192 * 8, 2 * 8192, 7168, 2048, 2048, 2);
  EXPECT_NEAR(tflops(deepseek, 13.936880111694336), 465.9572658663354, 1e-9);
  // Backward does twice the forward's work; a training step three times.
  EXPECT_DOUBLE_EQ(pass_flops(BenchPass::kForward, qwen3), qwen3);
  EXPECT_DOUBLE_EQ(pass_flops(BenchPass::kBackward, qwen3), 2 * qwen3);
  EXPECT_DOUBLE_EQ(pass_flops(BenchPass::kForwardBackward, qwen3), 3 * qwen3);
}

TEST(CliBench, CountsRowsThatCrossRanks) {
  HostProblem problem;
  problem.shape = tiny_shape();  // 2 experts per rank
  problem.ranks.resize(2);
  problem.ranks[0].topk_idx = {0, 2, 3, -1};  // rank 0: experts 2 and 3 live on rank 1
  problem.ranks[1].topk_idx = {1, 2, 0, 3};   // rank 1: experts 1 and 0 live on rank 0
  // 4 crossing pairs, each a row of H bf16 values there and back, averaged over 2 ranks.
  EXPECT_DOUBLE_EQ(forward_crossing_bytes_per_rank(problem), 4.0 * 128 * 2 * 2 / 2);
}

TEST(CliBench, RotatesEnoughInputSetsToMissL2) {
  const int64_t l2 = int64_t{60} << 20;
  Shape qwen3 = find_preset("qwen3-30b-a3b").shape;
  qwen3.max_tokens = 1024;
  const int64_t set = input_set_bytes(qwen3);
  EXPECT_EQ(set, 1024 * 2048 * 2 * 2 + 1024 * 8 * 8);
  const int sets = rotation_sets(set, l2);
  EXPECT_GT(sets * set, 2 * l2);
  EXPECT_LE((sets - 1) * set, 2 * l2) << "more sets than needed";
  EXPECT_EQ(rotation_sets(235 << 20, l2), kMinInputSets);  // large sets: the minimum
  EXPECT_EQ(rotation_sets(4096, l2), kMaxInputSets);       // tiny sets: capped in number
  EXPECT_EQ(rotation_sets(int64_t{3} << 29, l2), 2);       // 1.5 GiB sets: two, over the byte cap
  EXPECT_EQ(rotation_sets(int64_t{100} << 20, l2) * (int64_t{100} << 20) <= kMaxRotationBytes, true);
  // Set s starts s/N of the way through set 0's tokens.
  EXPECT_EQ(input_set_shift(10, 0, 4), 0);
  EXPECT_EQ(input_set_shift(10, 1, 4), 2);
  EXPECT_EQ(input_set_shift(10, 2, 4), 5);
  EXPECT_EQ(input_set_shift(10, 3, 4), 7);
  EXPECT_EQ(input_set_shift(0, 3, 4), 0);
}

TEST(CliBench, SelectsImplAndPreset) {
  Config config;
  EXPECT_NO_THROW(select_impl("staged", config));
  EXPECT_EQ(config.kernel_path, KernelPath::kStaged);
  EXPECT_EQ(config.backward_kernel_path, KernelPath::kStaged);
  EXPECT_NO_THROW(select_impl("fused-all", config));
  EXPECT_EQ(config.kernel_path, KernelPath::kFused);
  EXPECT_EQ(config.backward_kernel_path, KernelPath::kFused);
  EXPECT_NO_THROW(select_impl("fused-staged", config));
  EXPECT_EQ(config.kernel_path, KernelPath::kFused);
  EXPECT_EQ(config.backward_kernel_path, KernelPath::kStaged);
  EXPECT_NO_THROW(select_impl("fused", config));  // the defaults: fused forward, backward by shape
  EXPECT_EQ(config.kernel_path, KernelPath::kFused);
  EXPECT_EQ(config.backward_kernel_path, KernelPath::kAuto);
  EXPECT_TRUE(
      throws_with([&] { select_impl("fast", config); }, "choose fused, fused-all, fused-staged or staged"));
  EXPECT_EQ(bench_preset("deepseek-v3").shape.shared_intermediate, 2048);
  const Preset custom = bench_preset("custom:256:128:8:2:64");
  EXPECT_EQ(custom.name, "custom:256:128:8:2:64");
  EXPECT_EQ(custom.shape.hidden, 256);
  EXPECT_EQ(custom.shape.intermediate, 128);
  EXPECT_EQ(custom.shape.num_experts, 8);
  EXPECT_EQ(custom.shape.num_topk, 2);
  EXPECT_EQ(custom.shape.shared_intermediate, 64);
  EXPECT_EQ(bench_preset("custom:256:128:8:2").shape.shared_intermediate, 0);
  EXPECT_THROW(bench_preset("custom:256:128:8"), Error);
  EXPECT_THROW(bench_preset("custom:256:x:8:2"), Error);
  EXPECT_THROW(bench_preset("custom:256::8:2"), Error);
  EXPECT_THROW(bench_preset("qwen4"), Error);
}

Measurement measured(BenchPass pass, std::vector<double> times) {
  Measurement m;
  m.impl = "staged";
  m.preset = "qwen3-30b-a3b";
  m.pass = pass;
  m.shape = find_preset("qwen3-30b-a3b").shape;
  m.shape.max_tokens = 8192;
  m.shape.num_ranks = 2;
  m.warmup = 2;
  m.iters = static_cast<int>(times.size());
  m.input_sets = 3;
  m.flops = 6e12;
  m.crossing_bytes = 1e9;
  m.times_ms = std::move(times);
  return m;
}

TEST(CliBench, RecordsCarryEveryFieldOfDesignSection7) {
  const RecordContext context{"NVIDIA H200", "580.159.04",   "13.0", "2.28.9",
                              "abc1234",     "pounce bench", "now"};
  const json record = make_record(context, measured(BenchPass::kForwardBackward, {3.0, 1.0, 2.0}));
  for (const char* key :
       {"impl", "pass", "preset", "ranks", "tokens_per_rank", "macrobatch_size", "precision", "median_ms",
        "tflops", "speedup_vs_baseline", "gpu", "driver", "cuda", "nccl", "commit", "command", "date"})
    EXPECT_TRUE(record.contains(key)) << key;
  EXPECT_EQ(record["impl"], "staged");
  EXPECT_EQ(record["pass"], "forward_backward");
  EXPECT_EQ(record["ranks"], 2);
  EXPECT_EQ(record["tokens_per_rank"], 8192);
  EXPECT_EQ(record["macrobatch_size"], 0) << "the worst case unless --macrobatch says otherwise";
  EXPECT_EQ(record["precision"], "bf16");
  EXPECT_DOUBLE_EQ(record["median_ms"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(record["min_ms"].get<double>(), 1.0);
  EXPECT_EQ(record["times_ms"], json({3.0, 1.0, 2.0})) << "every timed run, in the order it ran";
  EXPECT_DOUBLE_EQ(record["tflops"].get<double>(), 3000.0);  // 6e12 flops in 2 ms
  EXPECT_DOUBLE_EQ(record["nvlink_gbps"].get<double>(), 500.0);
  EXPECT_TRUE(record["speedup_vs_baseline"].is_null());
  EXPECT_EQ(record["input_sets"], 3);
  EXPECT_EQ(record["gpu"], "NVIDIA H200");
  EXPECT_FALSE(record.contains("error"));

  Measurement failed = measured(BenchPass::kForwardBackward, {});
  failed.error = "backward did not run: the backward failed on this rank";
  const json missing = make_record(context, failed);
  EXPECT_TRUE(missing["median_ms"].is_null());
  EXPECT_TRUE(missing["tflops"].is_null());
  EXPECT_EQ(missing["error"], failed.error);
}

TEST(CliBench, SpeedupIsAgainstTheSamePassOfTheSameRun) {
  const RecordContext context;
  json records = json::array();
  records.push_back(make_record(context, measured(BenchPass::kForward, {2.0})));
  records.push_back(make_record(context, measured(BenchPass::kForwardBackward, {6.0})));
  Measurement other_tokens = measured(BenchPass::kForward, {1.0});
  other_tokens.shape.max_tokens = 4096;
  records.push_back(make_record(context, other_tokens));
  Measurement not_run = measured(BenchPass::kBackward, {});
  not_run.error = "backward did not run";
  records.push_back(make_record(context, not_run));
  auto baseline = [](const char* pass, double ms) {
    return json{{"impl", "baseline"},      {"pass", pass},   {"preset", "qwen3-30b-a3b"}, {"ranks", 2},
                {"tokens_per_rank", 8192}, {"median_ms", ms}};
  };
  records.push_back(baseline("forward", 5.0));
  records.push_back(baseline("forward_backward", 12.0));
  apply_speedups(records);
  EXPECT_DOUBLE_EQ(records[0]["speedup_vs_baseline"].get<double>(), 2.5);
  EXPECT_DOUBLE_EQ(records[1]["speedup_vs_baseline"].get<double>(), 2.0);
  EXPECT_TRUE(records[2]["speedup_vs_baseline"].is_null()) << "no baseline at 4096 tokens";
  EXPECT_TRUE(records[3]["speedup_vs_baseline"].is_null()) << "not measured";
  EXPECT_DOUBLE_EQ(records[4]["speedup_vs_baseline"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(records[5]["speedup_vs_baseline"].get<double>(), 1.0);
}

// A run that starts at the boost clock and settles lower (docs/design.md, "Power"): the late median and its
// speedup take only the later half of each side's runs, in run order.
TEST(CliBench, LateMedianIsTheLaterHalfOfTheRunsInOrder) {
  const RecordContext context;
  json records = json::array();
  records.push_back(make_record(context, measured(BenchPass::kForward, {1.0, 1.0, 1.0, 1.2, 1.2, 1.3})));
  records.push_back(make_record(context, measured(BenchPass::kForwardBackward, {3.0})));
  EXPECT_DOUBLE_EQ(records[0]["median_ms"].get<double>(), 1.1);
  EXPECT_DOUBLE_EQ(records[0]["late_median_ms"].get<double>(), 1.2) << "runs 4-6, not the sorted upper half";
  EXPECT_DOUBLE_EQ(records[1]["late_median_ms"].get<double>(), 3.0) << "one run is its own later half";
  records.push_back(json{{"impl", "baseline"},
                         {"pass", "forward"},
                         {"preset", "qwen3-30b-a3b"},
                         {"ranks", 2},
                         {"tokens_per_rank", 8192},
                         {"median_ms", 2.2},
                         {"late_median_ms", 3.0}});
  records.push_back(json{{"impl", "baseline"},
                         {"pass", "forward_backward"},
                         {"preset", "qwen3-30b-a3b"},
                         {"ranks", 2},
                         {"tokens_per_rank", 8192},
                         {"median_ms", 6.0}});  // an older baseline script: no late median
  apply_speedups(records);
  EXPECT_DOUBLE_EQ(records[0]["speedup_vs_baseline"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(records[0]["late_speedup_vs_baseline"].get<double>(), 2.5);
  EXPECT_DOUBLE_EQ(records[1]["speedup_vs_baseline"].get<double>(), 2.0);
  EXPECT_TRUE(records[1]["late_speedup_vs_baseline"].is_null()) << "the baseline has no late median";
  EXPECT_DOUBLE_EQ(records[2]["late_speedup_vs_baseline"].get<double>(), 1.0);
}

TEST(CliBench, BackwardThatDidNotRunIsReportedPerRecord) {
  RunOutcome outcome;
  outcome.forward_ms = {1.0, 2.0};
  outcome.backward_ran = false;
  outcome.backward_error = "the backward failed on this rank";
  const std::vector<Measurement> ms =
      take_measurements(outcome, parse_passes({"all", "backward"}), measured(BenchPass::kForward, {}));
  ASSERT_EQ(ms.size(), 3u);
  EXPECT_EQ(ms[0].times_ms, outcome.forward_ms);
  EXPECT_TRUE(ms[0].error.empty());
  for (size_t i = 1; i < 3; ++i) {
    EXPECT_TRUE(ms[i].times_ms.empty());
    EXPECT_NE(ms[i].error.find("the backward failed on this rank"), std::string::npos);
    EXPECT_FALSE(ms[i].run_failed);
  }
  EXPECT_DOUBLE_EQ(ms[2].flops, 3 * 6e12);
  EXPECT_DOUBLE_EQ(ms[2].crossing_bytes, 2 * 1e9);

  const std::vector<Measurement> failed =
      failed_measurements(parse_passes({"all"}), measured(BenchPass::kForward, {}), "pounce: out of memory");
  ASSERT_EQ(failed.size(), 2u);
  EXPECT_EQ(failed[0].error, "out of memory");
  EXPECT_TRUE(failed[0].run_failed);
}

TEST(CliBench, BaselineCommandAsksForTheSamePassesAndRotation) {
  BaselineRun run;
  run.torchrun = "/opt/torch/.venv/bin/torchrun";
  run.script = "bench/baselines/torch_moe.py";
  run.ranks = 2;
  run.presets = {"qwen3-30b-a3b", "custom:256:128:8:2", "deepseek-v3"};
  run.tokens = {1024, 8192};
  run.passes = baseline_passes(parse_passes({"all", "backward"}));
  run.warmup = 2;
  run.iters = 10;
  run.json_path = "/tmp/x.json";
  const std::string command = baseline_command(run);
  for (const char* part :
       {"'/opt/torch/.venv/bin/torchrun' --standalone --nproc-per-node=2 ",
        "--preset 'qwen3-30b-a3b,custom:256:128:8:2,deepseek-v3' ", "--tokens 1024,8192 ",
        "--passes forward,forward_backward ", "--warmup 2 --iters 10 --sets 0 ", "--json '/tmp/x.json'"})
    EXPECT_NE(command.find(part), std::string::npos) << part << " not in: " << command;
  EXPECT_EQ(command.find("--peers"), std::string::npos) << "no peers asked: " << command;
  run.peers = parse_peers({"floor", "liger"});
  EXPECT_NE(baseline_command(run).find(" --sets 0 --peers liger,floor --json "), std::string::npos)
      << baseline_command(run);
  EXPECT_EQ(shell_quote("it's"), "'it'\\''s'");
}

TEST(CliBench, ParsesPeers) {
  EXPECT_EQ(parse_peers({"floor", "liger", "floor"}), (std::vector<std::string>{"liger", "floor"}));
  EXPECT_EQ(parse_peers({"all"}), (std::vector<std::string>{"liger", "transformers", "floor"}));
  EXPECT_TRUE(parse_peers({}).empty());
  EXPECT_TRUE(parse_peers({"none"}).empty());
  EXPECT_TRUE(throws_with(
      [] {
        parse_peers({"liger", "megablocks"});
      },
      "--peers megablocks is unknown; choose liger, transformers, floor, all or none"));
  for (const char* impl : {"baseline", "liger", "transformers", "floor"})
    EXPECT_TRUE(is_peer_impl(impl)) << impl;
  for (const char* impl : {"fused", "fused-all", "fused-staged", "staged"})
    EXPECT_FALSE(is_peer_impl(impl)) << impl;
}

json peer_record(const std::string& impl, const std::string& pass, json median_ms) {
  json record = {{"impl", impl},
                 {"pass", pass},
                 {"preset", "qwen3-30b-a3b"},
                 {"ranks", 1},
                 {"tokens_per_rank", 8192},
                 {"precision", "bf16"},
                 {"median_ms", median_ms}};
  if (median_ms.is_number()) record["tflops"] = 100.0 / median_ms.get<double>();
  return record;
}

// Pounce against each peer of the same configuration, and everyone against the compute-only floor.
TEST(CliBench, RatiosAgainstEveryPeerAndTheFloor) {
  json records = {peer_record("fused", "forward", 2.0),
                  peer_record("baseline", "forward", 5.0),
                  peer_record("liger", "forward", 3.0),
                  peer_record("transformers", "forward", 4.0),
                  peer_record("floor", "forward", 1.5),
                  peer_record("fused", "forward_backward", 6.0),
                  peer_record("liger", "forward_backward", nullptr)};
  records[6]["unsupported"] = true;
  records[6]["error"] = "liger-kernel's fused MoE computes SwiGLU only";
  apply_speedups(records);
  EXPECT_EQ(records[0]["speedup_vs"], (json{{"baseline", 2.5}, {"liger", 1.5}, {"transformers", 2.0}}))
      << "the floor is a fraction, not a peer to beat";
  EXPECT_DOUBLE_EQ(records[0]["speedup_vs_baseline"].get<double>(), 2.5);
  EXPECT_DOUBLE_EQ(records[0]["floor_fraction"].get<double>(), 0.75);
  EXPECT_FALSE(records[2].contains("speedup_vs")) << "peers are not compared with each other";
  EXPECT_DOUBLE_EQ(records[2]["floor_fraction"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(records[2]["speedup_vs_baseline"].get<double>(), 5.0 / 3.0);
  EXPECT_DOUBLE_EQ(records[4]["floor_fraction"].get<double>(), 1.0);
  EXPECT_EQ(records[5]["speedup_vs"], json::object()) << "no measured peer in that pass";
  EXPECT_TRUE(records[5]["floor_fraction"].is_null());
  EXPECT_TRUE(records[6]["floor_fraction"].is_null());

  const std::string table = side_by_side(records);
  for (const char* part : {"qwen3-30b-a3b, EP1, 8192 tokens/rank, forward\n", "  liger ", "1.50x", "75%",
                           "qwen3-30b-a3b, EP1, 8192 tokens/rank, forward_backward\n",
                           "  liger did not run (cannot): liger-kernel's fused MoE computes SwiGLU only\n"})
    EXPECT_NE(table.find(part), std::string::npos) << part << " not in:\n" << table;
  // the baseline's row: Pounce's speed-up over it; the floor's: Pounce at 0.75x of its speed
  EXPECT_NE(table.find("2.50x"), std::string::npos) << table;
  EXPECT_NE(table.find("0.75x"), std::string::npos) << table;
  EXPECT_EQ(side_by_side(json{peer_record("fused", "forward", 2.0), peer_record("baseline", "forward", 5.0)}),
            "")
      << "without peers the main table says it all";
}

TEST(CliBench, RecordsWhatAPeerCannotRunButNotWhatFailed) {
  json cannot = peer_record("liger", "forward", nullptr);
  cannot["unsupported"] = true;
  cannot["error"] = "liger-kernel's fused MoE computes SwiGLU only";
  json missing = peer_record("transformers", "forward", nullptr);
  missing["unsupported"] = false;
  missing["error"] = "transformers does not import here";
  EXPECT_TRUE(is_recordable(cannot));
  EXPECT_FALSE(is_recordable(missing));
  EXPECT_TRUE(is_recordable(peer_record("floor", "forward", 1.0)));
  const json merged =
      merge_records(json::array(), json{cannot, missing, peer_record("floor", "forward", 1.0)});
  ASSERT_EQ(merged.size(), 2u);
  EXPECT_EQ(merged[0]["impl"], "floor");
  EXPECT_EQ(merged[1]["impl"], "liger");
  EXPECT_EQ(merged[1]["error"], cannot["error"]);
}

// The baseline's process reports each pass's timed window; its readings are those of that window.
TEST(CliBench, BaselineRecordsTakeTheTelemetryOfTheirTimedWindow) {
  const std::vector<TelemetrySample> samples = {{1980.0, 100.0, 40.0, 10.0},  // setup
                                                {1500.0, 600.0, 60.0, 20.5},
                                                {1700.0, 700.0, 70.0, 21.0},   // the first window
                                                {1800.0, 650.0, 65.0, 30.0}};  // the second
  const TelemetrySummary within = summarize_window(samples, 20.0, 21.0);
  EXPECT_EQ(within.samples, 2);
  EXPECT_DOUBLE_EQ(within.sm_clock_mhz, 1600.0);
  json first = peer_record("baseline", "forward", 1.0);
  first["timed_window_unix_s"] = {20.0, 21.0};
  json second = peer_record("liger", "forward", 1.0);
  second["timed_window_unix_s"] = {29.0, 31.0};
  json unwindowed = peer_record("baseline", "forward_backward", 1.0);
  json empty_window = peer_record("floor", "forward", 1.0);
  empty_window["timed_window_unix_s"] = {40.0, 41.0};
  json not_run = peer_record("transformers", "forward", nullptr);
  json records = {first, second, unwindowed, empty_window, not_run};
  TelemetrySummary whole;
  whole.samples = 9;
  whole.sm_clock_mhz = 1234.0;
  whole.power_w = 555.0;
  add_baseline_telemetry(records, samples, whole);
  EXPECT_DOUBLE_EQ(records[0]["sm_clock_mhz"].get<double>(), 1600.0);
  EXPECT_DOUBLE_EQ(records[0]["power_w"].get<double>(), 650.0);
  EXPECT_EQ(records[0]["telemetry_samples"], 2);
  EXPECT_DOUBLE_EQ(records[1]["sm_clock_mhz"].get<double>(), 1800.0);
  EXPECT_EQ(records[1]["telemetry_scope"], "the readings within this pass's timed runs");
  for (size_t i : {2u, 3u}) {
    EXPECT_DOUBLE_EQ(records[i]["sm_clock_mhz"].get<double>(), 1234.0) << i;
    EXPECT_EQ(records[i]["telemetry_scope"], "the baseline run's readings at >= half its highest power") << i;
  }
  EXPECT_FALSE(records[4].contains("sm_clock_mhz")) << "a record not measured has no readings";
}

// Off a terminal: stages only after the quiet seconds, updates at most every few seconds, lines always.
TEST(CliBench, ProgressPrintsLongWorkWithoutFlooding) {
  std::FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  double now = 0.0;
  {
    Progress progress(true, out, false, [&] { return now; });
    progress.line("configuration 1/2");
    progress.stage("quiet stage");
    progress.update("inputs 5 %");  // before the quiet seconds: not printed
    now = 3.5;
    progress.update("inputs 40 %");
    now = 4.0;
    progress.update("inputs 45 %");  // 0.5 s after the last update: not printed
    now = 8.6;
    progress.update("inputs 90 %");
    progress.stage("timing");
  }
  std::rewind(out);
  std::string text;
  for (int c = std::fgetc(out); c != EOF; c = std::fgetc(out)) text += static_cast<char>(c);
  std::fclose(out);
  EXPECT_EQ(text,
            "[pounce    0.0 s] configuration 1/2\n"
            "[pounce    3.5 s] inputs 40 %\n"
            "[pounce    8.6 s] inputs 90 %\n"
            "[pounce    8.6 s] timing\n");
}

// A large shape reports its generation as it goes; the values do not depend on it.
TEST(CliBench, InputGenerationReportsItsProgress) {
  Shape shape = tiny_shape();
  shape.max_tokens = 300;
  shape.hidden = 1024;
  shape.intermediate = 512;  // 3 x 2 x 512 x 1024 routed values per rank: several chunks per tensor
  std::vector<double> fractions;
  const HostProblem reported =
      generate_problem(shape, Activation::swiglu(), 7, 3, [&](double done) { fractions.push_back(done); });
  ASSERT_FALSE(fractions.empty());
  EXPECT_LE(fractions.size(), static_cast<size_t>(kProgressSteps));
  EXPECT_DOUBLE_EQ(fractions.back(), 1.0);
  for (size_t i = 1; i < fractions.size(); ++i) EXPECT_GT(fractions[i], fractions[i - 1]);
  const HostProblem quiet = generate_problem(shape, Activation::swiglu(), 7, 1);
  EXPECT_EQ(reported.ranks[1].routed.down, quiet.ranks[1].routed.down);
  EXPECT_EQ(reported.ranks[0].topk_idx, quiet.ranks[0].topk_idx);
  EXPECT_EQ(reported.shared.gate, quiet.shared.gate);
}

TEST(CliBench, WritesOutsideTheSourceTreeUnlessAskedToRecord) {
  EXPECT_EQ(default_out_path("", "2026-11-30T13:07:30Z", "/scratch"),
            "/scratch/pounce-bench-2026-11-30T13-07-30Z.json");
  EXPECT_EQ(default_out_path("closing", "2026-11-30T13:07:30Z", nullptr), "/tmp/closing.json");
  EXPECT_EQ(default_out_path("closing", "", ""), "/tmp/closing.json") << "an empty TMPDIR is unset";
  EXPECT_FALSE(is_record_dir(""));
  EXPECT_FALSE(is_record_dir("/tmp/closing.json"));
  EXPECT_TRUE(is_record_dir("bench/results/")) << "a trailing '/' asks for a folder, existing or not";
  EXPECT_TRUE(is_record_dir(std::filesystem::temp_directory_path().string()));
  EXPECT_EQ(results_file_name(2, "bf16"), "ep2_bf16.json");
}

json record_of(const std::string& impl, const std::string& pass, const std::string& preset, int64_t tokens,
               json median_ms, const std::string& date, int64_t ranks = 2) {
  return json{{"impl", impl},
              {"pass", pass},
              {"preset", preset},
              {"ranks", ranks},
              {"tokens_per_rank", tokens},
              {"precision", "bf16"},
              {"median_ms", median_ms},
              {"date", date}};
}

TEST(CliBench, RecordingKeepsTheLatestRecordPerConfiguration) {
  const json recorded = {
      record_of("fused", "forward_backward", "qwen3-30b-a3b", 8192, 4.2, "old"),
      record_of("fused", "forward", "qwen3-30b-a3b", 8192, 1.5, "old"),
      record_of("baseline", "forward", "qwen3-30b-a3b", 8192, 4.9, "old"),
      record_of("fused", "forward", "qwen3-30b-a3b", 16384, 2.9, "old"),
      record_of("staged", "forward", "deepseek-v3", 8192, 14.0, "old"),
  };
  json fp8 = record_of("fused", "forward", "qwen3-30b-a3b", 8192, 1.1, "new");
  fp8["precision"] = "fp8";
  const json run = {
      record_of("fused", "forward", "qwen3-30b-a3b", 8192, 1.4, "new"),
      record_of("baseline", "forward", "qwen3-30b-a3b", 8192, 5.0, "new"),
      record_of("fused", "forward_backward", "qwen3-30b-a3b", 8192, nullptr, "new"),  // failed: kept old
      record_of("fused", "forward", "custom:256:128:8:2", 8192, 0.1, "new"),
      fp8,
  };
  const json merged = merge_records(recorded, run);
  std::vector<std::string> order;
  for (const json& r : merged)
    order.push_back(r["preset"].get<std::string>() + " " + std::to_string(r["tokens_per_rank"].get<int>()) +
                    " " + r["pass"].get<std::string>() + " " + r["impl"].get<std::string>() + " " +
                    r["precision"].get<std::string>() + " " + r["date"].get<std::string>());
  EXPECT_EQ(order, (std::vector<std::string>{
                       "custom:256:128:8:2 8192 forward fused bf16 new",
                       "deepseek-v3 8192 forward staged bf16 old",
                       "qwen3-30b-a3b 8192 forward baseline bf16 new",
                       "qwen3-30b-a3b 8192 forward fused bf16 new",
                       "qwen3-30b-a3b 8192 forward fused fp8 new",
                       "qwen3-30b-a3b 8192 forward_backward fused bf16 old",
                       "qwen3-30b-a3b 16384 forward fused bf16 old",
                   }));
  EXPECT_EQ(merge_records(merged, run), merged) << "recording the same run again changes nothing";

  json no_precision = record_of("fused", "forward", "qwen3-30b-a3b", 8192, 1.3, "newer");
  no_precision.erase("precision");
  EXPECT_EQ(record_key(no_precision), record_key(run[0])) << "records before FP8 are bf16";
  const json replaced = merge_records(merged, json{no_precision});
  EXPECT_EQ(replaced.size(), merged.size());
  EXPECT_EQ(replaced[3]["date"], "newer");
}

TEST(CliBench, RecordsOneFilePerRanksAndPrecision) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("pounce_record_test_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const json first = {record_of("fused", "forward", "qwen3-30b-a3b", 8192, 1.5, "old"),
                      record_of("fused", "forward", "qwen3-30b-a3b", 8192, 2.5, "old", 1)};
  EXPECT_EQ(record_results(dir.string() + "/", first),
            (std::vector<std::string>{(dir / "ep1_bf16.json").string(), (dir / "ep2_bf16.json").string()}));
  const json second = {record_of("fused", "forward", "qwen3-30b-a3b", 8192, 1.4, "new"),
                       record_of("fused", "forward", "deepseek-v3", 8192, nullptr, "new", 4)};
  EXPECT_EQ(record_results(dir.string(), second),
            (std::vector<std::string>{(dir / "ep2_bf16.json").string()}))
      << "no file for a record that was not measured";
  auto read = [](const std::filesystem::path& path) {
    std::ifstream file(path);
    return json::parse(file);
  };
  EXPECT_EQ(read(dir / "ep2_bf16.json"), json({second[0]}));
  EXPECT_EQ(read(dir / "ep1_bf16.json"), json({first[1]}));
  EXPECT_FALSE(std::filesystem::exists(dir / "ep4_bf16.json"));

  std::ofstream(dir / "ep2_bf16.json") << "{\"not\": \"a list\"}";
  EXPECT_TRUE(throws_with([&] { record_results(dir.string(), second); }, "is not a JSON list of records"));
  std::filesystem::remove_all(dir);
}

// A rank that records which input set each run used, checks that no rank's timed call starts before every
// rank has begun that run, and returns times that tell ranks and passes apart.
struct FakeRanks {
  std::vector<int> sets[2];  // per rank, the set of each run
  std::atomic<int> runs_begun[2] = {0, 0};
  std::atomic<bool> misaligned{false};
  bool backward_fails = false;
};

class FakeRunner final : public RankRunner {
 public:
  FakeRunner(FakeRanks& ranks, int rank) : ranks_(ranks), rank_(rank) {}
  void poison() override {}
  void use_input_set(int set_idx) override {
    ranks_.sets[rank_].push_back(set_idx);
    if (rank_ == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));  // a slow host thread
    ranks_.runs_begun[rank_].fetch_add(1);
  }
  double forward() override {
    ++runs_;
    for (const std::atomic<int>& begun : ranks_.runs_begun)
      if (begun.load() < runs_) ranks_.misaligned = true;
    return 1.0 + rank_;  // rank 1 is slower forward...
  }
  double backward() override {
    if (ranks_.backward_fails) throw Error("the backward failed on this rank");
    return rank_ == 0 ? 10.0 : 8.0;  // ...and faster backward
  }
  RankOutputs outputs(const CheckPlan&, bool) override { return {}; }
  std::vector<uint8_t> snapshot(bool) override { return {1, 2, 3}; }

 private:
  FakeRanks& ranks_;
  int rank_;
  int runs_ = 0;
};

TEST(CliRunner, RotatesInputSetsAlignsRanksAndTakesTheSlowestStep) {
  FakeRanks ranks;
  RunRequest request;
  request.warmup = 1;
  request.iters = 4;
  request.num_input_sets = 3;
  const RunOutcome outcome = run_ranks(2, request, [&](int rank) -> std::unique_ptr<RankRunner> {
    return std::make_unique<FakeRunner>(ranks, rank);
  });
  for (const std::vector<int>& sets : ranks.sets) EXPECT_EQ(sets, (std::vector<int>{0, 1, 2, 0, 1}));
  EXPECT_FALSE(ranks.misaligned) << "a rank's forward started before its peer began the run";
  EXPECT_EQ(outcome.forward_ms, std::vector<double>(4, 2.0));
  EXPECT_EQ(outcome.backward_ms, std::vector<double>(4, 10.0));
  // max over ranks of (forward + backward) = max(1 + 10, 2 + 8), not 2 + 10
  EXPECT_EQ(outcome.forward_backward_ms, std::vector<double>(4, 11.0));
  ASSERT_TRUE(outcome.repeat_bitwise_equal.has_value()) << "runs 1 and 4 share set 1";
  EXPECT_TRUE(*outcome.repeat_bitwise_equal);
}

TEST(CliRunner, UsesSetsInTurnAndReportsABackwardThatThrows) {
  FakeRanks ranks;
  ranks.backward_fails = true;
  RunRequest request;
  request.warmup = 2;
  request.iters = 3;
  request.num_input_sets = 2;
  FakeRunner runner(ranks, 0);
  const RankResult result = drive_rank(runner, request, 0);
  EXPECT_EQ(ranks.sets[0], (std::vector<int>{0, 1, 0, 1, 0}));
  EXPECT_EQ(result.forward_ms.size(), 3u);
  EXPECT_FALSE(result.backward_ran);
  EXPECT_EQ(result.backward_error, "the backward failed on this rank");
  // With as many sets as runs no earlier run shares the last run's set: no repeat check.
  request.num_input_sets = 5;
  FakeRunner alone(ranks, 0);
  EXPECT_FALSE(drive_rank(alone, request, 0).repeat_bitwise_equal.has_value());
}

TEST(CliBench, MeasuresEveryPassOnTheCpuBackend) {
  const HostProblem problem = generate_problem(tiny_shape(), Activation::swiglu(), 5);
  Measurement setup;
  setup.impl = "staged";
  setup.preset = "custom:128:64:4:2:64";
  setup.backend = Backend::kCpu;
  setup.warmup = 1;
  setup.iters = 2;
  setup.input_sets = 3;
  const std::vector<Measurement> ms = measure(problem, setup, parse_passes({"all", "backward"}), nullptr);
  ASSERT_EQ(ms.size(), 3u);
  const double forward_flops = forward_flops_per_rank(problem);
  for (const Measurement& m : ms) {
    EXPECT_TRUE(m.error.empty()) << to_string(m.pass) << ": " << m.error;
    EXPECT_EQ(m.times_ms.size(), 2u) << to_string(m.pass);
    EXPECT_DOUBLE_EQ(m.flops, pass_flops(m.pass, forward_flops));
    EXPECT_EQ(m.shape, tiny_shape());
  }
  for (size_t i = 0; i < 2; ++i) EXPECT_GE(ms[2].times_ms[i], ms[1].times_ms[i]);
  EXPECT_FALSE(ms[0].repeat_bitwise_equal.has_value()) << "3 runs on 3 sets: none shares the last run's";

  // Every rotated set routes the same pairs: the schedule and a fresh bitwise repeat hold on the set.
  RunRequest request;
  request.problem = &problem;
  request.config.backend = Backend::kCpu;
  request.warmup = 1;
  request.iters = 3;
  request.num_input_sets = 3;  // runs 0 and 3 both use set 0
  const RunOutcome outcome = run_on_cpu(request);
  EXPECT_TRUE(outcome.backward_ran);
  ASSERT_TRUE(outcome.repeat_bitwise_equal.has_value());
  EXPECT_TRUE(*outcome.repeat_bitwise_equal);
  EXPECT_EQ(outcome.forward_backward_ms.size(), 3u);

  // The ring reaches the layer's config: an invalid one fails every pass with the config's message, not the
  // sweep.
  setup.macrobatch_size = pounce::kBlockM / 2;  // not a multiple of 128
  const std::vector<Measurement> small_ring = measure(problem, setup, parse_passes({"forward"}), nullptr);
  ASSERT_EQ(small_ring.size(), 1u);
  EXPECT_NE(small_ring[0].error.find("macrobatch_size"), std::string::npos) << small_ring[0].error;
  setup.macrobatch_size = 0;

  // An impl that does not exist fails every pass, not the sweep.
  setup.impl = "fast";
  const std::vector<Measurement> fast = measure(problem, setup, parse_passes({"forward"}), nullptr);
  ASSERT_EQ(fast.size(), 1u);
  EXPECT_TRUE(fast[0].run_failed);
  EXPECT_NE(fast[0].error.find("--impl fast"), std::string::npos);
}

// Telemetry: means of clock and power, the highest temperature; null fields without readings.
TEST(CliBench, TelemetrySummaryAndRecordFields) {
  const TelemetrySummary summary =
      summarize({{1500.0, 600.0, 60.0}, {1700.0, 700.0, 75.0}, {1600.0, 650.0, 70.0}});
  EXPECT_EQ(summary.samples, 3);
  EXPECT_DOUBLE_EQ(summary.sm_clock_mhz, 1600.0);
  EXPECT_DOUBLE_EQ(summary.power_w, 650.0);
  EXPECT_DOUBLE_EQ(summary.temperature_c, 75.0);
  json record = json::object();
  add_telemetry(record, summary);
  EXPECT_DOUBLE_EQ(record["sm_clock_mhz"].get<double>(), 1600.0);
  EXPECT_DOUBLE_EQ(record["power_w"].get<double>(), 650.0);
  EXPECT_DOUBLE_EQ(record["temperature_c"].get<double>(), 75.0);
  EXPECT_EQ(record["telemetry_samples"], 3);

  // Busy readings only: 300 W and 100 W are below half of 700 W.
  const TelemetrySummary busy = summarize(
      {{1980.0, 100.0, 40.0}, {1500.0, 600.0, 60.0}, {1900.0, 300.0, 80.0}, {1700.0, 700.0, 75.0}}, 0.5);
  EXPECT_EQ(busy.samples, 2);
  EXPECT_DOUBLE_EQ(busy.sm_clock_mhz, 1600.0);
  EXPECT_DOUBLE_EQ(busy.power_w, 650.0);
  EXPECT_DOUBLE_EQ(busy.temperature_c, 75.0);

  json empty = json::object();
  add_telemetry(empty, summarize({}));
  EXPECT_TRUE(empty["sm_clock_mhz"].is_null() && empty["power_w"].is_null() &&
              empty["temperature_c"].is_null());
  EXPECT_EQ(empty["telemetry_samples"], 0);
}

// No GPU to sample: nothing sampled, and stopping twice (stop(), then the destructor) is harmless.
TEST(CliBench, TelemetryWithoutGpusSamplesNothing) {
  GpuTelemetry telemetry(0, std::chrono::microseconds(1000));
  const TimedWork timed(true);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(telemetry.stop().samples, 0);
  EXPECT_EQ(telemetry.stop().samples, 0);
}

}  // namespace
}  // namespace pounce::cli
