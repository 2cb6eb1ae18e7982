// Grouped GEMM throughput on the expert shapes of the model presets (compute only, rows already grouped).
//
// For each case: random bf16 inputs (a 1M-element random pattern replicated on the device), warm-up, then
// kIters launches timed one by one with CUDA events; prints the median time and TFLOP/s counted as
// 2 * rows * n * k per GEMM (gate/up counts both GEMMs). Weights exceed L2 for the large cases, so no
// input rotation is needed. Usage: pounce_gemm_bench [filter-substring]
// With --fp8: the FP8 kinds (src/gpu/fp8_gemm.h), each launch alternated with the bf16 kind of the same
// shape and FLOPs, and their ratio (gate/up: the FP8 gate/up kind against the bf16 one's two
// GEMMs with the activation; the FP8 one also quantizes a, and does not store a in bf16).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "src/gpu/fp8_gemm.h"
#include "src/gpu/grouped_gemm.h"

namespace {

constexpr int kWarmup = 2;
constexpr int kIters = 10;

#define BENCH_CUDA(expr)                                                        \
  do {                                                                          \
    const cudaError_t err_ = (expr);                                            \
    if (err_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(err_)); \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)

// Which entry point: forward store / gate-up; backward activation (d_a GEMM + act'), transposed-weight
// d_x GEMM (K split over gate and up), weight gradient (n x k output per group, reduction over its rows).
enum class Kind { kStore, kGateUp, kActivationBackward, kTransposed, kWeightGrad };
constexpr int kVariants = 2;
constexpr const char* kScheduleLabels[kVariants] = {" pingpong", " cooperative"};

struct Case {
  const char* name;
  std::vector<int32_t> rows_per_group;  // multiples of 128
  int64_t n, k;                         // weight gradient: output [n, k] per group
  Kind kind;
  // Rows holding data per group (the rest of each segment is zero padding, as the layer's), empty = all. With
  // them the case runs twice, launches interleaved (clocks drift between cases by 10-25 % on the long ones):
  // the padding computed, and named (GroupedRows::group_rows) so that the GEMM skips work on it.
  std::vector<int32_t> data_rows = {};
};

std::vector<int32_t> balanced(int groups, int rows) {
  return std::vector<int32_t>(groups, rows);
}

// Rows per local expert as routing gives them: about `mean` each (sd sqrt(mean), a fixed draw).
std::vector<int32_t> routed(int groups, int mean) {
  std::mt19937 gen(2026);
  std::normal_distribution<double> dist(mean, std::sqrt(static_cast<double>(mean)));
  std::vector<int32_t> out;
  for (int g = 0; g < groups; ++g) out.push_back(std::max(1, static_cast<int>(std::lround(dist(gen)))));
  return out;
}
// Segments of those rows padded to 128, as the schedule lays them out.
std::vector<int32_t> padded(const std::vector<int32_t>& data_rows) {
  std::vector<int32_t> out;
  for (int32_t r : data_rows) out.push_back((r + 127) / 128 * 128);
  return out;
}
// One case over routed rows.
Case routed_case(const char* name, int groups, int mean, int64_t n, int64_t k, Kind kind) {
  const std::vector<int32_t> data = routed(groups, mean);
  return {name, padded(data), n, k, kind, data};
}

// Deterministic imbalance: 0..14 blocks of 128 rows per group, several empty groups.
std::vector<int32_t> skewed(int groups) {
  std::vector<int32_t> out;
  for (int g = 0; g < groups; ++g) out.push_back(128 * ((g * 37) % 15));
  return out;
}

// Fills `count` bf16 with a replicated random pattern (values in [-0.5, 0.5)).
void fill_random(uint16_t* dst, size_t count) {
  constexpr size_t kPattern = 1 << 20;
  static std::vector<uint16_t> pattern = [] {
    std::mt19937 gen(7);
    std::uniform_real_distribution<float> dist(-0.5f, 0.5f);
    std::vector<uint16_t> p(kPattern);
    for (auto& v : p) {
      const float f = dist(gen);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      v = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
    return p;
  }();
  const size_t first = std::min(count, kPattern);
  BENCH_CUDA(cudaMemcpy(dst, pattern.data(), first * 2, cudaMemcpyHostToDevice));
  for (size_t done = first; done < count;) {
    const size_t chunk = std::min(done, count - done);
    BENCH_CUDA(cudaMemcpy(dst + done, dst, chunk * 2, cudaMemcpyDeviceToDevice));
    done += chunk;
  }
}

void run_case(const Case& c) {
  std::vector<int32_t> off(c.rows_per_group.size() + 1, 0);
  for (size_t g = 0; g < c.rows_per_group.size(); ++g) off[g + 1] = off[g] + c.rows_per_group[g];
  const int64_t rows = off.back();
  const int num_groups = static_cast<int>(c.rows_per_group.size());
  const size_t w_count = static_cast<size_t>(num_groups) * c.n * c.k;
  // Weight gradient: A [rows, n], B [rows, k]; otherwise A [rows, k], C [rows, n].
  const size_t a_count = static_cast<size_t>(rows) * (c.kind == Kind::kWeightGrad ? c.n : c.k);
  const size_t o_count = static_cast<size_t>(rows) * std::max(c.n, c.k);
  const bool gate_up = c.kind != Kind::kStore;  // every other kind reads a second operand or writes two
  uint16_t *a, *w0, *w1 = nullptr, *o0, *o1 = nullptr, *o2 = nullptr;
  int32_t* d_off;
  BENCH_CUDA(cudaMalloc(&a, a_count * 2));
  BENCH_CUDA(cudaMalloc(&w0, w_count * 2));
  BENCH_CUDA(cudaMalloc(&o0, o_count * 2));
  if (gate_up) {
    BENCH_CUDA(cudaMalloc(&w1, w_count * 2));
    BENCH_CUDA(cudaMalloc(&o1, o_count * 2));
    BENCH_CUDA(cudaMalloc(&o2, o_count * 2));
    fill_random(w1, w_count);
  }
  BENCH_CUDA(cudaMalloc(&d_off, off.size() * 4));
  BENCH_CUDA(cudaMemcpy(d_off, off.data(), off.size() * 4, cudaMemcpyHostToDevice));
  fill_random(a, a_count);
  fill_random(w0, w_count);
  int32_t* d_data_rows = nullptr;
  int64_t useful_rows = rows;
  if (!c.data_rows.empty()) {  // zero padding rows of A; FLOPs count the rows holding data
    const int64_t a_cols = c.kind == Kind::kWeightGrad ? c.n : c.k;
    useful_rows = 0;
    for (int g = 0; g < num_groups; ++g) {
      useful_rows += c.data_rows[g];
      BENCH_CUDA(cudaMemset(a + (off[g] + c.data_rows[g]) * a_cols, 0,
                            (off[g + 1] - off[g] - c.data_rows[g]) * a_cols * 2));
    }
    BENCH_CUDA(cudaMalloc(&d_data_rows, c.data_rows.size() * 4));
    BENCH_CUDA(cudaMemcpy(d_data_rows, c.data_rows.data(), c.data_rows.size() * 4, cudaMemcpyHostToDevice));
  }

  const pounce::kernels::GroupedRows plain{rows, d_off, num_groups};
  pounce::kernels::GroupedRows named = plain;
  named.group_rows = d_data_rows;
  const pounce::kernels::ActivationParams act{pounce::kernels::kActivationSwiGLU, 7.0f, 1.0f};
  // Weight gradients and the activation backward: variant 0 the ping-pong tiles, variant 1 the cooperative
  // ones (pounce::kernels::TileSchedule), both over the named rows when the case has data rows. Other kinds:
  // variant 0 computes the padding, 1 names it.
  const bool two_schedules = c.kind == Kind::kWeightGrad || c.kind == Kind::kActivationBackward;
  const auto schedule = [](int variant) {
    return variant == 0 ? pounce::kernels::TileSchedule::kPingPong
                        : pounce::kernels::TileSchedule::kCooperative;
  };
  auto launch = [&](const pounce::kernels::GroupedRows& grouped, int variant) {
    switch (c.kind) {
      case Kind::kGateUp:
        pounce::kernels::grouped_gate_up(grouped, a, w0, w1, o0, o1, o2, c.n, c.k, act, nullptr);
        break;
      case Kind::kStore:
        pounce::kernels::grouped_gemm(grouped, a, w0, o0, c.n, c.k, nullptr);
        break;
      case Kind::kActivationBackward:  // w0 as [groups, k, n]; o1, o2 hold g and u
        pounce::kernels::grouped_activation_backward(grouped, a, w0, o1, o2, o0, o0, c.n, c.n, c.k, act,
                                                     nullptr, schedule(variant));
        break;
      case Kind::kTransposed:  // K = 2 x half, gate rows then up rows
        pounce::kernels::grouped_gemm_transposed(grouped, a, w0, w1, c.k / 2, o0, c.n, c.k, nullptr);
        break;
      case Kind::kWeightGrad:  // d[g] [n, k] bf16 = A^T B over the group's rows; w0 is the output
        pounce::kernels::grouped_weight_grad(grouped, a, c.n, c.n, o1, c.k, c.k, w0,
                                             pounce::kernels::WeightGradMode::kStoreBf16, nullptr,
                                             schedule(variant));
        break;
    }
  };
  cudaEvent_t start, stop;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
  const int variants = two_schedules ? kVariants : c.data_rows.empty() ? 1 : 2;
  const pounce::kernels::GroupedRows* launches[kVariants] = {two_schedules ? &named : &plain, &named};
  for (int i = 0; i < kWarmup; ++i) {
    for (int v = 0; v < variants; ++v) launch(*launches[v], v);
  }
  std::vector<float> ms[kVariants];
  for (auto& m : ms) m.resize(kIters);
  for (int i = 0; i < kIters; ++i) {
    for (int v = 0; v < variants; ++v) {
      BENCH_CUDA(cudaEventRecord(start));
      launch(*launches[v], v);
      BENCH_CUDA(cudaEventRecord(stop));
      BENCH_CUDA(cudaEventSynchronize(stop));
      BENCH_CUDA(cudaEventElapsedTime(&ms[v][i], start, stop));
    }
  }
  const double flops = 2.0 * useful_rows * c.n * c.k * (c.kind == Kind::kGateUp ? 2 : 1);
  const int32_t err = pounce::kernels::grouped_gemm_error_code(true);
  for (int v = 0; v < variants; ++v) {
    std::sort(ms[v].begin(), ms[v].end());
    const double median_ms = ms[v][kIters / 2];
    const char* label = two_schedules ? kScheduleLabels[v] : (v == 1 ? " named" : "");
    const std::string name = std::string(c.name) + label;
    std::printf("| %-34s | %4d | %7lld | %5lld | %5lld | %8.3f | %6.1f | %s |\n", name.c_str(), num_groups,
                static_cast<long long>(rows), static_cast<long long>(c.n), static_cast<long long>(c.k),
                median_ms, flops / (median_ms * 1e-3) / 1e12, err == 0 ? "ok" : "WAIT-TIMEOUT");
  }
  for (void* p : {static_cast<void*>(a), static_cast<void*>(w0), static_cast<void*>(w1),
                  static_cast<void*>(o0), static_cast<void*>(o1), static_cast<void*>(o2),
                  static_cast<void*>(d_off), static_cast<void*>(d_data_rows)}) {
    cudaFree(p);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

// ---- FP8 against bf16 ------------------------------------------------------------------------------------

enum class Fp8Kind { kGateUp, kStore, kPair, kWeightGrad };
struct Fp8Case {
  const char* name;
  std::vector<int32_t> rows_per_group;
  int64_t n, k;  // kGateUp: n = I (the FP8 GEMM runs n = 2I); kPair: k = 2I, two halves; wgrad: [n, k]
  Fp8Kind kind;
};

// e4m3 bytes from a random pattern with the exponent's top bit cleared (|v| < 2, never NaN).
void fill_random_e4m3(uint8_t* dst, size_t count) {
  constexpr size_t kPattern = 1 << 20;
  static std::vector<uint8_t> pattern = [] {
    std::mt19937 gen(11);
    std::vector<uint8_t> p(kPattern);
    for (auto& v : p) v = static_cast<uint8_t>(gen() & 0xBFu);
    return p;
  }();
  const size_t first = std::min(count, kPattern);
  BENCH_CUDA(cudaMemcpy(dst, pattern.data(), first, cudaMemcpyHostToDevice));
  for (size_t done = first; done < count;) {
    const size_t chunk = std::min(done, count - done);
    BENCH_CUDA(cudaMemcpy(dst + done, dst, chunk, cudaMemcpyDeviceToDevice));
    done += chunk;
  }
}

float* power_of_two_scales(size_t count) {
  std::vector<float> host(count);
  for (size_t i = 0; i < count; ++i) host[i] = std::ldexp(1.0f, static_cast<int>(i % 7) - 3);
  float* d = nullptr;
  BENCH_CUDA(cudaMalloc(&d, count * 4 + 16));
  BENCH_CUDA(cudaMemcpy(d, host.data(), count * 4, cudaMemcpyHostToDevice));
  return d;
}

void run_fp8_case(const Fp8Case& c) {
  std::vector<int32_t> off(c.rows_per_group.size() + 1, 0);
  for (size_t g = 0; g < c.rows_per_group.size(); ++g) off[g + 1] = off[g] + c.rows_per_group[g];
  const int64_t rows = off.back();
  const int groups = static_cast<int>(c.rows_per_group.size());
  const int64_t fp8_n = c.kind == Fp8Kind::kGateUp ? 2 * c.n : c.n;
  const size_t big = static_cast<size_t>(std::max<int64_t>(fp8_n, c.k));
  // Every operand sized for the largest use: activations [rows, max(n, k)], weights [groups, 2n or n, k].
  const size_t act_count = static_cast<size_t>(rows) * big;
  const size_t w_count = static_cast<size_t>(groups) * fp8_n * c.k;
  uint8_t *qa, *qb;
  uint16_t *a16, *w16a, *w16b, *o0, *o1, *o2;
  int32_t* d_off;
  BENCH_CUDA(cudaMalloc(&qa, act_count));
  BENCH_CUDA(cudaMalloc(&qb, std::max(w_count, act_count)));
  BENCH_CUDA(cudaMalloc(&a16, act_count * 2));
  BENCH_CUDA(cudaMalloc(&w16a, std::max(w_count, act_count) * 2));
  BENCH_CUDA(cudaMalloc(&w16b, std::max(w_count, act_count) * 2));
  for (uint16_t** o : {&o0, &o1, &o2}) BENCH_CUDA(cudaMalloc(o, std::max(act_count, w_count) * 2));
  fill_random_e4m3(qa, act_count);
  fill_random_e4m3(qb, std::max(w_count, act_count));
  fill_random(a16, act_count);
  fill_random(w16a, std::max(w_count, act_count));
  fill_random(w16b, std::max(w_count, act_count));
  fill_random(o1, std::max(act_count, w_count));
  fill_random(o2, std::max(act_count, w_count));
  float* a_scale = power_of_two_scales(static_cast<size_t>((big + 127) / 128 + 1) * (rows + big + 4));
  float* b_scale =
      power_of_two_scales(static_cast<size_t>(groups) * ((fp8_n + 127) / 128) * ((c.k + 127) / 128) +
                          static_cast<size_t>((rows + 127) / 128) * (big + 4));
  float* out_scale = power_of_two_scales(static_cast<size_t>((c.n + 127) / 128) * rows);
  BENCH_CUDA(cudaMalloc(&d_off, off.size() * 4));
  BENCH_CUDA(cudaMemcpy(d_off, off.data(), off.size() * 4, cudaMemcpyHostToDevice));
  const pounce::kernels::GroupedRows grouped{rows, d_off, groups};
  const pounce::kernels::ActivationParams act{pounce::kernels::kActivationSwiGLU, 7.0f, 1.0f};
  using pounce::kernels::Fp8Columns;
  using pounce::kernels::Fp8Matrices;
  using pounce::kernels::Fp8Rows;
  auto launch = [&](bool fp8) {
    switch (c.kind) {
      case Fp8Kind::kGateUp:
      case Fp8Kind::kStore:
        if (fp8 && c.kind == Fp8Kind::kGateUp) {  // g, u, and a's FP8 copy (no bf16 a)
          pounce::kernels::fp8_grouped_gate_up(
              grouped, Fp8Rows{qa, a_scale, rows}, Fp8Matrices{qb, b_scale},
              Fp8Matrices{qb + static_cast<size_t>(groups) * c.n * c.k, b_scale}, o0, o1, nullptr,
              pounce::kernels::Fp8Activation{o2, out_scale, rows}, c.n, c.k, act, nullptr);
        } else if (fp8) {
          pounce::kernels::fp8_grouped_gemm(grouped, Fp8Rows{qa, a_scale, rows}, Fp8Matrices{qb, b_scale}, o0,
                                            fp8_n, c.k, nullptr);
        } else if (c.kind == Fp8Kind::kGateUp) {
          pounce::kernels::grouped_gate_up(grouped, a16, w16a, w16b, o0, o1, o2, c.n, c.k, act, nullptr);
        } else {
          pounce::kernels::grouped_gemm(grouped, a16, w16a, o0, c.n, c.k, nullptr);
        }
        break;
      case Fp8Kind::kPair:
        if (fp8) {
          const int64_t half = c.k / 2;
          pounce::kernels::fp8_grouped_gemm_pair(
              grouped, Fp8Rows{qa, a_scale, rows}, Fp8Matrices{qb, b_scale}, half,
              Fp8Rows{qa + rows * half, a_scale, rows},
              Fp8Matrices{qb + static_cast<size_t>(groups) * c.n * half, b_scale}, half, o0, c.n, nullptr);
        } else {
          pounce::kernels::grouped_gemm_transposed(grouped, a16, w16a, w16b, c.k / 2, o0, c.n, c.k, nullptr);
        }
        break;
      case Fp8Kind::kWeightGrad:
        if (fp8) {
          pounce::kernels::fp8_grouped_weight_grad(grouped, Fp8Columns{qa, rows, a_scale, c.n + 4}, c.n,
                                                   Fp8Columns{qb, rows, b_scale, c.k + 4}, c.k, o0,
                                                   pounce::kernels::WeightGradMode::kStoreBf16, nullptr);
        } else {
          pounce::kernels::grouped_weight_grad(grouped, a16, c.n, c.n, o1, c.k, c.k, o0,
                                               pounce::kernels::WeightGradMode::kStoreBf16, nullptr,
                                               pounce::kernels::weight_grad_schedule_for(rows / groups));
        }
        break;
    }
  };
  cudaEvent_t start, stop;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < kWarmup; ++i) launch(true), launch(false);
  std::vector<float> ms[2];
  for (auto& m : ms) m.resize(kIters);
  for (int i = 0; i < kIters; ++i) {
    for (int v = 0; v < 2; ++v) {  // alternated: FP8, then bf16
      BENCH_CUDA(cudaEventRecord(start));
      launch(v == 0);
      BENCH_CUDA(cudaEventRecord(stop));
      BENCH_CUDA(cudaEventSynchronize(stop));
      BENCH_CUDA(cudaEventElapsedTime(&ms[v][i], start, stop));
    }
  }
  const double flops = 2.0 * rows * fp8_n * c.k;
  const int32_t err = pounce::kernels::grouped_gemm_error_code(true);
  double median[2];
  for (int v = 0; v < 2; ++v) {
    std::sort(ms[v].begin(), ms[v].end());
    median[v] = ms[v][kIters / 2];
  }
  std::printf("| %-30s | %4d | %7lld | %5lld | %5lld | %8.3f | %7.1f | %8.3f | %7.1f | %5.2fx | %s |\n",
              c.name, groups, static_cast<long long>(rows), static_cast<long long>(fp8_n),
              static_cast<long long>(c.k), median[0], flops / (median[0] * 1e-3) / 1e12, median[1],
              flops / (median[1] * 1e-3) / 1e12, median[1] / median[0], err == 0 ? "ok" : "WAIT-TIMEOUT");
  for (void* p : {static_cast<void*>(qa), static_cast<void*>(qb), static_cast<void*>(a16),
                  static_cast<void*>(w16a), static_cast<void*>(w16b), static_cast<void*>(o0),
                  static_cast<void*>(o1), static_cast<void*>(o2), static_cast<void*>(a_scale),
                  static_cast<void*>(b_scale), static_cast<void*>(out_scale), static_cast<void*>(d_off)})
    cudaFree(p);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

int run_fp8_cases(const std::string& filter) {
  // 512 rows per expert: what an EP2 rank of deepseek-v3 receives at 8192 tokens per rank.
  const std::vector<Fp8Case> cases = {
      {"deepseek-v3 gate_up", balanced(128, 512), 2048, 7168, Fp8Kind::kGateUp},
      {"deepseek-v3 down", balanced(128, 512), 7168, 2048, Fp8Kind::kStore},
      {"deepseek-v3 d_a", balanced(128, 512), 2048, 7168, Fp8Kind::kStore},
      {"deepseek-v3 d_x", balanced(128, 512), 7168, 4096, Fp8Kind::kPair},
      {"deepseek-v3 wgrad down", balanced(128, 512), 7168, 2048, Fp8Kind::kWeightGrad},
      {"deepseek-v3 wgrad gate", balanced(128, 512), 2048, 7168, Fp8Kind::kWeightGrad},
      // 256 rows per expert: deepseek-v3 at EP1 (8192 tokens, 256 experts, k = 8), two K blocks per tile.
      {"deepseek-v3 ep1 wgrad down", balanced(256, 256), 7168, 2048, Fp8Kind::kWeightGrad},
      {"deepseek-v3 ep1 wgrad gate", balanced(256, 256), 2048, 7168, Fp8Kind::kWeightGrad},
      {"gpt-oss-120b gate_up", balanced(64, 512), 2880, 2880, Fp8Kind::kGateUp},
      {"gpt-oss-120b down", balanced(64, 512), 2880, 2880, Fp8Kind::kStore},
      {"gpt-oss-120b d_x", balanced(64, 512), 2880, 5760, Fp8Kind::kPair},
      {"gpt-oss-120b wgrad", balanced(64, 512), 2880, 2880, Fp8Kind::kWeightGrad},
      {"qwen3-30b-a3b gate_up", balanced(64, 1024), 768, 2048, Fp8Kind::kGateUp},
      {"qwen3-30b-a3b down", balanced(64, 1024), 2048, 768, Fp8Kind::kStore},
      {"qwen3-30b-a3b d_x", balanced(64, 1024), 2048, 1536, Fp8Kind::kPair},
      {"qwen3-30b-a3b wgrad gate", balanced(64, 1024), 768, 2048, Fp8Kind::kWeightGrad},
  };
  std::printf("| %-30s | %4s | %7s | %5s | %5s | %8s | %7s | %8s | %7s | %6s | %s |\n", "fp8 case", "grp",
              "rows", "n", "k", "fp8 ms", "TFLOP/s", "bf16 ms", "TFLOP/s", "ratio", "status");
  for (const Fp8Case& c : cases) {
    if (filter.empty() || std::string(c.name).find(filter) != std::string::npos) run_fp8_case(c);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const bool fp8 = argc > 1 && std::string(argv[1]) == "--fp8";
  const std::string filter = argc > (fp8 ? 2 : 1) ? argv[fp8 ? 2 : 1] : "";
  std::vector<Case> cases = {
      {"deepseek-v3 gate_up", balanced(128, 1024), 2048, 7168, Kind::kGateUp},
      {"deepseek-v3 down", balanced(128, 1024), 7168, 2048, Kind::kStore},
      {"deepseek-v3 down skewed", skewed(128), 7168, 2048, Kind::kStore},
      // what one rank computes at EP2, 8192 tokens per rank: 512 rows per local expert (half the reuse of
      // every weight tile above), the fused forward's GEMM-bound floor
      {"deepseek-v3 ep2 gate_up", balanced(128, 512), 2048, 7168, Kind::kGateUp},
      {"deepseek-v3 ep2 down", balanced(128, 512), 7168, 2048, Kind::kStore},
      {"deepseek-v3 shared gate_up", balanced(1, 8192), 2048, 7168, Kind::kGateUp},
      {"deepseek-v3 shared down", balanced(1, 8192), 7168, 2048, Kind::kStore},
      {"qwen3-30b-a3b gate_up", balanced(64, 1024), 768, 2048, Kind::kGateUp},
      {"qwen3-30b-a3b down", balanced(64, 1024), 2048, 768, Kind::kStore},
      {"gpt-oss-120b gate_up", balanced(64, 512), 2880, 2880, Kind::kGateUp},
      {"gpt-oss-120b down", balanced(64, 512), 2880, 2880, Kind::kStore},
      // backward: d_a (n = I, k = H), d_x (n = H, k = 2I), weight gradients (down [H, I], gate [I, H])
      {"qwen3-30b-a3b bwd act", balanced(64, 1024), 768, 2048, Kind::kActivationBackward},
      {"qwen3-30b-a3b bwd d_x", balanced(64, 1024), 2048, 1536, Kind::kTransposed},
      {"qwen3-30b-a3b wgrad down", balanced(64, 1024), 2048, 768, Kind::kWeightGrad},
      {"qwen3-30b-a3b wgrad gate", balanced(64, 1024), 768, 2048, Kind::kWeightGrad},
      {"deepseek-v3 bwd act", balanced(128, 1024), 2048, 7168, Kind::kActivationBackward},
      {"deepseek-v3 bwd d_x", balanced(128, 1024), 7168, 4096, Kind::kTransposed},
      {"deepseek-v3 wgrad down", balanced(128, 1024), 7168, 2048, Kind::kWeightGrad},
      {"deepseek-v3 wgrad gate", balanced(128, 1024), 2048, 7168, Kind::kWeightGrad},
      {"gpt-oss-120b bwd act", balanced(64, 512), 2880, 2880, Kind::kActivationBackward},
      {"gpt-oss-120b bwd d_x", balanced(64, 512), 2880, 5760, Kind::kTransposed},
      {"gpt-oss-120b wgrad down", balanced(64, 512), 2880, 2880, Kind::kWeightGrad},
      // the backward at EP2 (512 rows per expert: weight gradients reduce over 8 K blocks per tile), and the
      // same gpt-oss reduction over whole tiles (3072) and over 1024 rows, to tell edge waste from depth
      {"deepseek-v3 ep2 bwd act", balanced(128, 512), 2048, 7168, Kind::kActivationBackward},
      {"deepseek-v3 ep2 bwd d_x", balanced(128, 512), 7168, 4096, Kind::kTransposed},
      {"deepseek-v3 ep2 wgrad down", balanced(128, 512), 7168, 2048, Kind::kWeightGrad},
      {"deepseek-v3 ep2 wgrad gate", balanced(128, 512), 2048, 7168, Kind::kWeightGrad},
      {"gpt-oss-120b wgrad whole tiles", balanced(64, 512), 3072, 3072, Kind::kWeightGrad},
      {"gpt-oss-120b wgrad 1024 rows", balanced(64, 1024), 2880, 2880, Kind::kWeightGrad},
  };
  // EP2 rows as routing gives them (about 512 per local expert, padded to 128): useful TFLOP/s with the
  // padding computed, and with it named (GroupedRows::group_rows, "named"; gate/up and the activation
  // backward compute it either way)
  cases.push_back(routed_case("deepseek-v3 routed gate_up", 128, 512, 2048, 7168, Kind::kGateUp));
  cases.push_back(routed_case("deepseek-v3 routed down", 128, 512, 7168, 2048, Kind::kStore));
  cases.push_back(routed_case("deepseek-v3 routed wgrad", 128, 512, 2048, 7168, Kind::kWeightGrad));
  cases.push_back(routed_case("deepseek-v3 routed bwd act", 128, 512, 2048, 7168, Kind::kActivationBackward));
  cases.push_back(routed_case("deepseek-v3 routed bwd d_x", 128, 512, 7168, 4096, Kind::kTransposed));
  cases.push_back(routed_case("gpt-oss-120b routed gate_up", 64, 512, 2880, 2880, Kind::kGateUp));
  cases.push_back(routed_case("gpt-oss-120b routed down", 64, 512, 2880, 2880, Kind::kStore));
  cases.push_back(routed_case("gpt-oss-120b routed bwd act", 64, 512, 2880, 2880, Kind::kActivationBackward));
  cases.push_back(routed_case("gpt-oss-120b routed wgrad", 64, 512, 2880, 2880, Kind::kWeightGrad));
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs; median of %d launches after %d warm-up\n", prop.name,
              prop.multiProcessorCount, kIters, kWarmup);
  if (fp8) return run_fp8_cases(filter);
  std::printf("| %-34s | %4s | %7s | %5s | %5s | %8s | %6s | %s |\n", "case", "grp", "rows", "n", "k", "ms",
              "TFLOP/s", "status");
  for (const Case& c : cases) {
    if (filter.empty() || std::string(c.name).find(filter) != std::string::npos) run_case(c);
  }
  return 0;
}
