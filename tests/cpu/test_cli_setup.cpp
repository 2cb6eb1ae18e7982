// `pounce run`'s decisions before it runs (cli/run_setup.h): backend choice, defaults, presets.
#include <gtest/gtest.h>

#include "pounce/error.h"
#include "cli/run_setup.h"

namespace pounce::cli {
namespace {

const Machine kNoCuda{false, 0};
const Machine kCudaNoGpu{true, 0};
const Machine kTwoGpus{true, 2};

TEST(CliSetup, ChoosesBackend) {
  EXPECT_EQ(choose_backend("auto", kNoCuda).backend, Backend::kCpu);
  EXPECT_NE(choose_backend("auto", kNoCuda).reason.find("no CUDA device code"), std::string::npos);
  EXPECT_EQ(choose_backend("auto", kCudaNoGpu).backend, Backend::kCpu);
  EXPECT_NE(choose_backend("auto", kCudaNoGpu).reason.find("no CUDA GPU is visible"), std::string::npos);
  EXPECT_EQ(choose_backend("auto", kTwoGpus).backend, Backend::kGpu);
  EXPECT_EQ(choose_backend("cpu", kTwoGpus).backend, Backend::kCpu);
  EXPECT_THROW(choose_backend("gpu", kNoCuda), Error);
  EXPECT_THROW(choose_backend("gpu", kCudaNoGpu), Error);
  EXPECT_THROW(choose_backend("tpu", kTwoGpus), Error);
}

TEST(CliSetup, CpuDefaultsAreSmall) {
  const RunSetup setup = resolve_run(RunOptions{}, choose_backend("auto", kNoCuda), kNoCuda);
  EXPECT_EQ(setup.shape, kCpuDefaultShape);
  EXPECT_EQ(setup.shape.hidden, 512);
  EXPECT_EQ(setup.shape.num_ranks, 2);
  EXPECT_EQ(setup.iters, 1);
  EXPECT_EQ(setup.warmup, 0);
  EXPECT_EQ(setup.check_tokens, 0);  // all tokens on the CPU
}

TEST(CliSetup, PresetOnCpuKeepsDimsWithFewTokens) {
  RunOptions options;
  options.preset = "mixtral-8x7b";
  const RunSetup setup = resolve_run(options, choose_backend("auto", kNoCuda), kNoCuda);
  EXPECT_EQ(setup.shape.hidden, 4096);
  EXPECT_EQ(setup.shape.intermediate, 14336);
  EXPECT_EQ(setup.shape.num_experts, 8);
  EXPECT_EQ(setup.shape.max_tokens, kCpuPresetTokens);
  options.preset = "gpt-oss-120b";
  options.experts = 8;  // keep the test's memory estimate small
  const RunSetup gpt = resolve_run(options, choose_backend("auto", kNoCuda), kNoCuda);
  EXPECT_EQ(gpt.config.activation.kind, ActivationKind::kGptOss);
  EXPECT_EQ(gpt.config.activation.clamp_limit, 7.0f);
}

TEST(CliSetup, GpuDefaultsUseEveryGpu) {
  const RunSetup setup = resolve_run(RunOptions{}, choose_backend("auto", kTwoGpus), kTwoGpus);
  EXPECT_EQ(setup.preset, kGpuDefaultPreset);
  EXPECT_EQ(setup.shape.num_ranks, 2);
  EXPECT_EQ(setup.shape.max_tokens, kGpuDefaultTokens);
  EXPECT_EQ(setup.warmup, 1);
  EXPECT_GE(setup.check_tokens, 8);
  EXPECT_LE(setup.check_tokens, 64);
  RunOptions too_many;
  too_many.ranks = 4;
  EXPECT_THROW(resolve_run(too_many, choose_backend("auto", kTwoGpus), kTwoGpus), Error);
}

TEST(CliSetup, UnknownPresetListsTheKnownOnes) {
  RunOptions options;
  options.preset = "llama-moe";
  try {
    resolve_run(options, choose_backend("cpu", kNoCuda), kNoCuda);
    FAIL() << "an unknown preset must throw";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("llama-moe"), std::string::npos) << message;
    for (const char* name : {"qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b", "mixtral-8x7b"})
      EXPECT_NE(message.find(name), std::string::npos) << message;
  }
  EXPECT_THROW(find_preset(""), Error);
}

TEST(CliSetup, CustomShapeNeedsAllDims) {
  RunOptions options;
  options.hidden = 256;
  options.intermediate = 128;
  EXPECT_THROW(resolve_run(options, choose_backend("cpu", kNoCuda), kNoCuda), Error);
  options.experts = 4;
  options.topk = 2;
  const RunSetup setup = resolve_run(options, choose_backend("cpu", kNoCuda), kNoCuda);
  EXPECT_EQ(setup.preset, "custom");
  EXPECT_EQ(setup.shape.shared_intermediate, 0);
  EXPECT_EQ(setup.shape.max_tokens, kCpuDefaultShape.max_tokens);
  options.experts = 3;  // not divisible by 2 ranks
  EXPECT_THROW(resolve_run(options, choose_backend("cpu", kNoCuda), kNoCuda), Error);
  options.experts = 4;
  options.activation = "relu";
  EXPECT_THROW(resolve_run(options, choose_backend("cpu", kNoCuda), kNoCuda), Error);
}

// --kernel picks the forward path, --backward-kernel the backward's (auto, by shape, unless asked); a typo
// names the option and the choices.
TEST(CliSetup, KernelPathsPerPass) {
  RunOptions options;
  const RunSetup defaults = resolve_run(options, choose_backend("cpu", kNoCuda), kNoCuda);
  EXPECT_EQ(defaults.config.kernel_path, KernelPath::kFused);
  EXPECT_EQ(defaults.config.backward_kernel_path, KernelPath::kAuto);
  options.kernel = "staged";
  options.backward_kernel = "fused";
  const RunSetup swapped = resolve_run(options, choose_backend("cpu", kNoCuda), kNoCuda);
  EXPECT_EQ(swapped.config.kernel_path, KernelPath::kStaged);
  EXPECT_EQ(swapped.config.backward_kernel_path, KernelPath::kFused);
  options.kernel = "auto";
  options.backward_kernel = "staged";
  const RunSetup chosen = resolve_run(options, choose_backend("cpu", kNoCuda), kNoCuda);
  EXPECT_EQ(chosen.config.kernel_path, KernelPath::kAuto);
  EXPECT_EQ(chosen.config.backward_kernel_path, KernelPath::kStaged);
  options.backward_kernel = "fast";
  try {
    resolve_run(options, choose_backend("cpu", kNoCuda), kNoCuda);
    FAIL() << "an unknown backward kernel must throw";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("--backward-kernel fast"), std::string::npos) << message;
    EXPECT_NE(message.find("auto, fused or staged"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace pounce::cli
