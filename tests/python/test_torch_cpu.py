"""pounce.torch on the CPU backend with torch CPU tensors: the module and the functional layer against a
plain PyTorch reference (forward and every gradient), ranks as threads, torch.compile(fullgraph=True),
workspaces shared across layers, fp32 master weights and main_grad, per-expert state_dict, errors."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pounce = pytest.importorskip(
    "pounce", reason="the pounce Python module is not built (needs nanobind; run tools/setup.sh)"
)
import pounce.torch as pt  # noqa: E402

from conftest import on_ranks, raise_first  # noqa: E402
from moe_reference import check_close  # noqa: E402
from torch_reference import group_reference  # noqa: E402

H, I, E, K = 64, 64, 8, 2


def make_inputs(tokens, seed=0, shared=0, num_experts=E, k=K):
    gen = torch.Generator().manual_seed(seed)

    def bf16(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    inputs = []
    for T in tokens:
        idx = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(T)]) if T else \
            torch.zeros(0, k, dtype=torch.int64)
        idx[torch.rand(T, k, generator=gen) < 0.15] = -1
        inputs.append((bf16(T, H), idx, 0.1 + torch.rand(T, k, generator=gen), bf16(T, H)))
    routed = (bf16(num_experts, I, H, scale=H**-0.5), bf16(num_experts, I, H, scale=H**-0.5),
              bf16(num_experts, H, I, scale=I**-0.5))
    shared_w = (bf16(shared, H, scale=H**-0.5), bf16(shared, H, scale=H**-0.5),
                bf16(H, shared, scale=shared**-0.5)) if shared else None
    return inputs, routed, shared_w


def expert_state_dict(routed, shared):
    state = {}
    for e in range(routed[0].shape[0]):
        state[f"experts.{e}.gate_proj.weight"] = routed[0][e]
        state[f"experts.{e}.up_proj.weight"] = routed[1][e]
        state[f"experts.{e}.down_proj.weight"] = routed[2][e]
    if shared is not None:
        for name, w in zip(("gate_proj", "up_proj", "down_proj"), shared):
            state[f"shared_expert.{name}.weight"] = w
    return state


def run_module(inputs, routed, shared, *, max_tokens=48, **module_kwargs):
    """Each rank (a thread) builds MoE, loads the full checkpoint (keeping its experts), runs forward and
    backward with loss = <out, d_out>."""
    R = len(inputs)
    groups = pounce.Group.create_cpu(R)
    state = expert_state_dict(routed, shared)

    def body(rank):
        x, idx, weights, d_out = inputs[rank]
        module = pt.MoE(H, I, E, K, max_tokens=max_tokens, shared_intermediate=shared[0].shape[0] if shared else 0,
                        group=groups[rank], **module_kwargs)
        module.load_state_dict(state)
        x = x.clone().requires_grad_()
        weights = weights.clone().requires_grad_()
        out = module(x, idx, weights)
        (out.float() * d_out.float()).sum().backward()
        return dict(out=out.detach(), d_x=x.grad, d_topk_weights=weights.grad, module=module)

    results, errors = on_ranks(R, body)
    raise_first(errors)
    return results


def check_rank(r, got, ref64, refb, module):
    def np64(t):
        return t.detach().double().numpy()

    check_close(f"rank {r} out", np64(got["out"]), np64(ref64["out"]), np64(refb["out"]))
    check_close(f"rank {r} d_x", np64(got["d_x"]), np64(ref64["d_x"]), np64(refb["d_x"]))
    check_close(f"rank {r} d_topk_weights", np64(got["d_topk_weights"]), np64(ref64["d_topk_weights"]),
                np64(refb["d_topk_weights"]))
    lo, hi = module.first_expert, module.first_expert + module.num_local_experts
    for name, g, e, b in zip(("w_gate", "w_up", "w_down"), (module.w_gate, module.w_up, module.w_down),
                             ref64["d_routed"], refb["d_routed"]):
        check_close(f"rank {r} d_{name}", np64(g.grad), np64(e[lo:hi]), np64(b[lo:hi]))
    if module.ws_gate is not None:
        for name, g, e, b in zip(("ws_gate", "ws_up", "ws_down"), (module.ws_gate, module.ws_up, module.ws_down),
                                 ref64["d_shared"], refb["d_shared"]):
            check_close(f"rank {r} d_{name}", np64(g.grad), np64(e), np64(b))


@pytest.mark.parametrize("tokens", [[37], [23, 9], [0, 17]])
@pytest.mark.parametrize("shared", [0, 64])
def test_module_matches_pytorch_reference(tokens, shared):
    inputs, routed, shared_w = make_inputs(tokens, seed=len(tokens) + shared, shared=shared)
    got = run_module(inputs, routed, shared_w)
    ref64 = group_reference(inputs, routed, shared_w, torch.float64)
    refb = group_reference(inputs, routed, shared_w, torch.bfloat16)
    for r in range(len(tokens)):
        check_rank(r, got[r], ref64[r], refb[r], got[r]["module"])


def test_gpt_oss_activation():
    inputs, routed, _ = make_inputs([29, 13], seed=9)
    got = run_module(inputs, routed, None, activation="gpt_oss")
    act = dict(kind="gpt_oss", limit=7.0)
    ref64 = group_reference(inputs, routed, None, torch.float64, act)
    refb = group_reference(inputs, routed, None, torch.bfloat16, act)
    for r in range(2):
        check_rank(r, got[r], ref64[r], refb[r], got[r]["module"])


def test_fp32_master_weights_get_fp32_gradients():
    inputs, routed, shared_w = make_inputs([21], seed=4, shared=64)
    bf16 = run_module(inputs, routed, shared_w)[0]["module"]
    fp32 = run_module(inputs, routed, shared_w, dtype=torch.float32)[0]["module"]
    for a, b in zip(bf16.parameters(), fp32.parameters()):
        assert b.dtype == torch.float32 and b.grad.dtype == torch.float32
        # fp32 gradients are the bf16 ones before their final rounding
        torch.testing.assert_close(b.grad.to(torch.bfloat16), a.grad, rtol=0, atol=0)


def test_main_grad_accumulates_and_compiles():
    inputs, routed, shared_w = make_inputs([19], seed=5, shared=64)
    x, idx, weights, d_out = inputs[0]
    plain = pt.MoE(H, I, E, K, max_tokens=32, shared_intermediate=64, dtype=torch.float32)
    plain.load_state_dict(expert_state_dict(routed, shared_w))
    (plain(x, idx, weights).float() * d_out.float()).sum().backward()

    module = pt.MoE(H, I, E, K, max_tokens=32, shared_intermediate=64, accumulate_main_grad=True)
    module.load_state_dict(expert_state_dict(routed, shared_w))
    with pytest.raises(pounce.PounceError, match="init_main_grad"):
        module(x, idx, weights)
    module.init_main_grad()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    for _ in range(2):  # two micro-batches add up
        (compiled(x, idx, weights).float() * d_out.float()).sum().backward()
    for p, q in zip(module.parameters(), plain.parameters()):
        assert p.grad is None
        torch.testing.assert_close(p.main_grad, 2 * q.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(backend):
    torch._dynamo.reset()
    inputs, routed, shared_w = make_inputs([33], seed=6, shared=64)
    x, idx, weights, d_out = inputs[0]
    module = pt.MoE(H, I, E, K, max_tokens=48, shared_intermediate=64)
    module.load_state_dict(expert_state_dict(routed, shared_w))

    def step(fn):
        module.zero_grad()
        xx, ww = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = fn(torch.tanh(xx.float()).to(torch.bfloat16), idx, ww)  # ops around the layer, in the graph
        (out.float() * d_out.float()).sum().backward()
        return [out, xx.grad, ww.grad] + [p.grad.clone() for p in module.parameters()]

    eager = step(module)
    compiled = step(torch.compile(module, fullgraph=True, backend=backend))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_layer_checks_device_errors_unless_turned_off(monkeypatch):
    """The layer runs pounce.check_errors (no sync) on its workspace before forward and after backward and
    raises a recorded failure naming the layer; check_errors=False never calls it; pt.check_errors checks
    on demand (with synchronize, as after a graph's replay)."""
    inputs, routed, _ = make_inputs([21], seed=12)
    x, idx, weights, d_out = inputs[0]
    calls, failure = [], []

    def check(workspace, stream=0, synchronize=False):
        calls.append((workspace, stream, synchronize))
        if failure:
            raise pounce.PounceError("pounce: topk_idx value out of range: rank 0 found topk_idx[0, 1] = 1000")

    monkeypatch.setattr(pounce, "check_errors", check)

    def step(module):
        out = module(x, idx, weights)
        (out.float() * d_out.float()).sum().backward()

    quiet = pt.MoE(H, I, E, K, max_tokens=32, check_errors=False)
    step(quiet)
    assert calls == []
    checked = pt.MoE(H, I, E, K, max_tokens=32)
    step(checked)
    assert [synchronize for _, _, synchronize in calls] == [False, False]  # before forward, after backward
    assert all(workspace is calls[0][0] for workspace, _, _ in calls)
    out = checked(x, idx, weights)
    failure.append(True)
    with pytest.raises(pounce.PounceError, match=rf"layer {checked.layer} .*after its backward.*out of range"):
        (out.float() * d_out.float()).sum().backward()
    failure.clear()
    calls.clear()
    pt.check_errors(checked, synchronize=True)
    assert [(stream, synchronize) for _, stream, synchronize in calls] == [(0, True)]


def test_layers_sharing_a_workspace_recompute_the_context():
    """Two layers in a row share one workspace: backward of the first runs after the second's forward
    replaced the context, so it is recomputed; results equal those of separate workspaces bitwise."""
    inputs, routed, _ = make_inputs([27], seed=8)
    x, idx, weights, d_out = inputs[0]
    state = expert_state_dict(routed, None)

    def two_layers(share):
        pt.free_workspaces()
        layers = [pt.MoE(H, I, E, K, max_tokens=32, share_workspace=share) for _ in range(2)]
        for layer in layers:
            layer.load_state_dict(state)
        xx = x.clone().requires_grad_()
        h = layers[0](xx, idx, weights)
        out = layers[1](h, idx.flip(0), weights)
        (out.float() * d_out.float()).sum().backward()
        stats = pt.workspace_stats()
        return [out, xx.grad] + [p.grad for layer in layers for p in layer.parameters()], stats

    shared_run, shared_stats = two_layers(True)
    separate_run, separate_stats = two_layers(False)
    assert [(s["shared"], s["layers"], s["recomputes"]) for s in shared_stats] == [(True, 2, 1)]
    assert [(s["shared"], s["layers"], s["recomputes"]) for s in separate_stats] == [(False, 1, 0)] * 2
    for a, b in zip(shared_run, separate_run):
        assert torch.equal(a, b)


def l_layer_steps(num_layers, steps, **module_kwargs):
    """A model of L MoE layers in a row trained `steps` steps (fresh routing per layer and step)."""
    inputs, routed, _ = make_inputs([24], seed=20)
    x, idx, weights, d_out = inputs[0]
    state = expert_state_dict(routed, None)
    layers = [pt.MoE(H, I, E, K, max_tokens=32, **module_kwargs) for _ in range(num_layers)]
    for layer in layers:
        layer.load_state_dict(state)
    for step in range(steps):
        h = x.clone().requires_grad_()
        for i, layer in enumerate(layers):
            h = layer(h, torch.roll(idx, i + step, dims=0), weights)
        (h.float() * d_out.float()).sum().backward()
    return [p.grad for layer in layers for p in layer.parameters()], layers  # layers: alive for the stats


def test_default_l_layer_training_recomputes_nothing():
    """The default gives each layer its own workspace (within the budget): no forward is recomputed."""
    pt.free_workspaces()
    default, kept = l_layer_steps(4, 2)
    stats = pt.workspace_stats()
    assert len(stats) == 4 and all(not s["shared"] and s["layers"] == 1 for s in stats)
    assert sum(s["recomputes"] for s in stats) == 0
    assert sum(s["forwards"] for s in stats) == 8
    pt.free_workspaces()
    checkpointed, kept = l_layer_steps(4, 2, share_workspace=True)  # explicit activation checkpointing
    (stats,) = pt.workspace_stats()
    assert stats["shared"] and stats["layers"] == 4 and stats["recomputes"] == 2 * 3
    for a, b in zip(default, checkpointed):  # the recompute is bitwise
        assert torch.equal(a, b)


def test_workspace_budget_shares_past_it():
    pt.free_workspaces()
    one = pounce.bytes_required(pounce.Shape(32, H, I, E, K), pounce.Config()).total
    pt.set_workspace_budget(2 * one)
    try:
        with pytest.warns(UserWarning, match="budget"):
            _, kept = l_layer_steps(4, 1)
        stats = pt.workspace_stats()
        assert [(s["shared"], s["layers"]) for s in stats] == [(True, 2), (False, 1), (False, 1)]
        assert [s["recomputes"] for s in stats] == [1, 0, 0]
    finally:
        pt.set_workspace_budget(None)
        pt.free_workspaces()


def test_fused_gate_up_gradient_is_one_tensor():
    """w_gate_up [E,2I,H] gives the same values as separate halves, and its gradient arrives whole."""
    inputs, routed, _ = make_inputs([21], seed=14)
    x, idx, weights, d_out = inputs[0]
    layer = pt.register_layer(hidden=H, intermediate=I, num_experts=E, num_topk=K, max_tokens=32)
    for dtype in (torch.bfloat16, torch.float32):
        gate, up, down = (w.to(dtype).clone().requires_grad_() for w in routed)
        out = pt.moe(x, idx, weights, gate, up, down, layer=layer)
        (out.float() * d_out.float()).sum().backward()
        gate_up = torch.cat((routed[0], routed[1]), dim=1).to(dtype).requires_grad_()
        down2 = routed[2].to(dtype).clone().requires_grad_()
        out2 = pt.moe(x, idx, weights, w_down=down2, w_gate_up=gate_up, layer=layer)
        (out2.float() * d_out.float()).sum().backward()
        assert torch.equal(out, out2)
        assert gate_up.grad.dtype == dtype and gate_up.grad.shape == (E, 2 * I, H)
        assert torch.equal(gate_up.grad, torch.cat((gate.grad, up.grad), dim=1))
        assert torch.equal(down2.grad, down.grad)
    # main_grad of the fused weight: the fp32 gradient accumulated in place (twice: two micro-batches)
    main = torch.zeros(E, 2 * I, H), torch.zeros(E, H, I)
    for _ in range(2):
        xx = x.clone().requires_grad_()
        out3 = pt.moe(xx, idx, weights, w_down=down2, w_gate_up=gate_up, layer=layer,
                      main_grads=(main[0], None, main[1], None, None, None))
        (out3.float() * d_out.float()).sum().backward()
    torch.testing.assert_close(main[0], 2 * gate_up.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(main[1], 2 * down2.grad, rtol=1e-6, atol=1e-6)
    pt.unregister_layer(layer)


def test_frozen_experts_get_no_gradients():
    inputs, routed, shared_w = make_inputs([19], seed=15, shared=64)
    x, idx, weights, d_out = inputs[0]
    state = expert_state_dict(routed, shared_w)
    trained = pt.MoE(H, I, E, K, max_tokens=32, shared_intermediate=64)
    frozen = pt.MoE(H, I, E, K, max_tokens=32, shared_intermediate=64)
    for module in (trained, frozen):
        module.load_state_dict(state)
    for p in (frozen.w_gate, frozen.w_up, frozen.w_down):
        p.requires_grad_(False)
    results = []
    for module in (trained, frozen):
        xx = x.clone().requires_grad_()
        (module(xx, idx, weights).float() * d_out.float()).sum().backward()
        results.append(xx.grad)
    assert torch.equal(results[0], results[1])
    assert frozen.w_gate.grad is None and frozen.w_up.grad is None and frozen.w_down.grad is None
    assert torch.equal(frozen.ws_gate.grad, trained.ws_gate.grad)
    for p in frozen.parameters():
        p.requires_grad_(False)
    xx = x.clone().requires_grad_()
    (frozen(xx, idx, weights).float() * d_out.float()).sum().backward()
    assert torch.equal(xx.grad, results[0]) and frozen.ws_down.grad is not None  # kept from before
    assert frozen.ws_down.grad.data_ptr() == frozen.ws_down.grad.data_ptr()


def test_tokens_per_expert_after_forward():
    inputs, routed, _ = make_inputs([30], seed=16)
    x, idx, weights, _ = inputs[0]
    module = pt.MoE(H, I, E, K, max_tokens=32)
    assert module.last_tokens_per_expert is None
    module(x, idx, weights)
    counts = module.last_tokens_per_expert
    expected = torch.bincount(idx[idx >= 0].flatten(), minlength=E)
    assert counts.dtype == torch.int64 and torch.equal(counts, expected)
    assert int(counts.sum()) == int((idx >= 0).sum())


def test_bad_dtypes_and_meta_weights_raise_clear_errors():
    inputs, routed, _ = make_inputs([8], seed=17)
    x, idx, weights, _ = inputs[0]
    module = pt.MoE(H, I, E, K, max_tokens=16)
    for bad in (x.to(torch.int32), x.to(torch.bool), x.to(torch.complex64)):
        with pytest.raises(TypeError, match="argument 'x'"):
            module(bad, idx, weights)
    with pytest.raises(TypeError, match="argument 'topk_weights'"):
        module(x, idx, weights.to(torch.int64))
    layer = pt.register_layer(hidden=H, intermediate=I, num_experts=E, num_topk=K, max_tokens=16)
    with pytest.raises(TypeError, match="argument 'topk_idx'"):
        pt.moe(x, idx.float(), weights, *routed, layer=layer)
    with pytest.raises(TypeError, match="argument 'w_up'"):
        pt.moe(x, idx, weights, routed[0], routed[1].to(torch.int16), routed[2], layer=layer)
    pt.unregister_layer(layer)
    meta = pt.MoE(H, I, E, K, max_tokens=16, device="meta")
    with pytest.raises(pounce.PounceError, match="'w_gate' is on the meta device"):
        meta(x, idx, weights)
    meta.to_empty(device="cpu")
    meta.load_state_dict(module.state_dict())
    assert torch.equal(meta(x, idx, weights), module(x, idx, weights))


def test_load_state_dict_reads_transformers_layouts():
    full = pt.MoE(H, I, E, K, max_tokens=8, shared_intermediate=64, init_seed=5)
    own = full.state_dict()
    fused = {
        "experts.gate_up_proj": torch.cat((full.w_gate, full.w_up), dim=1).detach(),
        "experts.down_proj": full.w_down.detach(),
    }
    mixtral = {}
    for e in range(E):
        mixtral[f"experts.{e}.w1.weight"] = own[f"experts.{e}.gate_proj.weight"]
        mixtral[f"experts.{e}.w3.weight"] = own[f"experts.{e}.up_proj.weight"]
        mixtral[f"experts.{e}.w2.weight"] = own[f"experts.{e}.down_proj.weight"]
    deepseek_shared = {f"shared_experts.{p}.weight": own[f"shared_expert.{p}.weight"]
                       for p in ("gate_proj", "up_proj", "down_proj")}
    groups = pounce.Group.create_cpu(2)
    for routed_keys in (fused, mixtral):
        for group, lo in ((None, 0), (groups[1], E // 2)):
            module = pt.MoE(H, I, E, K, max_tokens=8, shared_intermediate=64, group=group)
            module.load_state_dict({**routed_keys, **deepseek_shared})  # strict: nothing unexpected
            assert torch.equal(module.w_gate, full.w_gate[lo:]) and torch.equal(module.w_up, full.w_up[lo:])
            assert torch.equal(module.w_down, full.w_down[lo:]) and torch.equal(module.ws_down, full.ws_down)
    with pytest.raises(RuntimeError, match="shared_expert.gate_proj.weight"):
        pt.MoE(H, I, E, K, max_tokens=8, shared_intermediate=64).load_state_dict(fused)


def test_functional_api_and_opcheck():
    inputs, routed, shared_w = make_inputs([16], seed=10, shared=64)
    x, idx, weights, _ = inputs[0]
    layer = pt.register_layer(hidden=H, intermediate=I, num_experts=E, num_topk=K, max_tokens=16,
                              shared_intermediate=64)
    out = pt.moe(x, idx, weights, *routed, *shared_w, layer=layer)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    torch.library.opcheck(torch.ops.pounce.moe_forward.default,
                          (x, idx, weights, *routed, *shared_w, layer, []),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    pt.unregister_layer(layer)


def test_state_dict_is_per_expert_and_ep_slices_it():
    full = pt.MoE(H, I, E, K, max_tokens=8, shared_intermediate=64, init_seed=3)
    state = full.state_dict()
    assert len(state) == 3 * E + 3
    assert state["experts.5.down_proj.weight"].shape == (H, I)
    assert state["shared_expert.gate_proj.weight"].shape == (64, H)
    assert torch.equal(state["experts.5.up_proj.weight"], full.w_up[5])
    # Rank 1 of 2 takes experts 4..7 from the full checkpoint; the seeded init is the same per expert.
    groups = pounce.Group.create_cpu(2)
    half = pt.MoE(H, I, E, K, max_tokens=8, shared_intermediate=64, group=groups[1], init_seed=3)
    assert torch.equal(half.w_gate, full.w_gate[4:])
    half.reset_parameters()
    half.load_state_dict(state)
    assert torch.equal(half.w_down, full.w_down[4:]) and torch.equal(half.ws_up, full.ws_up)
    assert sorted(half.state_dict()) == sorted(k for k in state if not k.startswith(("experts.0.", "experts.1.",
                                                                                      "experts.2.", "experts.3.")))
    missing = {k: v for k, v in state.items() if k != "experts.6.gate_proj.weight"}
    with pytest.raises(RuntimeError, match="experts.6.gate_proj.weight"):
        half.load_state_dict(missing)
    with pytest.raises(RuntimeError, match="bogus"):
        half.load_state_dict(dict(state, bogus=torch.zeros(1)))


def test_wrong_inputs_raise_clear_errors():
    inputs, routed, _ = make_inputs([16], seed=12)
    x, idx, weights, _ = inputs[0]
    layer = pt.register_layer(hidden=H, intermediate=I, num_experts=E, num_topk=K, max_tokens=16)
    cases = [
        (dict(x=x.float()), "argument 'x'.*bf16"),
        (dict(x=torch.cat([x, x])), "max_tokens"),
        (dict(x=x.t().contiguous().t()), "'x' is not contiguous"),
        (dict(topk_idx=idx + E), r"'topk_idx'\[.*out of range"),
        (dict(topk_weights=weights.double()), "topk_weights"),
        (dict(w_down=routed[0]), "routed.down|'x'"),  # [E,I,H] instead of [E,H,I]: same here, I == H
    ]
    for override, needle in cases[:-1]:
        args = dict(x=x, topk_idx=idx, topk_weights=weights, w_gate=routed[0], w_up=routed[1], w_down=routed[2])
        args.update(override)
        with pytest.raises(pounce.PounceError, match=needle):
            pt.moe(**args, layer=layer)
    with pytest.raises(pounce.PounceError, match="shared.gate"):
        pt.moe(x, idx, weights, *routed, routed[0][0], routed[1][0], routed[2][0], layer=layer)
    with pytest.raises(pounce.PounceError, match="layer handle"):
        pt.moe(x, idx, weights, *routed, layer=10**9)
    with pytest.raises(pounce.PounceError, match="activation"):
        pt.MoE(H, I, E, K, max_tokens=8, activation="relu")
    with pytest.raises(pounce.PounceError, match="shape.hidden"):
        pt.MoE(100, I, E, K, max_tokens=8)
    pt.unregister_layer(layer)


def test_empty_batch_and_numpy_interop():
    inputs, routed, _ = make_inputs([0], seed=13)
    x, idx, weights, _ = inputs[0]
    module = pt.MoE(H, I, E, K, max_tokens=8)
    x = x.clone().requires_grad_()
    out = module(x, idx, weights)
    out.float().sum().backward()
    assert out.shape == (0, H) and x.grad.shape == (0, H)
    assert torch.count_nonzero(module.w_gate.grad) == 0  # experts without tokens get zero gradients
    assert np.asarray(module.w_gate.detach().float()).shape == (E, I, H)


def test_layer_config_copy_keeps_every_field():
    """A layer copies its Config field by field: the kernel path and the rest survive the copy."""
    from pounce.torch import _registry

    config = pounce.Config(
        kernel_path=pounce.KernelPath.staged,
        backward_kernel_path=pounce.KernelPath.fused,
        minibatch_size=256,
        forward_comm_sms=7,
    )
    copied = _registry.copy_config(config)
    assert repr(copied) == repr(config)
