"""EP x FSDP2 on the CPU: ``MoE(group=mesh["ep"])`` with ``fully_shard(moe, mesh=mesh["dp"])``, one training
step against the plain PyTorch reference of all experts (tests/python/torch_reference.py).

Four processes (gloo) are spawned once for the module; each runs every scenario and sends back, per
scenario, None or the text of its failure:

- ``mesh``: a ("dp"=2, "ep"=2) mesh; ``group=mesh`` (2-D) is refused naming ``mesh['ep']``;
  ``group=mesh["ep"]`` gives 2 EP ranks, this rank's coordinate and experts; its forward on the CPU
  says that EP across processes needs GPUs (the CPU backend's EP ranks are threads of one process).
- ``dp4_ep1``: a ("dp"=4, "ep"=1) mesh, the layer with a shared expert, FSDP2 over "dp" with bf16
  compute and fp32 reduction; out, d_x, d_topk_weights and every gradient (FSDP2 averages over dp)
  against the reference; state_dict / load_state_dict of the sharded layer.
- ``dp4_ep2``: EP over two CPU ranks inside each process (threads, pounce.Group.create_cpu(2)) and
  FSDP2 over the four processes for each EP rank's experts: the layout of EP in an NVLink domain, data
  parallel across nodes; frozen w_up (the default divide factor: gloo has no PREMUL_SUM for the one
  the docs advise, the GPU test sets it); a shared
  expert with gradients refused (it is replicated over "ep" but reduced over "dp" only).
- ``fp8``: under FSDP2 the FP8 copies are quantized at every forward (the gathered weights change
  without a version bump); ``accumulate_main_grad`` is refused with the fix.

The GPU twin (NCCL, EP across processes) is in test_torch_gpu.py.
"""
from __future__ import annotations

import datetime
import os
import socket
import traceback

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pounce = pytest.importorskip(
    "pounce", reason="the pounce Python module is not built (needs nanobind; run tools/setup.sh)"
)
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available", allow_module_level=True)
try:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:
    pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.4) is not available", allow_module_level=True)

import pounce.torch as pt  # noqa: E402

from conftest import on_ranks, raise_first  # noqa: E402
from moe_reference import check_close  # noqa: E402
from torch_reference import group_reference  # noqa: E402

H, I, E, K, IS = 64, 64, 8, 2, 64
WORLD = 4
SCENARIOS = ("mesh", "dp4_ep1", "dp4_ep2", "fp8")


def make_inputs(num_ranks, tokens, seed, shared=0):
    """Every rank's (x, topk_idx, topk_weights, d_out) and the full weights, the same in every process."""
    gen = torch.Generator().manual_seed(seed)

    def bf16(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    inputs = []
    for _ in range(num_ranks):
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
        idx[torch.rand(tokens, K, generator=gen) < 0.15] = -1
        inputs.append((bf16(tokens, H), idx, 0.1 + torch.rand(tokens, K, generator=gen), bf16(tokens, H)))
    routed = (bf16(E, I, H, scale=H**-0.5), bf16(E, I, H, scale=H**-0.5), bf16(E, H, I, scale=I**-0.5))
    shared_w = (bf16(shared, H, scale=H**-0.5), bf16(shared, H, scale=H**-0.5),
                bf16(H, shared, scale=shared**-0.5)) if shared else None
    return inputs, routed, shared_w


def expert_state_dict(routed, shared):
    state = {}
    for e in range(E):
        for name, w in zip(("gate_proj", "up_proj", "down_proj"), routed):
            state[f"experts.{e}.{name}.weight"] = w[e]
    if shared is not None:
        for name, w in zip(("gate_proj", "up_proj", "down_proj"), shared):
            state[f"shared_expert.{name}.weight"] = w
    return state


def sharded_module(group, dp_mesh, routed, shared, **kwargs):
    """fp32 master weights loaded from the bf16 checkpoint (so bf16 compute sees the reference's weights),
    then fully_shard over the data-parallel mesh: bf16 all-gather and compute, fp32 reduce-scatter."""
    module = pt.MoE(H, I, E, K, max_tokens=64, shared_intermediate=IS if shared else 0, group=group,
                    dtype=torch.float32, **kwargs)
    module.load_state_dict(expert_state_dict(routed, shared))
    fully_shard(module, mesh=dp_mesh,
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    return module


def train_step(module, inputs):
    x, idx, weights, d_out = inputs
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    out = module(x, idx, weights)
    (out.float() * d_out.float()).sum().backward()
    return dict(out=out.detach(), d_x=x.grad, d_topk_weights=weights.grad)


def np64(t):
    return t.detach().double().numpy()


def check_step(name, got, ref64, refb, module, divisor):
    """Per-rank outputs against the reference; the gathered gradients of this EP rank's experts against
    the reference's sum over every rank, divided by ``divisor`` (FSDP2 averages over its mesh unless told
    otherwise)."""
    for key in ("out", "d_x", "d_topk_weights"):
        check_close(f"{name} {key}", np64(got[key]), np64(ref64[key]), np64(refb[key]))
    lo, hi = module.first_expert, module.first_expert + module.num_local_experts
    for param_name, e64, eb in zip(("w_gate", "w_up", "w_down"), ref64["d_routed"], refb["d_routed"]):
        param = getattr(module, param_name)
        if not param.requires_grad:
            assert param.grad is None, f"{name}: frozen {param_name} got a gradient"
            continue
        assert isinstance(param.grad, torch.distributed.tensor.DTensor), f"{name}: {param_name}.grad not sharded"
        assert param.grad.dtype == torch.float32, f"{name}: {param_name}.grad is {param.grad.dtype}"
        check_close(f"{name} d_{param_name}", np64(param.grad.full_tensor()), np64(e64[lo:hi]) / divisor,
                    np64(eb[lo:hi]) / divisor)
    if module.ws_gate is not None:
        # The reference differentiates a copy per rank; FSDP2's gradient is their mean.
        for j, param_name in enumerate(("ws_gate", "ws_up", "ws_down")):
            grads = [torch.from_numpy(np64(r)) for r in ref64["all_d_shared"][j]]
            gradsb = [torch.from_numpy(np64(r)) for r in refb["all_d_shared"][j]]
            check_close(f"{name} d_{param_name}", np64(getattr(module, param_name).grad.full_tensor()),
                        (sum(grads) / divisor).numpy(), (sum(gradsb) / divisor).numpy())


def with_shared_grads(refs):
    """Each rank's reference dict gains every rank's shared-expert gradients (all_d_shared[j][rank])."""
    if refs[0]["d_shared"] is None:
        return refs
    per_weight = [[r["d_shared"][j] for r in refs] for j in range(3)]
    for r in refs:
        r["all_d_shared"] = per_weight
    return refs


# -- the scenarios, run in every process ------------------------------------------------------------


def scenario_mesh(rank):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    try:
        pt.MoE(H, I, E, K, max_tokens=16, group=mesh)
        raise AssertionError("a 2-D mesh was accepted as the EP group")
    except pounce.PounceError as error:
        assert "argument 'group'" in str(error) and "mesh['ep']" in str(error), str(error)
    module = pt.MoE(H, I, E, K, max_tokens=16, group=mesh["ep"], init_seed=3)
    ep_rank = mesh["ep"].get_local_rank()
    assert (module.num_ranks, module.rank, module.num_local_experts) == (2, ep_rank, E // 2), module
    assert module.first_expert == ep_rank * (E // 2)
    assert f"experts.{module.first_expert}.gate_proj.weight" in module.state_dict()
    x = torch.zeros(4, H, dtype=torch.bfloat16)
    try:
        module(x, torch.zeros(4, K, dtype=torch.int64), torch.ones(4, K))
        raise AssertionError("EP across processes ran on the CPU backend")
    except pounce.PounceError as error:
        assert "GPUs only" in str(error), str(error)


def scenario_dp4_ep1(rank):
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp", "ep"))
    inputs, routed, shared = make_inputs(WORLD, 24, seed=11, shared=IS)
    module = sharded_module(mesh["ep"], mesh["dp"], routed, shared)
    assert module.w_gate.to_local().shape[0] == E // WORLD, module.w_gate.to_local().shape
    got = train_step(module, inputs[rank])
    ref64 = with_shared_grads(group_reference(inputs, routed, shared, torch.float64))
    refb = with_shared_grads(group_reference(inputs, routed, shared, torch.bfloat16))
    check_step(f"rank {rank}", got, ref64[rank], refb[rank], module, WORLD)

    # state_dict of the sharded layer: every expert whole, on every dp rank; load writes each shard.
    state = module.state_dict()
    assert torch.equal(state["experts.5.up_proj.weight"].float(), routed[1][5].float())
    changed = {key: value.float() + 1 for key, value in expert_state_dict(routed, shared).items()}
    module.load_state_dict(changed)
    assert torch.equal(module.w_down.full_tensor(), (routed[2].float() + 1))
    assert torch.equal(module.ws_up.full_tensor(), (shared[1].float() + 1))


def scenario_dp4_ep2(rank):
    """Each process is one data-parallel replica of an EP group of two CPU ranks (threads); EP rank t's
    experts are sharded over the four processes with a process group of its own."""
    num_ep = 2
    groups = pounce.Group.create_cpu(num_ep)
    dp_meshes = [DeviceMesh.from_group(dist.new_group(list(range(WORLD))), "cpu") for _ in range(num_ep)]
    inputs, routed, shared = make_inputs(WORLD * num_ep, 20, seed=12, shared=IS)

    def body(ep_rank):
        module = sharded_module(groups[ep_rank], dp_meshes[ep_rank], routed, None)
        module.w_up.requires_grad_(False)
        got = train_step(module, inputs[rank * num_ep + ep_rank])
        with_shared = sharded_module(groups[ep_rank], dp_meshes[ep_rank], routed, shared)
        try:
            train_step(with_shared, inputs[rank * num_ep + ep_rank])
            raise AssertionError("a shared expert with gradients ran under EP x FSDP2")
        except pounce.PounceError as error:
            assert "shared_intermediate=0" in str(error), str(error)
        return module, got

    results, errors = on_ranks(num_ep, body, timeout=60.0)
    raise_first(errors)
    ref64 = group_reference(inputs, routed, None, torch.float64)
    refb = group_reference(inputs, routed, None, torch.bfloat16)
    for ep_rank, (module, got) in enumerate(results):  # the same order in every process (collectives)
        r = rank * num_ep + ep_rank
        check_step(f"dp {rank} ep {ep_rank}", got, ref64[r], refb[r], module, WORLD)


def scenario_fp8(rank):
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp", "ep"))
    inputs, routed, _ = make_inputs(WORLD, 16, seed=13)
    module = sharded_module(mesh["ep"], mesh["dp"], routed, None, precision="fp8")
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    outs = []
    for _ in range(2):
        outs.append(train_step(module, inputs[rank])["out"])
        optimizer.step()
        optimizer.zero_grad()
    assert module.fp8_cache.quantizations == 2, module.fp8_cache
    assert not torch.equal(outs[0], outs[1]), "the second step ran on the first step's FP8 weights"

    main_grad_module = sharded_module(mesh["ep"], mesh["dp"], routed, None, accumulate_main_grad=True)
    try:
        train_step(main_grad_module, inputs[rank])
        raise AssertionError("accumulate_main_grad=True ran under FSDP2")
    except pounce.PounceError as error:
        assert "reduce_dtype" in str(error), str(error)


def _worker(rank, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A rank that fails leaves the others in a collective: the timeout ends them.
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=30))
    try:
        for name in SCENARIOS:
            try:
                globals()[f"scenario_{name}"](rank)
                queue.put((rank, name, None))
            except BaseException:  # noqa: BLE001 - reported to the test
                queue.put((rank, name, traceback.format_exc()))
            dist.barrier()
    finally:
        pt.free_workspaces()
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def outcomes():
    """{scenario: [None or failure text per rank]} from one spawn of WORLD processes."""
    import multiprocessing

    import torch.multiprocessing as mp

    # fork: the children start with torch imported (spawn re-imports it four times, most of a minute on a
    # loaded two-core machine); they run torch single-threaded, so no OpenMP pool crosses the fork.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    queue = mp.get_context(method).Queue()
    mp.start_processes(_worker, args=(_free_port(), queue), nprocs=WORLD, start_method=method, join=True)
    results = {name: [f"rank {r} did not report" for r in range(WORLD)] for name in SCENARIOS}
    while not queue.empty():
        rank, name, failure = queue.get()
        results[name][rank] = failure
    return results


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ep_fsdp2(outcomes, scenario):
    failures = [f"rank {r}:\n{text}" for r, text in enumerate(outcomes[scenario]) if text is not None]
    assert not failures, "\n".join(failures)
