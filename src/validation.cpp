#include "src/validation.h"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cstdint>
#include <string>
#include <utility>

#include "pounce/error.h"
#include "pounce/fp8.h"
#include "src/state.h"

namespace pounce {
namespace {

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// The device every tensor of a call must be on: the workspace's (WorkspaceState::device_id: its GPU, or 0
// on the CPU backend).
struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;
  std::string name() const { return kind == DeviceKind::kCpu ? "cpu" : "cuda:" + std::to_string(index); }
};

Device expected_device(const Workspace& workspace) {
  if (workspace.group().backend() != Backend::kGpu) return {};
  return {DeviceKind::kCuda, workspace.state().device_id};
}

// Which layouts an argument may have: dense, or (weights and weight gradients) row-strided.
enum class Layout { kDense, kRows };

// A row-strided view's strides as the kernels take them: the last dimension contiguous, every other stride a
// 16-byte multiple (tensor maps and 16-byte vectors step by them), rows that do not overlap. "" when fine.
std::string row_layout_problem(const TensorView& view) {
  const int64_t rank = view.rank();
  if (static_cast<int64_t>(view.strides.size()) != rank)
    return "has " + std::to_string(view.strides.size()) + " strides for " + std::to_string(rank) +
           " dimensions; give one per dimension (or none for a dense tensor)";
  if (rank == 0 || (view.shape[rank - 1] != 1 && view.strides[rank - 1] != 1))
    return "is not contiguous in its last dimension; Pounce reads weights row by row (a transposed layout "
           "such as [E, H, 2I] is not read in place: pass w.transpose(-1, -2).contiguous() once)";
  std::vector<int64_t> order;
  for (int64_t d = 0; d + 1 < rank; ++d) {
    if (view.shape[d] == 1) continue;
    if (view.strides[d] <= 0 || view.strides[d] * size_of(view.dtype) % 16 != 0)
      return "has stride " + std::to_string(view.strides[d]) + " in dimension " + std::to_string(d) +
             "; strides must be positive and 16-byte multiples (" + std::to_string(16 / size_of(view.dtype)) +
             " elements)";
    order.push_back(d);
  }
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return view.strides[a] < view.strides[b]; });
  int64_t inner_span = view.shape[rank - 1];
  for (int64_t d : order) {
    if (view.strides[d] < inner_span)
      return "has stride " + std::to_string(view.strides[d]) + " in dimension " + std::to_string(d) +
             ", which makes its rows overlap; pass a view whose rows are disjoint";
    inner_span += view.strides[d] * (view.shape[d] - 1);
  }
  return {};
}

void check_tensor(const Device& device, const std::string& name, const TensorView& view,
                  std::initializer_list<DType> dtypes, const std::vector<int64_t>& shape,
                  Layout layout = Layout::kDense) {
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
  POUNCE_CHECK(view.device == device.kind, "argument '", name, "' is ", view.describe(),
               " but the workspace runs on ", device.kind == DeviceKind::kCuda ? "cuda" : "cpu",
               "; move it there");
  POUNCE_CHECK(view.device_id == device.index, "argument '", name, "' is ", view.describe(),
               " (device index ", view.device_id, ") but the workspace is on ", device.name(),
               device.kind == DeviceKind::kCpu ? " (host tensors have device index 0)" : "",
               "; pass every tensor of the call on the workspace's device",
               device.kind == DeviceKind::kCuda ? " (torch: .to('" + device.name() + "'))" : std::string());
  POUNCE_CHECK(view.is_dense() || layout == Layout::kRows, "argument '", name, "' is ", view.describe(),
               ", a strided view; only weights and their gradients may be strided: call .contiguous()");
  if (!view.is_dense()) {
    const std::string problem = row_layout_problem(view);
    POUNCE_CHECK(problem.empty(), "argument '", name, "' (", view.describe(), ") ", problem);
  }
  POUNCE_CHECK(view.numel() == 0 || view.data != nullptr, "argument '", name, "' has a null data pointer");
  POUNCE_CHECK(
      reinterpret_cast<uintptr_t>(view.data) % 16 == 0, "argument '", name, "' (", view.describe(),
      ") starts at an address that is not 16-byte aligned; the kernels move 16-byte vectors: pass a ",
      "tensor that starts at its allocation or at a 16-byte multiple");
}

void check_optional_none(const std::string& name, const TensorView& view) {
  POUNCE_CHECK(view.is_none(), "argument '", name, "' is ", view.describe(),
               " but shape.shared_intermediate is 0 (no shared expert); leave it empty or set the shape");
}

// Whether two views of the same shape, dtype and strides, row-strided of rank 2 or 3, share an element: their
// rows start on the lattice sum_d i_d stride_d (d an outer dimension) shifted by the views' distance, so some
// row of one overlaps some row of the other when a lattice step (i_0 - i_0', i_1 - i_1') lands within a row
// length of that distance. The halves of one fused gate_up tensor, or its interleaved rows, never do.
bool same_lattice_rows_overlap(const TensorView& a, const TensorView& b) {
  const int64_t element = size_of(a.dtype);
  const int64_t distance_bytes = static_cast<const char*>(b.data) - static_cast<const char*>(a.data);
  if (distance_bytes % element != 0) return true;  // misaligned views: say overlap, the safe answer
  const int64_t distance = distance_bytes / element, rank = a.rank(), row = a.shape[rank - 1];
  const int64_t outer = rank == 3 ? a.shape[0] : 1, outer_stride = rank == 3 ? a.strides[0] : 0;
  const int64_t rows = a.shape[rank - 2], row_stride = a.strides[rank - 2];
  for (int64_t di0 = -(outer - 1); di0 <= outer - 1; ++di0) {
    // Need |di0 * outer_stride + di1 * row_stride - distance| < row for some |di1| < rows.
    const int64_t target = distance - di0 * outer_stride;
    const int64_t low = target - row + 1, high = target + row - 1;  // di1 * row_stride in [low, high]
    const int64_t di1_low = low >= 0 ? (low + row_stride - 1) / row_stride : -((-low) / row_stride);
    const int64_t di1 = std::max(di1_low, -(rows - 1));
    if (di1 <= rows - 1 && di1 * row_stride <= high) return true;
  }
  return false;
}

// Integer division rounding toward minus infinity.
int64_t floor_div(int64_t a, int64_t b) {
  return a / b - (a % b != 0 && (a < 0) != (b < 0));
}

// Whether a row-strided view of rank 2 or 3 has an element in the bytes [lo, hi) (relative to its data):
// per outer index, the rows whose byte range meets [lo, hi) are an interval of row indices.
bool rows_touch(const TensorView& view, int64_t lo, int64_t hi) {
  const int64_t element = size_of(view.dtype), rank = view.rank();
  const int64_t outer = rank == 3 ? view.shape[0] : 1, outer_step = rank == 3 ? view.strides[0] * element : 0;
  const int64_t rows = view.shape[rank - 2], row_step = view.strides[rank - 2] * element;
  const int64_t row_bytes = view.shape[rank - 1] * element;
  for (int64_t e = 0; e < outer; ++e) {
    const int64_t base = e * outer_step;
    // Row i meets [lo, hi) when base + i * row_step < hi and base + i * row_step + row_bytes > lo.
    const int64_t first = std::max<int64_t>(0, floor_div(lo - base - row_bytes, row_step) + 1);
    const int64_t last = std::min(rows - 1, floor_div(hi - base - 1, row_step));
    if (first <= last) return true;
  }
  return false;
}

bool overlaps(const TensorView& a, const TensorView& b) {
  if (a.is_none() || b.is_none() || a.numel() == 0 || b.numel() == 0) return false;
  if (a.device != b.device || a.device_id != b.device_id) return false;
  const auto* a_begin = static_cast<const char*>(a.data);
  const auto* b_begin = static_cast<const char*>(b.data);
  if (!(a_begin < b_begin + b.span_bytes() && b_begin < a_begin + a.span_bytes())) return false;
  // Row by row where the layouts allow it; otherwise the spans meeting count as an overlap.
  auto rows_view = [](const TensorView& v) {
    return !v.is_dense() && (v.rank() == 2 || v.rank() == 3) && row_layout_problem(v).empty();
  };
  if (rows_view(a) && b.is_dense()) return rows_touch(a, b_begin - a_begin, b_begin - a_begin + b.bytes());
  if (rows_view(b) && a.is_dense()) return rows_touch(b, a_begin - b_begin, a_begin - b_begin + a.bytes());
  if (rows_view(a) && a.strides == b.strides && a.shape == b.shape && a.dtype == b.dtype)
    return same_lattice_rows_overlap(a, b);
  return true;
}

// The tensors of one call by name, in argument order: what it reads and what it writes.
using NamedViews = std::vector<std::pair<std::string, const TensorView*>>;

void add_weights(NamedViews& views, const std::string& prefix, const ExpertWeights& weights) {
  views.push_back({prefix + ".gate", &weights.gate});
  views.push_back({prefix + ".up", &weights.up});
  views.push_back({prefix + ".down", &weights.down});
  views.push_back({prefix + ".b_gate", &weights.b_gate});
  views.push_back({prefix + ".b_up", &weights.b_up});
  views.push_back({prefix + ".b_down", &weights.b_down});
}

NamedViews forward_inputs(const ForwardArgs& args) {
  NamedViews inputs = {{"x", &args.x}, {"topk_idx", &args.topk_idx}, {"topk_weights", &args.topk_weights}};
  add_weights(inputs, "routed", args.routed);
  add_weights(inputs, "shared", args.shared);
  if (const Fp8Weights* fp8 = args.routed_fp8) {
    const std::pair<const char*, const Fp8Tensor*> tensors[] = {
        {"gate", &fp8->gate},     {"up", &fp8->up},     {"down", &fp8->down},
        {"gate_t", &fp8->gate_t}, {"up_t", &fp8->up_t}, {"down_t", &fp8->down_t}};
    for (const auto& [name, tensor] : tensors) {
      inputs.push_back({std::string("routed_fp8.") + name + ".data", &tensor->data});
      inputs.push_back({std::string("routed_fp8.") + name + ".scale", &tensor->scale});
    }
  }
  return inputs;
}

// Outputs are written while inputs are still read (and by other ranks' pushes on GPUs), so an output may
// share memory with no input and no other output; inputs may share memory with each other.
void check_no_aliasing(const NamedViews& inputs, const NamedViews& outputs) {
  for (size_t o = 0; o < outputs.size(); ++o) {
    const auto& [name, output] = outputs[o];
    for (const auto& [input_name, input] : inputs)
      POUNCE_CHECK(!overlaps(*output, *input), "argument '", name, "' overlaps an input, argument '",
                   input_name, "'; pass an output buffer that shares no memory with the inputs");
    for (size_t other = 0; other < o; ++other)
      POUNCE_CHECK(!overlaps(*output, *outputs[other].second), "arguments '", outputs[other].first, "' and '",
                   name, "' overlap; both are written, so give each output its own buffer");
  }
}

// Weights: row-strided views allowed (any non-overlapping outer strides). Weight gradients (`gradients`):
// each may be left empty, and its GEMM is skipped (frozen experts); the kernels store a gradient as dense
// [groups, rows, cols] matrices, so a given one is dense, or the routed gate and up gradients are the two
// halves of one [El, 2I, H] tensor (one GEMM over [d_g | d_u] writes both).
void check_weights(const Workspace& workspace, const Device& device, const std::string& prefix,
                   const ExpertWeights& weights, bool shared, std::initializer_list<DType> dtypes,
                   bool gradients = false) {
  const Shape& s = workspace.shape();
  const std::pair<const char*, const TensorView*> biases[] = {
      {".b_gate", &weights.b_gate}, {".b_up", &weights.b_up}, {".b_down", &weights.b_down}};
  for (const auto& [part, view] : biases) {
    if (view->is_none()) continue;
    POUNCE_CHECK(!shared, "argument '", prefix, part, "' is ", view->describe(),
                 " but the shared expert has no biases (only routed experts do); leave it empty");
    check_tensor(device, prefix + part, *view, dtypes,
                 {s.num_local_experts(), view == &weights.b_down ? s.hidden : s.intermediate});
  }
  if (shared && !s.has_shared_expert()) {
    check_optional_none(prefix + ".gate", weights.gate);
    check_optional_none(prefix + ".up", weights.up);
    check_optional_none(prefix + ".down", weights.down);
    return;
  }
  const std::vector<int64_t> gate_shape =
      shared ? std::vector<int64_t>{s.shared_intermediate, s.hidden}
             : std::vector<int64_t>{s.num_local_experts(), s.intermediate, s.hidden};
  const std::vector<int64_t> down_shape =
      shared ? std::vector<int64_t>{s.hidden, s.shared_intermediate}
             : std::vector<int64_t>{s.num_local_experts(), s.hidden, s.intermediate};
  const std::pair<const char*, const TensorView*> tensors[] = {
      {".gate", &weights.gate}, {".up", &weights.up}, {".down", &weights.down}};
  for (const auto& [part, view] : tensors) {
    if (gradients && view->is_none()) continue;
    check_tensor(device, prefix + part, *view, dtypes, view == &weights.down ? down_shape : gate_shape,
                 Layout::kRows);
  }
  if (!gradients) return;
  auto dense = [](const TensorView& view) { return view.is_none() || view.is_dense(); };
  POUNCE_CHECK(
      dense(weights.down), "argument '", prefix, ".down' is ", weights.down.describe(),
      ", a strided view; weight gradients are written as dense tensors (gate and up may also be the ",
      "two halves of one [El, 2I, H] tensor): pass a contiguous down gradient");
  const TensorView &gate = weights.gate, &up = weights.up;
  if (dense(gate) && dense(up)) return;
  POUNCE_CHECK(!shared, "arguments '", prefix, ".gate' and '", prefix,
               ".up' must be dense: the shared expert's gradients are written as dense tensors (the halves ",
               "of one [2Is, H] tensor are dense views already)");
  const int64_t I = s.intermediate, H = s.hidden;
  const std::vector<int64_t> halves = {2 * I * H, H, 1};
  const bool halves_of_one =
      !gate.is_none() && !up.is_none() && gate.strides == halves && up.strides == halves &&
      gate.dtype == up.dtype &&
      static_cast<const char*>(up.data) == static_cast<const char*>(gate.data) + I * H * size_of(gate.dtype);
  POUNCE_CHECK(halves_of_one, "arguments '", prefix, ".gate' (", gate.is_none() ? "none" : gate.describe(),
               ") and '", prefix, ".up' (", up.is_none() ? "none" : up.describe(),
               "): weight gradients are written as dense tensors, or gate and up as the two halves of one [",
               s.num_local_experts(), ", ", 2 * I, ", ", H, "] tensor (d_gate_up[:, :", I,
               "] and d_gate_up[:, ", I, ":]); pass one of those layouts");
}

// The quantized routed weights, as pounce::quantize_weights_fp8 writes them (include/pounce/fp8.h).
void check_fp8_weights(const Workspace& workspace, const Device& device, const Fp8Weights& fp8) {
  const Shape& s = workspace.shape();
  const int64_t El = s.num_local_experts(), H = s.hidden, I = s.intermediate;
  const std::pair<const char*, const Fp8Tensor*> tensors[] = {{"gate", &fp8.gate}, {"up", &fp8.up},
                                                              {"down", &fp8.down}, {"gate_t", &fp8.gate_t},
                                                              {"up_t", &fp8.up_t}, {"down_t", &fp8.down_t}};
  const int64_t rows[] = {I, I, H, H, H, I};
  for (int i = 0; i < 6; ++i) {
    const std::string name = std::string("routed_fp8.") + tensors[i].first;
    const int64_t n = rows[i], k = rows[i] == I ? H : I;
    check_tensor(device, name + ".data", tensors[i].second->data, {DType::kFP8E4M3, DType::kUInt8},
                 {El, n, k});
    check_tensor(device, name + ".scale", tensors[i].second->scale, {DType::kFP32},
                 {El, (n + kFp8Block - 1) / kFp8Block, (k + kFp8Block - 1) / kFp8Block});
  }
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

void check_forward_inputs(const Workspace& workspace, const ForwardArgs& args, const Device& device) {
  const Shape& s = workspace.shape();
  const int64_t num_tokens = args.x.shape[0];
  check_tensor(device, "x", args.x, {DType::kBF16}, {num_tokens, s.hidden});
  check_tensor(device, "topk_idx", args.topk_idx, {DType::kInt32, DType::kInt64}, {num_tokens, s.num_topk});
  check_tensor(device, "topk_weights", args.topk_weights, {DType::kFP32}, {num_tokens, s.num_topk});
  check_weights(workspace, device, "routed", args.routed, false, {DType::kBF16});
  check_weights(workspace, device, "shared", args.shared, true, {DType::kBF16});
  check_expert_biases_supported(workspace.group().backend(), workspace.config().precision, args.routed,
                                nullptr);
  POUNCE_CHECK(workspace.config().precision == Precision::kBF16 || args.routed_fp8 != nullptr,
               "argument 'routed_fp8' is missing but config.precision is fp8; quantize the weights with ",
               "pounce::quantize_weights_fp8 and pass them");
  if (args.routed_fp8 != nullptr) check_fp8_weights(workspace, device, *args.routed_fp8);
  check_routing_ids(workspace, args.topk_idx);
}

void check_token_count(const Workspace& workspace, const TensorView& x) {
  const Shape& s = workspace.shape();
  POUNCE_CHECK(!x.is_none() && x.rank() == 2, "argument 'x' must be a [T, ", s.hidden, "] bf16 tensor; got ",
               x.is_none() ? std::string("none") : x.describe());
  POUNCE_CHECK(x.shape[0] <= s.max_tokens, "argument 'x' has ", x.shape[0],
               " tokens but the workspace was sized for max_tokens = ", s.max_tokens,
               "; create the workspace with a larger Shape::max_tokens");
}

// Shortest text that reads back as the same float.
std::string float_string(float value) {
  char text[32];
  const auto result = std::to_chars(text, text + sizeof(text), value);
  return std::string(text, result.ptr);
}

int64_t float_bits(float value) {
  return std::bit_cast<uint32_t>(value);
}

}  // namespace

void check_expert_biases_supported(Backend backend, Precision precision, const ExpertWeights& routed,
                                   const ExpertWeights* d_routed) {
  const bool given = routed.has_biases() || (d_routed != nullptr && d_routed->has_biases());
  if (!given) return;
  POUNCE_CHECK(backend != Backend::kGpu,
               "expert biases are not supported on GPUs yet (arguments 'routed.b_gate', 'routed.b_up', ",
               "'routed.b_down' and their gradients); fix: leave them empty on a GPU workspace (fold the ",
               "biases outside the layer, as pounce.torch does for GPT-OSS) or run on the CPU backend");
  POUNCE_CHECK(precision == Precision::kBF16,
               "expert biases ('routed.b_gate', 'routed.b_up', 'routed.b_down') are not supported with ",
               "config.precision = fp8 yet; fix: run with precision bf16 or leave the biases empty");
}

void validate_forward_args(const Workspace& workspace, const ForwardArgs& args, bool check_out) {
  check_token_count(workspace, args.x);
  const Device device = expected_device(workspace);
  check_forward_inputs(workspace, args, device);
  if (!check_out) return;
  check_tensor(device, "out", args.out, {DType::kBF16}, {args.x.shape[0], workspace.shape().hidden});
  check_no_aliasing(forward_inputs(args), {{"out", &args.out}});
}

void validate_backward_args(const Workspace& workspace, const BackwardArgs& args) {
  check_token_count(workspace, args.inputs.x);
  const Device device = expected_device(workspace);
  check_forward_inputs(workspace, args.inputs, device);
  const Shape& s = workspace.shape();
  const int64_t num_tokens = args.inputs.x.shape[0];
  check_tensor(device, "d_out", args.d_out, {DType::kBF16}, {num_tokens, s.hidden});
  check_tensor(device, "d_x", args.d_x, {DType::kBF16}, {num_tokens, s.hidden});
  check_tensor(device, "d_topk_weights", args.d_topk_weights, {DType::kFP32}, {num_tokens, s.num_topk});
  if (args.accumulate_weight_grads) {  // main_grad accumulation is fp32 only
    check_weights(workspace, device, "d_routed", args.d_routed, false, {DType::kFP32}, true);
    check_weights(workspace, device, "d_shared", args.d_shared, true, {DType::kFP32}, true);
  } else {
    check_weights(workspace, device, "d_routed", args.d_routed, false, {DType::kBF16, DType::kFP32}, true);
    check_weights(workspace, device, "d_shared", args.d_shared, true, {DType::kBF16, DType::kFP32}, true);
  }
  const ExpertWeights &biases = args.inputs.routed, &d_biases = args.d_routed;
  const std::pair<const char*, const TensorView*> pairs[] = {
      {"b_gate", &d_biases.b_gate}, {"b_up", &d_biases.b_up}, {"b_down", &d_biases.b_down}};
  for (const auto& [part, d_bias] : pairs) {
    const TensorView& bias = d_bias == &d_biases.b_gate ? biases.b_gate
                             : d_bias == &d_biases.b_up ? biases.b_up
                                                        : biases.b_down;
    POUNCE_CHECK(d_bias->is_none() || !bias.is_none(), "argument 'd_routed.", part, "' is ",
                 d_bias->describe(), " but 'routed.", part,
                 "' is empty: there is no bias to differentiate; pass the bias or ",
                 "leave its gradient empty");
  }
  check_expert_biases_supported(workspace.group().backend(), workspace.config().precision, args.inputs.routed,
                                &args.d_routed);
  NamedViews inputs = forward_inputs(args.inputs);
  inputs.push_back({"d_out", &args.d_out});
  NamedViews outputs = {{"d_x", &args.d_x}, {"d_topk_weights", &args.d_topk_weights}};
  add_weights(outputs, "d_routed", args.d_routed);
  add_weights(outputs, "d_shared", args.d_shared);
  check_no_aliasing(inputs, outputs);
}

WorkspaceFields WorkspaceFields::of(const Shape& shape, const Config& config) {
  // Bound by name: a field added to Shape, Config or Activation breaks these lines until it is listed here
  // (and in name() and show()), so ranks never disagree on a field nobody compares.
  const auto& [max_tokens, hidden, intermediate, num_experts, num_topk, shared_intermediate, num_ranks] =
      shape;
  const auto& [forward_comm_sms, backward_comm_sms, minibatch_size, macrobatch_size, activation, precision,
               deterministic, backend, kernel_path, backward_kernel_path, combine] = config;
  const auto& [kind, clamp_limit, alpha] = activation;
  WorkspaceFields fields;
  fields.values = {max_tokens,
                   hidden,
                   intermediate,
                   num_experts,
                   num_topk,
                   shared_intermediate,
                   num_ranks,
                   forward_comm_sms,
                   backward_comm_sms,
                   minibatch_size,
                   macrobatch_size,
                   static_cast<int64_t>(kind),
                   clamp_limit ? float_bits(*clamp_limit) : int64_t{-1},
                   float_bits(alpha),
                   static_cast<int64_t>(precision),
                   deterministic ? 1 : 0,
                   static_cast<int64_t>(backend),
                   static_cast<int64_t>(kernel_path),
                   static_cast<int64_t>(backward_kernel_path),
                   static_cast<int64_t>(combine)};
  return fields;
}

const char* WorkspaceFields::name(int field) {
  static constexpr const char* kNames[kCount] = {"shape.max_tokens",
                                                 "shape.hidden",
                                                 "shape.intermediate",
                                                 "shape.num_experts",
                                                 "shape.num_topk",
                                                 "shape.shared_intermediate",
                                                 "shape.num_ranks",
                                                 "config.forward_comm_sms",
                                                 "config.backward_comm_sms",
                                                 "config.minibatch_size",
                                                 "config.macrobatch_size",
                                                 "config.activation.kind",
                                                 "config.activation.clamp_limit",
                                                 "config.activation.alpha",
                                                 "config.precision",
                                                 "config.deterministic",
                                                 "config.backend",
                                                 "config.kernel_path",
                                                 "config.backward_kernel_path",
                                                 "config.combine"};
  return field >= 0 && field < kCount ? kNames[field] : "?";
}

std::string WorkspaceFields::show(int field, int64_t value) {
  switch (field) {
    case 11:
      return to_string(static_cast<ActivationKind>(value));
    case 12:
      return value < 0 ? "none" : float_string(std::bit_cast<float>(static_cast<uint32_t>(value)));
    case 13:
      return float_string(std::bit_cast<float>(static_cast<uint32_t>(value)));
    case 14:
      return to_string(static_cast<Precision>(value));
    case 15:
      return value ? "true" : "false";
    case 16:
      return to_string(static_cast<Backend>(value));
    case 17:
    case 18:
      return to_string(static_cast<KernelPath>(value));
    case 19:
      return to_string(static_cast<CombineMode>(value));
    default:
      return std::to_string(value);
  }
}

std::string workspace_disagreement(const std::vector<WorkspaceFields>& ranks) {
  for (int field = 0; field < WorkspaceFields::kCount; ++field) {
    const int64_t first = ranks[0].values[field];
    std::string others;
    for (size_t rank = 1; rank < ranks.size(); ++rank) {
      const int64_t value = ranks[rank].values[field];
      if (value != first)
        others += (others.empty() ? "" : ", ") + WorkspaceFields::show(field, value) + " on rank " +
                  std::to_string(rank);
    }
    if (!others.empty())
      return std::string("ranks created the workspace with different ") + WorkspaceFields::name(field) +
             ": " + WorkspaceFields::show(field, first) + " on rank 0 but " + others +
             "; every rank of the group must pass the same Shape and Config";
  }
  return {};
}

}  // namespace pounce
