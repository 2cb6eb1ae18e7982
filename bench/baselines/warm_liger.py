#!/usr/bin/env python3
"""Compiles every autotune candidate of Liger's fused MoE kernels for some shapes, in parallel processes, into
Triton's on-disk cache, so that the autotune proper (in ``pounce bench --peers liger``) only times them.

Why: Liger's seven autotuned kernels hold 16-40 candidate configs each and Triton's autotuner compiles them one
after another in the calling process: the first forward+backward of a new (H, I) spends about 3 minutes
compiling on one H200 machine (docs/benchmarks.md). Each worker here takes every N-th candidate of every kernel
and runs one forward+backward, so N workers compile all candidates in about 1/N of that time on N cores. The
workers write no autotune results (TRITON_CACHE_AUTOTUNING is off in them and their candidate lists differ
from the real ones, so their results could not be read back anyway): the choice of config is made later by
Liger's unmodified autotuner, timing every candidate on the benchmark's inputs, in a process of its own, and
only its compile step hits the cache.

Compile keys depend on H, I, k and the strides, not on E or the token count (Triton specialises integer
arguments only on divisibility by 16), so the workers use few experts and tokens and little memory.

  python3 bench/baselines/warm_liger.py --preset custom:4096:1536:128:8,qwen3-30b-a3b --workers 16

Set TRITON_CACHE_DIR to the cache the benchmark will use (Triton's default, ~/.triton/cache, otherwise).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# A worker's token count and expert cap: multiples of 16, so its integer arguments specialise as the
# benchmark's (8192 tokens) do.
WORKER_TOKENS = 1024
WORKER_EXPERTS = 16


def _shapes(text):
    from torch_moe import _preset_config  # noqa: PLC0415 - torch is imported only where the work runs
    from peers import unsupported_reason  # noqa: PLC0415

    shapes = []
    for name in [s for s in text.split(",") if s]:
        cfg = _preset_config(name, None)
        reason = unsupported_reason("liger", cfg, 1)
        if reason:
            print(f"warm_liger: {name}: skipped: {reason}", flush=True)
            continue
        shapes.append((name, cfg["hidden"], cfg["intermediate"], cfg["experts"], cfg["topk"]))
    return shapes


def _autotuned_kernels():
    from liger_kernel.ops import fused_moe_kernels  # noqa: PLC0415
    from triton.runtime.autotuner import Autotuner  # noqa: PLC0415

    return [getattr(fused_moe_kernels, n) for n in sorted(dir(fused_moe_kernels))
            if isinstance(getattr(fused_moe_kernels, n), Autotuner)]


def worker(index, count, shapes):
    """Compiles candidates index, index + count, ... of every autotuned kernel for each shape."""
    import torch  # noqa: PLC0415
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction  # noqa: PLC0415

    for kernel in _autotuned_kernels():
        kernel.configs = kernel.configs[index::count] or kernel.configs[:1]
    generator = torch.Generator(device="cuda").manual_seed(index)
    for _, hidden, inter, experts, topk in shapes:
        experts = min(experts, WORKER_EXPERTS)
        def normal(*shape):
            return (torch.randn(*shape, device="cuda", generator=generator) * 0.05).to(torch.bfloat16)
        x = normal(WORKER_TOKENS, hidden).requires_grad_()
        gate_up = normal(experts, 2 * inter, hidden).requires_grad_()
        down = normal(experts, hidden, inter).requires_grad_()
        ids = torch.rand(WORKER_TOKENS, experts, device="cuda", generator=generator).argsort(1)[:, :topk]
        weights = torch.softmax(torch.randn(WORKER_TOKENS, topk, device="cuda", generator=generator), dim=1)
        out = LigerFusedMoEFunction.apply(x, gate_up, down, ids.to(torch.int32).contiguous(), weights)
        out.float().square().mean().backward()
        torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, help="comma-separated presets or custom:H:I:E:k shapes")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallel processes (cores)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    shapes = _shapes(args.preset)
    if args.worker is not None:
        worker(args.worker, args.workers, shapes)
        return 0
    if not shapes:
        print("warm_liger: no shape Liger can run: nothing to compile", flush=True)
        return 0
    env = dict(os.environ, TRITON_CACHE_AUTOTUNING="0")
    start = time.monotonic()
    print(f"warm_liger: compiling Liger's autotune candidates for {', '.join(s[0] for s in shapes)} in "
          f"{args.workers} processes (cache {os.environ.get('TRITON_CACHE_DIR', '~/.triton/cache')})", flush=True)
    procs = [subprocess.Popen([sys.executable, __file__, "--preset", args.preset, "--workers", str(args.workers),
                               "--worker", str(i)], env=env) for i in range(args.workers)]
    failed = [i for i, p in enumerate(procs) if p.wait() != 0]
    print(f"warm_liger: done in {time.monotonic() - start:.0f} s"
          + (f"; workers {failed} failed (their candidates compile in the autotune instead)" if failed else ""),
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
