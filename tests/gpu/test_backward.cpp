// The backward through the public API, on Config's kernel paths, against reference::backward of the whole EP
// group: one to eight ranks, top-1 to top-8, tokens 0, 1, 127, 300 with unequal T per rank, every routing
// of gpu_fixtures.h, int32 and int64 topk_idx, shared expert, SwiGLU and GPT-OSS with clamps the data
// reaches; CUDA graph replay of forward + backward (also with the smallest macrobatch ring on both paths);
// and scheduling knobs (chunks of local experts, communication SM counts) that must not change a bit. Each
// call runs every step of backward_harness.h: fp32, bf16 and accumulated weight gradients, repeated runs
// and recompute_forward_context bitwise equal, every tensor within the §6 bound of the reference. The fused
// kernel against the staged chain is test_fused_backward.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "backward_harness.h"
#include "gpu_fixtures.h"
#include "pounce/pounce.h"

namespace pounce::gpu_test {
namespace {

TEST(StagedBackward, OneRankSwiGLU) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(300, 256, 128, 8, 2, 0, 1), Activation::swiglu(), 51);
  check_backward(m, {random_routing({300}, 52), with_int64_idx(random_routing({1}, 53)),
                     random_routing({0}, 54), all_to_one_expert({127}, 55), few_experts({300}, 56)});
}

// I = 192: the weight gradients' second 128-row tile is half empty.
TEST(StagedBackward, OneRankSharedGptOssClamp) {
  SKIP_UNLESS_GPUS(1);
  const Model m =
      make_model(make_shape(300, 256, 192, 8, 4, 128, 1), clamped(Activation::gpt_oss(), 1.0f), 61);
  check_backward(
      m, {random_routing({300}, 62), with_int64_idx(sparse_routing({127}, 63)), all_to_one_expert({1}, 64)});
}

TEST(StagedBackward, TwoRanksSharedTopEightSwiGLUClamp) {
  SKIP_UNLESS_GPUS(2);
  const Model m =
      make_model(make_shape(300, 256, 128, 8, 8, 128, 2), clamped(Activation::swiglu(), 1.5f), 71);
  check_backward(m, {random_routing({0, 300}, 72), with_int64_idx(random_routing({127, 1}, 73)),
                     all_to_one_expert({300, 127}, 74), few_experts({300, 300}, 75)});
}

TEST(StagedBackward, TwoRanksTopOneGptOssClamp) {
  SKIP_UNLESS_GPUS(2);
  const Model m = make_model(make_shape(300, 256, 192, 8, 1, 0, 2), clamped(Activation::gpt_oss(), 1.0f), 81);
  check_backward(m, {random_routing({300, 127}, 82), sparse_routing({1, 0}, 83)});
}

// Issue #7: 4 and 8 ranks where that many GPUs are visible.
TEST(StagedBackward, FourAndEightRanks) {
  SKIP_UNLESS_GPUS(4);
  for (int R : visible_rank_counts({4, 8})) {
    const Model m =
        make_model(make_shape(300, 256, 128, 2 * R, 4, 128, R), clamped(Activation::swiglu(), 1.5f), 130 + R);
    check_backward(m, many_rank_calls(R, 300, 127, 131), false, std::to_string(R) + " ranks");
  }
}

TEST(StagedBackward, CudaGraphReplaysForwardAndBackward) {
  SKIP_UNLESS_GPUS(1);
  const int R = std::min(2, visible_gpus());
  const Model m = make_model(make_shape(256, 256, 128, 8, 4, 128, R), Activation::swiglu(), 91);
  const std::vector<Call> calls = graph_calls(R, 92);  // same T per rank, new routing and data each call
  check_backward(m, calls, true);
  // With the smallest macrobatch ring, on both paths: every possible macrobatch's launches are in the graph,
  // those past the call's count find no rows.
  for (const KernelPath path : {KernelPath::kStaged, KernelPath::kFused}) {
    Config ringed;
    ringed.kernel_path = ringed.backward_kernel_path = path;
    ringed.macrobatch_size = smallest_ring(m.shape);
    check_backward(m, calls, true, std::string("cuda graph, macrobatch ring, ") + to_string(path), ringed);
  }
}

// Chunks of local experts (config.minibatch_size) and the communication SM counts only schedule the work:
// one chunk on 1 comm SM and one chunk per expert on 7 give bitwise-equal outputs and gradients.
TEST(StagedBackward, ChunksAndCommSmsDoNotChangeResults) {
  SKIP_UNLESS_GPUS(1);
  const int R = std::min(2, visible_gpus());
  const Model m = make_model(make_shape(300, 256, 128, 8, 4, 128, R), Activation::swiglu(), 121);
  const std::vector<int64_t> tokens = tokens_per_rank(R, 300, 127);
  const std::vector<Call> calls = {random_routing(tokens, 122), few_experts(tokens, 123)};
  Config one_chunk, many_chunks;
  one_chunk.minibatch_size = 10 * kBlockM;  // >= max_tokens * k: a single chunk
  one_chunk.forward_comm_sms = one_chunk.backward_comm_sms = 1;
  many_chunks.minibatch_size = kBlockM;  // clamped to one chunk per local expert
  many_chunks.forward_comm_sms = many_chunks.backward_comm_sms = 7;
  const BackwardResults a = check_backward(m, calls, false, "one chunk", one_chunk);
  const BackwardResults b = check_backward(m, calls, false, "a chunk per expert", many_chunks);
  for (size_t c = 0; c < calls.size(); ++c) {
    for (int r = 0; r < R; ++r) {
      const std::string where = "call " + std::to_string(c) + " rank " + std::to_string(r);
      ASSERT_FALSE(a[c][r].fp32_runs.empty() || b[c][r].fp32_runs.empty()) << where;
      EXPECT_EQ(bitwise_difference("out", a[c][r].out[0], b[c][r].out[0]), "")
          << where << ": forward outputs differ";
      EXPECT_EQ(snapshot_difference(a[c][r].fp32_runs[0].second, b[c][r].fp32_runs[0].second), "") << where;
    }
  }
}

// ---- native weight layouts and frozen experts (docs/design.md §5) ---------------------------------------

// How the layout tests pass the weights and gradients: separate dense tensors (what check_backward runs and
// checks against the reference); transformers' fused gate_up [El, 2I, H] as two views (gate rows then up
// rows), its gradient written into one [El, 2I, H] buffer through the same views; interleaved rows (gate row
// 2i, up row 2i + 1) as weights, the shared expert's too, gradients dense; or frozen weights: no routed
// gradients and only the shared down gradient (the rest is not computed).
enum class Layout { kFusedHalves, kInterleavedRows, kFrozen };

const char* to_string(Layout layout) {
  switch (layout) {
    case Layout::kFusedHalves:
      return "fused gate_up halves";
    case Layout::kInterleavedRows:
      return "interleaved rows";
    case Layout::kFrozen:
      return "frozen weights";
  }
  return "?";
}

// [groups, 2 rows, cols] from gate and up [groups, rows, cols]: gate rows then up rows, or alternating.
std::vector<uint16_t> fuse_rows(const uint16_t* gate, const uint16_t* up, int64_t groups, int64_t rows,
                                int64_t cols, bool interleaved) {
  std::vector<uint16_t> fused(2 * groups * rows * cols);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t gate_row = interleaved ? 2 * r : r, up_row = interleaved ? 2 * r + 1 : rows + r;
      std::copy_n(gate + (g * rows + r) * cols, cols, fused.begin() + (g * 2 * rows + gate_row) * cols);
      std::copy_n(up + (g * rows + r) * cols, cols, fused.begin() + (g * 2 * rows + up_row) * cols);
    }
  return fused;
}

// The gate and up views of a fused [groups, 2 rows, cols] device tensor (2-D without groups: the shared
// expert's).
std::pair<TensorView, TensorView> fused_views(void* base, DType dtype, int64_t groups, int64_t rows,
                                              int64_t cols, bool interleaved, bool two_d, int device) {
  const int64_t element = size_of(dtype);
  std::vector<int64_t> shape =
      two_d ? std::vector<int64_t>{rows, cols} : std::vector<int64_t>{groups, rows, cols};
  TensorView gate(base, dtype, shape, DeviceKind::kCuda, device);
  TensorView up(static_cast<char*>(base) + (interleaved ? cols : rows * cols) * element, dtype, shape,
                DeviceKind::kCuda, device);
  const int64_t row_stride = interleaved ? 2 * cols : cols;
  gate.strides = up.strides =
      two_d ? std::vector<int64_t>{row_stride, 1} : std::vector<int64_t>{2 * rows * cols, row_stride, 1};
  return {gate, up};
}

// One layout against the dense run `dense` of the same calls (check_backward: within the §6 bound of the
// reference): every output the layout computes is bitwise the dense run's (the same GEMMs over the same rows;
// the fused gradient's single m = 2I GEMM sums each element in the same order as the two m = I ones), two
// runs of each call are bitwise equal, gradients not asked for are never written (their buffers keep the
// poison).
void check_layout(const Model& m, const std::vector<Call>& calls, const BackwardResults& dense, Layout layout,
                  Config config) {
  config.activation = m.activation;
  const Shape& s = m.shape;
  const int R = static_cast<int>(s.num_ranks);
  const int64_t El = s.num_local_experts(), I = s.intermediate, H = s.hidden, Is = s.shared_intermediate,
                k = s.num_topk;
  const std::vector<std::vector<RankData>> data = make_call_data(s, calls);
  const std::string label = std::string(to_string(layout)) + ", " + to_string(config.kernel_path) +
                            " forward, " + to_string(config.backward_kernel_path) + " backward";
  std::vector<std::vector<std::string>> failures(R);
  run_ranks(R, [&](const Group& group, int rank) {
    Workspace workspace(group, s, config);
    DeviceWeights weights(m, rank, rank);
    const bool interleaved = layout == Layout::kInterleavedRows;
    DeviceBuffer<uint16_t> gate_up(
        fuse_rows(m.gate.data() + rank * El * I * H, m.up.data() + rank * El * I * H, El, I, H, interleaved));
    DeviceBuffer<uint16_t> shared_gate_up(
        Is > 0 ? fuse_rows(m.shared_gate.data(), m.shared_up.data(), 1, Is, H, interleaved)
               : std::vector<uint16_t>(1));
    ExpertWeights routed = weights.routed, shared = weights.shared;
    if (layout != Layout::kFrozen) {
      std::tie(routed.gate, routed.up) =
          fused_views(gate_up.ptr, DType::kBF16, El, I, H, interleaved, false, rank);
      if (Is > 0)
        std::tie(shared.gate, shared.up) =
            fused_views(shared_gate_up.ptr, DType::kBF16, 1, Is, H, interleaved, true, rank);
    }
    DeviceInputs in(s);
    DeviceBuffer<uint16_t> d_out(s.max_tokens * H), d_x(s.max_tokens * H);
    DeviceBuffer<float> d_topk(s.max_tokens * k), d_gate_up(2 * El * I * H), d_gate(El * I * H),
        d_up(El * I * H), d_down(El * H * I), d_shared_gate(Is * H), d_shared_up(Is * H),
        d_shared_down(H * Is);
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto fail = [&](const std::string& what) { failures[rank].push_back(what); };
    for (size_t c = 0; c < calls.size(); ++c) {
      const int64_t T = calls[c].num_tokens[rank];
      const std::string where = label + ", call " + std::to_string(c) + ", rank " + std::to_string(rank);
      const BackwardResult& want = dense[c][rank];
      if (want.fp32_runs.empty()) {
        fail(where + ": the dense run has no result");
        continue;
      }
      const Snapshot& ref = want.fp32_runs[0].second;
      in.upload(s, data[c][rank], false, stream);
      CUDA_OK(cudaMemcpyAsync(d_out.ptr, data[c][rank].d_out.data(), data[c][rank].d_out.size() * 2,
                              cudaMemcpyHostToDevice, stream));
      ForwardArgs fwd = in.args(s, T, false, rank);
      fwd.routed = routed;
      fwd.shared = shared;
      BackwardArgs bwd;
      bwd.inputs = fwd;
      bwd.d_out = TensorView(d_out.ptr, DType::kBF16, {T, H}, DeviceKind::kCuda, rank);
      bwd.d_x = TensorView(d_x.ptr, DType::kBF16, {T, H}, DeviceKind::kCuda, rank);
      bwd.d_topk_weights = TensorView(d_topk.ptr, DType::kFP32, {T, k}, DeviceKind::kCuda, rank);
      auto view = [&](float* p, std::vector<int64_t> dims) {
        return TensorView(p, DType::kFP32, std::move(dims), DeviceKind::kCuda, rank);
      };
      if (layout == Layout::kFusedHalves) {
        std::tie(bwd.d_routed.gate, bwd.d_routed.up) =
            fused_views(d_gate_up.ptr, DType::kFP32, El, I, H, false, false, rank);
      } else if (layout == Layout::kInterleavedRows) {
        bwd.d_routed.gate = view(d_gate.ptr, {El, I, H});
        bwd.d_routed.up = view(d_up.ptr, {El, I, H});
      }
      if (layout != Layout::kFrozen) bwd.d_routed.down = view(d_down.ptr, {El, H, I});
      if (Is > 0) {
        if (layout != Layout::kFrozen) {
          bwd.d_shared.gate = view(d_shared_gate.ptr, {Is, H});
          bwd.d_shared.up = view(d_shared_up.ptr, {Is, H});
        }
        bwd.d_shared.down = view(d_shared_down.ptr, {H, Is});
      }
      for (int run = 0; run < 2; ++run) {
        for (const DeviceBuffer<float>* b :
             {&d_topk, &d_gate_up, &d_gate, &d_up, &d_down, &d_shared_gate, &d_shared_up, &d_shared_down})
          b->poison(stream);
        d_x.poison(stream);
        in.out.poison(stream);
        try {
          forward(workspace, fwd, stream);
          backward(workspace, bwd, stream);
          CUDA_OK(cudaStreamSynchronize(stream));
        } catch (const std::exception& error) {
          cudaStreamSynchronize(stream);
          fail(where + ": " + error.what());
          break;
        }
        auto expect_same = [&](const std::string& name, const void* device, const std::vector<uint8_t>& bytes,
                               size_t element) {
          const std::vector<uint8_t> got = download<uint8_t>(device, bytes.size());
          const std::string difference = bitwise_difference(name, got.data(), got.size() / element,
                                                            bytes.data(), bytes.size() / element, element);
          if (!difference.empty()) fail(where + ", run " + std::to_string(run) + ": " + difference);
        };
        const std::vector<uint16_t>& out = want.out[0];
        expect_same("out", in.out.ptr,
                    std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(out.data()),
                                         reinterpret_cast<const uint8_t*>(out.data() + out.size())),
                    2);
        expect_same("d_x", d_x.ptr, ref.outputs[0], 2);
        expect_same("d_topk_weights", d_topk.ptr, ref.outputs[1], 4);
        if (layout == Layout::kFusedHalves) {  // [El, 2I, H]: expert e's gate rows, then its up rows
          const std::vector<uint8_t> got = download<uint8_t>(d_gate_up.ptr, 2 * El * I * H * 4);
          std::vector<uint8_t> fused(got.size());
          const size_t block = I * H * 4;
          for (int64_t e = 0; e < El; ++e) {
            std::copy_n(ref.outputs[2].begin() + e * block, block, fused.begin() + 2 * e * block);
            std::copy_n(ref.outputs[3].begin() + e * block, block, fused.begin() + (2 * e + 1) * block);
          }
          const std::string difference =
              bitwise_difference("d_gate_up", got.data(), got.size() / 4, fused.data(), fused.size() / 4, 4);
          if (!difference.empty()) fail(where + ": " + difference);
        } else if (layout == Layout::kInterleavedRows) {
          expect_same("d_routed.gate", d_gate.ptr, ref.outputs[2], 4);
          expect_same("d_routed.up", d_up.ptr, ref.outputs[3], 4);
        }
        if (layout != Layout::kFrozen) expect_same("d_routed.down", d_down.ptr, ref.outputs[4], 4);
        if (Is > 0) expect_same("d_shared.down", d_shared_down.ptr, ref.outputs[7], 4);
        if (Is > 0 && layout != Layout::kFrozen) {
          expect_same("d_shared.gate", d_shared_gate.ptr, ref.outputs[5], 4);
          expect_same("d_shared.up", d_shared_up.ptr, ref.outputs[6], 4);
        }
        if (layout == Layout::kFrozen) {  // nothing written where no gradient was asked for
          for (const auto& [name, b] :
               {std::pair<const char*, const DeviceBuffer<float>*>{"d_routed.gate", &d_gate},
                {"d_routed.down", &d_down},
                {"d_shared.gate", &d_shared_gate}}) {
            const std::vector<float> v = download<float>(b->ptr, b->count);
            if (count_unpoisoned(v.data(), v.data() + v.size()) != 0)
              fail(where + ": frozen " + name + " written");
          }
        }
      }
    }
    CUDA_OK(cudaStreamDestroy(stream));
  });
  for (int r = 0; r < R; ++r)
    for (const std::string& failure : failures[r]) ADD_FAILURE() << failure;
}

// Both kernel paths, one and two ranks: I = 192, so the fused gradient's m = 2I = 384 GEMM has a tile across
// the gate/up boundary; few_experts leaves experts without rows (their [2I, H] blocks must be zeros).
TEST(WeightLayouts, FusedGateUpInterleavedRowsAndFrozenWeightsMatchSeparateTensors) {
  SKIP_UNLESS_GPUS(1);
  for (int R : visible_rank_counts({1, 2})) {
    const Model m =
        make_model(make_shape(300, 256, 192, 8, 4, 128, R), clamped(Activation::gpt_oss(), 1.0f), 141 + R);
    const std::vector<int64_t> tokens = tokens_per_rank(R, 300, 127);
    const std::vector<Call> calls = {random_routing(tokens, 142), few_experts(tokens, 143)};
    for (const KernelPath path : {KernelPath::kStaged, KernelPath::kFused}) {
      Config config;
      config.kernel_path = config.backward_kernel_path = path;
      const BackwardResults dense =
          check_backward(m, calls, false, std::to_string(R) + " ranks, dense, " + to_string(path), config);
      for (Layout layout : {Layout::kFusedHalves, Layout::kInterleavedRows, Layout::kFrozen})
        check_layout(m, calls, dense, layout, config);
    }
  }
}

// Accumulating into a fused [El, 2I, H] main_grad: exactly prefill + the gradient the separate run adds.
TEST(WeightLayouts, FusedGateUpAccumulatesIntoMainGrad) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(256, 256, 128, 8, 2, 0, 1), Activation::swiglu(), 151);
  const Shape& s = m.shape;
  const int64_t El = s.num_local_experts(), I = s.intermediate, H = s.hidden;
  const RankData data = make_rank_data(s, random_routing({256}, 152), 0);
  std::vector<float> separate_gate, separate_up, fused;
  run_ranks(1, [&](const Group& group, int rank) {
    Config config;
    config.activation = m.activation;
    Workspace workspace(group, s, config);
    DeviceWeights weights(m, rank, rank);
    DeviceInputs in(s);
    in.upload(s, data, false, nullptr);
    DeviceBuffer<uint16_t> d_out(data.d_out), d_x(256 * H);
    DeviceBuffer<float> d_topk(256 * 2), d_down(El * H * I), d_gate(El * I * H), d_up(El * I * H),
        d_gate_up(2 * El * I * H);
    std::vector<float> prefill(2 * El * I * H);
    for (size_t i = 0; i < prefill.size(); ++i) prefill[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
    d_gate_up.upload(prefill);
    ForwardArgs fwd = in.args(s, 256, false, rank);
    fwd.routed = weights.routed;
    BackwardArgs bwd;
    bwd.inputs = fwd;
    bwd.d_out = TensorView(d_out.ptr, DType::kBF16, {256, H}, DeviceKind::kCuda, rank);
    bwd.d_x = TensorView(d_x.ptr, DType::kBF16, {256, H}, DeviceKind::kCuda, rank);
    bwd.d_topk_weights = TensorView(d_topk.ptr, DType::kFP32, {256, 2}, DeviceKind::kCuda, rank);
    bwd.d_routed.down = TensorView(d_down.ptr, DType::kFP32, {El, H, I}, DeviceKind::kCuda, rank);
    bwd.d_routed.gate = TensorView(d_gate.ptr, DType::kFP32, {El, I, H}, DeviceKind::kCuda, rank);
    bwd.d_routed.up = TensorView(d_up.ptr, DType::kFP32, {El, I, H}, DeviceKind::kCuda, rank);
    forward(workspace, fwd, nullptr);
    backward(workspace, bwd, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    separate_gate = download<float>(d_gate.ptr, d_gate.count);
    separate_up = download<float>(d_up.ptr, d_up.count);
    std::tie(bwd.d_routed.gate, bwd.d_routed.up) =
        fused_views(d_gate_up.ptr, DType::kFP32, El, I, H, false, false, rank);
    bwd.accumulate_weight_grads = true;
    backward(workspace, bwd, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    fused = download<float>(d_gate_up.ptr, d_gate_up.count);
    for (int64_t e = 0; e < El; ++e)
      for (int64_t n = 0; n < I * H; ++n) {
        const int64_t gate_at = e * 2 * I * H + n, up_at = gate_at + I * H;
        ASSERT_TRUE(same_bits(fused[gate_at], prefill[gate_at] + separate_gate[e * I * H + n]))
            << "gate " << e << ", " << n;
        ASSERT_TRUE(same_bits(fused[up_at], prefill[up_at] + separate_up[e * I * H + n]))
            << "up " << e << ", " << n;
      }
  });
}

}  // namespace
}  // namespace pounce::gpu_test
