// Internals of the reference's FP8 mode (docs/design.md §1 "FP8 mode"); not part of the interface.
//
// Tensors in block-scaled E4M3 are held as their e4m3 bits, their power-of-two scales and the decoded e4m3
// values (unscaled) in T, so a GEMM multiplies e4m3 values exactly as the tensor cores do and applies the
// scales once per 128-deep K block:
//   c[r, n] = sum_{kb ascending} ( sum_{k in kb, ascending} a_q[r, k] * b_q[k, n] ) * (scale_a[r, kb] *
//   scale_b[kb, n])
// one accumulator per c element in T (fp32 in kBf16 numerics, fp64 in kFp64). Products of two e4m3 values
// and products of power-of-two scales are exact, so the rounding happens in the sums only.
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "pounce/config.h"
#include "pounce/error.h"
#include "reference/detail.h"

namespace pounce::reference::detail {

inline constexpr int64_t kQuantBlock = kFp8Block;  // 128: the 1x128, 128x1 and 128x128 blocks

inline int64_t num_blocks(int64_t extent) {
  return (extent + kQuantBlock - 1) / kQuantBlock;
}

// ---- quantized tensors ---------------------------------------------------------------------------------

// in[rows, cols] in block_rows x block_cols blocks: bits and scale as quantize_fp8_blocks writes them,
// q = e4m3_to_float(bits) in T.
template <typename T>
struct QuantT {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t block_rows = 1;
  int64_t block_cols = kQuantBlock;
  std::vector<uint8_t> bits;  // [rows, cols]
  std::vector<float> scale;   // [ceil(rows / block_rows), ceil(cols / block_cols)]
  std::vector<T> q;           // [rows, cols] decoded e4m3, not scaled

  int64_t scale_cols() const { return (cols + block_cols - 1) / block_cols; }
  float scale_at(int64_t r, int64_t c) const {
    return scale[(r / block_rows) * scale_cols() + c / block_cols];
  }
  T value(int64_t r, int64_t c) const { return q[r * cols + c] * static_cast<T>(scale_at(r, c)); }

  void resize(int64_t num_rows, int64_t num_cols, int64_t rows_per_block, int64_t cols_per_block) {
    rows = num_rows, cols = num_cols, block_rows = rows_per_block, block_cols = cols_per_block;
    bits.assign(rows * cols, 0);
    q.assign(rows * cols, T(0));
    scale.assign(((rows + block_rows - 1) / block_rows) * scale_cols(), 1.0f);
  }
};

// Quantizes in[rows, cols] (row stride `cols`) into the rows [row0, row0 + rows) of `out`, whose blocks must
// align with row0. The values go through fp32 (exact in kBf16; in kFp64 the one rounding before the
// quantizer). A non-finite value fails naming `name` and its coordinates.
template <typename T>
void quantize_rows_into(const T* in, int64_t rows, const std::string& name, int64_t row0, QuantT<T>& out) {
  const int64_t cols = out.cols;
  std::vector<float> values(rows * cols);
  for (int64_t n = 0; n < rows * cols; ++n) {
    values[n] = static_cast<float>(in[n]);
    POUNCE_CHECK(std::isfinite(values[n]), "FP8 reference: ", name, "[", row0 + n / cols, ", ", n % cols,
                 "] = ", values[n], " is not finite, so no block scale represents it; scale the inputs down ",
                 "or use Precision::kBF16");
  }
  const int64_t scale_row0 = row0 / out.block_rows;
  quantize_fp8_blocks(values.data(), rows, cols, out.block_rows, out.block_cols,
                      out.bits.data() + row0 * cols, out.scale.data() + scale_row0 * out.scale_cols());
  for (int64_t n = row0 * cols; n < (row0 + rows) * cols; ++n)
    out.q[n] = static_cast<T>(e4m3_to_float(out.bits[n]));
}

template <typename T>
QuantT<T> quantize_t(const T* in, int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols,
                     const std::string& name) {
  QuantT<T> out;
  out.resize(rows, cols, block_rows, block_cols);
  quantize_rows_into(in, rows, name, 0, out);
  return out;
}

// Rows [row0, row0 + rows) of `src` into `dst` at dst_row0 (bits, decoded values and, per row, the 1x128
// scales): a dispatch pull of quantized rows. Both are 1 x block_cols quantized with the same cols.
template <typename T>
void copy_quantized_rows(const QuantT<T>& src, int64_t src_row0, int64_t rows, QuantT<T>& dst,
                         int64_t dst_row0) {
  const int64_t cols = src.cols, scale_cols = src.scale_cols();
  std::copy(src.bits.begin() + src_row0 * cols, src.bits.begin() + (src_row0 + rows) * cols,
            dst.bits.begin() + dst_row0 * cols);
  std::copy(src.q.begin() + src_row0 * cols, src.q.begin() + (src_row0 + rows) * cols,
            dst.q.begin() + dst_row0 * cols);
  std::copy(src.scale.begin() + src_row0 * scale_cols, src.scale.begin() + (src_row0 + rows) * scale_cols,
            dst.scale.begin() + dst_row0 * scale_cols);
}

// ---- weights in 128x128 blocks, both orientations -------------------------------------------------------

// W [n, k] quantized in 128x128 blocks. The backward orientation W^T [k, n] has the same e4m3 values,
// transposed, and the transposed scale grid (src/fp8.cpp writes it so), so one quantization serves both.
template <typename T>
struct Fp8Matrix {
  QuantT<T> w;         // [n, k]
  std::vector<T> q_t;  // [k, n] decoded e4m3 of w, transposed: the B operand of x · W^T
};

template <typename T>
Fp8Matrix<T> make_fp8_matrix(const double* weights, int64_t n, int64_t k, const std::string& name) {
  std::vector<T> values(weights, weights + n * k);
  Fp8Matrix<T> m;
  m.w = quantize_t(values.data(), n, k, kQuantBlock, kQuantBlock, name);
  m.q_t.resize(k * n);
  for (int64_t row = 0; row < n; ++row) {
    for (int64_t col = 0; col < k; ++col) m.q_t[col * n + row] = m.w.q[row * k + col];
  }
  return m;
}

template <typename T>
struct Fp8Expert {
  Fp8Matrix<T> gate;  // [I, H]
  Fp8Matrix<T> up;    // [I, H]
  Fp8Matrix<T> down;  // [H, I]
};

// ---- GEMMs with per-block promotion ---------------------------------------------------------------------

// c[rows, cols] += sum_kb (A(kb) · B(kb)) * a_scale[i, kb] * b_scale(kb, j / 128) over K blocks kb of 128
// (the last may be shorter), with A(i, k) = a[i * a_stride + k], a_scale[i * a_scale_stride + kb],
// b[k * cols + j] and b_scale(kb, nb) = b_scale[kb * b_scale_stride_k + nb * b_scale_stride_n].
// The partial sum of a block is one accumulator in T over k ascending (matmul), promoted into c once.
template <typename T>
void matmul_fp8(const T* a, int64_t a_stride, const float* a_scale, int64_t a_scale_stride, const T* b,
                const float* b_scale, int64_t b_scale_stride_k, int64_t b_scale_stride_n, int64_t rows,
                int64_t depth, int64_t cols, T* c) {
  std::vector<T> partial(rows * cols);
  for (int64_t kb = 0; kb < num_blocks(depth); ++kb) {
    const int64_t k0 = kb * kQuantBlock, block_depth = std::min(kQuantBlock, depth - k0);
    matmul(a + k0, a_stride, 1, b + k0 * cols, rows, block_depth, cols, partial.data());
    for (int64_t i = 0; i < rows; ++i) {
      const T sa = static_cast<T>(a_scale[i * a_scale_stride + kb]);
      for (int64_t j = 0; j < cols; ++j) {
        const T sb = static_cast<T>(b_scale[kb * b_scale_stride_k + (j / kQuantBlock) * b_scale_stride_n]);
        c[i * cols + j] += partial[i * cols + j] * (sa * sb);
      }
    }
  }
}

// c[rows, n] += a_q[rows, k] · W^T for W [n, k] (the forward orientation: x · w_gate^T, a · w_down^T).
// `a` holds rows [row0, row0 + rows) of a 1x128-quantized tensor with k columns.
template <typename T>
void matmul_fp8_forward(const QuantT<T>& a, int64_t row0, int64_t rows, const Fp8Matrix<T>& w, T* c) {
  const int64_t n = w.w.rows, k = w.w.cols;
  matmul_fp8(a.q.data() + row0 * k, k, a.scale.data() + row0 * a.scale_cols(), a.scale_cols(), w.q_t.data(),
             w.w.scale.data(), /*stride_k=*/1, /*stride_n=*/w.w.scale_cols(), rows, k, n, c);
}

// c[rows, k] += a_q[rows, n] · W for W [n, k] (the backward orientation: d_y · w_down = d_y · (w_down^T)^T).
template <typename T>
void matmul_fp8_backward(const QuantT<T>& a, int64_t row0, int64_t rows, const Fp8Matrix<T>& w, T* c) {
  const int64_t n = w.w.rows, k = w.w.cols;
  matmul_fp8(a.q.data() + row0 * n, n, a.scale.data() + row0 * a.scale_cols(), a.scale_cols(), w.w.q.data(),
             w.w.scale.data(), /*stride_k=*/w.w.scale_cols(), /*stride_n=*/1, rows, n, k, c);
}

// Weight gradient over the token axis: c[i - begin, j] = sum_mb ( sum_{m in mb} a[m, i] b[m, j] ) *
// a.scale[mb, i] * b.scale[mb, j] for i in [begin, end), rows [row0, row0 + num_rows) of two 128x1-quantized
// tensors (blocks of 128 rows from row0, which is block aligned). c is overwritten.
template <typename T>
void matmul_fp8_token_axis(const QuantT<T>& a, const QuantT<T>& b, int64_t row0, int64_t num_rows,
                           int64_t begin, int64_t end, T* c) {
  const int64_t a_cols = a.cols, cols = b.cols, out_rows = end - begin;
  std::fill(c, c + out_rows * cols, T(0));
  std::vector<T> partial(out_rows * cols);
  for (int64_t m0 = 0; m0 < num_rows; m0 += kQuantBlock) {
    const int64_t block_rows = std::min(kQuantBlock, num_rows - m0), mb = (row0 + m0) / kQuantBlock;
    matmul(a.q.data() + (row0 + m0) * a_cols + begin, 1, a_cols, b.q.data() + (row0 + m0) * cols, out_rows,
           block_rows, cols, partial.data());
    for (int64_t i = 0; i < out_rows; ++i) {
      const T sa = static_cast<T>(a.scale[mb * a_cols + begin + i]);
      for (int64_t j = 0; j < cols; ++j) {
        c[i * cols + j] += partial[i * cols + j] * (sa * static_cast<T>(b.scale[mb * cols + j]));
      }
    }
  }
}

// ---- the group's inputs and one rank's expert-side rows --------------------------------------------------

template <typename T>
struct Fp8GroupData {
  std::vector<RankSchedule> schedules;             // [R]
  std::vector<std::vector<T>> x;                   // [R][T_r, H] (the shared expert's input, BF16)
  std::vector<QuantT<T>> x_q;                      // [R][T_r, H] q1x128_H(x), at the source
  std::vector<std::vector<T>> topk_weights;        // [R][T_r, k]
  std::vector<std::vector<T>> d_out;               // [R][T_r, H], backward only
  std::vector<std::vector<Fp8Expert<T>>> experts;  // [R][El]
  ExpertMatrices<T> shared;                        // BF16; unused when Is = 0
};

// Inputs must have passed validate_inputs().
template <typename T>
Fp8GroupData<T> make_fp8_group_data(const Problem& p, const std::vector<RankInputs>& ranks,
                                    const std::vector<Weights>& routed_per_rank, const Weights& shared,
                                    bool for_backward) {
  const int64_t R = p.num_ranks, El = p.num_local_experts(), H = p.hidden, I = p.intermediate;
  Fp8GroupData<T> group;
  fill_rank_inputs<T>(p, ranks, for_backward, group);
  group.x_q.resize(R);
  // Tasks [0, R): x_q of rank r; [R, R + R * El): the weights of one expert. Each fills its own slot.
  std::vector<Fp8Expert<T>> flat(R * El);
  parallel_for(R + R * El, p.num_threads, [&](int64_t task) {
    if (task < R) {
      group.x_q[task] = quantize_t(group.x[task].data(), ranks[task].num_tokens, H, 1, kQuantBlock,
                                   "x[rank " + std::to_string(task) + "]");
      return;
    }
    const int64_t r = (task - R) / El, le = (task - R) % El;
    const Weights& w = routed_per_rank[r];
    const std::string name = "routed_per_rank[" + std::to_string(r) + "]";
    flat[task - R] = {make_fp8_matrix<T>(w.gate.data() + le * I * H, I, H, name + ".gate"),
                      make_fp8_matrix<T>(w.up.data() + le * I * H, I, H, name + ".up"),
                      make_fp8_matrix<T>(w.down.data() + le * H * I, H, I, name + ".down")};
  });
  for (int64_t r = 0; r < R; ++r) {
    group.experts[r].assign(std::make_move_iterator(flat.begin() + r * El),
                            std::make_move_iterator(flat.begin() + (r + 1) * El));
  }
  if (p.shared_intermediate > 0) {
    group.shared = make_expert_matrices<T>(shared.gate.data(), shared.up.data(), shared.down.data(), H,
                                           p.shared_intermediate, for_backward);
  }
  return group;
}

// One rank's routed tensors, one row per receive-schedule row; padding rows stay zero. Row chunks write
// disjoint rows, 128-row blocks of the token-axis copies disjoint blocks.
template <typename T>
struct Fp8Rows {
  QuantT<T> x_q;                            // [rows, H] pulled from the sources (bits and scales)
  std::vector<T> g_acc, u_acc, g, u, a;     // [rows, I]
  QuantT<T> a_q;                            // [rows, I]
  std::vector<T> y_acc, y;                  // [rows, H]
  std::vector<T> d_out, d_y;                // [rows, H] backward: pulled d_out, bf16(w * d_out)
  QuantT<T> d_y_q;                          // [rows, H]
  std::vector<T> d_a_acc, d_g, d_u;         // [rows, I]
  QuantT<T> d_g_q, d_u_q;                   // [rows, I]
  std::vector<T> d_x_acc, d_x;              // [rows, H]
  QuantT<T> x_t, a_t, d_y_t, d_g_t, d_u_t;  // 128x1 token-axis copies

  void resize(int64_t rows, int64_t H, int64_t I, bool for_backward) {
    x_q.resize(rows, H, 1, kQuantBlock);
    for (std::vector<T>* v : {&g_acc, &u_acc, &g, &u, &a}) v->assign(rows * I, T(0));
    a_q.resize(rows, I, 1, kQuantBlock);
    y_acc.assign(rows * H, T(0));
    y.assign(rows * H, T(0));
    if (!for_backward) return;
    for (std::vector<T>* v : {&d_out, &d_y, &d_x_acc, &d_x}) v->assign(rows * H, T(0));
    for (std::vector<T>* v : {&d_a_acc, &d_g, &d_u}) v->assign(rows * I, T(0));
    d_y_q.resize(rows, H, 1, kQuantBlock);
    d_g_q.resize(rows, I, 1, kQuantBlock);
    d_u_q.resize(rows, I, 1, kQuantBlock);
    x_t.resize(rows, H, kQuantBlock, 1);
    a_t.resize(rows, I, kQuantBlock, 1);
    d_y_t.resize(rows, H, kQuantBlock, 1);
    d_g_t.resize(rows, I, kQuantBlock, 1);
    d_u_t.resize(rows, I, kQuantBlock, 1);
  }
};

// Forward of rows [row0, row0 + rows) of one expert, x_q already pulled (docs/design.md §1):
//   g_acc, u_acc = x_q · w_gate_q^T, x_q · w_up_q^T   g, u = round(.)   a = round(act(g, u))   [rows, I]
//   a_q = q1x128_I(a)   y_acc = a_q · w_down_q^T   y = round(y_acc)                             [rows, H]
template <typename T>
void fp8_mlp_forward_rows(const Fp8Expert<T>& w, const Activation& act, Fp8Rows<T>& r, int64_t row0,
                          int64_t rows, const std::string& rank_name) {
  const int64_t I = w.gate.w.rows, H = w.gate.w.cols;
  T* g_acc = r.g_acc.data() + row0 * I;
  T* u_acc = r.u_acc.data() + row0 * I;
  matmul_fp8_forward(r.x_q, row0, rows, w.gate, g_acc);
  matmul_fp8_forward(r.x_q, row0, rows, w.up, u_acc);
  for (int64_t n = row0 * I; n < (row0 + rows) * I; ++n) {
    r.g[n] = round_point(r.g_acc[n]);
    r.u[n] = round_point(r.u_acc[n]);
    r.a[n] = round_point(activation_t<T>(act, r.g[n], r.u[n]));
  }
  quantize_rows_into(r.a.data() + row0 * I, rows, "a" + rank_name, row0, r.a_q);
  matmul_fp8_forward(r.a_q, row0, rows, w.down, r.y_acc.data() + row0 * H);
  for (int64_t n = row0 * H; n < (row0 + rows) * H; ++n) r.y[n] = round_point(r.y_acc[n]);
}

// Data backward of the same rows, d_y already set:
//   d_y_q = q1x128_H(d_y)   d_a = round(d_y_q · w_down_t_q^T)   d_g, d_u = round(act'(g, u) d_a)   [rows, I]
//   d_x_acc = d_g_q · w_gate_t_q^T + d_u_q · w_up_t_q^T: one accumulator, the d_g blocks then the d_u
//   blocks (the K axis of [d_g | d_u] as the GPU lays it out); d_x = round(d_x_acc)               [rows, H]
template <typename T>
void fp8_mlp_backward_rows(const Fp8Expert<T>& w, const Activation& act, Fp8Rows<T>& r, int64_t row0,
                           int64_t rows, const std::string& rank_name) {
  const int64_t I = w.gate.w.rows, H = w.gate.w.cols;
  quantize_rows_into(r.d_y.data() + row0 * H, rows, "d_y" + rank_name, row0, r.d_y_q);
  matmul_fp8_backward(r.d_y_q, row0, rows, w.down, r.d_a_acc.data() + row0 * I);
  for (int64_t n = row0 * I; n < (row0 + rows) * I; ++n) {
    T d_g, d_u;
    activation_backward_t<T>(act, r.g[n], r.u[n], round_point(r.d_a_acc[n]), &d_g, &d_u);
    r.d_g[n] = round_point(d_g);
    r.d_u[n] = round_point(d_u);
  }
  quantize_rows_into(r.d_g.data() + row0 * I, rows, "d_g" + rank_name, row0, r.d_g_q);
  quantize_rows_into(r.d_u.data() + row0 * I, rows, "d_u" + rank_name, row0, r.d_u_q);
  T* d_x_acc = r.d_x_acc.data() + row0 * H;
  matmul_fp8_backward(r.d_g_q, row0, rows, w.gate, d_x_acc);
  matmul_fp8_backward(r.d_u_q, row0, rows, w.up, d_x_acc);
  for (int64_t n = row0 * H; n < (row0 + rows) * H; ++n) r.d_x[n] = round_point(r.d_x_acc[n]);
}

// The token-axis copies of rows [row0, row0 + 128) (row0 a multiple of 128): x from the dequantized x_q
// rows, the others from the bf16 row tensors.
template <typename T>
void fp8_token_axis_block(Fp8Rows<T>& r, int64_t row0, const std::string& rank_name) {
  const int64_t H = r.x_q.cols, I = r.a_q.cols, rows = kQuantBlock;
  std::vector<T> x(rows * H);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t h = 0; h < H; ++h) x[m * H + h] = r.x_q.value(row0 + m, h);
  }
  quantize_rows_into(x.data(), rows, "x_t" + rank_name, row0, r.x_t);
  quantize_rows_into(r.a.data() + row0 * I, rows, "a_t" + rank_name, row0, r.a_t);
  quantize_rows_into(r.d_y.data() + row0 * H, rows, "d_y_t" + rank_name, row0, r.d_y_t);
  quantize_rows_into(r.d_g.data() + row0 * I, rows, "d_g_t" + rank_name, row0, r.d_g_t);
  quantize_rows_into(r.d_u.data() + row0 * I, rows, "d_u_t" + rank_name, row0, r.d_u_t);
}

inline std::string rank_name(int64_t rank) {
  return "[rank " + std::to_string(rank) + "]";
}

// The FP8 passes (fp8_forward.cpp, fp8_backward.cpp); inputs validated. fp8_backward_t fills `trace` when
// it is not null.
template <typename T>
std::vector<RankForward> fp8_forward_t(const Problem& p, const std::vector<RankInputs>& ranks,
                                       const std::vector<Weights>& routed_per_rank, const Weights& shared);
template <typename T>
std::vector<RankGradients> fp8_backward_t(const Problem& p, const std::vector<RankInputs>& ranks,
                                          const std::vector<Weights>& routed_per_rank, const Weights& shared,
                                          std::vector<RankFp8Trace>* trace);

}  // namespace pounce::reference::detail
