"""pounce._C on the CPU backend with numpy arrays: results against the numpy reference, the ranks of a
group as Python threads (the calls release the GIL and meet inside the library), and wrong inputs
rejected with a PounceError that names the argument, before any output is written."""
from __future__ import annotations

import numpy as np
import pytest

pounce = pytest.importorskip(
    "pounce", reason="the pounce Python module is not built (needs nanobind; run tools/setup.sh)"
)

from conftest import on_ranks, raise_first  # noqa: E402
from moe_reference import Problem, check_close, make_ranks, reference  # noqa: E402

POISON = np.uint16(0xFFFF)  # a bf16 NaN: an element left unwritten shows


def shape_of(p: Problem, max_tokens: int) -> pounce.Shape:
    return pounce.Shape(max_tokens=max_tokens, hidden=p.hidden, intermediate=p.intermediate,
                        num_experts=p.num_experts, num_topk=p.num_topk,
                        shared_intermediate=p.shared_intermediate, num_ranks=p.num_ranks)


def config_of(p: Problem) -> pounce.Config:
    kind = pounce.ActivationKind.swiglu if p.activation == "swiglu" else pounce.ActivationKind.gpt_oss
    return pounce.Config(activation=pounce.Activation(kind, p.clamp_limit, p.alpha))


class NumpyRank:
    """One rank's arrays in the API's layout: bf16 as uint16 bit patterns."""

    def __init__(self, data, idx_dtype=np.int32, grad_dtype=np.float32):
        bits = pounce.bf16_bits
        self.x = bits(data.x)
        self.topk_idx = data.topk_idx.astype(idx_dtype)
        self.topk_weights = data.topk_weights.astype(np.float32)
        self.routed = (bits(data.w_gate), bits(data.w_up), bits(data.w_down))
        self.shared = None if data.ws_gate is None else (bits(data.ws_gate), bits(data.ws_up), bits(data.ws_down))
        self.d_out = bits(data.d_out)
        T, H = data.x.shape
        self.out = np.full((T, H), POISON)
        self.d_x = np.full((T, H), POISON)
        self.d_topk_weights = np.full(self.topk_weights.shape, np.nan, np.float32)

        def grad(like):
            return np.full(like.shape, POISON) if grad_dtype == np.uint16 else np.full(like.shape, np.nan, grad_dtype)

        self.d_routed = tuple(grad(w) for w in self.routed)
        self.d_shared = None if self.shared is None else tuple(grad(w) for w in self.shared)

    def forward(self, workspace, **overrides):
        args = dict(x=self.x, topk_idx=self.topk_idx, topk_weights=self.topk_weights, routed=self.routed,
                    out=self.out, shared=self.shared)
        args.update(overrides)
        pounce.forward(workspace, **args)

    def backward(self, workspace, accumulate=False, **overrides):
        args = dict(x=self.x, topk_idx=self.topk_idx, topk_weights=self.topk_weights, routed=self.routed,
                    d_out=self.d_out, d_x=self.d_x, d_topk_weights=self.d_topk_weights, d_routed=self.d_routed,
                    shared=self.shared, d_shared=self.d_shared, accumulate_weight_grads=accumulate)
        args.update(overrides)
        pounce.backward(workspace, **args)


def as_float(values):
    values = np.asarray(values)
    return pounce.bf16_to_float(values).astype(np.float64) if values.dtype == np.uint16 else values.astype(np.float64)


def run_group(p: Problem, ranks, max_tokens=None, **rank_kwargs):
    groups = pounce.Group.create_cpu(p.num_ranks)
    shape = shape_of(p, max_tokens or max(max(r.x.shape[0] for r in ranks), 1))

    def body(rank):
        workspace = pounce.Workspace(groups[rank], shape, config_of(p))
        arrays = NumpyRank(ranks[rank], **rank_kwargs)
        arrays.forward(workspace)
        arrays.backward(workspace)
        return arrays

    results, errors = on_ranks(p.num_ranks, body)
    raise_first(errors)
    return results


def check_against_reference(p: Problem, ranks, got):
    ref64 = reference(p, ranks)
    refb = reference(p, ranks, bf16=True)
    for r, (arrays, exact, emulated) in enumerate(zip(got, ref64, refb)):
        out = as_float(arrays.out)
        # Forward against the bf16-emulating reference, tightly: rounding-order noise only (a bf16 ulp).
        tight = 2.0**-7 * np.abs(emulated.out) + 1e-6 * max(np.abs(emulated.out).max(initial=0), 1)
        assert np.all(np.abs(out - emulated.out) <= tight), f"rank {r}: out differs from the bf16 reference"
        check_close(f"rank {r} out", out, exact.out, emulated.out)
        check_close(f"rank {r} d_x", as_float(arrays.d_x), exact.d_x, emulated.d_x)
        check_close(f"rank {r} d_topk_weights", arrays.d_topk_weights, exact.d_topk_weights, emulated.d_topk_weights)
        for name, g, e, b in zip(("d_w_gate", "d_w_up", "d_w_down"), arrays.d_routed,
                                 (exact.d_w_gate, exact.d_w_up, exact.d_w_down),
                                 (emulated.d_w_gate, emulated.d_w_up, emulated.d_w_down)):
            check_close(f"rank {r} {name}", as_float(g), e, b)
        if arrays.d_shared is not None:
            for name, g, e, b in zip(("d_ws_gate", "d_ws_up", "d_ws_down"), arrays.d_shared, exact.d_ws,
                                     emulated.d_ws):
                check_close(f"rank {r} {name}", as_float(g), e, b)


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_ranks,tokens", [(1, [37]), (2, [23, 9]), (2, [0, 17]), (4, [5, 1, 0, 12])])
@pytest.mark.parametrize("shared", [0, 64])
def test_forward_backward_match_reference(num_ranks, tokens, shared):
    p = Problem(hidden=64, intermediate=64, num_experts=8, num_topk=2, shared_intermediate=shared,
                num_ranks=num_ranks)
    ranks = make_ranks(p, tokens, seed=num_ranks * 10 + shared)
    check_against_reference(p, ranks, run_group(p, ranks))


@pytest.mark.parametrize("activation,clamp", [("swiglu", 0.5), ("gpt_oss", 7.0), ("gpt_oss", 0.5)])
def test_activations_and_clamp(activation, clamp):
    p = Problem(hidden=64, intermediate=128, num_experts=4, num_topk=3, num_ranks=2, activation=activation,
                clamp_limit=clamp)
    ranks = make_ranks(p, [19, 11], seed=3)
    check_against_reference(p, ranks, run_group(p, ranks))


def test_int64_routing_bf16_grads_and_all_tokens_to_one_expert():
    p = Problem(hidden=64, intermediate=64, num_experts=4, num_topk=2, shared_intermediate=64, num_ranks=2)
    ranks = make_ranks(p, [13, 21], seed=5, one_expert=3)
    check_against_reference(p, ranks, run_group(p, ranks, idx_dtype=np.int64, grad_dtype=np.uint16))


def test_deterministic_and_accumulate_weight_grads():
    p = Problem(hidden=64, intermediate=64, num_experts=4, num_topk=2, shared_intermediate=64)
    (data,) = make_ranks(p, [16], seed=7)
    workspace = pounce.Workspace(pounce.Group.create_cpu(1)[0], shape_of(p, 16), config_of(p))
    first, second = NumpyRank(data), NumpyRank(data)
    for arrays in (first, second):
        arrays.forward(workspace)
        arrays.backward(workspace)
    for a, b in zip((first.out, first.d_x, first.d_topk_weights) + first.d_routed + first.d_shared,
                    (second.out, second.d_x, second.d_topk_weights) + second.d_routed + second.d_shared):
        assert np.array_equal(a, b), "two runs differ"
    # accumulate_weight_grads adds into fp32 main grads.
    base = [np.full(g.shape, 0.5, np.float32) for g in first.d_routed + first.d_shared]
    main = [b.copy() for b in base]
    second.backward(workspace, accumulate=True, d_routed=tuple(main[:3]), d_shared=tuple(main[3:]))
    for m, b, g in zip(main, base, first.d_routed + first.d_shared):
        np.testing.assert_array_equal(m, b + g)


def test_fused_gate_up_views_in_place_and_frozen_weight_grads():
    """transformers' fused gate_up [El,2I,H] passed as numpy views (gate = [:, :I], up = [:, I:]) and its
    gradient written into one [El,2I,H] buffer: bitwise the separate tensors' results. Weight gradients
    passed as None are not computed, and d_x stays bitwise the same."""
    assert pounce._C.supports_expert_stride is True and pounce._C.supports_frozen_weight_grads is True
    p = Problem(hidden=64, intermediate=64, num_experts=4, num_topk=2, shared_intermediate=64)
    (data,) = make_ranks(p, [16], seed=9)
    I = p.intermediate

    def run(fused, frozen):
        workspace = pounce.Workspace(pounce.Group.create_cpu(1)[0], shape_of(p, 16), config_of(p))
        arrays = NumpyRank(data)
        gate_up = np.concatenate(arrays.routed[:2], axis=1)
        d_gate_up = np.full(gate_up.shape, np.nan, np.float32)
        routed = (gate_up[:, :I], gate_up[:, I:], arrays.routed[2]) if fused else arrays.routed
        d_routed = (d_gate_up[:, :I], d_gate_up[:, I:], arrays.d_routed[2]) if fused else arrays.d_routed
        arrays.forward(workspace, routed=routed)
        arrays.backward(workspace, routed=routed, d_routed=None if frozen else d_routed,
                        d_shared=(None, None, arrays.d_shared[2]) if frozen else arrays.d_shared)
        return arrays, d_gate_up

    separate, _ = run(fused=False, frozen=False)
    fused, d_gate_up = run(fused=True, frozen=False)
    assert np.array_equal(fused.out, separate.out) and np.array_equal(fused.d_x, separate.d_x)
    np.testing.assert_array_equal(d_gate_up, np.concatenate(separate.d_routed[:2], axis=1))
    np.testing.assert_array_equal(fused.d_routed[2], separate.d_routed[2])
    frozen, _ = run(fused=False, frozen=True)
    assert np.array_equal(frozen.d_x, separate.d_x) and np.array_equal(frozen.d_topk_weights, separate.d_topk_weights)
    assert all(np.isnan(g).all() for g in frozen.d_routed), "a frozen gradient was written"
    assert np.isnan(frozen.d_shared[0]).all()
    np.testing.assert_array_equal(frozen.d_shared[2], separate.d_shared[2])
    # Other strided arguments stay rejected, naming the argument.
    workspace = pounce.Workspace(pounce.Group.create_cpu(1)[0], shape_of(p, 16), config_of(p))
    wide = np.zeros((16, 2 * p.hidden), np.uint16)
    with pytest.raises(pounce.PounceError, match="'x' is not contiguous"):
        separate.forward(workspace, x=wide[:, : p.hidden])
    with pytest.raises(pounce.PounceError, match="last dimension"):
        separate.forward(workspace, routed=(separate.routed[0].transpose(0, 2, 1).copy().transpose(0, 2, 1),)
                         + separate.routed[1:])


def test_recompute_forward_context_restores_another_forward():
    p = Problem(hidden=64, intermediate=64, num_experts=8, num_topk=2)
    (a,), (b,) = make_ranks(p, [20], seed=1), make_ranks(p, [12], seed=2)
    workspace = pounce.Workspace(pounce.Group.create_cpu(1)[0], shape_of(p, 32), config_of(p))
    direct = NumpyRank(a)
    direct.forward(workspace)
    direct.backward(workspace)
    later = NumpyRank(a)
    later.forward(workspace)
    NumpyRank(b).forward(workspace)  # another layer uses the workspace
    with pytest.raises(pounce.PounceError, match="tokens"):
        later.backward(workspace)  # the context is b's: 12 tokens, not 20
    pounce.recompute_forward_context(workspace, later.x, later.topk_idx, later.topk_weights, later.routed)
    later.backward(workspace)
    for x, y in zip((direct.d_x, direct.d_topk_weights) + direct.d_routed,
                    (later.d_x, later.d_topk_weights) + later.d_routed):
        assert np.array_equal(x, y)


def test_check_errors_is_a_no_op_on_the_cpu_backend():
    """The CPU backend defers nothing: a failing call raised already, and the check finds nothing."""
    p = Problem(hidden=64, intermediate=64, num_experts=8, num_topk=2)
    (a,) = make_ranks(p, [20], seed=3)
    workspace = pounce.Workspace(pounce.Group.create_cpu(1)[0], shape_of(p, 32), config_of(p))
    rank = NumpyRank(a)
    with pytest.raises(pounce.PounceError, match="run forward first"):
        rank.backward(workspace)
    assert pounce.check_errors(workspace) is None
    rank.forward(workspace)
    pounce.check_errors(workspace, 0, True)
    pounce.check_errors(workspace, stream=0, synchronize=True)
    rank.backward(workspace)


# ------------------------------------------------------------------------------------------------
# Types, sizes, errors
# ------------------------------------------------------------------------------------------------


def test_types_presets_build_info():
    info = pounce.build_info()
    assert set(info) == {"version", "commit", "cuda", "cuda_version", "nccl_version"}
    assert info["version"] == pounce.__version__
    names = [preset.name for preset in pounce.presets()]
    assert names == ["qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b", "mixtral-8x7b"]
    deepseek = pounce.find_preset("deepseek-v3")
    assert (deepseek.shape.hidden, deepseek.shape.shared_intermediate) == (7168, 2048)
    assert pounce.find_preset("gpt-oss-120b").activation == pounce.Activation.gpt_oss()
    with pytest.raises(pounce.PounceError, match="qwen3-30b-a3b"):
        pounce.find_preset("llama")
    assert issubclass(pounce.PounceError, ValueError)
    shape = pounce.Shape(max_tokens=128, hidden=2048, intermediate=768, num_experts=128, num_topk=8, num_ranks=2)
    assert shape.num_local_experts == 64 and not shape.has_shared_expert
    assert "hidden=2048" in repr(shape) and "precision=bf16" in repr(pounce.Config())
    # The GPU paths: the fused forward and the backward by shape by default, either on request.
    assert pounce.Config().kernel_path == pounce.KernelPath.fused
    assert pounce.Config().backward_kernel_path == pounce.KernelPath.auto
    staged = pounce.Config(kernel_path=pounce.KernelPath.staged, minibatch_size=256)
    assert "kernel_path=staged" in repr(staged)
    fused = pounce.Config(backward_kernel_path=pounce.KernelPath.fused)
    assert "backward_kernel_path=fused" in repr(fused)
    size = pounce.bytes_required(shape, pounce.Config())
    assert size.symmetric > 0 and size.local > 0 and size.total == size.symmetric + size.local
    assert pounce.Workspace.bytes_required(shape).total == size.total


@pytest.mark.parametrize("field,value,needle", [
    ("hidden", 100, "shape.hidden"),
    ("num_experts", 7, "shape.num_experts"),
    ("num_topk", 0, "shape.num_topk"),
    ("shared_intermediate", 10, "shape.shared_intermediate"),
])
def test_bad_shape_names_the_field(field, value, needle):
    shape = pounce.Shape(max_tokens=16, hidden=64, intermediate=64, num_experts=8, num_topk=2, num_ranks=2)
    setattr(shape, field, value)
    with pytest.raises(pounce.PounceError, match=needle):
        shape.validate()
    with pytest.raises(pounce.PounceError, match=needle):
        pounce.bytes_required(shape)


def test_bad_config_and_group_mismatch():
    shape = pounce.Shape(max_tokens=16, hidden=64, intermediate=64, num_experts=8, num_topk=2)
    with pytest.raises(pounce.PounceError, match="deterministic"):
        pounce.Workspace(pounce.Group.create_cpu(1)[0], shape, pounce.Config(deterministic=False))
    with pytest.raises(pounce.PounceError, match="num_ranks"):
        pounce.Workspace(pounce.Group.create_cpu(2)[0], shape)  # shape says 1 rank: fails before meeting


def _one_rank():
    p = Problem(hidden=64, intermediate=64, num_experts=8, num_topk=2, shared_intermediate=64)
    (data,) = make_ranks(p, [16], seed=11)
    workspace = pounce.Workspace(pounce.Group.create_cpu(1)[0], shape_of(p, 16), config_of(p))
    return workspace, NumpyRank(data)


BAD_FORWARD = {
    "x fp32": (lambda a: dict(x=pounce.bf16_to_float(a.x)), "argument 'x'.*bf16"),
    "x strided": (lambda a: dict(x=np.repeat(a.x, 2, axis=1)[:, ::2]), "'x' is not contiguous"),
    "x misaligned": (lambda a: dict(x=np.frombuffer(np.zeros(a.x.size + 1, np.uint16).data, np.uint16,
                                                    a.x.size, 2).reshape(a.x.shape)), "'x'.*16-byte"),
    "x a list": (lambda a: dict(x=[[1.0, 2.0]]), "argument 'x' is a list"),
    "too many tokens": (lambda a: dict(x=np.concatenate([a.x, a.x]), out=np.concatenate([a.out, a.out])),
                        "max_tokens"),
    "topk_idx fp32": (lambda a: dict(topk_idx=a.topk_idx.astype(np.float32)), "'topk_idx'.*int32 or int64"),
    "topk_idx out of range": (lambda a: dict(topk_idx=np.where(a.topk_idx == a.topk_idx[3, 1], 8, a.topk_idx)),
                              r"'topk_idx'\[.*\] = 8 is out of range"),
    "topk_weights shape": (lambda a: dict(topk_weights=a.topk_weights[:, :1].copy()), "'topk_weights'.*shape"),
    "routed two tensors": (lambda a: dict(routed=a.routed[:2]), "'routed' must be a tuple"),
    "routed.down shape": (lambda a: dict(routed=(a.routed[0], a.routed[1], a.routed[2][:, :32].copy())),
                          "'routed.down'.*expected shape"),
    "shared missing": (lambda a: dict(shared=None), "'shared.gate' is missing"),
    "out read-only": (lambda a: dict(out=np.broadcast_to(a.out, a.out.shape)), "'out' is read-only"),
    "out aliases x": (lambda a: dict(out=a.x), "'out' overlaps an input"),
}


@pytest.mark.parametrize("case", sorted(BAD_FORWARD))
def test_bad_forward_input_names_the_argument(case):
    workspace, arrays = _one_rank()
    corrupt, needle = BAD_FORWARD[case]
    with pytest.raises(pounce.PounceError, match=needle):
        arrays.forward(workspace, **corrupt(arrays))
    assert np.all(arrays.out == POISON), "an output was written despite the error"


def test_bad_backward_inputs():
    workspace, arrays = _one_rank()
    with pytest.raises(pounce.PounceError, match="before forward"):
        arrays.backward(workspace)
    arrays.forward(workspace)
    with pytest.raises(pounce.PounceError, match="'d_routed.up'"):
        arrays.backward(workspace, d_routed=(arrays.d_routed[0], arrays.d_routed[0][:1], arrays.d_routed[2]))
    with pytest.raises(pounce.PounceError, match="main_grad|fp32"):
        bf16_grads = tuple(np.zeros(g.shape, np.uint16) for g in arrays.d_routed)
        arrays.backward(workspace, accumulate=True, d_routed=bf16_grads)
    with pytest.raises(pounce.PounceError, match="'d_x' overlaps"):
        arrays.backward(workspace, d_x=arrays.d_out)
    assert np.all(arrays.d_x == POISON)


@pytest.mark.parametrize("bad", ["fp64", "shape"])
def test_a_bad_rank_fails_every_rank(bad):
    """A bad tensor on one rank fails every rank at once, naming the argument. fp64 is refused by the
    binding itself, before the call: the rank still joins the call so that its peers need not wait
    for the peer timeout."""
    p = Problem(hidden=64, intermediate=64, num_experts=8, num_topk=2, num_ranks=2)
    ranks = make_ranks(p, [8, 8], seed=4)
    groups = pounce.Group.create_cpu(2)
    shape = shape_of(p, 8)

    def body(rank):
        workspace = pounce.Workspace(groups[rank], shape, config_of(p))
        arrays = NumpyRank(ranks[rank])
        if rank == 0:
            arrays.forward(workspace)
        elif bad == "fp64":
            arrays.forward(workspace, topk_weights=arrays.topk_weights.astype(np.float64))
        else:
            arrays.forward(workspace, topk_weights=arrays.topk_weights[:, :1].copy())

    _, errors = on_ranks(2, body, timeout=60)
    assert all(isinstance(e, pounce.PounceError) for e in errors), errors
    assert "'topk_weights'" in str(errors[1])
    assert "rank 1 rejected its inputs" in str(errors[0]) and "'topk_weights'" in str(errors[0])


def test_gpu_group_without_gpu_says_so():
    if pounce.build_info()["cuda"]:
        pytest.skip("built with CUDA: GPU groups are tested by test_torch_gpu.py")
    with pytest.raises(pounce.PounceError, match=r"(?i)cuda|gpu"):
        pounce.Group.new_unique_id()


def test_a_rank_passing_shared_weights_without_a_shared_expert_writes_nothing():
    """A shared tuple that cannot be converted, on a shape without a shared expert: still rejected on
    every rank (an empty stand-in would pass for "no shared expert"), and no output is written."""
    p = Problem(hidden=64, intermediate=64, num_experts=8, num_topk=2, num_ranks=2)
    ranks = make_ranks(p, [8, 8], seed=6)
    groups = pounce.Group.create_cpu(2)
    shape = shape_of(p, 8)
    arrays = [NumpyRank(data) for data in ranks]

    def body(rank):
        workspace = pounce.Workspace(groups[rank], shape, config_of(p))
        arrays[rank].forward(workspace)
        extra = dict(d_shared=("not", "a", "tensor")) if rank == 1 else {}
        arrays[rank].backward(workspace, **extra)

    _, errors = on_ranks(2, body, timeout=60)
    assert "'d_shared.gate' is a str" in str(errors[1])
    assert "rank 1 rejected its inputs" in str(errors[0]) and "d_shared.gate" in str(errors[0])
    for rank_arrays in arrays:
        assert np.all(rank_arrays.d_x == POISON)


def test_expert_biases_six_tuple():
    """routed = (gate, up, down, b_gate, b_up, b_down) on the CPU backend: d_b_down[e] is the sum over e's
    pairs of w * d_out; an expert without rows gets zero bias gradients; a bad length is rejected by name."""
    p = Problem(hidden=64, intermediate=64, num_experts=4, num_topk=2, num_ranks=1)
    data = make_ranks(p, [16], seed=5)[0]
    rank = NumpyRank(data)
    rank.topk_idx[rank.topk_idx == 3] = 2  # expert 3 gets no rows
    rng = np.random.default_rng(0)
    biases = tuple(pounce.bf16_bits(rng.normal(0, 0.5, shape).astype(np.float32))
                   for shape in [(4, 64), (4, 64), (4, 64)])
    d_biases = tuple(np.full((4, 64), np.nan, np.float32) for _ in range(3))
    workspace = pounce.Workspace(pounce.Group.create_cpu(1)[0], shape_of(p, 16), config_of(p))
    rank.forward(workspace, routed=rank.routed + biases)
    rank.backward(workspace, routed=rank.routed + biases, d_routed=rank.d_routed + d_biases)
    d_out = as_float(rank.d_out)
    want = np.zeros((4, 64))
    for t in range(16):
        for j in range(2):
            if rank.topk_idx[t, j] >= 0:
                want[rank.topk_idx[t, j]] += rank.topk_weights[t, j] * d_out[t]
    np.testing.assert_allclose(d_biases[2], want, rtol=2e-2, atol=2e-2)
    for d_b in d_biases:
        assert np.all(d_b[3] == 0.0)
    with pytest.raises(pounce.PounceError, match="'routed' must be a tuple"):
        rank.forward(workspace, routed=rank.routed + biases[:2])
