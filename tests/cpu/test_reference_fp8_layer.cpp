// The reference's FP8 layer (docs/design.md §1 "FP8 mode"), on fresh random inputs over routings with -1
// slots, duplicate ids, an empty expert, an expert with more than 128 rows, T not a multiple of 128 and
// several ranks:
//   - every quantization point: the trace's quantized tensors equal quantize_fp8_blocks of the tensors they
//     quantize, bitwise (x at the source, a, d_y, d_g, d_u along the row, the token-axis copies), padding
//     rows exactly zero; every bf16 rounding point and the combine sums bitwise from the trace's values;
//   - every GEMM against an fp64 evaluation of the same quantized operands, within the fp32 accumulation
//     bound (K + K/128 additions) * 2^-24 * sum |terms|;
//   - against the BF16 reference within the FP8 error budget: relative error ||fp8 - bf16|| / ||bf16|| <=
//     0.1 per tensor and cosine similarity >= 0.996 per gradient; the shared expert bitwise BF16;
//   - out, y, d_x, d_topk_weights bitwise equal over 1, 2 and 4 ranks (the weight gradients' 128-row blocks
//     hold other rows, so they agree within the FP8 budget only).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "reference/detail.h"
#include "reference_fixtures.h"

namespace pounce::reference {
namespace {

using testing::Case;

constexpr double kMaxRelativeError = 0.1;
constexpr double kMinCosine = 0.996;

Problem fp8_problem(int64_t num_ranks, const Activation& act, int64_t shared_intermediate) {
  Problem p;
  p.hidden = 192;        // 1.5 blocks of 128: a partial K block in x · W^T and d_a · W
  p.intermediate = 160;  // 1.25 blocks
  p.num_experts = 8;
  p.num_topk = 3;
  p.shared_intermediate = shared_intermediate;
  p.num_ranks = num_ranks;
  p.block_m = 128;
  p.activation = act;
  p.precision = Precision::kFP8;
  p.num_threads = 2;
  return p;
}

// Random routing (duplicates, 10 % unused slots), then: slot 0 of most tokens names expert 1 (more than
// 128 rows: two token-axis blocks), expert 5 is never named (an empty segment).
Case fp8_case(const Problem& p, const std::vector<int64_t>& tokens_per_rank, uint32_t seed) {
  Case c = testing::random_case(p, tokens_per_rank, seed, 0.1);
  for (RankInputs& in : c.ranks) {
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      if (t % 7 != 3) in.topk_idx[t * p.num_topk] = 1;
      for (int64_t j = 0; j < p.num_topk; ++j) {
        if (in.topk_idx[t * p.num_topk + j] == 5) in.topk_idx[t * p.num_topk + j] = 6;
      }
    }
  }
  return c;
}

Case as_bf16(Case c) {
  c.problem.precision = Precision::kBF16;
  return c;
}

// ---- comparisons ---------------------------------------------------------------------------------------

void expect_blocks_equal(const Fp8Blocks& got, const std::vector<double>& source, int64_t rows, int64_t cols,
                         int64_t block_rows, int64_t block_cols, const std::string& name) {
  ASSERT_EQ(got.rows, rows) << name;
  ASSERT_EQ(got.cols, cols) << name;
  ASSERT_EQ(got.block_rows, block_rows) << name;
  ASSERT_EQ(got.block_cols, block_cols) << name;
  std::vector<float> in(source.begin(), source.end());
  std::vector<uint8_t> q(rows * cols);
  std::vector<float> scale(((rows + block_rows - 1) / block_rows) * ((cols + block_cols - 1) / block_cols));
  quantize_fp8_blocks(in.data(), rows, cols, block_rows, block_cols, q.data(), scale.data());
  for (size_t n = 0; n < q.size(); ++n) {
    if (got.q[n] != q[n]) {
      ADD_FAILURE() << name << " bits [" << n / cols << ", " << n % cols << "]: got 0x" << std::hex
                    << int{got.q[n]} << ", want 0x" << int{q[n]} << std::dec << " (from " << in[n] << ")";
      return;
    }
  }
  for (size_t n = 0; n < scale.size(); ++n) {
    if (got.scale[n] != scale[n]) {
      ADD_FAILURE() << name << " scale [" << n << "]: got " << got.scale[n] << ", want " << scale[n];
      return;
    }
  }
}

// |got - exact| <= (depth + depth / 128 + 1) * 2^-24 * magnitude: fp32 sums of exact products. Names the
// tensor and the coordinate of a failure.
bool within_fp32_sum(double got, double exact, double magnitude, int64_t depth, const char* name,
                     int64_t rank, int64_t row, int64_t col) {
  const double bound =
      static_cast<double>(depth + depth / 128 + 1) * std::ldexp(1.0, -24) * magnitude + 1e-30;
  if (std::abs(got - exact) <= bound) return true;
  ADD_FAILURE() << name << "[rank " << rank << "][" << row << ", " << col << "]: got " << got
                << ", fp64 of the quantized operands " << exact << " (sum |terms| " << magnitude << ", bound "
                << bound << ")";
  return false;
}

double norm(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x * x;
  return std::sqrt(sum);
}

// ||got - want|| / ||want|| <= 0.1 and, for gradients, cos(got, want) >= 0.996.
void expect_within_budget(const std::vector<double>& got, const std::vector<double>& want, bool gradient,
                          const std::string& name) {
  ASSERT_EQ(got.size(), want.size()) << name;
  double diff = 0, dot = 0;
  for (size_t n = 0; n < got.size(); ++n) {
    diff += (got[n] - want[n]) * (got[n] - want[n]);
    dot += got[n] * want[n];
  }
  ASSERT_GT(norm(want), 0.0) << name << " is all zero: the case does not exercise it";
  const double relative = std::sqrt(diff) / norm(want), cosine = dot / (norm(got) * norm(want));
  EXPECT_LE(relative, kMaxRelativeError) << name << ": relative error " << relative;
  if (gradient) {
    EXPECT_GE(cosine, kMinCosine) << name << ": cosine similarity " << cosine;
  }
}

// ---- the operands a test recomputes from the trace -------------------------------------------------------

struct Weights8 {  // one expert's weights quantized in 128x128 blocks, as values
  Fp8Blocks gate, up, down;
};

Fp8Blocks quantize_weight(const double* w, int64_t n, int64_t k) {
  Fp8Blocks b{
      n, k, 128, 128, std::vector<uint8_t>(n * k), std::vector<float>(((n + 127) / 128) * ((k + 127) / 128))};
  std::vector<float> in(w, w + n * k);
  quantize_fp8_blocks(in.data(), n, k, 128, 128, b.q.data(), b.scale.data());
  return b;
}

Weights8 expert_weights(const Case& c, int64_t rank, int64_t le) {
  const int64_t H = c.problem.hidden, I = c.problem.intermediate;
  const Weights& w = c.routed[rank];
  return {quantize_weight(w.gate.data() + le * I * H, I, H), quantize_weight(w.up.data() + le * I * H, I, H),
          quantize_weight(w.down.data() + le * H * I, H, I)};
}

int64_t expert_of_row(const RankSchedule& s, int64_t m) {
  int64_t le = 0;
  while (m >= s.expert_row_offset[le + 1]) ++le;
  return le;
}

// ---- tests -----------------------------------------------------------------------------------------------

// Each quantized tensor of the trace equals the quantizer applied to what it quantizes; each bf16 tensor
// is the rounding of its accumulator; the combine sums follow from the trace.
void check_quantization_points(const Case& c) {
  const Problem& p = c.problem;
  const int64_t H = p.hidden, I = p.intermediate, k = p.num_topk;
  const std::vector<RankFp8Trace> trace = fp8_trace(p, c.ranks, c.routed, c.shared);
  const std::vector<RankForward> f = forward(p, c.ranks, c.routed, c.shared);
  const std::vector<RankGradients> b = backward(p, c.ranks, c.routed, c.shared);
  ASSERT_EQ(trace.size(), static_cast<size_t>(p.num_ranks));
  for (int64_t r = 0; r < p.num_ranks; ++r) {
    const std::string rank = "[rank " + std::to_string(r) + "]";
    const RankFp8Trace& tr = trace[r];
    const RankSchedule s = build_schedule(p, c.ranks, r);
    const int64_t rows = static_cast<int64_t>(s.rows.size());
    expect_blocks_equal(tr.x_q, c.ranks[r].x, c.ranks[r].num_tokens, H, 1, 128, "x_q" + rank);

    // The pulled x rows as the expert holds them (dequantized x_q of the source), zero padding rows.
    std::vector<double> x_rows(rows * H, 0.0);
    for (int64_t m = 0; m < rows; ++m) {
      const ScheduleRow& row = s.rows[m];
      if (row.is_padding()) {
        for (const std::vector<double>* v : {&tr.a, &tr.d_y, &tr.d_g, &tr.d_u}) {
          const int64_t cols = v == &tr.a || v == &tr.d_g || v == &tr.d_u ? I : H;
          for (int64_t n = 0; n < cols; ++n)
            ASSERT_EQ((*v)[m * cols + n], 0.0) << "padding row " << m << rank;
        }
        continue;
      }
      for (int64_t h = 0; h < H; ++h) x_rows[m * H + h] = trace[row.src_rank].x_q.value(row.src_token, h);
      const RankInputs& src = c.ranks[row.src_rank];
      const float w = static_cast<float>(src.topk_weights[row.src_token * k + row.slot]);
      for (int64_t h = 0; h < H; ++h) {
        const float d_y = round_bf16(w * static_cast<float>(src.d_out[row.src_token * H + h]));
        ASSERT_EQ(tr.d_y[m * H + h], d_y) << "d_y" << rank << "[" << m << ", " << h << "]";
      }
      for (int64_t i = 0; i < I; ++i) {
        const float g = round_bf16(static_cast<float>(tr.g_acc[m * I + i]));
        const float u = round_bf16(static_cast<float>(tr.u_acc[m * I + i]));
        ASSERT_EQ(tr.a[m * I + i], round_bf16(detail::activation_t<float>(p.activation, g, u)))
            << "a" << rank << "[" << m << ", " << i << "]";
        float d_g, d_u;
        detail::activation_backward_t<float>(
            p.activation, g, u, round_bf16(static_cast<float>(tr.d_a_acc[m * I + i])), &d_g, &d_u);
        ASSERT_EQ(tr.d_g[m * I + i], round_bf16(d_g)) << "d_g" << rank << "[" << m << ", " << i << "]";
        ASSERT_EQ(tr.d_u[m * I + i], round_bf16(d_u)) << "d_u" << rank << "[" << m << ", " << i << "]";
      }
      // y per (token, slot) is the rounded accumulator, pushed to the owner.
      for (int64_t h = 0; h < H; ++h) {
        ASSERT_EQ(f[row.src_rank].y[(row.src_token * k + row.slot) * H + h],
                  round_bf16(static_cast<float>(tr.y_acc[m * H + h])))
            << "y" << rank << " row " << m;
      }
    }
    int64_t largest_segment = 0;
    for (int64_t rows_of_expert : s.expert_num_rows)
      largest_segment = std::max(largest_segment, rows_of_expert);
    EXPECT_TRUE(r > 0 || largest_segment > 128) << "no expert segment spans two token-axis blocks";
    expect_blocks_equal(tr.a_q, tr.a, rows, I, 1, 128, "a_q" + rank);
    expect_blocks_equal(tr.d_y_q, tr.d_y, rows, H, 1, 128, "d_y_q" + rank);
    expect_blocks_equal(tr.d_g_q, tr.d_g, rows, I, 1, 128, "d_g_q" + rank);
    expect_blocks_equal(tr.d_u_q, tr.d_u, rows, I, 1, 128, "d_u_q" + rank);
    expect_blocks_equal(tr.x_t, x_rows, rows, H, 128, 1, "x_t" + rank);
    expect_blocks_equal(tr.a_t, tr.a, rows, I, 128, 1, "a_t" + rank);
    expect_blocks_equal(tr.d_y_t, tr.d_y, rows, H, 128, 1, "d_y_t" + rank);
    expect_blocks_equal(tr.d_g_t, tr.d_g, rows, I, 128, 1, "d_g_t" + rank);
    expect_blocks_equal(tr.d_u_t, tr.d_u, rows, I, 128, 1, "d_u_t" + rank);
  }

  // Owner side (no shared expert here): out, d_x and d_topk_weights from the pushed rows, in fp32.
  ASSERT_EQ(p.shared_intermediate, 0);
  for (int64_t r = 0; r < p.num_ranks; ++r) {
    const RankInputs& in = c.ranks[r];
    std::vector<int64_t> row_of(in.num_tokens * k, -1), owner_of(in.num_tokens * k, -1);
    for (int64_t owner = 0; owner < p.num_ranks; ++owner) {
      const RankSchedule s = build_schedule(p, c.ranks, owner);
      for (int64_t m = 0; m < static_cast<int64_t>(s.rows.size()); ++m) {
        if (s.rows[m].is_padding() || s.rows[m].src_rank != r) continue;
        row_of[s.rows[m].src_token * k + s.rows[m].slot] = m;
        owner_of[s.rows[m].src_token * k + s.rows[m].slot] = owner;
      }
    }
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        float out = 0, d_x = 0;
        for (int64_t j = 0; j < k; ++j) {
          if (in.topk_idx[t * k + j] < 0) continue;
          out += static_cast<float>(in.topk_weights[t * k + j]) *
                 static_cast<float>(f[r].y[(t * k + j) * H + h]);
          d_x +=
              round_bf16(static_cast<float>(trace[owner_of[t * k + j]].d_x_acc[row_of[t * k + j] * H + h]));
        }
        ASSERT_EQ(f[r].out[t * H + h], round_bf16(out)) << "out[rank " << r << "][" << t << ", " << h << "]";
        ASSERT_EQ(b[r].d_x[t * H + h], round_bf16(d_x)) << "d_x[rank " << r << "][" << t << ", " << h << "]";
      }
      for (int64_t j = 0; j < k; ++j) {
        float dot = 0;
        if (in.topk_idx[t * k + j] >= 0) {
          for (int64_t h = 0; h < H; ++h)
            dot += static_cast<float>(in.d_out[t * H + h]) * static_cast<float>(f[r].y[(t * k + j) * H + h]);
        }
        ASSERT_EQ(b[r].d_topk_weights[t * k + j], dot)
            << "d_topk_weights[rank " << r << "][" << t << ", " << j << "]";
      }
    }
  }
}

TEST(ReferenceFp8Layer, QuantizationAndRoundingPointsAreExact) {
  Activation gpt_oss = Activation::gpt_oss();
  gpt_oss.clamp_limit = 0.6f;
  uint32_t seed = 100;
  for (const Activation& act : {Activation::swiglu(), gpt_oss}) {
    for (const std::vector<int64_t>& tokens : std::vector<std::vector<int64_t>>{{130}, {77, 0, 61, 9}}) {
      SCOPED_TRACE(::testing::Message() << "ranks " << tokens.size() << " seed " << seed + 1);
      check_quantization_points(
          fp8_case(fp8_problem(static_cast<int64_t>(tokens.size()), act, 0), tokens, ++seed));
    }
  }
}

std::vector<double> dequantize(const Fp8Blocks& b) {
  std::vector<double> v(b.rows * b.cols);
  for (int64_t r = 0; r < b.rows; ++r) {
    for (int64_t c = 0; c < b.cols; ++c) v[r * b.cols + c] = b.value(r, c);
  }
  return v;
}

// sum_k a[k * a_step] * b[k * b_step] in fp64 and sum_k |a b|, over `depth` terms.
struct Dot {
  double sum = 0, magnitude = 0;
};
Dot dot64(const double* a, int64_t a_step, const double* b, int64_t b_step, int64_t depth) {
  Dot d;
  for (int64_t n = 0; n < depth; ++n) {
    const double term = a[n * a_step] * b[n * b_step];
    d.sum += term, d.magnitude += std::abs(term);
  }
  return d;
}

// Every GEMM of the trace and every routed weight gradient against fp64 sums of the same quantized operands.
void check_gemms(const Case& c) {
  const Problem& p = c.problem;
  const int64_t H = p.hidden, I = p.intermediate;
  const std::vector<RankFp8Trace> trace = fp8_trace(p, c.ranks, c.routed, c.shared);
  const std::vector<RankGradients> b = backward(p, c.ranks, c.routed, c.shared);
  std::vector<std::vector<double>> x_q(p.num_ranks);
  for (int64_t r = 0; r < p.num_ranks; ++r) x_q[r] = dequantize(trace[r].x_q);
  bool ok = true;  // the first failure ends the checks
  for (int64_t r = 0; r < p.num_ranks; ++r) {
    const RankFp8Trace& tr = trace[r];
    const RankSchedule s = build_schedule(p, c.ranks, r);
    std::vector<std::vector<double>> gate, up, down;  // [El] dequantized [I, H], [I, H], [H, I]
    for (int64_t le = 0; le < p.num_local_experts(); ++le) {
      const Weights8 e = expert_weights(c, r, le);
      gate.push_back(dequantize(e.gate)), up.push_back(dequantize(e.up)), down.push_back(dequantize(e.down));
    }
    const std::vector<double> a_q = dequantize(tr.a_q), d_y_q = dequantize(tr.d_y_q),
                              d_g_q = dequantize(tr.d_g_q), d_u_q = dequantize(tr.d_u_q);
    for (int64_t m = 0; m < static_cast<int64_t>(s.rows.size()); ++m) {
      const ScheduleRow& row = s.rows[m];
      if (row.is_padding()) continue;
      const int64_t le = expert_of_row(s, m);
      const double* x = x_q[row.src_rank].data() + row.src_token * H;
      for (int64_t i = 0; i < I; ++i) {
        const Dot g = dot64(x, 1, gate[le].data() + i * H, 1, H),
                  u = dot64(x, 1, up[le].data() + i * H, 1, H);
        const Dot d_a = dot64(d_y_q.data() + m * H, 1, down[le].data() + i, I, H);
        ok = ok && within_fp32_sum(tr.g_acc[m * I + i], g.sum, g.magnitude, H, "g_acc", r, m, i);
        ok = ok && within_fp32_sum(tr.u_acc[m * I + i], u.sum, u.magnitude, H, "u_acc", r, m, i);
        ok = ok && within_fp32_sum(tr.d_a_acc[m * I + i], d_a.sum, d_a.magnitude, H, "d_a_acc", r, m, i);
      }
      for (int64_t h = 0; h < H; ++h) {
        const Dot y = dot64(a_q.data() + m * I, 1, down[le].data() + h * I, 1, I);
        const Dot d_x_g = dot64(d_g_q.data() + m * I, 1, gate[le].data() + h, H, I);
        const Dot d_x_u = dot64(d_u_q.data() + m * I, 1, up[le].data() + h, H, I);
        ok = ok && within_fp32_sum(tr.y_acc[m * H + h], y.sum, y.magnitude, I, "y_acc", r, m, h);
        ok = ok && within_fp32_sum(tr.d_x_acc[m * H + h], d_x_g.sum + d_x_u.sum,
                                   d_x_g.magnitude + d_x_u.magnitude, 2 * I, "d_x_acc", r, m, h);
      }
    }
    // Weight gradients over each expert's rows, from the token-axis copies.
    const std::vector<double> x_t = dequantize(tr.x_t), a_t = dequantize(tr.a_t),
                              d_y_t = dequantize(tr.d_y_t), d_g_t = dequantize(tr.d_g_t),
                              d_u_t = dequantize(tr.d_u_t);
    for (int64_t le = 0; le < p.num_local_experts(); ++le) {
      const int64_t first = s.expert_row_offset[le], depth = s.expert_num_rows[le];
      for (int64_t i = 0; i < I; ++i) {
        for (int64_t h = 0; h < H; ++h) {
          const Dot d_gate = dot64(d_g_t.data() + first * I + i, I, x_t.data() + first * H + h, H, depth);
          const Dot d_up = dot64(d_u_t.data() + first * I + i, I, x_t.data() + first * H + h, H, depth);
          const Dot d_down = dot64(d_y_t.data() + first * H + h, H, a_t.data() + first * I + i, I, depth);
          const double got_gate = b[r].d_routed.gate[(le * I + i) * H + h];
          ok = ok &&
               within_fp32_sum(got_gate, d_gate.sum, d_gate.magnitude, depth, "d_w_gate", r, le * I + i, h);
          ok = ok && within_fp32_sum(b[r].d_routed.up[(le * I + i) * H + h], d_up.sum, d_up.magnitude, depth,
                                     "d_w_up", r, le * I + i, h);
          ok = ok && within_fp32_sum(b[r].d_routed.down[(le * H + h) * I + i], d_down.sum, d_down.magnitude,
                                     depth, "d_w_down", r, le * H + h, i);
          if (depth == 0) {
            ASSERT_EQ(got_gate, 0.0) << "d_w_gate of an empty expert, rank " << r;
          }
        }
      }
    }
  }
}

TEST(ReferenceFp8Layer, GemmsMatchFp64OfTheQuantizedOperands) {
  check_gemms(fp8_case(fp8_problem(1, Activation::swiglu(), 0), {150}, 200));
  check_gemms(fp8_case(fp8_problem(2, Activation::gpt_oss(), 32), {100, 45}, 201));
}

// FP8 against BF16 on the same inputs: within the error budget; the shared expert bitwise BF16. A clamp
// passes no gradient where it is active, so where FP8 and BF16 put g or u on different sides of the limit a
// gradient flips between 0 and its full value: with g ~ N(0, 0.67) here a limit of 1.5 (1.2 % of g beyond
// it) already costs d_w_gate its 0.996 cosine; 2.0 (0.3 %) keeps the budget of the unclamped layer.
TEST(ReferenceFp8Layer, WithinTheFp8ErrorBudgetOfBf16) {
  Activation clamped = Activation::swiglu(), gpt_oss = Activation::gpt_oss();
  clamped.clamp_limit = gpt_oss.clamp_limit = 2.0f;
  uint32_t seed = 300;
  for (const Activation& act : {Activation::swiglu(), clamped, gpt_oss}) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed + 1);
    const Case c = fp8_case(fp8_problem(2, act, 64), {190, 67}, ++seed);
    const Case c16 = as_bf16(c);
    const std::vector<RankForward> f = forward(c.problem, c.ranks, c.routed, c.shared);
    const std::vector<RankForward> f16 = forward(c16.problem, c16.ranks, c16.routed, c16.shared);
    const std::vector<RankGradients> b = backward(c.problem, c.ranks, c.routed, c.shared);
    const std::vector<RankGradients> b16 = backward(c16.problem, c16.ranks, c16.routed, c16.shared);
    if (act.clamp_limit) {  // the clamp is active on some g: a few masks flip between FP8 and BF16
      int64_t clamped_g = 0;
      for (const RankFp8Trace& tr : fp8_trace(c.problem, c.ranks, c.routed, c.shared)) {
        for (double g : tr.g_acc) clamped_g += round_bf16(static_cast<float>(g)) > *act.clamp_limit;
      }
      EXPECT_GT(clamped_g, 0);
    }
    expect_within_budget(testing::concat(f, &RankForward::out), testing::concat(f16, &RankForward::out),
                         false, "out");
    expect_within_budget(testing::concat(f, &RankForward::y), testing::concat(f16, &RankForward::y), false,
                         "y");
    expect_within_budget(testing::concat(b, &RankGradients::d_x), testing::concat(b16, &RankGradients::d_x),
                         true, "d_x");
    expect_within_budget(testing::concat(b, &RankGradients::d_topk_weights),
                         testing::concat(b16, &RankGradients::d_topk_weights), true, "d_topk_weights");
    for (int64_t r = 0; r < c.problem.num_ranks; ++r) {
      const std::string rank = "[rank " + std::to_string(r) + "]";
      expect_within_budget(b[r].d_routed.gate, b16[r].d_routed.gate, true, "d_w_gate" + rank);
      expect_within_budget(b[r].d_routed.up, b16[r].d_routed.up, true, "d_w_up" + rank);
      expect_within_budget(b[r].d_routed.down, b16[r].d_routed.down, true, "d_w_down" + rank);
      testing::expect_bitwise_equal(f[r].ys, f16[r].ys, "ys" + rank);
      testing::expect_bitwise_equal(b[r].d_shared.gate, b16[r].d_shared.gate, "d_ws_gate" + rank);
      testing::expect_bitwise_equal(b[r].d_shared.up, b16[r].d_shared.up, "d_ws_up" + rank);
      testing::expect_bitwise_equal(b[r].d_shared.down, b16[r].d_shared.down, "d_ws_down" + rank);
    }
  }
}

// kFp64 numerics keep the quantization points and drop the bf16 rounding: close to the kBf16 FP8 result.
TEST(ReferenceFp8Layer, Fp64NumericsIsTheNoiseYardstick) {
  Case c = fp8_case(fp8_problem(2, Activation::swiglu(), 0), {90, 40}, 400);
  const std::vector<RankForward> f = forward(c.problem, c.ranks, c.routed, c.shared);
  const std::vector<RankGradients> b = backward(c.problem, c.ranks, c.routed, c.shared);
  c.problem.numerics = Numerics::kFp64;
  const std::vector<RankForward> f64 = forward(c.problem, c.ranks, c.routed, c.shared);
  const std::vector<RankGradients> b64 = backward(c.problem, c.ranks, c.routed, c.shared);
  const std::vector<double> out = testing::concat(f, &RankForward::out),
                            out64 = testing::concat(f64, &RankForward::out);
  const std::vector<double> d_x = testing::concat(b, &RankGradients::d_x),
                            d_x64 = testing::concat(b64, &RankGradients::d_x);
  testing::expect_close(out, out64, 0.0, 0.1 * testing::max_abs(out64), "out vs fp64");
  testing::expect_close(d_x, d_x64, 0.0, 0.1 * testing::max_abs(d_x64), "d_x vs fp64");
  expect_within_budget(b[0].d_routed.gate, b64[0].d_routed.gate, true, "d_w_gate vs fp64");
}

// The same global batch over 1, 2 and 4 ranks.
TEST(ReferenceFp8Layer, SameBatchOverOneTwoFourRanks) {
  const Case global = fp8_case(fp8_problem(1, Activation::swiglu(), 32), {170}, 500);
  const std::vector<RankForward> f1 = forward(global.problem, global.ranks, global.routed, global.shared);
  const std::vector<RankGradients> b1 = backward(global.problem, global.ranks, global.routed, global.shared);
  for (const std::vector<int64_t>& split : std::vector<std::vector<int64_t>>{{100, 70}, {41, 0, 100, 29}}) {
    const int64_t R = static_cast<int64_t>(split.size());
    SCOPED_TRACE(::testing::Message() << "R = " << R);
    const Case c = testing::split_case(global, R, split);
    const std::vector<RankForward> f = forward(c.problem, c.ranks, c.routed, c.shared);
    const std::vector<RankGradients> b = backward(c.problem, c.ranks, c.routed, c.shared);
    testing::expect_bitwise_equal(testing::concat(f, &RankForward::out), f1[0].out, "out");
    testing::expect_bitwise_equal(testing::concat(f, &RankForward::y), f1[0].y, "y");
    testing::expect_bitwise_equal(testing::concat(f, &RankForward::ys), f1[0].ys, "ys");
    testing::expect_bitwise_equal(testing::concat(b, &RankGradients::d_x), b1[0].d_x, "d_x");
    testing::expect_bitwise_equal(testing::concat(b, &RankGradients::d_topk_weights), b1[0].d_topk_weights,
                                  "d_topk_weights");
    std::vector<double> gate, down;
    for (const RankGradients& g : b) {
      gate.insert(gate.end(), g.d_routed.gate.begin(), g.d_routed.gate.end());
      down.insert(down.end(), g.d_routed.down.begin(), g.d_routed.down.end());
    }
    expect_within_budget(gate, b1[0].d_routed.gate, true, "d_w_gate");
    expect_within_budget(down, b1[0].d_routed.down, true, "d_w_down");
  }
}

TEST(ReferenceFp8Layer, RejectsBlockMNotAMultipleOf128) {
  Problem p = fp8_problem(1, Activation::swiglu(), 0);
  p.block_m = 64;
  const Case c = fp8_case(fp8_problem(1, Activation::swiglu(), 0), {10}, 600);
  try {
    forward(p, c.ranks, c.routed, c.shared);
    FAIL() << "block_m = 64 accepted in FP8";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("block_m"), std::string::npos) << error.what();
  }
  Problem bf16 = c.problem;
  bf16.precision = Precision::kBF16;
  EXPECT_THROW(fp8_trace(bf16, c.ranks, c.routed, c.shared), Error);
}

}  // namespace
}  // namespace pounce::reference
