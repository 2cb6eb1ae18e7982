#include "src/validation.h"

#include <cstdint>
#include <string>

#include "pounce/error.h"

namespace pounce {
namespace {

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

DeviceKind expected_device(const Workspace& workspace) {
  return workspace.group().backend() == Backend::kGpu ? DeviceKind::kCuda : DeviceKind::kCpu;
}

void check_tensor(const Workspace& workspace, const char* name, const TensorView& view,
                  std::initializer_list<DType> dtypes, const std::vector<int64_t>& shape) {
  POUNCE_CHECK(!view.is_none(), "argument '", name, "' is missing; pass a tensor of shape ",
               shape_string(shape));
  bool dtype_ok = false;
  std::string allowed;
  for (DType dtype : dtypes) {
    dtype_ok |= view.dtype == dtype;
    allowed += (allowed.empty() ? "" : " or ") + std::string(to_string(dtype));
  }
  POUNCE_CHECK(dtype_ok, "argument '", name, "' is ", view.describe(), "; it must be ", allowed);
  POUNCE_CHECK(view.shape == shape, "argument '", name, "' is ", view.describe(), "; expected shape ",
               shape_string(shape));
  const DeviceKind device = expected_device(workspace);
  POUNCE_CHECK(view.device == device, "argument '", name, "' is ", view.describe(),
               " but the workspace runs on ", device == DeviceKind::kCuda ? "cuda" : "cpu",
               "; move it there");
  POUNCE_CHECK(view.numel() == 0 || view.data != nullptr, "argument '", name, "' has a null data pointer");
  POUNCE_CHECK(
      reinterpret_cast<uintptr_t>(view.data) % 16 == 0, "argument '", name, "' (", view.describe(),
      ") starts at an address that is not 16-byte aligned; the kernels move 16-byte vectors: pass a ",
      "tensor that starts at its allocation or at a 16-byte multiple");
}

void check_optional_none(const char* name, const TensorView& view) {
  POUNCE_CHECK(view.is_none(), "argument '", name, "' is ", view.describe(),
               " but shape.shared_intermediate is 0 (no shared expert); leave it empty or set the shape");
}

bool overlaps(const TensorView& a, const TensorView& b) {
  if (a.is_none() || b.is_none() || a.numel() == 0 || b.numel() == 0) return false;
  const auto* a_begin = static_cast<const char*>(a.data);
  const auto* b_begin = static_cast<const char*>(b.data);
  return a_begin < b_begin + b.bytes() && b_begin < a_begin + a.bytes();
}

void check_weights(const Workspace& workspace, const char* prefix, const ExpertWeights& weights, bool shared,
                   std::initializer_list<DType> dtypes) {
  const Shape& s = workspace.shape();
  const std::string gate = std::string(prefix) + ".gate", up = std::string(prefix) + ".up",
                    down = std::string(prefix) + ".down";
  if (shared && !s.has_shared_expert()) {
    check_optional_none(gate.c_str(), weights.gate);
    check_optional_none(up.c_str(), weights.up);
    check_optional_none(down.c_str(), weights.down);
    return;
  }
  const std::vector<int64_t> gate_shape =
      shared ? std::vector<int64_t>{s.shared_intermediate, s.hidden}
             : std::vector<int64_t>{s.num_local_experts(), s.intermediate, s.hidden};
  const std::vector<int64_t> down_shape =
      shared ? std::vector<int64_t>{s.hidden, s.shared_intermediate}
             : std::vector<int64_t>{s.num_local_experts(), s.hidden, s.intermediate};
  check_tensor(workspace, gate.c_str(), weights.gate, dtypes, gate_shape);
  check_tensor(workspace, up.c_str(), weights.up, dtypes, gate_shape);
  check_tensor(workspace, down.c_str(), weights.down, dtypes, down_shape);
}

// Routing lives in host memory only on the CPU backend; on GPUs the schedule kernel rejects bad ids.
void check_routing_ids(const Workspace& workspace, const TensorView& topk_idx) {
  if (topk_idx.device != DeviceKind::kCpu) return;
  const int64_t num_experts = workspace.shape().num_experts, k = workspace.shape().num_topk;
  for (int64_t i = 0; i < topk_idx.numel(); ++i) {
    const int64_t id =
        topk_idx.dtype == DType::kInt32 ? topk_idx.as<int32_t>()[i] : topk_idx.as<int64_t>()[i];
    POUNCE_CHECK(id >= -1 && id < num_experts, "argument 'topk_idx'[", i / k, ", ", i % k, "] = ", id,
                 " is out of range [-1, ", num_experts, "); pass global expert ids below num_experts, or -1 ",
                 "for an unused slot");
  }
}

}  // namespace

void validate_forward_args(const Workspace& workspace, const ForwardArgs& args, bool check_out) {
  const Shape& s = workspace.shape();
  POUNCE_CHECK(!args.x.is_none() && args.x.rank() == 2, "argument 'x' must be a [T, ", s.hidden,
               "] bf16 tensor; got ", args.x.is_none() ? std::string("none") : args.x.describe());
  const int64_t num_tokens = args.x.shape[0];
  POUNCE_CHECK(num_tokens <= s.max_tokens, "argument 'x' has ", num_tokens,
               " tokens but the workspace was sized ", "for max_tokens = ", s.max_tokens,
               "; create the workspace with a larger Shape::max_tokens");
  check_tensor(workspace, "x", args.x, {DType::kBF16}, {num_tokens, s.hidden});
  check_tensor(workspace, "topk_idx", args.topk_idx, {DType::kInt32, DType::kInt64},
               {num_tokens, s.num_topk});
  check_tensor(workspace, "topk_weights", args.topk_weights, {DType::kFP32}, {num_tokens, s.num_topk});
  check_weights(workspace, "routed", args.routed, false, {DType::kBF16});
  check_weights(workspace, "shared", args.shared, true, {DType::kBF16});
  POUNCE_CHECK(workspace.config().precision == Precision::kBF16 || args.routed_fp8 != nullptr,
               "argument 'routed_fp8' is missing but config.precision is fp8; quantize the weights with ",
               "pounce::quantize_weights_fp8 and pass them");
  check_routing_ids(workspace, args.topk_idx);
  if (!check_out) return;
  check_tensor(workspace, "out", args.out, {DType::kBF16}, {num_tokens, s.hidden});
  POUNCE_CHECK(!overlaps(args.out, args.x) && !overlaps(args.out, args.topk_idx) &&
                   !overlaps(args.out, args.topk_weights),
               "argument 'out' overlaps an input tensor; pass a separate output buffer");
}

void validate_backward_args(const Workspace& workspace, const BackwardArgs& args) {
  validate_forward_args(workspace, args.inputs, false);
  const Shape& s = workspace.shape();
  const int64_t num_tokens = args.inputs.x.shape[0];
  check_tensor(workspace, "d_out", args.d_out, {DType::kBF16}, {num_tokens, s.hidden});
  check_tensor(workspace, "d_x", args.d_x, {DType::kBF16}, {num_tokens, s.hidden});
  check_tensor(workspace, "d_topk_weights", args.d_topk_weights, {DType::kFP32}, {num_tokens, s.num_topk});
  if (args.accumulate_weight_grads) {  // main_grad accumulation is fp32 only
    check_weights(workspace, "d_routed", args.d_routed, false, {DType::kFP32});
    check_weights(workspace, "d_shared", args.d_shared, true, {DType::kFP32});
  } else {
    check_weights(workspace, "d_routed", args.d_routed, false, {DType::kBF16, DType::kFP32});
    check_weights(workspace, "d_shared", args.d_shared, true, {DType::kBF16, DType::kFP32});
  }
  const TensorView* inputs[] = {&args.inputs.x, &args.inputs.topk_idx, &args.inputs.topk_weights,
                                &args.d_out};
  const std::pair<const char*, const TensorView*> outputs[] = {{"d_x", &args.d_x},
                                                               {"d_topk_weights", &args.d_topk_weights}};
  for (const auto& [name, output] : outputs)
    for (const TensorView* input : inputs)
      POUNCE_CHECK(!overlaps(*output, *input), "argument '", name,
                   "' overlaps an input tensor; pass a separate ", "output buffer");
}

}  // namespace pounce
