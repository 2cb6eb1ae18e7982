#!/usr/bin/env python3
"""Trains a small MoE transformer twice, with pounce.torch.MoE and with the plain-PyTorch baseline layer
(bench/baselines/torch_moe.py: all_to_all_single + torch._grouped_mm), from the same initialisation on
the same synthetic data, and writes both loss curves (JSON, and a PNG when matplotlib is installed).

    torchrun --nproc-per-node=2 examples/train_moe.py --steps 300 --out examples/out

``--precision fp8`` adds a third run, ``pounce.torch.MoE(..., precision="fp8")`` (block-scaled FP8 routed
experts, docs/design.md §1; the fp32 master weights re-quantized after each optimizer step), from the same
initialisation on the same data, and reports its final loss against the BF16 Pounce run's (the target: within
1 %); all curves go in one chart.

Expert parallelism over every rank (each holds experts/ranks experts) and data parallelism for the
rest of the model. Data: token sequences from a fixed random sparse bigram process (each token is
followed by one of 4 tokens), so the loss falls from ln(vocab) towards that process's entropy.
``--device cpu`` runs both on one CPU process (pounce's CPU backend) at tiny sizes: a smoke test.

Model: embedding, ``--layers`` x (RMSNorm, causal attention, RMSNorm, top-k router + MoE), RMSNorm, LM
head; fp32 master weights, bf16 compute (autocast; the MoE layers run in bf16 and hand fp32 gradients
to the fp32 expert weights).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import pounce
import pounce.torch as pt

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench" / "baselines"))
sys.path.insert(0, str(HERE))
from torch_moe import baseline_forward  # noqa: E402


class BaselineMoE(pt.MoE):
    """The same parameters (and per-expert state_dict) as pounce.torch.MoE, computed by the baseline."""

    def forward(self, x, topk_idx, topk_weights):
        shape = x.shape
        bf16 = torch.bfloat16
        shared = (self.ws_gate.to(bf16), self.ws_up.to(bf16), self.ws_down.to(bf16)) if self.ws_gate is not None \
            else (None, None, None)
        out = baseline_forward(x.reshape(-1, self.hidden).to(bf16), topk_idx.reshape(-1, self.num_topk),
                               topk_weights.reshape(-1, self.num_topk).float(), self.w_gate.to(bf16),
                               self.w_up.to(bf16), self.w_down.to(bf16), *shared,
                               group=dist.group.WORLD if dist.is_initialized() else None)
        return out.view(shape).to(x.dtype)


class Block(nn.Module):
    def __init__(self, args, moe_class):
        super().__init__()
        H = args.hidden
        self.heads = args.heads
        self.norm1 = nn.RMSNorm(H)
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.proj = nn.Linear(H, H, bias=False)
        self.norm2 = nn.RMSNorm(H)
        self.router = nn.Linear(H, args.experts, bias=False)
        self.topk = args.topk
        self.moe = moe_class(H, args.intermediate, args.experts, args.topk, max_tokens=args.batch * args.seq,
                             shared_intermediate=args.shared_intermediate, dtype=torch.float32, device=args.device,
                             init_seed=args.seed)

    def forward(self, h):
        B, S, H = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(B, S, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(attn.transpose(1, 2).reshape(B, S, H))
        x = self.norm2(h)
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, idx = probs.topk(self.topk, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        # Switch-style load balance: fraction of pairs routed to each expert times its mean probability.
        counts = torch.zeros(probs.shape[-1], device=h.device).scatter_add_(0, idx.flatten(),
                                                                          torch.ones(idx.numel(), device=h.device))
        aux = probs.shape[-1] * (counts / idx.numel() * probs.mean((0, 1))).sum()
        return h + self.moe(x, idx, weights), aux


class Model(nn.Module):
    def __init__(self, args, moe_class):
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.hidden)
        self.blocks = nn.ModuleList(Block(args, moe_class) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.hidden)
        self.head = nn.Linear(args.hidden, args.vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        aux = 0.0
        for block in self.blocks:
            h, block_aux = block(h)
            aux = aux + block_aux
        return self.head(self.norm(h)), aux / len(self.blocks)


def bigram_table(vocab, seed, device):
    gen = torch.Generator().manual_seed(seed)
    successors = torch.stack([torch.randperm(vocab, generator=gen)[:4] for _ in range(vocab)])
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    return successors.to(device), probs.to(device)


def batch(table, args, step, rank, device):
    successors, probs = table
    gen = torch.Generator(device=device).manual_seed(args.seed * 7919 + step * 131 + rank)
    tokens = torch.empty(args.batch, args.seq + 1, dtype=torch.int64, device=device)
    tokens[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=gen, device=device)
    choice = torch.multinomial(probs.expand(args.batch * args.seq, 4), 1, generator=gen).view(args.batch, args.seq)
    for s in range(args.seq):
        tokens[:, s + 1] = successors[tokens[:, s], choice[:, s]]
    return tokens[:, :-1], tokens[:, 1:]


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_expert_param(name):
    return ".moe.w_" in name  # routed experts: each rank owns its own; shared expert and the rest are replicas


def train(args, moe_class, label, rank, num_ranks, device):
    torch.manual_seed(args.seed)  # the same dense initialisation for both models
    model = Model(args, moe_class).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    table = bigram_table(args.vocab, args.seed, device)
    losses, times = [], []
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
        inputs, targets = batch(table, args, step, rank, device)
        synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits, aux = model(inputs)
        loss = F.cross_entropy(logits.float().view(-1, args.vocab), targets.reshape(-1))
        (loss + args.aux_weight * aux).backward()
        # The objective is the mean over ranks: replicas average their gradients; the routed experts
        # already hold every rank's contribution (through the all-to-all), so they are divided by R.
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            if is_expert_param(name):
                p.grad.div_(num_ranks)
            elif num_ranks > 1:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - start)
        mean_loss = loss.detach().clone()
        if num_ranks > 1:
            dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        losses.append(mean_loss.item())
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"[{label}] step {step:4d} loss {losses[-1]:.4f}", flush=True)
    return dict(label=label, loss=losses, final_loss=sum(losses[-50:]) / len(losses[-50:]),
                median_step_ms=1e3 * sorted(times[5:] or times)[len(times[5:] or times) // 2])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--shared-intermediate", type=int, default=0)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--aux-weight", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--out", default="examples/out", help="folder for train_moe.json / train_moe.png")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp8"],
                        help="fp8: also train with FP8 routed experts and compare with the BF16 Pounce run")
    parser.add_argument("--fp8-tolerance", type=float, default=0.01,
                        help="largest relative difference of the FP8 run's final loss from BF16's (exit 1 past it)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: one rank on pounce's CPU backend (the exact reference), a smoke test at tiny sizes")
    args = parser.parse_args(argv)

    num_ranks = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.device == "cpu":
        if num_ranks > 1:
            sys.exit("--device cpu runs one process (the CPU backend's ranks are threads of one process)")
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available() or not pounce.build_info()["cuda"]:
            sys.exit("train_moe.py needs CUDA GPUs and pounce built with CUDA (pip install . where nvcc is "
                     "found), or --device cpu")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        if num_ranks > 1:
            dist.init_process_group("nccl", device_id=device)

    runs = {
        "pounce": train(args, pt.MoE, "pounce", rank, num_ranks, device),
        "baseline": train(args, BaselineMoE, "PyTorch baseline", rank, num_ranks, device),
    }
    if args.precision == "fp8":
        runs["pounce_fp8"] = train(args, functools.partial(pt.MoE, precision="fp8"), "pounce FP8", rank,
                                   num_ranks, device)
    pt.free_workspaces()
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        diffs = [abs(a - b) for a, b in zip(runs["pounce"]["loss"], runs["baseline"]["loss"])]
        run = dict(
            config=dict(vars(args), ranks=num_ranks, tokens_per_rank=args.batch * args.seq,
                        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        torch=torch.__version__,
                        pounce=pounce.build_info()),
            steps=list(range(args.steps)),
            max_abs_loss_diff=max(diffs),
            mean_abs_loss_diff_last_50=sum(diffs[-50:]) / len(diffs[-50:]),
            entropy_floor=-sum(p * math.log(p) for p in (0.55, 0.25, 0.15, 0.05)),
            **runs,
        )
        fp8_ok = True
        if "pounce_fp8" in runs:
            bf16_final, fp8_final = runs["pounce"]["final_loss"], runs["pounce_fp8"]["final_loss"]
            run["fp8_final_loss_rel_diff"] = abs(fp8_final - bf16_final) / bf16_final
            run["fp8_tolerance"] = args.fp8_tolerance
            fp8_ok = run["fp8_final_loss_rel_diff"] <= args.fp8_tolerance
        with open(out / "train_moe.json", "w") as f:
            json.dump(run, f, indent=1)
        print(f"final loss (mean of last 50 steps): pounce {runs['pounce']['final_loss']:.4f}, "
              f"baseline {runs['baseline']['final_loss']:.4f}; max |diff| {run['max_abs_loss_diff']:.4f}; "
              f"median step pounce {runs['pounce']['median_step_ms']:.1f} ms, "
              f"baseline {runs['baseline']['median_step_ms']:.1f} ms; wrote {out / 'train_moe.json'}")
        if "pounce_fp8" in runs:
            print(f"fp8: final loss {runs['pounce_fp8']['final_loss']:.4f} against bf16 "
                  f"{runs['pounce']['final_loss']:.4f}: relative difference {run['fp8_final_loss_rel_diff']:.4%} "
                  f"(tolerance {args.fp8_tolerance:.2%}): {'PASS' if fp8_ok else 'FAIL'}; median step "
                  f"{runs['pounce_fp8']['median_step_ms']:.1f} ms")
        try:
            from plot_loss import plot

            plot(run, str(out / "train_moe.png"))
            print(f"wrote {out / 'train_moe.png'}")
        except ImportError:
            print("matplotlib not installed: python examples/plot_loss.py", out / "train_moe.json")
    if num_ranks > 1:
        dist.destroy_process_group()
    if rank == 0 and "pounce_fp8" in runs and not fp8_ok:
        sys.exit(1)
    return runs


if __name__ == "__main__":
    main()
