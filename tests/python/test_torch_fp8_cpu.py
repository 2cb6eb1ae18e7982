"""pounce.torch in FP8 (precision="fp8") on the CPU backend with torch CPU tensors: forward and every gradient
against the BF16 layer within the FP8 error budget (docs/design.md §1: relative error <= 0.1 per tensor,
gradient cosine >= 0.996), the FP8 weight cache (quantized once per optimizer step, never stale, fp32
masters, fused gate_up halves, frozen weights, recompute, torch.compile), the bindings' routed_fp8 argument,
and the errors.

The CPU backend computes the FP8 layer from the bf16 weights (the reference quantizes them itself) and only
checks the routed_fp8 tensors it is given, so a stale cache cannot show in the outputs here: the cache tests
compare the cache's bytes with a fresh pounce.quantize_weights_fp8 of the current weights instead.
"""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pounce = pytest.importorskip(
    "pounce", reason="the pounce Python module is not built (needs nanobind; run tools/setup.sh)"
)
import pounce.torch as pt  # noqa: E402
from pounce.torch import _fp8  # noqa: E402

from conftest import on_ranks, raise_first  # noqa: E402

# H of one full FP8 block, I of 1.5 (a partial K block in the down GEMM and a partial N block in gate/up)
H, I, E, K = 128, 192, 8, 2
MAX_TOKENS = 64
REL_BUDGET, COSINE_BUDGET = 0.1, 0.996


def make_inputs(tokens, seed, hidden=H):
    """Per rank (x [T,H], topk_idx [T,k], topk_weights [T,k], d_out [T,H]); routing with unused slots."""
    gen = torch.Generator().manual_seed(seed)
    inputs = []
    for T in tokens:
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        idx[torch.rand(T, K, generator=gen) < 0.15] = -1
        x = torch.randn(T, hidden, generator=gen).to(torch.bfloat16)
        d_out = torch.randn(T, hidden, generator=gen).to(torch.bfloat16)
        inputs.append((x, idx, 0.1 + torch.rand(T, K, generator=gen), d_out))
    return inputs


def step(module, x, idx, weights, d_out, fn=None):
    """forward + backward with loss <out, d_out>: [out, d_x, d_topk_weights, *weight gradients]."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    out = (module if fn is None else fn)(x, idx, weights)
    (out.float() * d_out.float()).sum().backward()
    return [out.detach(), x.grad, weights.grad] + [p.grad for p in module.parameters()]


def names_of(module):
    return ["out", "d_x", "d_topk_weights"] + [f"d_{n}" for n, _ in module.named_parameters()]


def check_budget(label, names, got, ref):
    """Every tensor within 0.1 relative error of the BF16 layer's, every gradient at cosine >= 0.996."""
    for name, g, r in zip(names, got, ref):
        g, r = g.double().flatten(), r.double().flatten()
        rel = ((g - r).norm() / r.norm().clamp_min(1e-30)).item()
        assert rel <= REL_BUDGET, f"{label} {name}: relative error {rel:.4f} > {REL_BUDGET}"
        if name != "out":
            cosine = torch.nn.functional.cosine_similarity(g, r, dim=0).item()
            assert cosine >= COSINE_BUDGET, f"{label} {name}: cosine {cosine:.5f} < {COSINE_BUDGET}"


def quantized(w_gate, w_up, w_down):
    """A fresh pounce.quantize_weights_fp8 of the weights (as the cache should hold them): 12 tensors."""
    El, inter, hidden = w_gate.shape
    fresh = _fp8.Fp8Cache(El, inter, hidden)
    dense = tuple(w.detach().to(torch.bfloat16).contiguous() for w in (w_gate, w_up, w_down))
    pounce._C.quantize_weights_fp8(dense, fresh.as_pairs())  # not the one a test counts calls of
    return fresh.tensors


def assert_cache_holds(cache, w_gate, w_up, w_down):
    for i, (got, want) in enumerate(zip(cache.tensors, quantized(w_gate, w_up, w_down))):
        assert torch.equal(got, want), f"cache tensor {i} ({_fp8._NAMES[i // 2]}) is stale"


@pytest.mark.parametrize("hidden,inter,tokens,shared", [
    (128, 192, [45], 0),
    (128, 192, [37, 21], 128),  # two ranks (threads), a shared expert (bf16 in FP8 mode)
    (64, 64, [33], 0),          # smaller than one FP8 block
])
def test_fp8_module_matches_the_bf16_layer_within_the_fp8_budget(hidden, inter, tokens, shared):
    R = len(tokens)
    inputs = make_inputs(tokens, seed=hidden + inter + R, hidden=hidden)
    groups = pounce.Group.create_cpu(R)

    def body(rank):
        results = []
        for precision in ("bf16", "fp8"):
            module = pt.MoE(hidden, inter, E, K, max_tokens=MAX_TOKENS, shared_intermediate=shared,
                            group=groups[rank] if R > 1 else None, init_seed=7, precision=precision)
            results.append((module, step(module, *inputs[rank])))
        return results

    results, errors = on_ranks(R, body)
    raise_first(errors)
    for rank, ((bf16, ref), (fp8, got)) in enumerate(results):
        assert fp8.precision == "fp8" and fp8.fp8_cache.quantizations == 1 and bf16.fp8_cache is None
        assert not torch.equal(got[0], ref[0]), "the FP8 layer gave the BF16 result: FP8 did not run"
        check_budget(f"rank {rank}", names_of(fp8), got, ref)
        assert_cache_holds(fp8.fp8_cache, fp8.w_gate, fp8.w_up, fp8.w_down)


def test_cache_requantizes_once_per_optimizer_step(monkeypatch):
    """Two micro-batches per step, three steps: one quantization per step (the first forward after the
    step), the cache then holds the current weights; load_state_dict counts as a change, a write through
    .data does not (invalidate() is the remedy)."""
    calls = []
    quantize = pounce.quantize_weights_fp8
    monkeypatch.setattr(pounce, "quantize_weights_fp8", lambda *a, **k: (calls.append(1), quantize(*a, **k)))
    (x, idx, weights, d_out), = make_inputs([40], seed=3)
    module = pt.MoE(H, I, E, K, max_tokens=MAX_TOKENS, init_seed=3, precision="fp8")
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    for n in range(3):
        for _ in range(2):
            (module(x, idx, weights).float() * d_out.float()).sum().backward()
            assert len(calls) == n + 1 and module.fp8_cache.quantizations == n + 1
            assert_cache_holds(module.fp8_cache, module.w_gate, module.w_up, module.w_down)
        optimizer.step()
        optimizer.zero_grad()
    module(x, idx, weights)
    assert len(calls) == 4
    module(x, idx, weights)  # a second forward without a step
    assert len(calls) == 4
    module.load_state_dict(pt.MoE(H, I, E, K, max_tokens=8, init_seed=11).state_dict())
    module(x, idx, weights)
    assert len(calls) == 5
    assert_cache_holds(module.fp8_cache, module.w_gate, module.w_up, module.w_down)
    module.w_down.data.mul_(2)  # not seen by the version counter
    module(x, idx, weights)
    assert len(calls) == 5
    module.fp8_cache.invalidate()
    module(x, idx, weights)
    assert len(calls) == 6
    assert_cache_holds(module.fp8_cache, module.w_gate, module.w_up, module.w_down)


def test_fp32_master_weights_quantize_their_bf16_values():
    (x, idx, weights, d_out), = make_inputs([30], seed=4)
    bf16 = pt.MoE(H, I, E, K, max_tokens=MAX_TOKENS, init_seed=4, precision="fp8")
    fp32 = pt.MoE(H, I, E, K, max_tokens=MAX_TOKENS, init_seed=4, precision="fp8", dtype=torch.float32)
    with torch.no_grad():  # fp32 masters with bits below bf16's: quantized from their bf16 rounding
        for p in fp32.parameters():
            p.add_(torch.randn_like(p) * 1e-5)
    a, b = step(bf16, x, idx, weights, d_out), step(fp32, x, idx, weights, d_out)
    assert all(p.grad.dtype == torch.float32 for p in fp32.parameters())
    check_budget("fp32 masters", names_of(fp32), b, a)
    assert_cache_holds(fp32.fp8_cache, fp32.w_gate, fp32.w_up, fp32.w_down)
    optimizer = torch.optim.SGD(fp32.parameters(), lr=1e-3)
    optimizer.step()
    fp32(x, idx, weights)
    assert fp32.fp8_cache.quantizations == 2
    assert_cache_holds(fp32.fp8_cache, fp32.w_gate, fp32.w_up, fp32.w_down)


def test_main_grad_accumulates_in_fp8():
    (x, idx, weights, d_out), = make_inputs([25], seed=5)
    plain = pt.MoE(H, I, E, K, max_tokens=MAX_TOKENS, init_seed=5, precision="fp8", dtype=torch.float32)
    (plain(x, idx, weights).float() * d_out.float()).sum().backward()
    module = pt.MoE(H, I, E, K, max_tokens=MAX_TOKENS, init_seed=5, precision="fp8", accumulate_main_grad=True)
    module.init_main_grad()
    for _ in range(2):  # two micro-batches add up
        (module(x, idx, weights).float() * d_out.float()).sum().backward()
    assert module.fp8_cache.quantizations == 1
    for p, q in zip(module.parameters(), plain.parameters()):
        assert p.grad is None
        torch.testing.assert_close(p.main_grad, 2 * q.grad, rtol=1e-6, atol=1e-6)


def test_fused_gate_up_halves_and_frozen_weights():
    """The functional layer with w_gate_up [El,2I,H]: its row-strided halves are quantized from a dense
    copy, the results equal those of separate weights bit for bit; frozen weights quantize once too."""
    (x, idx, weights, d_out), = make_inputs([29], seed=6)
    source = pt.MoE(H, I, E, K, max_tokens=8, init_seed=6)
    gate, up, down = (w.detach().clone().requires_grad_() for w in (source.w_gate, source.w_up, source.w_down))
    layer = pt.register_layer(hidden=H, intermediate=I, num_experts=E, num_topk=K, max_tokens=MAX_TOKENS,
                              precision="fp8")
    separate, fused = pt.Fp8Cache(E, I, H), pt.Fp8Cache(E, I, H)
    xx = x.clone().requires_grad_()
    out = pt.moe(xx, idx, weights, gate, up, down, layer=layer, fp8_cache=separate)
    (out.float() * d_out.float()).sum().backward()
    gate_up = torch.cat((gate, up), dim=1).detach().requires_grad_()
    down2 = down.detach().clone().requires_grad_()
    xx2 = x.clone().requires_grad_()
    out2 = pt.moe(xx2, idx, weights, w_down=down2, w_gate_up=gate_up, layer=layer, fp8_cache=fused)
    (out2.float() * d_out.float()).sum().backward()
    assert torch.equal(out, out2) and torch.equal(xx.grad, xx2.grad)
    assert torch.equal(gate_up.grad, torch.cat((gate.grad, up.grad), dim=1)) and torch.equal(down2.grad, down.grad)
    assert_cache_holds(fused, gate_up[:, :I], gate_up[:, I:], down2)
    for t, u in zip(separate.tensors, fused.tensors):
        assert torch.equal(t, u)

    frozen = [w.detach() for w in (gate, up, down)]
    cache = pt.Fp8Cache(E, I, H)
    for _ in range(2):
        xx3 = x.clone().requires_grad_()
        (pt.moe(xx3, idx, weights, *frozen, layer=layer, fp8_cache=cache).float() * d_out.float()).sum().backward()
        assert torch.equal(xx3.grad, xx.grad)
    assert cache.quantizations == 1
    pt.unregister_layer(layer)


def test_layers_sharing_a_workspace_recompute_in_fp8():
    """The recompute before backward gets the FP8 weights too: bitwise the results of separate workspaces."""
    (x, idx, weights, d_out), = make_inputs([27], seed=8)

    def two_layers(share):
        pt.free_workspaces()
        layers = [pt.MoE(H, I, E, K, max_tokens=32, share_workspace=share, init_seed=8 + i, precision="fp8")
                  for i in range(2)]
        xx = x.clone().requires_grad_()
        out = layers[1](layers[0](xx, idx, weights), idx.flip(0), weights)
        (out.float() * d_out.float()).sum().backward()
        stats = pt.workspace_stats()
        return [out, xx.grad] + [p.grad for layer in layers for p in layer.parameters()], stats

    shared_run, shared_stats = two_layers(True)
    separate_run, _ = two_layers(False)
    assert [(s["shared"], s["layers"], s["recomputes"]) for s in shared_stats] == [(True, 2, 1)]
    for a, b in zip(shared_run, separate_run):
        assert torch.equal(a, b)
    pt.free_workspaces()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager_and_requantizes_per_step(backend):
    torch._dynamo.reset()
    (x, idx, weights, d_out), = make_inputs([33], seed=9)
    module = pt.MoE(H, I, E, K, max_tokens=48, shared_intermediate=128, init_seed=9, precision="fp8")
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    eager = step(module, x, idx, weights, d_out)
    got = step(module, x, idx, weights, d_out, fn=compiled)
    for i, (a, b) in enumerate(zip(eager, got)):
        assert torch.equal(a, b), f"tensor {i} differs from eager"
    assert module.fp8_cache.quantizations == 1
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-2)
    for n in range(2):
        optimizer.step()
        for _ in range(2):
            step(module, x, idx, weights, d_out, fn=compiled)
        assert module.fp8_cache.quantizations == n + 2
        assert_cache_holds(module.fp8_cache, module.w_gate, module.w_up, module.w_down)
    assert torch.equal(step(module, x, idx, weights, d_out, fn=compiled)[0], module(x, idx, weights).detach())


def test_opcheck_of_the_fp8_ops():
    (x, idx, weights, _), = make_inputs([16], seed=10)
    module = pt.MoE(H, I, E, K, max_tokens=16, init_seed=10, precision="fp8")
    routed = tuple(w.detach() for w in (module.w_gate, module.w_up, module.w_down))
    fp8 = list(module.fp8_cache.tensors)
    torch.library.opcheck(torch.ops.pounce.quantize_fp8.default, (*routed, fp8, module.fp8_cache.handle),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.pounce.moe_forward.default,
                          (x, idx, weights, *routed, None, None, None, module.layer, fp8),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_cache_follows_the_module_and_copies_are_independent():
    module = pt.MoE(H, I, E, K, max_tokens=16, init_seed=12, precision="fp8", device="meta")
    assert module.fp8_cache.device.type == "meta"
    module.to_empty(device="cpu")
    assert module.fp8_cache.device.type == "cpu" and module.fp8_cache.tensors[1].dtype == torch.float32
    module.load_state_dict(pt.MoE(H, I, E, K, max_tokens=16, init_seed=12).state_dict())
    module.to(torch.float32)  # casts the parameters, never the cache's fp32 scales or uint8 data
    assert module.fp8_cache.tensors[1].dtype == torch.float32 and module.fp8_cache.tensors[0].dtype == torch.uint8
    assert "fp8" not in " ".join(module.state_dict()) and not list(module.buffers())
    (x, idx, weights, _), = make_inputs([12], seed=12)
    module(x, idx, weights)
    twin = copy.deepcopy(module)
    assert twin.fp8_cache.handle != module.fp8_cache.handle
    twin(x, idx, weights)
    with torch.no_grad():
        twin.w_up.mul_(0.5)
    twin(x, idx, weights)
    module(x, idx, weights)
    assert module.fp8_cache.quantizations == 1 and twin.fp8_cache.quantizations == 3
    assert_cache_holds(module.fp8_cache, module.w_gate, module.w_up, module.w_down)
    assert_cache_holds(twin.fp8_cache, twin.w_gate, twin.w_up, twin.w_down)


def test_bad_precision_and_cache_arguments_raise_clear_errors():
    for bad in ("fp16", "FP8", "e4m3", 8):
        with pytest.raises(ValueError, match=r"argument 'precision' = .* is unknown; pass 'bf16' or 'fp8'"):
            pt.MoE(H, I, E, K, max_tokens=8, precision=bad)
        with pytest.raises(ValueError, match=r"argument 'precision'"):
            pt.register_layer(hidden=H, intermediate=I, num_experts=E, num_topk=K, max_tokens=8, precision=bad)
    assert pt.MoE(H, I, E, K, max_tokens=8, precision=pounce.Precision.fp8).precision == "fp8"
    config = pounce.Config(precision=pounce.Precision.fp8)
    assert pt.MoE(H, I, E, K, max_tokens=8, config=config).precision == "fp8"
    assert pt.MoE(H, I, E, K, max_tokens=8, config=config, precision="bf16").precision == "bf16"

    (x, idx, weights, _), = make_inputs([8], seed=13)
    routed = tuple(w.detach() for w in pt.MoE(H, I, E, K, max_tokens=8, init_seed=13).parameters())
    fp8_layer = pt.register_layer(hidden=H, intermediate=I, num_experts=E, num_topk=K, max_tokens=8,
                                  precision="fp8")
    bf16_layer = pt.register_layer(hidden=H, intermediate=I, num_experts=E, num_topk=K, max_tokens=8)
    with pytest.raises(pounce.PounceError, match="'fp8_cache' is missing but the layer's precision is fp8"):
        pt.moe(x, idx, weights, *routed, layer=fp8_layer)
    with pytest.raises(pounce.PounceError, match="'fp8_cache' is given but the layer's precision is bf16"):
        pt.moe(x, idx, weights, *routed, layer=bf16_layer, fp8_cache=pt.Fp8Cache(E, I, H))
    with pytest.raises(pounce.PounceError, match=r"'fp8_cache' holds 4 experts.*Fp8Cache\(8, 192, 128"):
        pt.moe(x, idx, weights, *routed, layer=fp8_layer, fp8_cache=pt.Fp8Cache(4, I, H))
    with pytest.raises(TypeError, match="'fp8_cache' is list"):
        pt.moe(x, idx, weights, *routed, layer=fp8_layer, fp8_cache=[])
    with pytest.raises(pounce.PounceError, match="'fp8_cache' is on the meta device"):
        pt.moe(x, idx, weights, *routed, layer=fp8_layer, fp8_cache=pt.Fp8Cache(E, I, H, device="meta"))
    pt.unregister_layer(fp8_layer)
    pt.unregister_layer(bf16_layer)


def test_bindings_take_routed_fp8():
    """pounce.forward/backward/recompute_forward_context with routed_fp8= (keyword): accepted as six
    (data, scale) pairs, required on an fp8 workspace, every wrong part named; BF16 calls unchanged."""
    (x, idx, weights, d_out), = make_inputs([20], seed=14)
    routed = tuple(w.detach() for w in pt.MoE(H, I, E, K, max_tokens=8, init_seed=14).parameters())
    group = pounce.Group.create_cpu(1)[0]
    shape = pounce.Shape(32, H, I, E, K)
    bf16 = pounce.Workspace(group, shape, pounce.Config())
    fp8 = pounce.Workspace(group, shape, pounce.Config(precision=pounce.Precision.fp8))
    cache = pt.Fp8Cache(E, I, H)
    pounce.quantize_weights_fp8(routed, cache.as_pairs())

    def forward(workspace, **kwargs):
        out = torch.empty_like(x)
        pounce.forward(workspace, x, idx, weights, routed, out, **kwargs)
        return out

    def backward(workspace, **kwargs):
        d_x, d_w = torch.empty_like(x), torch.empty_like(weights)
        d_routed = tuple(torch.empty_like(w) for w in routed)
        pounce.backward(workspace, x, idx, weights, routed, d_out, d_x, d_w, d_routed, **kwargs)
        return [d_x, d_w, *d_routed]

    out_bf16, out_fp8 = forward(bf16), forward(fp8, routed_fp8=cache.as_pairs())
    grads_fp8 = backward(fp8, routed_fp8=cache.as_pairs())
    check_budget("bindings", ["out", "d_x", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down"],
                 [out_fp8] + grads_fp8, [out_bf16] + backward(bf16))
    other = torch.empty_like(x)  # another forward replaces the context; the recompute rebuilds this one
    pounce.forward(fp8, x.flip(0), idx, weights, routed, other, routed_fp8=cache.as_pairs())
    pounce.recompute_forward_context(fp8, x, idx, weights, routed, routed_fp8=cache.as_pairs())
    assert all(torch.equal(a, b) for a, b in zip(backward(fp8, routed_fp8=cache.as_pairs()), grads_fp8))

    with pytest.raises(pounce.PounceError, match="'routed_fp8' is missing but config.precision is fp8"):
        forward(fp8)
    with pytest.raises(pounce.PounceError, match="'routed_fp8' is missing"):
        pounce.recompute_forward_context(fp8, x, idx, weights, routed)
    with pytest.raises(pounce.PounceError, match=r"'routed_fp8' must be six \(data, scale\) pairs"):
        forward(fp8, routed_fp8=cache.as_pairs()[:5])
    bad = cache.as_pairs()
    bad[4] = (bad[4][0], torch.ones(E, 1, 1))
    with pytest.raises(pounce.PounceError, match=r"'routed_fp8\.up_t\.scale'"):
        forward(fp8, routed_fp8=bad)
    bad = cache.as_pairs()
    bad[5] = (bad[5][0].float(), bad[5][1])
    with pytest.raises(pounce.PounceError, match=r"'routed_fp8\.down_t\.data'"):
        backward(fp8, routed_fp8=bad)
    bad = cache.as_pairs()
    bad[1] = bad[1][0]
    with pytest.raises(pounce.PounceError, match=r"'routed_fp8\.up' must be a \(data, scale\) pair"):
        forward(fp8, routed_fp8=bad)
    with pytest.raises(TypeError):  # keyword only: the BF16 positional signature is unchanged
        pounce.forward(fp8, x, idx, weights, routed, torch.empty_like(x), None, 0, cache.as_pairs())


def test_a_rank_with_bad_routed_fp8_fails_its_peers_at_once():
    """Two ranks of a CPU group: rank 1's routed_fp8 does not convert, so it joins the call with the set
    rejected and rank 0 fails at once naming it (instead of waiting out the peer timeout)."""
    groups = pounce.Group.create_cpu(2)
    shape = pounce.Shape(32, H, I, E, K, num_ranks=2)
    (x, idx, weights, _), = make_inputs([10], seed=15)

    def body(rank):
        workspace = pounce.Workspace(groups[rank], shape, pounce.Config(precision=pounce.Precision.fp8))
        module = pt.MoE(H, I, E, K, max_tokens=8, group=groups[rank], init_seed=15)
        routed = tuple(w.detach() for w in module.parameters())
        cache = pt.Fp8Cache(E // 2, I, H)
        pounce.quantize_weights_fp8(routed, cache.as_pairs())
        fp8 = cache.as_pairs()
        if rank == 1:
            fp8[3] = (fp8[3][0], "not a tensor")
        pounce.forward(workspace, x, idx, weights, routed, torch.empty_like(x), routed_fp8=fp8)

    _, errors = on_ranks(2, body, timeout=60)
    assert "rank 1 rejected its inputs: argument 'routed_fp8.gate_t.scale'" in str(errors[0])
    assert "argument 'routed_fp8.gate_t.scale' is a str" in str(errors[1])
