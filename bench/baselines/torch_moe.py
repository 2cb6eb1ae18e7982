#!/usr/bin/env python3
"""The plain-PyTorch expert-parallel MoE layer that Pounce is measured against (docs/design.md §7).

This is the stack a user assembles today from stock PyTorch, written the way a competent user would:

  sort (token, slot) pairs by destination expert
  -> all_to_all_single of the per-expert counts, then .tolist() on the host   (the host sync)
  -> all_to_all_single of the token rows                                       (dispatch)
  -> regroup the received rows by local expert
  -> torch._grouped_mm gate and up, SwiGLU (or the GPT-OSS form), torch._grouped_mm down
  -> inverse regroup, all_to_all_single back                                   (combine)
  -> weighted sum over the k slots in fp32, plus the shared expert, cast to bf16.

Backward is autograd through all of it; the all-to-alls go through an autograd.Function whose
backward is the reverse all-to-all.

Importable: ``baseline_forward(...)`` is the layer (one rank's view; with no process group, or a
group of one rank, it runs without communication and can serve as a single-GPU reference).

Run as a script under torchrun for the benchmark or the ``--check`` self-test, e.g.

  torchrun --nproc-per-node=2 bench/baselines/torch_moe.py --check
  torchrun --nproc-per-node=2 bench/baselines/torch_moe.py --preset qwen3-30b-a3b,deepseek-v3 \
      --tokens 8192 --passes forward,forward_backward --iters 20 --json out.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

GPTOSS_ALPHA = 1.702

# Model presets (docs/design.md §5). "deepseek-v3-routed" drops the shared expert, to compare with
# measurements that count routed experts only.
PRESETS = {
    "qwen3-30b-a3b": dict(hidden=2048, intermediate=768, experts=128, topk=8,
                          shared_intermediate=0, activation="swiglu", limit=None),
    "deepseek-v3": dict(hidden=7168, intermediate=2048, experts=256, topk=8,
                        shared_intermediate=2048, activation="swiglu", limit=None),
    "deepseek-v3-routed": dict(hidden=7168, intermediate=2048, experts=256, topk=8,
                               shared_intermediate=0, activation="swiglu", limit=None),
    "gpt-oss-120b": dict(hidden=2880, intermediate=2880, experts=128, topk=4,
                         shared_intermediate=0, activation="gptoss", limit=7.0),
    "mixtral-8x7b": dict(hidden=4096, intermediate=14336, experts=8, topk=2,
                         shared_intermediate=0, activation="swiglu", limit=None),
}


# --------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------

def expert_activation(g, u, activation="swiglu", limit=None, alpha=GPTOSS_ALPHA):
    """SwiGLU ``silu(g) * u`` or GPT-OSS ``(u + 1) * g * sigmoid(alpha * g)``.

    With ``limit``: g = min(g, limit), u = clamp(u, -limit, limit) first (GPT-OSS uses limit 7).
    """
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    if activation == "swiglu":
        return F.silu(g) * u
    if activation == "gptoss":
        return (u + 1) * (g * torch.sigmoid(alpha * g))
    raise ValueError(f"activation must be 'swiglu' or 'gptoss', got {activation!r}")


class _AllToAll(torch.autograd.Function):
    """all_to_all_single on rows; backward sends the gradient rows back the way they came."""

    @staticmethod
    def forward(ctx, inp, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = inp.new_empty((sum(out_splits),) + tuple(inp.shape[1:]))
        dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_in = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), ctx.in_splits, ctx.out_splits,
                               group=ctx.group)
        return grad_in, None, None, None


def _group_size_rank(group):
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _route(topk_idx, num_experts, R, group):
    """Sort pairs by destination expert, exchange per-expert counts, and bring the splits to the host."""
    T, k = topk_idx.shape
    El = num_experts // R
    dev = topk_idx.device
    flat = topk_idx.reshape(-1).long()
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_experts))  # unused slots sort last
    order = torch.argsort(key, stable=True)
    # (scatter_add rather than bincount: CUDA bincount syncs with the host to size its output)
    send_counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(
        0, key, torch.ones_like(key))[:num_experts]                                  # [E]
    if R > 1:
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)               # [R*El]
    else:
        recv_counts = send_counts
    recv_counts = recv_counts.view(R, El)            # rows from source rank r for local expert e
    # The host synchronisation every all_to_all_single user pays: split sizes must be Python ints.
    host = torch.cat([send_counts.view(R, El).sum(1), recv_counts.sum(1)]).tolist()
    in_splits, out_splits = host[:R], host[R:]
    n_send, n_recv = sum(in_splits), sum(out_splits)

    pair_order = order[:n_send]                      # flat (token*k + slot) ids, by destination expert
    token_of_pair = torch.div(pair_order, k, rounding_mode="floor")
    # Received rows arrive [source rank][local expert]; regroup them [local expert][source rank].
    seg_expert = torch.arange(El, device=dev).repeat(R)
    row_expert = torch.repeat_interleave(seg_expert, recv_counts.reshape(-1), output_size=n_recv)
    group_order = torch.argsort(row_expert, stable=True)
    group_inverse = torch.empty_like(group_order)
    group_inverse[group_order] = torch.arange(n_recv, device=dev)
    offs = torch.cumsum(recv_counts.sum(0), 0, dtype=torch.int32)   # cumulative row ends, [El]
    return dict(pair_order=pair_order, token_of_pair=token_of_pair, group_order=group_order,
                group_inverse=group_inverse, offs=offs, in_splits=in_splits,
                out_splits=out_splits, n_recv=n_recv)


def _experts(xg, offs, w_gate, w_up, w_down, activation, limit, alpha, fused_gate_up):
    """Routed expert MLPs on rows grouped by local expert (offs = int32 cumulative row ends)."""
    H = w_down.shape[1]
    if xg.shape[0] == 0:
        # No rows at all: keep the weights in the graph so they get zero gradients.
        z = (w_gate.sum() + w_up.sum() + w_down.sum()) * 0
        return z.to(xg.dtype).expand(0, H)
    # nn.Linear layout [El, out, in] -> mat_b [El, in, out] as a transposed view (no copy).
    # torch._grouped_mm (sm90 CUTLASS path) needs 16-byte aligned strides (H, I multiples of 8)
    # and fewer than 1024 groups; group sizes themselves need no padding. offs[-1] equals the
    # row count, so no output row is left unwritten.
    if fused_gate_up:
        I = w_gate.shape[1]
        w13 = torch.cat([w_gate, w_up], dim=1)
        gu = torch._grouped_mm(xg, w13.transpose(-2, -1), offs=offs)
        g, u = gu[:, :I], gu[:, I:]
    else:
        g = torch._grouped_mm(xg, w_gate.transpose(-2, -1), offs=offs)
        u = torch._grouped_mm(xg, w_up.transpose(-2, -1), offs=offs)
    a = expert_activation(g, u, activation, limit, alpha)
    return torch._grouped_mm(a, w_down.transpose(-2, -1), offs=offs)


def shared_expert(x, ws_gate, ws_up, ws_down, activation="swiglu", limit=None, alpha=GPTOSS_ALPHA):
    return F.linear(expert_activation(F.linear(x, ws_gate), F.linear(x, ws_up), activation, limit,
                                      alpha), ws_down)


def baseline_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down,
                     ws_gate=None, ws_up=None, ws_down=None, *, group=None,
                     activation="swiglu", limit=None, alpha=GPTOSS_ALPHA, fused_gate_up=False):
    """Expert-parallel MoE forward on this rank; differentiable w.r.t. x, topk_weights and weights.

    x [T,H] bf16; topk_idx [T,k] int32/int64 global expert ids (-1 = unused slot);
    topk_weights [T,k] fp32 (used as given); w_gate/w_up [El,I,H], w_down [El,H,I] bf16 for the
    local experts (expert e lives on rank e // El); optional shared ws_gate/ws_up [Is,H],
    ws_down [H,Is]. ``group``: the EP process group (None = default group if initialised, else a
    single rank). Returns out [T,H] bf16.
    """
    R, _ = _group_size_rank(group)
    T, k = topk_idx.shape
    El, _, H = w_gate.shape
    E = El * R
    assert x.shape == (T, H), f"x must be [T={T}, H={H}], got {tuple(x.shape)}"
    assert topk_weights.shape == (T, k), f"topk_weights must be [{T}, {k}], got {tuple(topk_weights.shape)}"

    rt = _route(topk_idx, E, R, group)
    xs = x.index_select(0, rt["token_of_pair"])                                  # [n_send, H]
    xr = _AllToAll.apply(xs, rt["out_splits"], rt["in_splits"], group) if R > 1 else xs
    xg = xr.index_select(0, rt["group_order"])                                   # by local expert
    yg = _experts(xg, rt["offs"], w_gate, w_up, w_down, activation, limit, alpha, fused_gate_up)
    yr = yg.index_select(0, rt["group_inverse"])                                 # back to arrival order
    ys = _AllToAll.apply(yr, rt["in_splits"], rt["out_splits"], group) if R > 1 else yr
    y_pairs = ys.new_zeros(T * k, H).index_copy(0, rt["pair_order"], ys)         # [T*k, H] bf16
    # Weighted sum over slots in fp32 (unused slots hold zero rows).
    out = torch.bmm(topk_weights.float().unsqueeze(1), y_pairs.view(T, k, H).float()).squeeze(1)
    if ws_gate is not None and ws_gate.shape[0] > 0:
        out = out + shared_expert(x, ws_gate, ws_up, ws_down, activation, limit, alpha).float()
    return out.to(torch.bfloat16)


# --------------------------------------------------------------------------------------------
# fp32 reference for --check (whole EP group in one process, dense per slot)
# --------------------------------------------------------------------------------------------

def _bf16_values(t):
    """t rounded to bf16 values, with an identity (fp32) gradient."""
    return t + (t.to(torch.bfloat16).float() - t).detach()


def reference_forward_fp32(x, topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate=None,
                           ws_up=None, ws_down=None, activation="swiglu", limit=None,
                           alpha=GPTOSS_ALPHA, round_gu=True):
    """All tensors fp32, weights for ALL experts [E,...]. Loops over slots, dense over tokens.

    round_gu: take g and u at their bf16 values (the rounding point of docs/design.md §1) so a
    clamp `limit` masks the same elements as the bf16 layer does; gradients stay fp32. Without it
    an element within one bf16 ulp of the limit flips between zero and full gradient.
    """
    T, k = topk_idx.shape
    rnd = _bf16_values if round_gu else (lambda t: t)

    def act(g, u):
        return expert_activation(rnd(g), rnd(u), activation, limit, alpha)

    out = torch.zeros_like(x)
    for j in range(k):
        e = topk_idx[:, j].long()
        valid = (e >= 0).to(x.dtype).unsqueeze(1)
        ec = e.clamp(min=0)
        g = torch.einsum("th,tih->ti", x, w_gate[ec])
        u = torch.einsum("th,tih->ti", x, w_up[ec])
        a = act(g, u)
        y = torch.einsum("ti,thi->th", a, w_down[ec])
        out = out + valid * topk_weights[:, j:j + 1] * y
    if ws_gate is not None and ws_gate.shape[0] > 0:
        out = out + F.linear(act(F.linear(x, ws_gate), F.linear(x, ws_up)), ws_down)
    return out


def _rel_err(a, b):
    a, b = a.detach().float(), b.detach().float()
    denom = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / denom if denom > 0 else diff


def run_check(rank, R, group, device):
    """Compare forward and all gradients against the fp32 reference on small shapes."""
    H, I, k, El = 256, 128, 3, 4
    E = El * R
    configs = [
        dict(name="swiglu+shared", activation="swiglu", limit=None, Is=64, wscale=1.0, fused=False),
        dict(name="swiglu-limit0.5,fused", activation="swiglu", limit=0.5, Is=0, wscale=1.0,
             fused=True),
        dict(name="gptoss-limit7", activation="gptoss", limit=7.0, Is=96, wscale=4.0, fused=False),
    ]
    tokens = [61 + 16 * r for r in range(R)]        # unequal T per rank, not multiples of anything
    worst = 0.0
    for ci, cfg in enumerate(configs):
        gen = torch.Generator().manual_seed(1234 + ci)
        bf = torch.bfloat16
        sc = cfg["wscale"]
        Wg = (torch.randn(E, I, H, generator=gen) * sc / H ** 0.5).to(bf)
        Wu = (torch.randn(E, I, H, generator=gen) * sc / H ** 0.5).to(bf)
        Wd = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(bf)
        Is = cfg["Is"]
        Sg = (torch.randn(Is, H, generator=gen) * sc / H ** 0.5).to(bf)
        Su = (torch.randn(Is, H, generator=gen) * sc / H ** 0.5).to(bf)
        Sd = (torch.randn(H, Is, generator=gen) / max(Is, 1) ** 0.5).to(bf)
        xs, idxs, ws, douts = [], [], [], []
        for r in range(R):
            T = tokens[r]
            xs.append(torch.randn(T, H, generator=gen).to(bf))
            # distinct experts per token, never the last expert (so one expert stays empty)
            idx = torch.rand(T, E - 1, generator=gen).topk(k, dim=1).indices
            drop = torch.rand(T, k, generator=gen) < 0.15
            idx = torch.where(drop, torch.full_like(idx, -1), idx)
            idxs.append(idx)
            ws.append(torch.randn(T, k, generator=gen).softmax(-1))
            douts.append(torch.randn(T, H, generator=gen).to(bf))

        def leaf(t, dtype=None):
            return t.detach().to(device, dtype, copy=True).requires_grad_()

        # ---- the baseline on this rank
        sl = slice(rank * El, (rank + 1) * El)
        x, tw = leaf(xs[rank]), leaf(ws[rank])
        wg, wu, wd = leaf(Wg[sl]), leaf(Wu[sl]), leaf(Wd[sl])
        shared = [leaf(t) for t in (Sg, Su, Sd)] if Is else [None] * 3
        out = baseline_forward(x, idxs[rank].to(device), tw, wg, wu, wd, *shared, group=group,
                               activation=cfg["activation"], limit=cfg["limit"],
                               fused_gate_up=cfg["fused"])
        out.backward(douts[rank].to(device))

        # ---- fp32 reference of the whole group (every rank computes it, compares its own part)
        f32 = torch.float32
        rx = [leaf(t, f32) for t in xs]
        rw = [leaf(t, f32) for t in ws]
        rWg, rWu, rWd = (leaf(t, f32) for t in (Wg, Wu, Wd))
        rS = [[leaf(t, f32) for t in (Sg, Su, Sd)] if Is else [None] * 3 for _ in range(R)]
        loss = 0
        routs = []
        for r in range(R):
            o = reference_forward_fp32(rx[r], idxs[r].to(device), rw[r], rWg, rWu, rWd, *rS[r],
                                       activation=cfg["activation"], limit=cfg["limit"])
            routs.append(o)
            loss = loss + (o * douts[r].to(device, f32)).sum()
        loss.backward()

        errs = {
            "out": _rel_err(out, routs[rank]),
            "d_x": _rel_err(x.grad, rx[rank].grad),
            "d_topk_weights": _rel_err(tw.grad, rw[rank].grad),
            "d_w_gate": _rel_err(wg.grad, rWg.grad[sl]),
            "d_w_up": _rel_err(wu.grad, rWu.grad[sl]),
            "d_w_down": _rel_err(wd.grad, rWd.grad[sl]),
        }
        if Is:
            for name, mine, ref in zip(("d_ws_gate", "d_ws_up", "d_ws_down"), shared, rS[rank]):
                errs[name] = _rel_err(mine.grad, ref.grad)
        # the empty expert (global E-1, on the last rank) must get exactly zero gradients
        empty_ok = True
        if rank == R - 1:
            empty_ok = all(bool((t.grad[El - 1] == 0).all()) for t in (wg, wu, wd))
        e_t = torch.tensor([max(errs.values()), 0.0 if empty_ok else 1.0], device=device)
        if R > 1:
            dist.all_reduce(e_t, op=dist.ReduceOp.MAX, group=group)
        if rank == 0:
            detail = ", ".join(f"{n} {v:.2e}" for n, v in errs.items())
            print(f"[check] {cfg['name']:24s} R={R} T={tokens} H={H} I={I} E={E} k={k} Is={Is}: "
                  f"max rel err (all ranks) {e_t[0].item():.3e}; rank0: {detail}; "
                  f"empty expert grads zero: {e_t[1].item() == 0}", flush=True)
        worst = max(worst, e_t[0].item())
        assert e_t[0].item() < 2e-2, f"{cfg['name']}: max relative error {e_t[0].item():.3e} >= 2e-2"
        assert e_t[1].item() == 0, f"{cfg['name']}: the empty expert got nonzero gradients"
    if rank == 0:
        print(f"[check] PASSED (worst max relative error {worst:.3e} < 2e-2)", flush=True)


# --------------------------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------------------------

def _driver_version():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown"
    except Exception:
        return "unknown"


def _nccl_version():
    v = torch.cuda.nccl.version()
    if isinstance(v, int):      # older torch: 22809 -> 2.28.9
        v = (v // 10000, v // 100 % 100, v % 100)
    return ".".join(str(x) for x in v)


def _commit():
    env = os.environ.get("POUNCE_COMMIT")
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=here, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except Exception:
        pass
    return env or "unknown"


def _make_inputs(T, H, E, k, seed, device):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, generator=gen, device=device, dtype=torch.bfloat16)
    idx = torch.rand(T, E, generator=gen, device=device).topk(k, dim=1).indices   # distinct, uniform
    w = torch.randn(T, k, generator=gen, device=device).softmax(-1)
    dout = torch.randn(T, H, generator=gen, device=device, dtype=torch.bfloat16)
    return x, idx, w, dout


def _time_iterations(prep, run, nsets, warmup, iters, group, device):
    """Per-iteration CUDA-event times, maxed over ranks, and the wall-clock (Unix seconds) window of the timed
    iterations (pounce bench matches its GPU telemetry to it); ranks aligned before every iteration."""
    tiny = torch.zeros(1, device=device)
    for i in range(warmup):
        prep(i % nsets)
        run(i % nsets)
    torch.cuda.synchronize()
    window_start = time.time()
    events = []
    for i in range(iters):
        s = i % nsets
        prep(s)
        dist.all_reduce(tiny, group=group)
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run(s)
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    window = (window_start, time.time())
    t = torch.tensor([a.elapsed_time(b) for a, b in events], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist(), window


def rotation_sets(set_bytes, l2_bytes, min_sets=3, max_sets=256, max_bytes=2 << 30):
    """Input sets to rotate, by the rule of ``pounce bench`` (cli/bench.h): the fewest (at least
    ``min_sets``) that together exceed twice the L2, so no iteration finds its inputs' previous use in
    L2; at most ``max_sets`` and ``max_bytes`` in all, but never fewer than 2."""
    if set_bytes <= 0:
        return min_sets
    enough = max(min_sets, 2 * l2_bytes // set_bytes + 1)
    affordable = min(max_sets, max_bytes // set_bytes)
    return max(2, min(enough, affordable))


def progress(rank, text):
    """A progress line on rank 0, at once (long setups never sit silent)."""
    if rank == 0:
        print(f"[baseline {time.strftime('%H:%M:%S')}] {text}", flush=True)


def pass_record(impl, pss, times, window, flops, preset, cfg, T, R, nsets, args, meta, **extra):
    """One record of a timed pass (the baseline's or a peer's), the keys of docs/design.md §7."""
    med = statistics.median(times)
    # the later half of the runs, as `pounce bench`'s late_median_ms (cli/parallel.h)
    late = statistics.median(times[len(times) // 2:])
    return dict(impl=impl, **{"pass": pss}, preset=preset, ranks=R, tokens_per_rank=T,
                precision="bf16", median_ms=round(med, 4), tflops=round(flops / (med * 1e-3) / 1e12, 2),
                late_median_ms=round(late, 4), times_ms=[round(t, 4) for t in times],
                min_ms=round(min(times), 4), max_ms=round(max(times), 4),
                flops_per_rank=flops, timed_window_unix_s=[round(window[0], 3), round(window[1], 3)],
                hidden=cfg["hidden"], intermediate=cfg["intermediate"], experts=cfg["experts"],
                topk=cfg["topk"], shared_intermediate=cfg["shared_intermediate"],
                activation=cfg["activation"], limit=cfg["limit"],
                iters=args.iters, warmup=args.warmup, input_sets=nsets, **extra, **meta)


def not_run_record(impl, pss, reason, unsupported, preset, cfg, T, R, meta, **extra):
    """The record of a peer that did not run: why (and whether its design cannot: ``unsupported``)."""
    return dict(impl=impl, **{"pass": pss}, preset=preset, ranks=R, tokens_per_rank=T, precision="bf16",
                median_ms=None, tflops=None, error=reason, unsupported=bool(unsupported),
                hidden=cfg["hidden"], intermediate=cfg["intermediate"], experts=cfg["experts"],
                topk=cfg["topk"], shared_intermediate=cfg["shared_intermediate"],
                activation=cfg["activation"], limit=cfg["limit"], **extra, **meta)


def _print_record(rank, rec):
    if rank == 0 and isinstance(rec.get("median_ms"), (int, float)):
        print(f"  {rec['impl']:12s} {rec['preset']:20s} T={rec['tokens_per_rank']:6d} {rec['pass']:17s} median "
              f"{rec['median_ms']:9.3f} ms  {rec['tflops']:7.1f} TFLOP/s  (min {rec['min_ms']:.3f}, max "
              f"{rec['max_ms']:.3f})", flush=True)
    elif rank == 0:
        print(f"  {rec['impl']:12s} {rec['preset']:20s} T={rec['tokens_per_rank']:6d} {rec['pass']:17s} not run: "
              f"{rec['error']}", flush=True)


def bench_config(preset, cfg, T, passes, args, rank, R, group, device, meta, peer_names=()):
    H, I, E, k = cfg["hidden"], cfg["intermediate"], cfg["experts"], cfg["topk"]
    Is, act, limit = cfg["shared_intermediate"], cfg["activation"], cfg["limit"]
    assert E % R == 0, f"{preset}: experts {E} not divisible by ranks {R}"
    El = E // R
    bf = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(args.seed + 7919 * rank)

    def param(*shape, fan_in):
        t = torch.randn(*shape, generator=gen, device=device, dtype=bf)
        return t.mul_(fan_in ** -0.5).requires_grad_()

    progress(rank, f"{preset} T={T}: generating weights ({3 * El * I * H * 2 / 2**30:.1f} GiB per rank)")
    w_gate, w_up, w_down = param(El, I, H, fan_in=H), param(El, I, H, fan_in=H), param(El, H, I, fan_in=I)
    shared = [param(Is, H, fan_in=H), param(Is, H, fan_in=H), param(H, Is, fan_in=Is)] if Is else []
    params = [w_gate, w_up, w_down] + shared
    nsets = args.sets
    if nsets == 0:
        # x and d_out [T,H] bf16, topk_idx [T,k] int64, topk_weights [T,k] fp32
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 60 << 20
        nsets = rotation_sets(2 * T * H * 2 + T * k * (8 + 4), l2)
    progress(rank, f"{preset} T={T}: generating {nsets} input sets")
    sets = [_make_inputs(T, H, E, k, args.seed + 1000 * rank + s + 1, device) for s in range(nsets)]
    sets = [(x.requires_grad_(), idx, w.requires_grad_(), d) for x, idx, w, d in sets]

    # useful work on this rank (pairs actually present), and rows that cross to another rank
    pairs = sum(int((idx >= 0).sum()) for _, idx, _, _ in sets) / len(sets)
    remote = sum(int(((idx >= 0) & (idx // El != rank)).sum()) for _, idx, _, _ in sets) / len(sets)
    flops_fwd = 6.0 * (pairs * H * I + T * H * Is)
    stat = torch.tensor([flops_fwd, remote], device=device, dtype=torch.float64)
    dist.all_reduce(stat, group=group)
    flops_fwd, remote = (stat / R).tolist()
    a2a_bytes_fwd = 2 * remote * H * 2       # dispatch + combine rows, bf16

    def fwd(s):
        x, idx, w, _ = sets[s]
        return baseline_forward(x, idx, w, w_gate, w_up, w_down, *shared, group=group,
                                activation=act, limit=limit, fused_gate_up=args.fused_gate_up)

    def zero_grads(s):
        for p in params + [sets[s][0], sets[s][2]]:
            p.grad = None

    def run_fwd(s):
        fwd(s)

    def run_fwd_bwd(s):
        fwd(s).backward(sets[s][3])

    records = []
    for pss in passes:
        progress(rank, f"{preset} T={T}: baseline {pss}, {args.warmup} warm-up + {args.iters} timed runs")
        if pss == "forward":
            times, window = _time_iterations(zero_grads, run_fwd, nsets, args.warmup, args.iters, group, device)
            flops, a2a = flops_fwd, a2a_bytes_fwd
        elif pss == "forward_backward":
            times, window = _time_iterations(zero_grads, run_fwd_bwd, nsets, args.warmup, args.iters, group,
                                             device)
            flops, a2a = 3 * flops_fwd, 2 * a2a_bytes_fwd
        else:
            raise ValueError(f"--passes: unknown pass {pss!r} (forward | forward_backward)")
        med = statistics.median(times)
        rec = pass_record("baseline", pss, times, window, flops, preset, cfg, T, R, nsets, args, meta,
                          a2a_gbps=round(a2a / (med * 1e-3) / 1e9, 1), fused_gate_up=bool(args.fused_gate_up),
                          peer="PyTorch all_to_all_single + torch._grouped_mm (bench/baselines/torch_moe.py)",
                          peer_version=f"torch {torch.__version__}")
        records.append(rec)
        _print_record(rank, rec)

    if peer_names:
        weights = dict(gate=w_gate, up=w_up, down=w_down)
        with torch.no_grad():
            reference = fwd(0).detach()  # set 0's baseline output: each peer's output is checked against it
        zero_grads(0)
        for name in peer_names:
            records += bench_peer(name, preset, cfg, T, passes, args, rank, R, group, device, meta, weights,
                                  shared, sets, nsets, flops_fwd, params, reference)
            torch.cuda.empty_cache()
    return records


def bench_peer(name, preset, cfg, T, passes, args, rank, R, group, device, meta, weights, shared, sets, nsets,
               flops_fwd, params, reference):
    """Records of one peer (bench/baselines/peers.py) on the baseline's weights and input sets: timed, or
    why not."""
    import peers

    def not_run(reason, unsupported, **extra):
        fields = dict(dict(peer=peers.DESCRIPTIONS[name]), **extra)
        recs = [not_run_record(name, pss, reason, unsupported, preset, cfg, T, R, meta, **fields) for pss in passes]
        for rec in recs:
            _print_record(rank, rec)
        return recs

    reason = peers.unsupported_reason(name, cfg, R)
    if reason:
        return not_run(reason, True)
    version, missing = peers.availability(name)
    if missing:
        return not_run(missing, False)
    progress(rank, f"{preset} T={T}: {name} ({version}): setting up"
             + (" (its first call autotunes; the cache keeps it)" if name == "liger" else ""))
    described = dict(peer=peers.DESCRIPTIONS[name], peer_version=version)
    try:
        if name == "floor":
            run, grads_of, leaves, notes = peers.build_floor(weights, sets, cfg, group, R, shared)
        else:
            builder = peers.build_liger if name == "liger" else peers.build_transformers
            one, leaves, notes = builder(weights, sets, cfg)
            run = lambda s: (one(s),)  # noqa: E731

            def grads_of(s):
                return (sets[s][3],)
    except Exception as error:  # noqa: BLE001 - a peer that fails to set up is reported, the sweep goes on
        return not_run(f"{name} failed to set up: {type(error).__name__}: {error}", False, **described)
    described["peer_notes"] = notes

    check = None
    try:
        if name != "floor":
            with torch.no_grad():
                check = _rel_err(run(0)[0], reference)
            check_t = torch.tensor([check], device=device, dtype=torch.float64)
            dist.all_reduce(check_t, op=dist.ReduceOp.MAX, group=group)
            check = check_t.item()
            if not check < 2e-2:
                return not_run(f"{name}'s output differs from the baseline's: max relative error {check:.3e} "
                               f">= 2e-2", False, **described)
    except Exception as error:  # noqa: BLE001
        return not_run(f"{name} failed: {type(error).__name__}: {error}", False, **described)

    every_leaf = params + leaves + [t for st in sets for t in (st[0], st[2])]

    def zero_grads(s):
        for p in every_leaf:
            p.grad = None

    def run_fwd(s):
        run(s)

    def run_fwd_bwd(s):
        torch.autograd.backward(run(s), grads_of(s))

    recs = []
    for pss in passes:
        progress(rank, f"{preset} T={T}: {name} {pss}, {args.warmup} warm-up + {args.iters} timed runs")
        try:
            timed = run_fwd if pss == "forward" else run_fwd_bwd
            times, window = _time_iterations(zero_grads, timed, nsets, args.warmup, args.iters, group, device)
        except Exception as error:  # noqa: BLE001 - e.g. out of memory in Triton's autotune
            recs += not_run(f"{name} {pss} failed: {type(error).__name__}: {error}", False, **described)
            zero_grads(0)
            continue
        flops = flops_fwd if pss == "forward" else 3 * flops_fwd
        rec = pass_record(name, pss, times, window, flops, preset, cfg, T, R, nsets, args, meta,
                          check_vs_baseline_max_rel_err=check, **described)
        recs.append(rec)
        _print_record(rank, rec)
    zero_grads(0)
    return recs


def _parse_args(argv=None):
    p = argparse.ArgumentParser(description="PyTorch expert-parallel MoE baseline (run under torchrun)")
    p.add_argument("--preset", default="qwen3-30b-a3b",
                   help="comma list of: " + ", ".join(PRESETS) + ", custom")
    p.add_argument("--tokens", default="8192", help="tokens per rank, comma list")
    p.add_argument("--passes", default="forward,forward_backward", help="forward,forward_backward")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--sets", type=int, default=4,
                   help="input sets rotated so L2 does not hold them (>= 3; 0 = enough to exceed twice "
                        "the L2, as pounce bench chooses)")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--json", default=None, help="write the records (a JSON list) here")
    p.add_argument("--check", action="store_true", help="correctness self-check against an fp32 reference")
    p.add_argument("--fused-gate-up", action="store_true",
                   help="one [2I] grouped GEMM for gate and up (concatenates the weights every call)")
    # custom shape
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--topk", type=int)
    p.add_argument("--shared-intermediate", type=int, default=0)
    p.add_argument("--activation", choices=["swiglu", "gptoss"], default="swiglu")
    p.add_argument("--limit", type=float, default=None)
    p.add_argument("--peers", default="",
                   help="comma list of peers measured after the baseline on its inputs (bench/baselines/peers.py):"
                        " liger, transformers, floor, or all")
    args = p.parse_args(argv)
    if args.sets != 0 and args.sets < 3:
        p.error("--sets must be >= 3, or 0 for as many as exceed twice the L2")
    return args


def custom_spec_config(name):
    """``custom:H:I:E:k[:Is]`` (``pounce bench``'s custom shapes, cli/bench.h: SwiGLU, no clamp) -> its config."""
    fields = name.split(":")[1:]
    if len(fields) not in (4, 5) or not all(f.isdigit() for f in fields):
        raise SystemExit(f"--preset {name}: write custom:H:I:E:k or custom:H:I:E:k:Is")
    H, I, E, k = (int(f) for f in fields[:4])
    return dict(hidden=H, intermediate=I, experts=E, topk=k, shared_intermediate=int(fields[4]) if len(fields) == 5
                else 0, activation="swiglu", limit=None)


def _preset_config(name, args):
    if name.startswith("custom:"):
        return custom_spec_config(name)
    if name == "custom":
        missing = [o for o in ("hidden", "intermediate", "experts", "topk") if getattr(args, o) is None]
        if missing:
            raise SystemExit("--preset custom needs " + ", ".join("--" + m for m in missing))
        return dict(hidden=args.hidden, intermediate=args.intermediate, experts=args.experts,
                    topk=args.topk, shared_intermediate=args.shared_intermediate,
                    activation=args.activation, limit=args.limit)
    if name not in PRESETS:
        raise SystemExit(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}, custom, custom:H:I:E:k[:Is]")
    return dict(PRESETS[name])


def _write_records(records, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".part", "w") as f:
        json.dump(records, f, indent=1)
    os.replace(path + ".part", path)


def main(argv=None):
    args = _parse_args(argv)
    if "RANK" in os.environ:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
            dist.init_process_group("nccl", device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo")
        group = dist.group.WORLD
        R, rank = dist.get_world_size(), dist.get_rank()
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        group, R, rank = None, 1, 0

    try:
        if args.check:
            run_check(rank, R, group, device)
            return
        if device.type != "cuda":
            raise SystemExit("the benchmark needs CUDA GPUs")
        if group is None:
            # benchmark timing uses collectives: run a one-rank group
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29511")
            dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
            group = dist.group.WORLD
        meta = dict(gpu=torch.cuda.get_device_name(device), driver=_driver_version(),
                    cuda=torch.version.cuda,
                    nccl=_nccl_version(),
                    torch=torch.__version__, commit=_commit(),
                    command=f"torchrun --nproc-per-node={R} " + " ".join(sys.argv),
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        import peers

        peer_names = peers.parse_peers(args.peers)
        presets = [s.strip() for s in args.preset.split(",") if s.strip()]
        tokens = [int(s) for s in args.tokens.split(",") if s.strip()]
        passes = [s.strip() for s in args.passes.split(",") if s.strip()]
        if rank == 0:
            print(f"baseline: {R} x {meta['gpu']}, torch {torch.__version__}, CUDA {meta['cuda']}, "
                  f"NCCL {meta['nccl']}, driver {meta['driver']}; median of {args.iters} iterations "
                  f"(per-iteration max over ranks), "
                  f"{args.sets or 'enough (> 2 x L2)'} rotated input sets"
                  + (f"; then on the same inputs: {', '.join(peer_names)}" if peer_names else ""), flush=True)
        records = []
        configs = [(name, _preset_config(name, args), T) for name in presets for T in tokens]
        for n, (name, cfg, T) in enumerate(configs):
            progress(rank, f"configuration {n + 1}/{len(configs)}: {name}, {T} tokens per rank")
            records += bench_config(name, cfg, T, passes, args, rank, R, group, device, meta, peer_names)
            torch.cuda.empty_cache()
            if rank == 0 and args.json:  # after every configuration: a later crash keeps what was measured
                _write_records(records, args.json)
        if rank == 0:
            print()
            print("| impl | preset | tokens/rank | pass | median ms | TFLOP/s |")
            print("|---|---|---|---|---|---|")
            for r in records:
                if isinstance(r.get("median_ms"), (int, float)):
                    print(f"| {r['impl']} | {r['preset']} | {r['tokens_per_rank']} | {r['pass']} | "
                          f"{r['median_ms']:.3f} | {r['tflops']:.1f} |")
                else:
                    print(f"| {r['impl']} | {r['preset']} | {r['tokens_per_rank']} | {r['pass']} | - | - |")
            if args.json:
                _write_records(records, args.json)
                print(f"wrote {len(records)} records to {args.json}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
