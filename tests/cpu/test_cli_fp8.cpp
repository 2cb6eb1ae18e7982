// `pounce run --precision fp8` and `pounce bench --precision fp8` on the CPU backend (cli/run_command.cpp,
// cli/reference_check.h, cli/bench*.cpp): the option and its errors, the CPU reference at a check plan's
// coordinates (bitwise the layer's values), the FP8 error budget, a whole checked run and a whole bench run
// with their JSON fields, and the FP8 records' speed-up over BF16.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>

#include "pounce/error.h"
#include "cli/bench.h"
#include "cli/commands.h"
#include "cli/reference_check.h"
#include "cli/run_setup.h"
#include "cli/runner.h"

namespace pounce::cli {
namespace {

using nlohmann::json;

// H and I of 1.5 FP8 blocks (a partial K block in every GEMM), 2 ranks, a shared expert.
Shape fp8_shape() {
  Shape shape;
  shape.max_tokens = 40;
  shape.hidden = 192;
  shape.intermediate = 192;
  shape.num_experts = 4;
  shape.num_topk = 2;
  shape.shared_intermediate = 64;
  shape.num_ranks = 2;
  return shape;
}

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

std::filesystem::path temp_path(const std::string& name) {
  return std::filesystem::temp_directory_path() /
         ("pounce_fp8_test_" + std::to_string(::getpid()) + "_" + name);
}

json read_json(const std::filesystem::path& path) {
  std::ifstream file(path);
  return json::parse(file);
}

RunOptions fp8_run_options(const std::string& json_path) {
  const Shape s = fp8_shape();
  RunOptions options;
  options.hidden = s.hidden;
  options.intermediate = s.intermediate;
  options.experts = s.num_experts;
  options.topk = s.num_topk;
  options.shared_intermediate = s.shared_intermediate;
  options.tokens = s.max_tokens;
  options.ranks = static_cast<int>(s.num_ranks);
  options.backend = "cpu";
  options.precision = "fp8";
  options.json = json_path;
  return options;
}

const Machine kNoCuda{false, 0};

TEST(CliFp8, PrecisionOptionAndItsErrors) {
  EXPECT_EQ(parse_precision("bf16"), Precision::kBF16);
  EXPECT_EQ(parse_precision("fp8"), Precision::kFP8);
  EXPECT_EQ(error_of([] { parse_precision("fp16"); }),
            "pounce: --precision fp16 is unknown; choose bf16 or fp8");

  const BackendChoice cpu = choose_backend("cpu", kNoCuda);
  EXPECT_EQ(resolve_run(RunOptions{}, cpu, kNoCuda).config.precision, Precision::kBF16) << "the default";
  RunOptions options = fp8_run_options("");
  EXPECT_EQ(resolve_run(options, cpu, kNoCuda).config.precision, Precision::kFP8);
  options.precision = "e4m3";
  EXPECT_NE(error_of([&] { resolve_run(options, cpu, kNoCuda); }).find("--precision e4m3 is unknown"),
            std::string::npos);
  // The layer rejects biases in FP8 only when it is called; the CLI says so before anything runs, in its
  // options' names.
  options.precision = "fp8";
  options.biases = true;
  const std::string biases = error_of([&] { resolve_run(options, cpu, kNoCuda); });
  EXPECT_NE(biases.find("--biases with --precision fp8"), std::string::npos) << biases;
  EXPECT_NE(biases.find("BF16-only"), std::string::npos) << biases;
  options.precision = "bf16";
  EXPECT_EQ(resolve_run(options, cpu, kNoCuda).config.precision, Precision::kBF16) << "biases run in BF16";

  BenchOptions bench;
  bench.backend = "cpu";
  bench.precision = "fp16";
  EXPECT_EQ(error_of([&] { bench_command(bench, "pounce bench"); }),
            "pounce: --precision fp16 is unknown; choose bf16 or fp8");
}

// The smaller problems reference_evaluate gives the reference yield exactly what the layer (the CPU backend
// runs the same reference on the whole problem) produced at the plan's coordinates: FP8, and BF16 with
// biases, on sampled plans: 1 expert per rank of 4; k = 8 > R x 1 sampled experts (the experts problem
// packs each token's pairs into 2 slots, its schedule segments of 160 rows as they were); 2 tokens per rank
// using at most 8 of 64 experts (the tokens problem renumbers them); the tokens in batches of one token, and
// of a few.
TEST(CliFp8, ReferenceAtAPlanIsTheWholeLayersValues) {
  struct Case {
    const char* name;
    Shape shape;
    PlanOptions plan;
    double batch_bytes = kReferenceBatchBytes;
  };
  Shape wide_topk = fp8_shape();
  wide_topk.num_experts = 16;
  wide_topk.num_topk = 8;
  wide_topk.max_tokens = 160;  // 160 rows per expert: two 128-row token-axis blocks
  Shape many_experts = fp8_shape();
  many_experts.num_experts = 64;
  many_experts.num_topk = 4;
  Shape batched = fp8_shape();
  batched.num_experts = 16;
  batched.num_topk = 4;
  const double expert_bytes = kReferenceBytesPerWeight * 3.0 * batched.hidden * batched.intermediate;
  const std::vector<Case> cases = {
      {"4 experts, k = 2", fp8_shape(), {5, 1, 3, 11}},
      {"16 experts, k = 8 > 2 x 1 sampled", wide_topk, {5, 1, 3, 11}},
      {"64 experts, k = 4, 2 tokens", many_experts, {2, 2, 3, 11}},
      {"batches of one token", batched, {6, 2, 3, 11}, 1.0},
      {"batches of up to 10 experts", batched, {6, 2, 3, 11}, 10.5 * expert_bytes},
  };
  for (const Case& c : cases) {
    for (const Precision precision : {Precision::kFP8, Precision::kBF16}) {
      const bool biases = precision == Precision::kBF16;
      SCOPED_TRACE(::testing::Message() << c.name << ", " << to_string(precision));
      const HostProblem problem = generate_problem(c.shape, Activation::swiglu(), 11, 0, {}, biases);
      const CheckPlan plan = make_check_plan(problem, c.plan);
      RunRequest request;
      request.problem = &problem;
      request.config.backend = Backend::kCpu;
      request.config.precision = precision;
      request.plan = &plan;
      const RunOutcome outcome = run_on_cpu(request);
      ASSERT_TRUE(outcome.backward_ran) << outcome.backward_error;
      EXPECT_EQ(outcome.weight_quantize_ms.has_value(), precision == Precision::kFP8);

      const SampledTensors ref = reference_evaluate(problem, plan, true, precision, 2, c.batch_bytes);
      for (int f = 0; f < kNumFields; ++f) {
        const Field field = static_cast<Field>(f);
        const bool shared =
            field == Field::kDSharedGate || field == Field::kDSharedUp || field == Field::kDSharedDown;
        const bool bias =
            field == Field::kDRoutedBGate || field == Field::kDRoutedBUp || field == Field::kDRoutedBDown;
        if (shared || (bias && !biases)) {
          EXPECT_TRUE(ref[field].empty()) << field_name(field) << ": the shared expert is dense_evaluate's";
          continue;
        }
        ASSERT_FALSE(ref[field].empty()) << field_name(field);
        EXPECT_EQ(ref[field], outcome.observed[field]) << field_name(field);
      }
      const SampledTensors forward = reference_evaluate(problem, plan, false, precision, 2, c.batch_bytes);
      EXPECT_EQ(forward[Field::kOut], outcome.observed[Field::kOut]) << "forward only";
      for (int f = 1; f < kNumFields; ++f) EXPECT_TRUE(forward.values[f].empty()) << f;
    }
  }
}

// k > R x the sampled experts packs a token's pairs to them into min(k, R x n) slots, which only a token
// repeating an expert overflows: refused by name.
TEST(CliFp8, ReferenceRefusesATokenRepeatingASampledExpert) {
  Shape shape = fp8_shape();
  shape.num_experts = 16;
  shape.num_topk = 8;
  HostProblem problem = generate_problem(shape, Activation::swiglu(), 11);
  const CheckPlan plan = make_check_plan(problem, {5, 1, 3, 11});
  const int32_t sampled = static_cast<int32_t>(plan.experts[0][0]);  // rank 0's: global id = local id
  for (int j = 0; j < 3; ++j) problem.ranks[0].topk_idx[7 * shape.num_topk + j] = sampled;
  const std::string error = error_of([&] { reference_evaluate(problem, plan, true, Precision::kFP8, 2); });
  EXPECT_NE(error.find("token 7 of rank 0 routes more than 2 of its 8 pairs to the 2 sampled experts"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("repeats an expert"), std::string::npos) << error;
}

// The FP8 check's host memory on a GPU machine: deepseek-v3 at 2048 tokens on one GPU (the whole-layer
// estimate, 303 GB, refused it on a 128 GiB host), at the default check tokens of this machine and of an
// H200 host (16 cores: 40 tokens), and at the most the default gives (64); qwen3-30b-a3b beside it.
TEST(CliFp8, CheckMemoryIsTheReducedProblems) {
  Shape deepseek = find_preset("deepseek-v3").shape;
  deepseek.max_tokens = 2048;
  deepseek.num_ranks = 1;
  const RunOptions defaults;
  EXPECT_GT(estimate_cpu_bytes(deepseek), 300e9) << "the whole layer's";
  const int64_t here = default_check_tokens(deepseek);
  for (const int64_t tokens : {here, int64_t{40}, int64_t{64}}) {
    for (const int threads : {16, 128}) {
      const double bytes = estimate_reference_check_bytes(deepseek, tokens, defaults.check_experts, threads);
      std::cout << "deepseek-v3, 2048 tokens x 1 rank, " << tokens << " check tokens, " << threads
                << " threads: " << bytes / 1e9 << " GB\n";
      EXPECT_LT(bytes, 100e9) << tokens << " tokens, " << threads << " threads";
      // At least the host inputs (bf16, every expert) and 42 experts' reference weights (one batch).
      const double inputs = 2.0 * 3.0 * 7168.0 * (256.0 * 2048.0 + 2048.0);
      EXPECT_GT(bytes, inputs + 42.0 * kReferenceBytesPerWeight * 3.0 * 7168.0 * 2048.0);
    }
  }
  // Unbatched, the 40 tokens' 320 pairs may reach every expert.
  EXPECT_GT(estimate_reference_check_bytes(deepseek, 40, 2, 16, 1e300),
            3.0 * 7168.0 * 2048.0 * 256.0 * (2.0 + kReferenceBytesPerWeight));
  Shape qwen = find_preset("qwen3-30b-a3b").shape;
  qwen.max_tokens = 2048;
  qwen.num_ranks = 1;
  for (const int64_t tokens : {int64_t{40}, int64_t{64}}) {  // 64: its default on a 16-core host
    const double qwen_bytes = estimate_reference_check_bytes(qwen, tokens, defaults.check_experts, 16);
    std::cout << "qwen3-30b-a3b, 2048 tokens x 1 rank, " << tokens
              << " check tokens, 16 threads: " << qwen_bytes / 1e9 << " GB\n";
    EXPECT_LT(qwen_bytes, 30e9);
  }
  Shape deepseek8 = deepseek;
  deepseek8.num_ranks = 8;
  std::cout << "deepseek-v3, 2048 tokens x 8 ranks, 40 check tokens, 128 threads: "
            << estimate_reference_check_bytes(deepseek8, 40, 2, 128) / 1e9 << " GB\n";
}

TEST(CliFp8, BudgetIsRelativeErrorAndGradientCosine) {
  SampledTensors bf16, fp8;
  bf16[Field::kOut] = {1.0, 2.0, 3.0, 4.0};
  fp8[Field::kOut] = {1.0, 2.0, 3.0, 4.5};  // 0.5 / sqrt(30) = 0.091: within 0.1
  bf16[Field::kDX] = {1.0, 0.0};
  fp8[Field::kDX] = {1.0, 0.09};  // rel err 0.09, cosine 0.996: just out
  bf16[Field::kDTopkWeights] = {0.0, 0.0};
  fp8[Field::kDTopkWeights] = {0.0, 0.0};  // an expert no token chose: both zero agree
  bf16[Field::kDRoutedGate] = {1.0, 2.0};
  fp8[Field::kDRoutedGate] = {1.0, NAN};
  bf16[Field::kDRoutedUp] = {1.0, 2.0};
  fp8[Field::kDRoutedUp] = {1.0};
  const std::vector<BudgetCheck> checks = check_fp8_budget(fp8, bf16);
  ASSERT_EQ(checks.size(), 5u) << "one per field the BF16 side has";
  EXPECT_EQ(checks[0].name, "out");
  EXPECT_FALSE(checks[0].gradient);
  EXPECT_NEAR(checks[0].rel_error, 0.5 / std::sqrt(30.0), 1e-12);
  EXPECT_TRUE(checks[0].passed);
  EXPECT_EQ(checks[1].name, "d_x");
  EXPECT_TRUE(checks[1].gradient);
  EXPECT_LT(checks[1].rel_error, kFp8MaxRelError);
  EXPECT_LT(checks[1].cosine, kFp8MinGradCosine);
  EXPECT_FALSE(checks[1].passed) << "within the relative error, not the cosine";
  EXPECT_TRUE(checks[2].passed);
  EXPECT_DOUBLE_EQ(checks[2].cosine, 1.0);
  EXPECT_FALSE(checks[3].passed) << "non-finite";
  EXPECT_FALSE(checks[4].passed) << "a size mismatch";
}

// `pounce run --precision fp8`: PASS against the FP8 reference (exactly: the CPU backend is the reference)
// and within the budget of BF16 (and visibly not BF16), with the weights' quantization time.
TEST(CliFp8, RunChecksAgainstTheFp8ReferenceAndWithinTheBudget) {
  for (const int64_t check_tokens : {int64_t{0}, int64_t{5}}) {
    SCOPED_TRACE(::testing::Message() << "check tokens " << check_tokens);
    const std::filesystem::path path = temp_path("run.json");
    RunOptions options = fp8_run_options(path.string());
    options.check_tokens = check_tokens;
    options.check_experts = check_tokens == 0 ? 2 : 1;
    ASSERT_EQ(run_command(options), 0);
    const json report = read_json(path);
    std::filesystem::remove(path);
    EXPECT_TRUE(report["passed"].get<bool>());
    EXPECT_EQ(report["precision"], "fp8");
    EXPECT_NE(report["check"]["method"].get<std::string>().find("CPU reference in FP8"), std::string::npos);
    ASSERT_EQ(report["check"]["tensors"].size(), 9u);
    for (const json& tensor : report["check"]["tensors"]) {
      EXPECT_TRUE(tensor["passed"].get<bool>()) << tensor["name"];
      if (tensor["name"].get<std::string>().rfind("d_shared", 0) != 0) {
        EXPECT_EQ(tensor["rel_error"].get<double>(), 0.0) << tensor["name"];
      }
    }
    const json& budget = report["fp8_budget"];
    EXPECT_TRUE(budget["passed"].get<bool>());
    EXPECT_EQ(budget["max_rel_error"], 0.1);
    EXPECT_EQ(budget["min_gradient_cosine"], 0.996);
    ASSERT_EQ(budget["tensors"].size(), 9u);
    for (const json& tensor : budget["tensors"]) {
      const std::string name = tensor["name"];
      EXPECT_TRUE(tensor["passed"].get<bool>()) << name;
      EXPECT_LE(tensor["rel_error"].get<double>(), 0.1) << name;
      EXPECT_EQ(tensor["cosine"].is_null(), name == "out") << name;
      if (name.rfind("d_shared", 0) != 0) {
        EXPECT_GT(tensor["rel_error"].get<double>(), 1e-2) << name << ": FP8 rounds differently from BF16";
      }
    }
    ASSERT_TRUE(report["timing"]["weight_quantize_ms"].is_number());
    EXPECT_GT(report["timing"]["weight_quantize_ms"].get<double>(), 0.0);
  }
  const std::filesystem::path path = temp_path("bf16.json");
  RunOptions bf16 = fp8_run_options(path.string());
  bf16.precision = "bf16";
  ASSERT_EQ(run_command(bf16), 0);
  const json report = read_json(path);
  std::filesystem::remove(path);
  EXPECT_EQ(report["precision"], "bf16");
  EXPECT_TRUE(report["fp8_budget"].is_null());
  EXPECT_TRUE(report["timing"]["weight_quantize_ms"].is_null());
}

// `pounce bench --precision fp8`: the BF16 layer beside the FP8 one on the same inputs, FP8 records with
// speedup_vs_bf16 and weight_quantize_ms, recorded into ep<R>_fp8.json (the BF16 ones into ep<R>_bf16.json).
TEST(CliFp8, BenchMeasuresTheFp8LayerBesideTheBf16One) {
  const std::filesystem::path path = temp_path("bench.json");
  BenchOptions options;
  options.presets = {"custom:192:192:4:2:64"};
  options.tokens = {24};
  options.backend = "cpu";
  options.precision = "fp8";
  options.warmup = 0;
  options.iters = 2;
  options.input_sets = 2;
  options.plot_script = "";
  options.out = path.string();
  ASSERT_EQ(bench_command(options, "pounce bench --precision fp8"), 0);
  const json records = read_json(path);
  std::filesystem::remove(path);
  ASSERT_EQ(records.size(), 4u) << "forward and forward_backward, BF16 then FP8";
  std::map<std::string, double> bf16_ms;
  for (const json& r : records) {
    ASSERT_TRUE(r["median_ms"].is_number()) << r.value("error", "");
    if (r["precision"] == "bf16") {
      bf16_ms[r["pass"]] = r["median_ms"].get<double>();
      EXPECT_FALSE(r.contains("speedup_vs_bf16"));
      EXPECT_FALSE(r.contains("weight_quantize_ms"));
    }
  }
  for (const json& r : records) {
    if (r["precision"] != "fp8") continue;
    EXPECT_EQ(r["impl"], "fused");
    EXPECT_EQ(r["input_sets"], 2);
    ASSERT_TRUE(r["speedup_vs_bf16"].is_number()) << r["pass"];
    EXPECT_DOUBLE_EQ(r["speedup_vs_bf16"].get<double>(),
                     bf16_ms.at(r["pass"]) / r["median_ms"].get<double>());
    ASSERT_TRUE(r["weight_quantize_ms"].is_number());
    EXPECT_GT(r["weight_quantize_ms"].get<double>(), 0.0);
    EXPECT_NE(r["precision_notes"].get<std::string>().find("the baseline and the peers are BF16"),
              std::string::npos);
  }

  const std::filesystem::path dir = temp_path("results");
  EXPECT_EQ(record_results(dir.string(), records),
            (std::vector<std::string>{(dir / "ep2_bf16.json").string(), (dir / "ep2_fp8.json").string()}));
  for (const json& r : read_json(dir / "ep2_fp8.json")) EXPECT_EQ(r["precision"], "fp8");
  EXPECT_EQ(read_json(dir / "ep2_fp8.json").size(), 2u);
  std::filesystem::remove_all(dir);
}

// speedup_vs_bf16 pairs each FP8 record with the BF16 record of its impl, pass, preset, ranks and tokens; the
// baseline's (BF16) ratios reach both precisions without one's times standing in for the other's.
TEST(CliFp8, SpeedupVsBf16IsPerImplAndPass) {
  auto record = [](const char* impl, const char* pass, const char* precision, double ms) {
    return json{{"impl", impl},
                {"pass", pass},
                {"preset", "qwen3-30b-a3b"},
                {"ranks", 2},
                {"tokens_per_rank", 8192},
                {"precision", precision},
                {"median_ms", ms}};
  };
  json records = {
      record("fused", "forward", "bf16", 1.5),          record("fused", "forward", "fp8", 1.0),
      record("fused", "forward_backward", "bf16", 6.0), record("fused", "forward_backward", "fp8", 5.0),
      record("staged", "forward", "fp8", 2.0),          record("baseline", "forward", "bf16", 3.0),
      record("floor", "forward", "bf16", 0.9)};
  apply_speedups(records);
  EXPECT_FALSE(records[0].contains("speedup_vs_bf16"));
  EXPECT_DOUBLE_EQ(records[1]["speedup_vs_bf16"].get<double>(), 1.5);
  EXPECT_DOUBLE_EQ(records[3]["speedup_vs_bf16"].get<double>(), 1.2);
  EXPECT_TRUE(records[4]["speedup_vs_bf16"].is_null()) << "no BF16 staged record";
  EXPECT_DOUBLE_EQ(records[0]["speedup_vs_baseline"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(records[1]["speedup_vs_baseline"].get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(records[1]["floor_fraction"].get<double>(), 0.9);
  EXPECT_TRUE(records[3]["speedup_vs_baseline"].is_null()) << "no baseline forward_backward";
}

}  // namespace
}  // namespace pounce::cli
