// Fixtures of the API tests on the CPU backend: one rank's host buffers (random bf16-representable inputs,
// poisoned outputs), the small shape they use, and a driver that runs a body on one thread per rank.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "pounce/pounce.h"
#include "reference/bf16.h"

namespace pounce::api_testing {

using reference::float_to_bf16_bits;

constexpr uint16_t kPoisonBf16 = 0xFFFF;  // a NaN: any element left unwritten shows

// Host buffers of one rank, filled with random bf16-representable values; `views()` wraps them.
struct RankData {
  int64_t num_tokens = 0;
  std::vector<uint16_t> x, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, out, d_out, d_x;
  std::vector<int32_t> topk_idx;
  std::vector<float> topk_weights, d_topk_weights, d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down;

  RankData(const Shape& s, int64_t tokens, int rank, uint64_t seed) : num_tokens(tokens) {
    std::mt19937_64 rng(seed * 1000 + rank);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto fill = [&](std::vector<uint16_t>& v, int64_t n, float scale) {
      v.resize(n);
      for (auto& e : v) e = float_to_bf16_bits(normal(rng) * scale);
    };
    const int64_t H = s.hidden, I = s.intermediate, El = s.num_local_experts(), Is = s.shared_intermediate;
    fill(x, tokens * H, 1.0f);
    fill(d_out, tokens * H, 1.0f);
    fill(w_gate, El * I * H, 1.0f / std::sqrt(float(H)));
    fill(w_up, El * I * H, 1.0f / std::sqrt(float(H)));
    fill(w_down, El * H * I, 1.0f / std::sqrt(float(I)));
    // Shared weights are replicas: the same seed on every rank.
    std::mt19937_64 shared_rng(seed);
    std::swap(rng, shared_rng);
    fill(ws_gate, Is * H, 1.0f / std::sqrt(float(H)));
    fill(ws_up, Is * H, 1.0f / std::sqrt(float(H)));
    fill(ws_down, H * Is, Is ? 1.0f / std::sqrt(float(Is)) : 0.0f);
    std::swap(rng, shared_rng);
    topk_idx.resize(tokens * s.num_topk);
    topk_weights.resize(tokens * s.num_topk);
    std::vector<int32_t> experts(s.num_experts);
    for (int64_t t = 0; t < tokens; ++t) {
      std::iota(experts.begin(), experts.end(), 0);
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int64_t j = 0; j < s.num_topk; ++j) {
        topk_idx[t * s.num_topk + j] = experts[j];
        topk_weights[t * s.num_topk + j] = 0.1f + std::abs(normal(rng));
      }
    }
    out.assign(tokens * H, kPoisonBf16);
    d_x.assign(tokens * H, kPoisonBf16);
    d_topk_weights.assign(tokens * s.num_topk, NAN);
    d_w_gate.assign(w_gate.size(), NAN);
    d_w_up.assign(w_up.size(), NAN);
    d_w_down.assign(w_down.size(), NAN);
    d_ws_gate.assign(ws_gate.size(), NAN);
    d_ws_up.assign(ws_up.size(), NAN);
    d_ws_down.assign(ws_down.size(), NAN);
  }

  ForwardArgs forward_args(const Shape& s) {
    const int64_t H = s.hidden, I = s.intermediate, El = s.num_local_experts(), Is = s.shared_intermediate;
    ForwardArgs args;
    args.x = {x.data(), DType::kBF16, {num_tokens, H}};
    args.topk_idx = {topk_idx.data(), DType::kInt32, {num_tokens, s.num_topk}};
    args.topk_weights = {topk_weights.data(), DType::kFP32, {num_tokens, s.num_topk}};
    args.routed = {{w_gate.data(), DType::kBF16, {El, I, H}},
                   {w_up.data(), DType::kBF16, {El, I, H}},
                   {w_down.data(), DType::kBF16, {El, H, I}}};
    if (Is > 0)
      args.shared = {{ws_gate.data(), DType::kBF16, {Is, H}},
                     {ws_up.data(), DType::kBF16, {Is, H}},
                     {ws_down.data(), DType::kBF16, {H, Is}}};
    args.out = {out.data(), DType::kBF16, {num_tokens, H}};
    return args;
  }

  BackwardArgs backward_args(const Shape& s) {
    const int64_t H = s.hidden, I = s.intermediate, El = s.num_local_experts(), Is = s.shared_intermediate;
    BackwardArgs args;
    args.inputs = forward_args(s);
    args.d_out = {d_out.data(), DType::kBF16, {num_tokens, H}};
    args.d_x = {d_x.data(), DType::kBF16, {num_tokens, H}};
    args.d_topk_weights = {d_topk_weights.data(), DType::kFP32, {num_tokens, s.num_topk}};
    args.d_routed = {{d_w_gate.data(), DType::kFP32, {El, I, H}},
                     {d_w_up.data(), DType::kFP32, {El, I, H}},
                     {d_w_down.data(), DType::kFP32, {El, H, I}}};
    if (Is > 0)
      args.d_shared = {{d_ws_gate.data(), DType::kFP32, {Is, H}},
                       {d_ws_up.data(), DType::kFP32, {Is, H}},
                       {d_ws_down.data(), DType::kFP32, {H, Is}}};
    return args;
  }
};

inline Shape small_shape(int64_t ranks) {
  return {.max_tokens = 40,
          .hidden = 64,
          .intermediate = 64,
          .num_experts = 8,
          .num_topk = 2,
          .shared_intermediate = 64,
          .num_ranks = ranks};
}

// Runs `body(rank)` on one thread per rank; returns each rank's exception message ("" = none).
inline std::vector<std::string> on_every_rank(int num_ranks, const std::function<void(int)>& body) {
  std::vector<std::string> errors(num_ranks);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < num_ranks; ++rank)
    threads.emplace_back([&, rank] {
      try {
        body(rank);
      } catch (const std::exception& error) {
        errors[rank] = error.what();
      }
    });
  for (auto& thread : threads) thread.join();
  return errors;
}

// One rank's routed weights quantized by pounce::quantize_weights_fp8 (both orientations), as a caller
// passes them in ForwardArgs::routed_fp8.
struct RankFp8Weights {
  std::vector<std::vector<uint8_t>> data;
  std::vector<std::vector<float>> scale;
  Fp8Weights views;

  RankFp8Weights(const Shape& s, RankData& rank) {
    const int64_t H = s.hidden, I = s.intermediate, El = s.num_local_experts();
    const std::vector<int64_t> shapes[6] = {{El, I, H}, {El, I, H}, {El, H, I},
                                            {El, H, I}, {El, H, I}, {El, I, H}};
    Fp8Tensor* tensors[6] = {&views.gate, &views.up, &views.down, &views.gate_t, &views.up_t, &views.down_t};
    data.resize(6);
    scale.resize(6);
    for (int i = 0; i < 6; ++i) {
      const int64_t bn = (shapes[i][1] + kFp8Block - 1) / kFp8Block,
                    bk = (shapes[i][2] + kFp8Block - 1) / kFp8Block;
      data[i].assign(El * shapes[i][1] * shapes[i][2], 0xFF);
      scale[i].assign(El * bn * bk, NAN);
      *tensors[i] = {TensorView(data[i].data(), DType::kUInt8, shapes[i]),
                     TensorView(scale[i].data(), DType::kFP32, {El, bn, bk})};
    }
    quantize_weights_fp8(rank.forward_args(s).routed, views);
  }
};

}  // namespace pounce::api_testing
