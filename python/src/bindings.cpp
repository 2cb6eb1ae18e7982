// pounce._C: the C++ API (include/pounce/) for Python, over DLPack tensors of any framework.
//
// Tensors arrive as anything nanobind can import without a copy (__dlpack__ or the buffer protocol:
// numpy arrays, torch/jax/cupy tensors) and become pounce::TensorView. numpy has no bfloat16, so a
// uint16 tensor is read as bf16 bit patterns (no other argument takes uint16). Nothing is ever
// converted or copied: an output that were a copy would be written and then thrown away.
//
// Routed weights (and d_routed) are (gate, up, down) or, with expert biases (GPT-OSS; CPU backend only for
// now), (gate, up, down, b_gate, b_up, b_down): b_gate, b_up [El, I], b_down [El, H] bf16, any of them None
// for no such bias; in d_routed their gradients (None = not computed; fp32/bf16 as the weight gradients).
//
// Quantized routed weights (Config.precision fp8: `routed_fp8` of forward/backward/recompute_forward_context,
// `out` of quantize_weights_fp8) are six (data, scale) pairs in the order gate, up, down, gate_t, up_t,
// down_t, as include/pounce/fp8.h lays them out: data uint8 (the e4m3 bits) or fp8e4m3, scale fp32.
//
// forward/backward/recompute_forward_context and the collective constructors release the GIL: on the
// CPU backend the R ranks are R Python threads whose calls meet at a host barrier inside the call.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "pounce/pounce.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace pounce {
namespace {

// The tensors of one call, imported with the GIL held; the ndarrays they came from (owners of the
// DLPack capsules, so of the memory) live until the call returns, the views are read with the GIL
// released.
class TensorArgs {
 public:
  // An input (read-only memory is fine) or an output (must be writable). Dense unless `policy` says
  // otherwise (weights and their gradients may be row-strided views: the halves of a fused gate_up tensor).
  TensorView input(nb::handle object, const std::string& name, StridePolicy policy = StridePolicy::kDense) {
    return take<nb::ro>(object, name, policy);
  }
  TensorView output(nb::handle object, const std::string& name, StridePolicy policy = StridePolicy::kDense) {
    return take<>(object, name, policy);
  }

  // (gate, up, down) from any sequence of three tensors, or (gate, up, down, b_gate, b_up, b_down) of six
  // (expert biases, dense); None = no weights (no shared expert). Fills
  // `weights` one tensor at a time, so that a failure leaves the tensors before it converted. A None
  // element stays empty: for gradients, one not to compute (frozen weights); for weights, a missing one
  // (the layer's validation names it).
  void weights(nb::handle object, const std::string& name, bool is_output, ExpertWeights& weights,
               StridePolicy policy = StridePolicy::kDense) {
    if (object.is_none()) return;
    if (!is_sequence(object, 3) && !is_sequence(object, 6)) {
      weights.gate = placeholder();
      detail::fail("argument '", name,
                   "' must be a tuple (gate, up, down) of three tensors, or (gate, up, down, b_gate, b_up, ",
                   "b_down) of six with expert biases; got ", describe(object));
    }
    auto take_one = [&](Py_ssize_t i, const char* part, TensorView& view) {
      try {
        const nb::object element = item(object, i);
        if (element.is_none()) return;
        view = is_output ? output(element, name + part, policy) : input(element, name + part, policy);
      } catch (...) {
        view = placeholder();
        throw;
      }
    };
    take_one(0, ".gate", weights.gate);
    take_one(1, ".up", weights.up);
    take_one(2, ".down", weights.down);
    if (nb::len(object) == 3) return;
    const StridePolicy dense = policy;
    policy = StridePolicy::kDense;  // biases and their gradients are dense
    take_one(3, ".b_gate", weights.b_gate);
    take_one(4, ".b_up", weights.b_up);
    take_one(5, ".b_down", weights.b_down);
    policy = dense;
  }

  // Six (data, scale) pairs in the order gate, up, down, gate_t, up_t, down_t (include/pounce/fp8.h), named
  // `name`.gate.data, ... in messages. Fills `fp8` one tensor at a time, like weights(): a failure leaves a
  // placeholder in the failed slot and the later ones empty, so the layer rejects the set.
  void fp8_weights(nb::handle object, const std::string& name, bool is_output, Fp8Weights& fp8) {
    static const char* const kNames[] = {"gate", "up", "down", "gate_t", "up_t", "down_t"};
    Fp8Tensor* slots[] = {&fp8.gate, &fp8.up, &fp8.down, &fp8.gate_t, &fp8.up_t, &fp8.down_t};
    if (!is_sequence(object, 6)) {
      fp8.gate.data = placeholder();
      detail::fail("argument '", name,
                   "' must be six (data, scale) pairs in the order gate, up, down, gate_t, ",
                   "up_t, down_t (pounce.quantize_weights_fp8's layout); got ", describe(object));
    }
    for (Py_ssize_t i = 0; i < 6; ++i) {
      const std::string part = name + "." + kNames[i];
      TensorView* current = &slots[i]->data;
      try {
        const nb::object pair = item(object, i);
        POUNCE_CHECK(is_sequence(pair, 2), "argument '", part,
                     "' must be a (data, scale) pair: uint8/fp8e4m3 data and fp32 scales; got ",
                     describe(pair));
        slots[i]->data =
            is_output ? output(item(pair, 0), part + ".data") : input(item(pair, 0), part + ".data");
        current = &slots[i]->scale;
        slots[i]->scale =
            is_output ? output(item(pair, 1), part + ".scale") : input(item(pair, 1), part + ".scale");
      } catch (...) {
        *current = placeholder();
        throw;
      }
    }
  }

  // ForwardArgs::routed_fp8 from a Python argument (None = not given): the views live in this TensorArgs,
  // as long as the call. The pointer is set before the conversion, so that a failed one is rejected too.
  void routed_fp8(nb::handle object, ForwardArgs& args) {
    if (object.is_none()) return;
    args.routed_fp8 = &routed_fp8_;
    fp8_weights(object, "routed_fp8", false, routed_fp8_);
  }

 private:
  static bool is_sequence(nb::handle object, size_t length) {
    return nb::isinstance<nb::sequence>(object) && !nb::isinstance<nb::str>(object) &&
           nb::len(object) == length;
  }

  static nb::object item(nb::handle object, Py_ssize_t i) {
    PyObject* element = PySequence_GetItem(object.ptr(), i);
    if (element == nullptr) throw nb::python_error();
    return nb::steal(element);
  }

  // Stands for a tensor that failed to convert: an empty view would pass for "no shared expert", and
  // run_collective relies on the call being rejected.
  static TensorView placeholder() { return TensorView(nullptr, DType::kUInt8, {0}); }

  static std::string describe(nb::handle object) {
    std::string out = "a " + std::string(nb::type_name(object.type()).c_str());
    if (nb::isinstance<nb::sequence>(object)) out += " of length " + std::to_string(nb::len(object));
    return out;
  }

  template <typename... Constraints>
  TensorView take(nb::handle object, const std::string& name, StridePolicy policy) {
    nb::ndarray<Constraints...> array;
    if (!nb::try_cast(object, array, /*convert=*/false)) {
      POUNCE_CHECK(!nb::hasattr(object, "requires_grad") || !nb::cast<bool>(object.attr("requires_grad")),
                   "argument '", name,
                   "' requires grad; pass a detached tensor (pounce.torch does autograd)");
      nb::ndarray<nb::ro> readonly;
      POUNCE_CHECK(!nb::try_cast(object, readonly, false), "argument '", name,
                   "' is read-only but is written; pass a writable tensor");
      detail::fail("argument '", name, "' is ", describe(object),
                   "; pass a DLPack tensor (numpy array, torch tensor, ...)");
    }
    DLTensor tensor{};
    tensor.data = const_cast<void*>(static_cast<const void*>(array.data()));
    tensor.device = {static_cast<DLDeviceType>(array.device_type()), array.device_id()};
    tensor.ndim = static_cast<int32_t>(array.ndim());
    const nb::dlpack::dtype dtype = array.dtype();
    tensor.dtype = {dtype.code, dtype.bits, dtype.lanes};
    if (dtype.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt) && dtype.bits == 16)
      tensor.dtype.code = kDLBfloat;  // numpy's stand-in for bf16
    tensor.shape = const_cast<int64_t*>(array.shape_ptr());
    // Strides of a tensor without elements are arbitrary (numpy gives 0s); it is trivially dense.
    tensor.strides = array.size() == 0 ? nullptr : const_cast<int64_t*>(array.stride_ptr());
    tensor.byte_offset = 0;  // nanobind's data() already includes it
    const TensorView view = TensorView::from_dlpack(tensor, name.c_str(), policy);
    if constexpr (sizeof...(Constraints) == 0) {
      outputs_.push_back(std::move(array));
    } else {
      inputs_.push_back(std::move(array));
    }
    return view;
  }

  std::vector<nb::ndarray<nb::ro>> inputs_;
  std::vector<nb::ndarray<>> outputs_;
  Fp8Weights routed_fp8_;
};

void forward_args(TensorArgs& tensors, ForwardArgs& args, nb::handle x, nb::handle topk_idx,
                  nb::handle topk_weights, nb::handle routed, nb::handle shared, nb::handle routed_fp8) {
  args.x = tensors.input(x, "x");
  args.topk_idx = tensors.input(topk_idx, "topk_idx");
  args.topk_weights = tensors.input(topk_weights, "topk_weights");
  POUNCE_CHECK(!routed.is_none(), "argument 'routed' is missing; pass (w_gate, w_up, w_down)");
  tensors.weights(routed, "routed", false, args.routed, StridePolicy::kRowStrided);
  tensors.weights(shared, "shared", false, args.shared, StridePolicy::kRowStrided);
  tensors.routed_fp8(routed_fp8, args);
}

// Converts the arguments, then runs the call with the GIL released. When a conversion fails on a CPU
// group of several ranks, this rank still joins the collective call with the arguments converted so far
// (the failed one and those after it left empty), so that its peers fail at once ("rank r rejected its
// inputs: argument 'name' is missing") instead of waiting out POUNCE_PEER_TIMEOUT_S; then it raises its
// own error.
template <typename Args, typename Convert, typename Run>
void run_collective(const Workspace& workspace, Convert&& convert, Run&& run) {
  Args args;
  try {
    convert(args);
  } catch (...) {
    if (workspace.group().backend() == Backend::kCpu && workspace.group().num_ranks() > 1) {
      nb::gil_scoped_release release;
      try {
        run(args);
      } catch (...) {
        // expected: every rank rejects the call
      }
    }
    throw;
  }
  nb::gil_scoped_release release;
  run(args);
}

void* stream_pointer(uintptr_t stream) {
  return reinterpret_cast<void*>(stream);
}

std::string shape_repr(const Shape& s) {
  std::ostringstream out;
  out << "Shape(max_tokens=" << s.max_tokens << ", hidden=" << s.hidden << ", intermediate=" << s.intermediate
      << ", num_experts=" << s.num_experts << ", num_topk=" << s.num_topk
      << ", shared_intermediate=" << s.shared_intermediate << ", num_ranks=" << s.num_ranks << ")";
  return out.str();
}

std::string activation_repr(const Activation& a) {
  std::ostringstream out;
  out << "Activation(kind=" << to_string(a.kind) << ", clamp_limit=";
  if (a.clamp_limit) {
    out << *a.clamp_limit;
  } else {
    out << "None";
  }
  out << ", alpha=" << a.alpha << ")";
  return out.str();
}

std::string config_repr(const Config& c) {
  std::ostringstream out;
  out << "Config(forward_comm_sms=" << c.forward_comm_sms << ", backward_comm_sms=" << c.backward_comm_sms
      << ", minibatch_size=" << c.minibatch_size << ", macrobatch_size=" << c.macrobatch_size
      << ", activation=" << activation_repr(c.activation) << ", precision=" << to_string(c.precision)
      << ", deterministic=" << (c.deterministic ? "True" : "False") << ", backend=" << to_string(c.backend)
      << ", kernel_path=" << to_string(c.kernel_path)
      << ", backward_kernel_path=" << to_string(c.backward_kernel_path)
      << ", combine=" << to_string(c.combine) << ")";
  return out.str();
}

void bind_types(nb::module_& m) {
  nb::enum_<ActivationKind>(m, "ActivationKind")
      .value("swiglu", ActivationKind::kSwiGLU)
      .value("gpt_oss", ActivationKind::kGptOss);
  nb::enum_<Precision>(m, "Precision").value("bf16", Precision::kBF16).value("fp8", Precision::kFP8);
  nb::enum_<Backend>(m, "Backend")
      .value("auto", Backend::kAuto)
      .value("cpu", Backend::kCpu)
      .value("gpu", Backend::kGpu);
  nb::enum_<KernelPath>(m, "KernelPath")
      .value("fused", KernelPath::kFused)
      .value("staged", KernelPath::kStaged)
      .value("auto", KernelPath::kAuto);
  nb::enum_<CombineMode>(m, "CombineMode")
      .value("auto", CombineMode::kAuto)
      .value("push", CombineMode::kPush)
      .value("scatter", CombineMode::kScatter);

  nb::class_<Activation>(m, "Activation", "Expert activation: SwiGLU or GPT-OSS, optional clamp (DESIGN §1).")
      .def(
          "__init__",
          [](Activation* self, ActivationKind kind, std::optional<float> clamp_limit, float alpha) {
            new (self) Activation{kind, clamp_limit, alpha};
          },
          "kind"_a = ActivationKind::kSwiGLU, "clamp_limit"_a = nb::none(), "alpha"_a = 1.702f)
      .def_rw("kind", &Activation::kind)
      .def_rw("clamp_limit", &Activation::clamp_limit)
      .def_rw("alpha", &Activation::alpha)
      .def_static("swiglu", &Activation::swiglu)
      .def_static("gpt_oss", &Activation::gpt_oss)
      .def("__eq__", [](const Activation& a, const Activation& b) { return a == b; })
      .def("__repr__", &activation_repr);

  nb::class_<Shape>(m, "Shape",
                    "One MoE layer on one expert-parallel group (DESIGN §1); tokens are per rank.")
      .def(
          "__init__",
          [](Shape* self, int64_t max_tokens, int64_t hidden, int64_t intermediate, int64_t num_experts,
             int64_t num_topk, int64_t shared_intermediate, int64_t num_ranks) {
            new (self) Shape{max_tokens,          hidden,   intermediate, num_experts, num_topk,
                             shared_intermediate, num_ranks};
          },
          "max_tokens"_a = 0, "hidden"_a = 0, "intermediate"_a = 0, "num_experts"_a = 0, "num_topk"_a = 0,
          "shared_intermediate"_a = 0, "num_ranks"_a = 1)
      .def_rw("max_tokens", &Shape::max_tokens)
      .def_rw("hidden", &Shape::hidden)
      .def_rw("intermediate", &Shape::intermediate)
      .def_rw("num_experts", &Shape::num_experts)
      .def_rw("num_topk", &Shape::num_topk)
      .def_rw("shared_intermediate", &Shape::shared_intermediate)
      .def_rw("num_ranks", &Shape::num_ranks)
      .def_prop_ro("num_local_experts", &Shape::num_local_experts)
      .def_prop_ro("has_shared_expert", &Shape::has_shared_expert)
      .def("validate", [](const Shape& shape) { validate(shape); })
      .def("__eq__", [](const Shape& a, const Shape& b) { return a == b; })
      .def("__repr__", &shape_repr);

  nb::class_<Preset>(m, "Preset", "A model preset: shape (max_tokens and num_ranks left 0/1) and activation.")
      .def_ro("name", &Preset::name)
      .def_ro("shape", &Preset::shape)
      .def_ro("activation", &Preset::activation)
      .def("__repr__",
           [](const Preset& p) { return "Preset('" + p.name + "', " + shape_repr(p.shape) + ")"; });
  m.def("presets", &presets, "The model presets of DESIGN §5.");
  m.def("find_preset", &find_preset, "name"_a,
        "The preset called `name`; PounceError lists the known names.");

  nb::class_<Config>(m, "Config", "Launch and numerics configuration; 0 = let the heuristic choose.")
      .def(
          "__init__",
          [](Config* self, int forward_comm_sms, int backward_comm_sms, int64_t minibatch_size,
             int64_t macrobatch_size, std::optional<Activation> activation, Precision precision,
             bool deterministic, Backend backend, KernelPath kernel_path, KernelPath backward_kernel_path,
             CombineMode combine) {
            new (self) Config{forward_comm_sms,
                              backward_comm_sms,
                              minibatch_size,
                              macrobatch_size,
                              activation.value_or(Activation{}),
                              precision,
                              deterministic,
                              backend,
                              kernel_path,
                              backward_kernel_path,
                              combine};
          },
          "forward_comm_sms"_a = 0, "backward_comm_sms"_a = 0, "minibatch_size"_a = 0,
          "macrobatch_size"_a = 0, "activation"_a = nb::none(), "precision"_a = Precision::kBF16,
          "deterministic"_a = true, "backend"_a = Backend::kAuto, "kernel_path"_a = KernelPath::kFused,
          "backward_kernel_path"_a = KernelPath::kAuto, "combine"_a = CombineMode::kAuto)
      .def_rw("forward_comm_sms", &Config::forward_comm_sms)
      .def_rw("backward_comm_sms", &Config::backward_comm_sms)
      .def_rw("minibatch_size", &Config::minibatch_size)
      .def_rw("macrobatch_size", &Config::macrobatch_size)
      .def_rw("activation", &Config::activation)
      .def_rw("precision", &Config::precision)
      .def_rw("deterministic", &Config::deterministic)
      .def_rw("backend", &Config::backend)
      .def_rw("kernel_path", &Config::kernel_path)
      .def_rw("backward_kernel_path", &Config::backward_kernel_path)
      .def_rw("combine", &Config::combine)
      .def(
          "validate", [](const Config& config, const Shape& shape) { validate(config, shape); }, "shape"_a)
      .def("__repr__", &config_repr);
  m.attr("BLOCK_M") = kBlockM;
  // Capabilities the PyTorch layer checks: weights and routed gate/up gradients as views of a fused
  // [El, 2I, H] gate_up tensor, read and written in place (no copies); weight gradients passed as None are
  // skipped (frozen experts).
  m.attr("supports_expert_stride") = true;
  m.attr("supports_frozen_weight_grads") = true;
}

void bind_group_and_workspace(nb::module_& m) {
  nb::class_<Group>(m, "Group", "An expert-parallel group: one handle per rank.")
      .def_static("create_cpu", &Group::create_cpu, "num_ranks"_a,
                  "R ranks of the CPU backend in this process; drive rank r from its own thread.")
      .def_static(
          "new_unique_id",
          [] {
            const std::vector<uint8_t> id = Group::new_unique_id();
            return nb::bytes(reinterpret_cast<const char*>(id.data()), id.size());
          },
          "128 bytes (an NCCL unique id) for create_nccl; draw it on rank 0 and send it to the others.")
      .def_static(
          "create_nccl",
          [](int rank, int num_ranks, nb::bytes unique_id) {
            const auto* begin = static_cast<const uint8_t*>(unique_id.data());
            const std::vector<uint8_t> id(begin, begin + unique_id.size());
            nb::gil_scoped_release release;
            return Group::create_nccl(rank, num_ranks, id);
          },
          "rank"_a, "num_ranks"_a, "unique_id"_a,
          "One rank of a GPU group on the current CUDA device (collective over the ranks).")
      .def_static(
          "create_nccl_from_env",
          [] {
            nb::gil_scoped_release release;
            return Group::create_nccl_from_env();
          },
          "One rank per process from the torchrun/mpirun environment (sets the device to LOCAL_RANK).")
      .def_prop_ro("rank", &Group::rank)
      .def_prop_ro("num_ranks", &Group::num_ranks)
      .def_prop_ro("backend", &Group::backend)
      .def("__repr__", [](const Group& g) {
        return "Group(rank=" + std::to_string(g.rank()) + ", num_ranks=" + std::to_string(g.num_ranks()) +
               ", backend=" + to_string(g.backend()) + ")";
      });

  nb::class_<WorkspaceBytes>(m, "WorkspaceBytes")
      .def_ro("symmetric", &WorkspaceBytes::symmetric)
      .def_ro("local", &WorkspaceBytes::local)
      .def_prop_ro("total", &WorkspaceBytes::total)
      .def("__repr__", [](const WorkspaceBytes& b) {
        return "WorkspaceBytes(symmetric=" + std::to_string(b.symmetric) +
               ", local=" + std::to_string(b.local) + ")";
      });
  m.def("bytes_required", &Workspace::bytes_required, "shape"_a, "config"_a = Config{},
        "Bytes a workspace of this shape and config allocates (symmetric + local).");

  nb::class_<Workspace>(m, "Workspace",
                        "Every buffer of a forward/backward pair and the forward context; reuse it across "
                        "layers. Collective: every rank creates it with the same shape and config.")
      .def(
          "__init__",
          [](Workspace* self, const Group& group, const Shape& shape, const Config& config) {
            nb::gil_scoped_release release;
            new (self) Workspace(group, shape, config);
          },
          "group"_a, "shape"_a, "config"_a = Config{})
      .def_static("bytes_required", &Workspace::bytes_required, "shape"_a, "config"_a = Config{})
      .def_prop_ro("shape", &Workspace::shape)
      .def_prop_ro("config", &Workspace::config)
      .def_prop_ro("group", &Workspace::group);
}

void bind_layer(nb::module_& m) {
  m.def(
      "forward",
      [](Workspace& workspace, nb::handle x, nb::handle topk_idx, nb::handle topk_weights, nb::handle routed,
         nb::handle out, nb::handle shared, uintptr_t stream, nb::handle routed_fp8) {
        TensorArgs tensors;
        run_collective<ForwardArgs>(
            workspace,
            [&](ForwardArgs& args) {
              forward_args(tensors, args, x, topk_idx, topk_weights, routed, shared, routed_fp8);
              args.out = tensors.output(out, "out");
            },
            [&](const ForwardArgs& args) { forward(workspace, args, stream_pointer(stream)); });
      },
      "workspace"_a, "x"_a, "topk_idx"_a, "topk_weights"_a, "routed"_a, "out"_a, "shared"_a = nb::none(),
      "stream"_a = 0, nb::kw_only(), "routed_fp8"_a = nb::none(),
      "out[T,H] = the MoE layer of x[T,H] bf16 with topk_idx[T,k] int32/int64 and topk_weights[T,k] fp32;\n"
      "routed = (w_gate [El,I,H], w_up [El,I,H], w_down [El,H,I]) bf16, shared = (gate [Is,H], up [Is,H],\n"
      "down [H,Is]) or None. `stream` is a cudaStream_t as an int (0 = default stream). Saves the forward\n"
      "context in the workspace for backward. With config.precision fp8, routed_fp8 = the six (data, scale)\n"
      "pairs quantize_weights_fp8 wrote from these routed weights (gate, up, down, gate_t, up_t, down_t).");
  m.def(
      "recompute_forward_context",
      [](Workspace& workspace, nb::handle x, nb::handle topk_idx, nb::handle topk_weights, nb::handle routed,
         nb::handle shared, uintptr_t stream, nb::handle routed_fp8) {
        TensorArgs tensors;
        run_collective<ForwardArgs>(
            workspace,
            [&](ForwardArgs& args) {
              forward_args(tensors, args, x, topk_idx, topk_weights, routed, shared, routed_fp8);
            },
            [&](const ForwardArgs& args) {
              recompute_forward_context(workspace, args, stream_pointer(stream));
            });
      },
      "workspace"_a, "x"_a, "topk_idx"_a, "topk_weights"_a, "routed"_a, "shared"_a = nb::none(),
      "stream"_a = 0, nb::kw_only(), "routed_fp8"_a = nb::none(),
      "Rebuilds the forward context of these inputs in the workspace (bitwise as forward saved it) without\n"
      "writing out: run it before backward when another forward used the workspace in between. routed_fp8:\n"
      "as for forward (required with config.precision fp8).");
  m.def(
      "backward",
      [](Workspace& workspace, nb::handle x, nb::handle topk_idx, nb::handle topk_weights, nb::handle routed,
         nb::handle d_out, nb::handle d_x, nb::handle d_topk_weights, nb::handle d_routed, nb::handle shared,
         nb::handle d_shared, bool accumulate_weight_grads, uintptr_t stream, nb::handle routed_fp8) {
        TensorArgs tensors;
        run_collective<BackwardArgs>(
            workspace,
            [&](BackwardArgs& args) {
              forward_args(tensors, args.inputs, x, topk_idx, topk_weights, routed, shared, routed_fp8);
              args.d_out = tensors.input(d_out, "d_out");
              args.d_x = tensors.output(d_x, "d_x");
              args.d_topk_weights = tensors.output(d_topk_weights, "d_topk_weights");
              tensors.weights(d_routed, "d_routed", true, args.d_routed, StridePolicy::kRowStrided);
              tensors.weights(d_shared, "d_shared", true, args.d_shared, StridePolicy::kRowStrided);
              args.accumulate_weight_grads = accumulate_weight_grads;
            },
            [&](const BackwardArgs& args) { backward(workspace, args, stream_pointer(stream)); });
      },
      "workspace"_a, "x"_a, "topk_idx"_a, "topk_weights"_a, "routed"_a, "d_out"_a, "d_x"_a,
      "d_topk_weights"_a, "d_routed"_a.none(), "shared"_a = nb::none(), "d_shared"_a = nb::none(),
      "accumulate_weight_grads"_a = false, "stream"_a = 0, nb::kw_only(), "routed_fp8"_a = nb::none(),
      "Writes d_x [T,H] bf16, d_topk_weights [T,k] fp32 and the weight gradients (bf16 or fp32, shaped as "
      "the\n"
      "weights; added into fp32 tensors when accumulate_weight_grads) from d_out [T,H] bf16. The inputs "
      "must\n"
      "be those of the forward whose context the workspace holds. A weight gradient given as None (or\n"
      "d_routed / d_shared None) is not computed: frozen weights cost no weight-gradient GEMM. The routed\n"
      "gate and up gradients may be the halves of one [El,2I,H] tensor (d[:, :I], d[:, I:]), written in\n"
      "place; weights may be row-strided views (the halves or interleaved rows of a fused gate_up).\n"
      "routed_fp8: as for forward (required with config.precision fp8; the weight gradients stay "
      "bf16/fp32).");

  m.def(
      "check_errors",
      [](Workspace& workspace, uintptr_t stream, bool synchronize) {
        if (!synchronize) {
          check_errors(workspace, stream_pointer(stream), false);  // one host read: keeps the GIL
          return;
        }
        nb::gil_scoped_release release;
        check_errors(workspace, stream_pointer(stream), true);
      },
      "workspace"_a, "stream"_a = 0, "synchronize"_a = false,
      "Raises PounceError for the device-side failure (timed-out wait, topk_idx out of range, overflow)\n"
      "that earlier calls on this workspace recorded, naming the wait or argument with its counters, and\n"
      "clears it. Without synchronize: one read of host-mapped memory, so it sees the calls whose kernels\n"
      "have ended (a call just launched shows at a later check); cheap enough for every step, and legal\n"
      "during CUDA-graph capture. synchronize=True first waits for `stream` (a cudaStream_t as an int,\n"
      "0 = default stream), so every call on it is checked: run it after a graph's replay. On the CPU\n"
      "backend calls raise their errors themselves and this returns at once.");

  m.def(
      "quantize_weights_fp8",
      [](nb::handle routed, nb::handle out, uintptr_t stream) {
        TensorArgs tensors;
        ExpertWeights weights;
        POUNCE_CHECK(!routed.is_none(), "argument 'routed' is missing; pass (w_gate, w_up, w_down)");
        tensors.weights(routed, "routed", false, weights);
        Fp8Weights fp8;
        tensors.fp8_weights(out, "out", true, fp8);
        nb::gil_scoped_release release;
        quantize_weights_fp8(weights, fp8, stream_pointer(stream));
      },
      "routed"_a, "out"_a, "stream"_a = 0,
      "Quantizes routed = (w_gate [El,I,H], w_up [El,I,H], w_down [El,H,I]) bf16 into block-scaled FP8 E4M3\n"
      "(128x128 blocks, power-of-two fp32 scales) in both orientations. `out` holds six (data, scale) "
      "pairs:\n"
      "gate, up ([El,I,H], [El,ceil(I/128),ceil(H/128)]), down ([El,H,I], ...), then the transposed gate_t,\n"
      "up_t ([El,H,I], ...) and down_t ([El,I,H], ...); data is uint8 (the e4m3 bits) or float8_e4m3fn.\n"
      "All on the CPU, or all on one CUDA device (one launch on `stream`, a cudaStream_t as an int).");

  m.def("build_info", [] {
    const BuildInfo& info = build_info();
    nb::dict out;
    out["version"] = info.version;
    out["commit"] = info.commit;
    out["cuda"] = info.cuda;
    out["cuda_version"] = info.cuda_version;
    out["nccl_version"] = info.nccl_version;
    return out;
  });
}

}  // namespace
}  // namespace pounce

NB_MODULE(_C, m) {
  m.doc() = "Pounce: the MoE layer after the router, for Hopper GPUs (C++ API bindings).";
  nb::exception<pounce::Error>(m, "PounceError", PyExc_ValueError);
  pounce::bind_types(m);
  pounce::bind_group_and_workspace(m);
  pounce::bind_layer(m);
  m.attr("__version__") = pounce::build_info().version;
}
