"""pounce.torch on GPUs: forward and every gradient against a plain PyTorch reference, determinism,
torch.compile(fullgraph=True), CUDA graph capture replayed with new routing, wrong inputs.

One process per GPU, the EP group over torch.distributed:

    torchrun --nproc-per-node=2 -m pytest -q -p no:cacheprovider tests/python/test_torch_gpu.py

(plain ``pytest`` runs it on one GPU, EP = 1). Every rank builds every rank's inputs from the same seed,
so the reference needs no communication; each test agrees on pass/fail over the ranks before failing,
so one rank's failure does not leave the others waiting in a collective. Skips without CUDA, torch,
or a CUDA build of pounce.
"""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pounce = pytest.importorskip("pounce", reason="the pounce Python module is not installed (pip install .)")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible", allow_module_level=True)
if not pounce.build_info()["cuda"]:
    pytest.skip("pounce was built without CUDA (no nvcc at build time)", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

import pounce.torch as pt  # noqa: E402
from moe_reference import check_close  # noqa: E402
from torch_reference import group_reference, route_as  # noqa: E402

H, I, E, K, IS = 256, 128, 8, 2, 128
MAX_TOKENS = 512


@pytest.fixture(scope="module")
def world():
    """(rank, num_ranks, device); initialises the NCCL process group under torchrun."""
    num_ranks = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    if num_ranks > 1 and not dist.is_initialized():
        dist.init_process_group("nccl", device_id=device)
    yield rank, num_ranks, device
    pt.free_workspaces()
    if dist.is_initialized():
        dist.destroy_process_group()


def require(condition, message):
    assert condition, message


def agree(check):
    """Runs ``check`` (raises AssertionError) and fails on every rank when it failed on any."""
    error = None
    try:
        check()
    except (AssertionError, pytest.fail.Exception) as e:
        error = e
    if dist.is_initialized():
        flag = torch.tensor([0 if error is None else 1], device="cuda")
        dist.all_reduce(flag)
        failed_elsewhere = flag.item() > 0
    else:
        failed_elsewhere = False
    if error is not None:
        raise error
    if failed_elsewhere:
        pytest.fail("another rank failed this check (see its output)")


def make_inputs(num_ranks, tokens, seed, shared=0, one_expert=None, device="cuda"):
    """Every rank's inputs, the same on every rank; routed weights for all E experts."""
    gen = torch.Generator().manual_seed(seed)

    def bf16(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(device)

    inputs = []
    for r in range(num_ranks):
        T = tokens[r % len(tokens)]
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else \
            torch.zeros(0, K, dtype=torch.int64)
        idx[torch.rand(T, K, generator=gen) < 0.15] = -1
        if one_expert is not None:
            idx[:] = -1
            idx[:, 0] = one_expert
        inputs.append((bf16(T, H), idx.to(device), (0.1 + torch.rand(T, K, generator=gen)).to(device),
                       bf16(T, H)))
    routed = (bf16(E, I, H, scale=H**-0.5), bf16(E, I, H, scale=H**-0.5), bf16(E, H, I, scale=I**-0.5))
    shared_w = (bf16(shared, H, scale=H**-0.5), bf16(shared, H, scale=H**-0.5),
                bf16(H, shared, scale=shared**-0.5)) if shared else None
    return inputs, routed, shared_w


def state_dict_of(routed, shared):
    state = {}
    for e in range(E):
        for proj, w in zip(("gate_proj", "up_proj", "down_proj"), routed):
            state[f"experts.{e}.{proj}.weight"] = w[e]
    if shared is not None:
        for proj, w in zip(("gate_proj", "up_proj", "down_proj"), shared):
            state[f"shared_expert.{proj}.weight"] = w
    return state


def make_module(routed, shared, **kwargs):
    module = pt.MoE(H, I, E, K, max_tokens=MAX_TOKENS, shared_intermediate=shared[0].shape[0] if shared else 0,
                    device="cuda", **kwargs)
    module.load_state_dict(state_dict_of(routed, shared))
    return module


def step(module, x, idx, weights, d_out, fn=None):
    """forward + backward with loss <out, d_out>; returns out and every gradient."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    out = (fn if fn is not None else module)(x, idx, weights)  # not `or`: bool() calls MoE.__len__
    (out.float() * d_out.float()).sum().backward()
    grads = [p.grad for p in module.parameters()]
    return [out.detach(), x.grad, weights.grad] + grads


def check_against_reference(rank, module, got, inputs, routed, shared, act=None):
    ref64 = group_reference([tuple(t.cpu() for t in i) for i in inputs], [w.cpu() for w in routed],
                            [w.cpu() for w in shared] if shared else None, torch.float64, act)[rank]
    refb = group_reference(inputs, routed, shared, torch.bfloat16, act)[rank]
    lo, hi = module.first_expert, module.first_expert + module.num_local_experts
    names = ["out", "d_x", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down"]
    exact = [ref64["out"], ref64["d_x"], ref64["d_topk_weights"]] + [w[lo:hi] for w in ref64["d_routed"]]
    noisy = [refb["out"], refb["d_x"], refb["d_topk_weights"]] + [w[lo:hi] for w in refb["d_routed"]]
    if shared:
        names += ["d_ws_gate", "d_ws_up", "d_ws_down"]
        exact += ref64["d_shared"]
        noisy += refb["d_shared"]

    def check():
        for name, g, e, b in zip(names, got, exact, noisy):
            check_close(f"rank {rank} {name}", g.double().cpu().numpy(), e.double().cpu().numpy(),
                        b.double().cpu().numpy())

    agree(check)


@pytest.mark.parametrize("shared", [0, IS])
@pytest.mark.parametrize("tokens", [[300, 170], [0, 129], [1, 512]])
def test_forward_and_gradients_match_pytorch(world, tokens, shared):
    rank, R, _ = world
    inputs, routed, shared_w = make_inputs(R, tokens, seed=tokens[0] + shared, shared=shared)
    module = make_module(routed, shared_w)
    got = step(module, *inputs[rank])
    check_against_reference(rank, module, got, inputs, routed, shared_w)
    again = step(module, *inputs[rank])
    agree(lambda: require(all(torch.equal(a, b) for a, b in zip(got, again)), "two runs differ (determinism)"))


def expect_same_results(world, tokens, seed, config_a, config_b, message):
    """Two layers with the same weights, one per config, give bitwise the same outputs and gradients; the
    second also meets the reference."""
    rank, R, _ = world
    inputs, routed, shared_w = make_inputs(R, tokens, seed=seed, shared=IS)
    a = make_module(routed, shared_w, config=config_a)
    b = make_module(routed, shared_w, config=config_b)
    got_a = step(a, *inputs[rank])
    got_b = step(b, *inputs[rank])
    check_against_reference(rank, b, got_b, inputs, routed, shared_w)
    agree(lambda: require(all(torch.equal(x, y) for x, y in zip(got_a, got_b)), message))


def test_fused_backward_kernel_equals_staged(world):
    """Config.backward_kernel_path = fused: the same gradients as the staged backward, bit for bit."""
    expect_same_results(world, [300, 129], 17, pounce.Config(backward_kernel_path=pounce.KernelPath.staged),
                        pounce.Config(backward_kernel_path=pounce.KernelPath.fused),
                        "fused and staged backward differ")


def test_macrobatch_ring_equals_worst_case(world):
    """Config.macrobatch_size at its minimum (ranks x max_tokens rows): the routed experts run in macrobatches,
    the backward replays all but the last, and every output and gradient is the worst-case layer's, bit for
    bit."""
    ring = (world[1] * MAX_TOKENS + 127) // 128 * 128
    expect_same_results(world, [300, 170], 23, pounce.Config(), pounce.Config(macrobatch_size=ring),
                        "the macrobatch ring changes the results")


def test_gpt_oss_and_all_tokens_to_one_expert(world):
    rank, R, _ = world
    inputs, routed, _ = make_inputs(R, [257, 64], seed=5, one_expert=E - 1)
    module = make_module(routed, None, activation="gpt_oss")
    got = step(module, *inputs[rank])
    check_against_reference(rank, module, got, inputs, routed, None, dict(kind="gpt_oss", limit=7.0))


def test_compile_fullgraph_matches_eager(world):
    rank, R, _ = world
    torch._dynamo.reset()
    inputs, routed, shared_w = make_inputs(R, [200, 100], seed=7, shared=IS)
    module = make_module(routed, shared_w)

    def around(m):  # exact elementwise work around the layer, fused by inductor
        return lambda x, idx, w: m(x * 2, idx, w * 0.5) * 2

    eager = step(module, *inputs[rank], fn=around(module))
    compiled = torch.compile(around(module), fullgraph=True)
    got = step(module, *inputs[rank], fn=compiled)
    agree(lambda: [require(torch.equal(a, b), f"tensor {i} differs from eager") for i, (a, b) in
                   enumerate(zip(eager, got))])


def capture_step(model, params, inputs):
    """One forward+backward of `model(x, idx, weights)` captured in a CUDA graph on static copies of `inputs`
    (x, idx, weights, d_out), after two warm-up steps on a side stream (groups, workspaces, autograd state).
    Returns the graph, the static inputs (copy new values into them before a replay) and the captured output
    followed by the gradients of x, the weights and `params`."""
    x0, idx0, w0, d0 = inputs
    static = dict(x=x0.clone().requires_grad_(), idx=idx0.clone(), w=w0.clone().requires_grad_(), d=d0.clone())

    def graph_step():
        out = model(static["x"], static["idx"], static["w"])
        (out.float() * static["d"].float()).sum().backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for t in params + [static["x"], static["w"]]:
                t.grad = None
            graph_step()
    torch.cuda.current_stream().wait_stream(side)
    for t in params + [static["x"], static["w"]]:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = graph_step()
    return graph, static, [static_out, static["x"].grad, static["w"].grad] + [p.grad for p in params]


def test_cuda_graph_replay_with_new_routing_matches_eager(world):
    """Two layers sharing a workspace (so backward recomputes a context inside the graph): one
    forward+backward captured, replayed with new routing copied into the captured inputs."""
    rank, R, device = world
    inputs, routed, shared_w = make_inputs(R, [384, 256], seed=11, shared=IS)
    layers = [make_module(routed, shared_w), make_module(routed, shared_w)]
    params = [p for layer in layers for p in layer.parameters()]

    def model(x, idx, weights):
        return layers[1](layers[0](x, idx, weights), idx.flip(0), weights)

    graph, static, captured = capture_step(model, params, inputs[rank])

    for seed in (21, 22, 23):
        new_inputs, _, _ = make_inputs(R, [384, 256], seed=seed)
        x, idx, weights, d_out = new_inputs[rank]
        static["x"].data.copy_(x)
        static["idx"].copy_(idx)
        static["w"].data.copy_(weights)
        static["d"].copy_(d_out)
        graph.replay()
        replayed = [t.clone() for t in captured]
        for p in params:
            p.grad = None
        xx, ww = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = model(xx, idx, ww)
        (out.float() * d_out.float()).sum().backward()
        eager = [out.detach(), xx.grad, ww.grad] + [p.grad for p in params]
        pairs = list(zip(replayed, eager))
        agree(lambda seed=seed, pairs=pairs: [
            require(torch.equal(a, b), f"seed {seed}: tensor {i} differs from eager") for i, (a, b) in enumerate(pairs)
        ])


def test_workspace_shared_across_layers_and_ep_group_cached(world):
    rank, R, _ = world
    pt.free_workspaces()
    inputs, routed, _ = make_inputs(R, [64, 32], seed=3)
    a, b = make_module(routed, None, share_workspace=True), make_module(routed, None, share_workspace=True)
    step(a, *inputs[rank])
    step(b, *inputs[rank])
    stats = pt.workspace_stats()
    agree(lambda: require(len(stats) == 1 and stats[0]["forwards"] == 2, f"one shared workspace expected: {stats}"))
    if R > 1:
        agree(lambda: require(pt.ep_group() is pt.ep_group(), "ep_group() is not cached"))


def test_wrong_inputs_raise_clear_errors(world):
    """Every rank makes the same mistake, so every rank fails on the host before launching."""
    rank, R, _ = world
    inputs, routed, _ = make_inputs(R, [64, 64], seed=4)
    x, idx, weights, _ = inputs[rank]
    layer = pt.register_layer(hidden=H, intermediate=I, num_experts=E, num_topk=K, max_tokens=MAX_TOKENS)
    El = E // R
    local = [w[rank * El:(rank + 1) * El].contiguous() for w in routed]
    pt.moe(x, idx, weights, *local, layer=layer)  # creates the workspace
    cases = [
        (dict(x=x.float()), "argument 'x'.*bf16"),
        (dict(x=x.cpu()), "'topk_idx' is on cuda.*x is on cpu"),
        (dict(x=torch.cat([x] * (MAX_TOKENS // 64 + 1))), "max_tokens"),
        (dict(x=x.t().contiguous().t()), "'x' is not contiguous"),
        (dict(topk_weights=weights.half()), "topk_weights"),
        (dict(w_up=local[1][:, :, :64].contiguous()), "'routed.up'"),
    ]
    messages = []
    for override, needle in cases:
        args = dict(x=x, topk_idx=idx, topk_weights=weights, w_gate=local[0], w_up=local[1], w_down=local[2])
        args.update(override)
        try:
            pt.moe(**args, layer=layer)
            messages.append((needle, None))
        except pounce.PounceError as error:
            messages.append((needle, str(error)))

    def check():
        import re
        for needle, message in messages:
            assert message is not None and re.search(needle, message), f"expected /{needle}/, got {message!r}"

    agree(check)
    pt.unregister_layer(layer)


def test_default_layers_recompute_nothing_and_equal_checkpointing(world):
    """Four layers in a row, two steps: by default each has its own workspace and no forward is
    recomputed; share_workspace=True (activation checkpointing) recomputes and gives the same bits."""
    rank, R, _ = world
    inputs, routed, _ = make_inputs(R, [96, 64], seed=5)
    x, idx, weights, d_out = inputs[rank]

    def run(**kwargs):
        pt.free_workspaces()
        layers = [make_module(routed, None, **kwargs) for _ in range(4)]
        for step_idx in range(2):
            h = x.clone().requires_grad_()
            for i, layer in enumerate(layers):
                h = layer(h, torch.roll(idx, i + step_idx, dims=0), weights)
            (h.float() * d_out.float()).sum().backward()
        return [p.grad for layer in layers for p in layer.parameters()], pt.workspace_stats(), layers

    default, stats, _ = run()
    agree(lambda: require(sum(s["recomputes"] for s in stats) == 0 and len(stats) == 4, f"{stats}"))
    checkpointed, stats, _ = run(share_workspace=True)
    agree(lambda: require([s["recomputes"] for s in stats] == [6], f"{stats}"))
    agree(lambda: [require(torch.equal(a, b), f"gradient {i} differs") for i, (a, b) in
                   enumerate(zip(default, checkpointed))])


def test_fused_gate_up_and_frozen_experts(world):
    rank, R, _ = world
    inputs, routed, _ = make_inputs(R, [128, 64], seed=6)
    x, idx, weights, d_out = inputs[rank]
    El = E // R
    local = [w[rank * El:(rank + 1) * El] for w in routed]
    layer = pt.register_layer(hidden=H, intermediate=I, num_experts=E, num_topk=K, max_tokens=MAX_TOKENS)
    gate, up, down = (w.clone().requires_grad_() for w in local)
    out = pt.moe(x, idx, weights, gate, up, down, layer=layer)
    (out.float() * d_out.float()).sum().backward()
    gate_up = torch.cat((local[0], local[1]), dim=1).requires_grad_()
    down2 = local[2].clone().requires_grad_()
    out2 = pt.moe(x, idx, weights, w_down=down2, w_gate_up=gate_up, layer=layer)
    (out2.float() * d_out.float()).sum().backward()
    xx = x.clone().requires_grad_()
    frozen = pt.moe(xx, idx, weights, local[0], local[1], local[2], layer=layer)  # no weight requires grad
    (frozen.float() * d_out.float()).sum().backward()
    xx2 = x.clone().requires_grad_()
    (pt.moe(xx2, idx, weights, gate, up, down, layer=layer).float() * d_out.float()).sum().backward()

    def check():
        assert torch.equal(out, out2)
        # gate/up/down ran backward twice (first and last call), the fused weights once; doubling is exact
        assert torch.equal(gate_up.grad * 2, torch.cat((gate.grad, up.grad), dim=1))
        assert torch.equal(down2.grad * 2, down.grad)
        assert torch.equal(xx.grad, xx2.grad)

    agree(check)
    pt.unregister_layer(layer)


def test_transformers_backend_matches_grouped_mm(world):
    """A tiny Qwen3-MoE on the GPU, bf16: experts_implementation="pounce" and transformers' grouped_mm
    (one rank, or with EP over the process group: every rank its own batch) against an fp64 evaluation of
    the same model on the CPU; Pounce's error on every gradient within 1.5x grouped_mm's own plus 5e-3.

    Every run takes grouped_mm's routing: layer 1 has tokens whose second and third router logits lie
    within one bf16 ulp of each other, so which expert such a token picks follows the bf16-level
    differences of layer 0, any two bf16 implementations may route one differently, and one such token of
    128 moves layer 1's expert and router gradients by 5-20%: that would measure the tie, not the experts."""
    transformers = pytest.importorskip("transformers")
    rank, R, device = world
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=H, intermediate_size=2 * I, moe_intermediate_size=I, num_experts=E,
        num_experts_per_tok=K, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        norm_topk_prob=True, initializer_range=0.05,
    )
    torch.manual_seed(0)
    ref = transformers.Qwen3MoeForCausalLM(config).to(device, torch.bfloat16)
    ref.set_experts_implementation("grouped_mm")
    import copy

    exact = copy.deepcopy(ref).to("cpu", torch.float64)  # the bf16 weights' values, evaluated in fp64
    exact.set_experts_implementation("eager")
    model = copy.deepcopy(ref)
    model.set_experts_implementation("pounce")
    if R > 1:
        pt.configure_transformers(model, max_tokens=MAX_TOKENS, group=dist.group.WORLD)
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 128, (2, 64), generator=gen).to(device) for _ in range(R)]

    def grads_of(m, ids, routing, record=False):
        handles = route_as(m, routing, record)
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids.to(m.device), labels=ids.to(m.device)).loss
        loss.backward()
        for handle in handles:
            handle.remove()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    routings = [{} for _ in batches]
    refs = [grads_of(ref, ids, routing, record=True) for ids, routing in zip(batches, routings)]
    exacts = [grads_of(exact, ids, routing) for ids, routing in zip(batches, routings)]
    loss, grads = grads_of(model, batches[rank], routings[rank])

    def rel(a, b):
        return ((a.double().cpu() - b.double().cpu()).norm() / (b.double().cpu().norm() + 1e-30)).item()

    def check():
        (loss_ref, grads_ref), grads_exact = refs[rank], exacts[rank][1]
        assert abs(loss.item() - loss_ref.item()) <= 1e-2 * abs(loss_ref.item()), (loss, loss_ref)
        assert set(grads) == set(grads_ref), set(grads) ^ set(grads_ref)
        failures = []
        for name, g in grads.items():
            g_ref, g_exact = grads_ref[name], grads_exact[name]
            if ".experts." in name:  # a local expert's gradient sums over every rank's tokens
                El = g.shape[0]
                g_ref = sum(r[1][name] for r in refs)[rank * El:(rank + 1) * El]
                g_exact = sum(r[1][name] for r in exacts)[rank * El:(rank + 1) * El]
            err, err_ref, direct = rel(g, g_exact), rel(g_ref, g_exact), rel(g, g_ref)
            if err > 1.5 * err_ref + 5e-3 or direct > 0.05:
                failures.append(f"{name}: relative error vs fp64 {err:.4f} (grouped_mm's {err_ref:.4f}), "
                                f"vs grouped_mm {direct:.4f}")
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)

    agree(check)
    pt.free_workspaces()


# -- FP8 (precision="fp8") ----------------------------------------------------------------------------------


def check_fp8_budget(rank, names, got, ref):
    """docs/design.md §1's FP8 budget against the BF16 layer: relative error <= 0.1 per tensor, gradient
    cosine >= 0.996."""
    def check():
        for name, g, r in zip(names, got, ref):
            g, r = g.double().flatten(), r.double().flatten()
            rel = ((g - r).norm() / r.norm().clamp_min(1e-30)).item()
            assert rel <= 0.1, f"rank {rank} {name}: relative error {rel:.4f} > 0.1"
            if name != "out":
                cosine = torch.nn.functional.cosine_similarity(g, r, dim=0).item()
                assert cosine >= 0.996, f"rank {rank} {name}: cosine {cosine:.5f} < 0.996"

    agree(check)


FP8_NAMES = ["out", "d_x", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down", "d_ws_gate", "d_ws_up", "d_ws_down"]


def test_fp8_forward_and_gradients_within_the_budget(world):
    rank, R, _ = world
    inputs, routed, shared_w = make_inputs(R, [300, 170], seed=31, shared=IS)
    bf16 = make_module(routed, shared_w)
    fp8 = make_module(routed, shared_w, precision="fp8")
    ref = step(bf16, *inputs[rank])
    got = step(fp8, *inputs[rank])
    check_fp8_budget(rank, FP8_NAMES, got, ref)
    again = step(fp8, *inputs[rank])
    agree(lambda: require(all(torch.equal(a, b) for a, b in zip(got, again)), "two FP8 runs differ"))
    agree(lambda: require(fp8.fp8_cache.quantizations == 1, f"{fp8.fp8_cache.quantizations} quantizations"))


def test_fp8_compile_fullgraph_matches_eager(world):
    rank, R, _ = world
    torch._dynamo.reset()
    inputs, routed, shared_w = make_inputs(R, [200, 100], seed=33, shared=IS)
    module = make_module(routed, shared_w, precision="fp8")
    eager = step(module, *inputs[rank])
    got = step(module, *inputs[rank], fn=torch.compile(module, fullgraph=True))
    agree(lambda: [require(torch.equal(a, b), f"tensor {i} differs from eager") for i, (a, b) in
                   enumerate(zip(eager, got))])


def test_fp8_cuda_graph_replay_requantizes_the_updated_weights(world):
    """A captured FP8 forward+backward records the weight quantization: replays after in-place weight
    updates (an optimizer step outside the graph) match eager steps with those weights, bit for bit."""
    rank, R, _ = world
    inputs, routed, shared_w = make_inputs(R, [384, 256], seed=35, shared=IS)
    module = make_module(routed, shared_w, precision="fp8")
    params = list(module.parameters())
    x0, idx0, w0, d0 = inputs[rank]
    graph, _, captured = capture_step(module, params, inputs[rank])

    for n in range(3):
        with torch.no_grad():  # the optimizer step, outside the graph
            for p in params:
                p.mul_(0.9).add_(0.01 * torch.randn_like(p))
        graph.replay()
        replayed = [t.clone() for t in captured]
        eager = step(module, x0, idx0, w0, d0)
        pairs = list(zip(replayed, eager))
        agree(lambda n=n, pairs=pairs: [
            require(torch.equal(a, b), f"update {n}: tensor {i} differs from eager") for i, (a, b) in enumerate(pairs)
        ])


def test_ep_fsdp2_matches_reference(world):
    """EP over mesh["ep"] (NCCL, across processes) composed with FSDP2 over mesh["dp"], the experts in fp32
    masters computed in bf16 and reduced in fp32: one step against the reference of all experts. Each rank's
    backward sums its EP group's tokens; FSDP2 sums over dp and divides by every rank (the factor the docs
    advise), so the gathered gradients are the reference's sum over all ranks / R."""
    rank, R, _ = world
    if R < 2:
        pytest.skip("EP x FSDP2 needs torchrun with two processes or more")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.4) is not available")
    from torch.distributed.device_mesh import init_device_mesh

    ep = 2 if R % 2 == 0 else 1
    mesh = init_device_mesh("cuda", (R // ep, ep), mesh_dim_names=("dp", "ep"))
    inputs, routed, _ = make_inputs(R, [(130 + 37 * r) % MAX_TOKENS for r in range(R)], seed=31)
    module = pt.MoE(H, I, E, K, max_tokens=MAX_TOKENS, group=mesh["ep"], device="cuda", dtype=torch.float32)
    module.load_state_dict(state_dict_of(routed, None))
    fsdp.fully_shard(module, mesh=mesh["dp"], mp_policy=fsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    module.set_gradient_divide_factor(R)
    x, idx, weights, d_out = inputs[rank]
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    out = module(x, idx, weights)
    (out.float() * d_out.float()).sum().backward()
    got = [out.detach(), x.grad, weights.grad] + [
        p.grad.full_tensor() * R for p in (module.w_gate, module.w_up, module.w_down)]
    check_against_reference(rank, module, got, inputs, routed, None)
