#!/usr/bin/env python3
"""Trains one Hugging Face transformers MoE model once per experts implementation (``pounce``, transformers'
``grouped_mm``, optionally ``eager``) from the same initial weights on the same data with AdamW, and
writes both loss curves and step times (JSON, and a PNG when matplotlib is installed).

    python examples/hf_finetune.py --device cpu      # tiny random-init Qwen3-MoE, 100 steps, seconds
    python examples/hf_finetune.py --dims qwen3-30b-a3b --layers 4 --batch 8 --seq 1024 --steps 300 --out examples/out

The model is built from a config (random init, nothing downloaded): ``--dims`` picks a family and its
layer dimensions (``tiny``: a few-second CPU run; ``qwen3-30b-a3b``, ``olmoe-1b-7b``, ``gpt-oss-20b``: the
named model's layers, hidden, expert intermediate, experts, top-k and attention heads), the size options
override single fields and ``--model-config KEY=VALUE`` any other field of the config. The vocabulary is
the toy language's (``--vocab``), not the named model's: embedding and LM head are no layer dimension, and
a 150k-token head would be more than half of the step's FLOPs, the same for every implementation.

Data: token sequences from a fixed random sparse bigram process (every token is followed by one of 4
tokens, with probabilities 0.55/0.25/0.15/0.05), drawn from ``--seed`` and the step, so the loss falls
from ln(vocab) towards that process's entropy (1.11 nats). Every implementation sees the same batches.

Precision: the model's parameters are ``--dtype`` (bf16 on GPUs: transformers' grouped_mm runs bf16
only; fp32 on the CPU) with AdamW on them, values rounded to bf16 at the start so that every
implementation starts from the weights pounce reads. Without ``--device`` it runs on the GPU when there
is one. A step is forward, backward, gradient clipping and optimizer step, timed with the device
synchronised at both ends; the median is taken over the steps after ``--warmup``. Pounce's CPU backend
is its exact reference: a correctness run, not a speed one.

Output (``--out``): hf_finetune.json (config, per implementation: loss and step times per step, median
step and forward+backward times, peak memory, pounce's workspace counters) and hf_finetune.png.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    import transformers
except ImportError:
    sys.exit("hf_finetune.py needs transformers 5 (pip install transformers)")

import pounce
import pounce.torch as pt  # registers "pounce" in transformers' ExpertsInterface

IMPLEMENTATIONS = ("pounce", "grouped_mm", "eager")

# Layer dimensions by name: family, hidden, expert intermediate, experts, top-k, heads, KV heads,
# head dim, and the defaults of the run's other sizes.
DIMS = {
    "tiny": dict(family="qwen3_moe", hidden=64, intermediate=64, experts=8, topk=2, heads=2, kv_heads=1,
                 head_dim=32, layers=2, vocab=256),
    "qwen3-30b-a3b": dict(family="qwen3_moe", hidden=2048, intermediate=768, experts=128, topk=8, heads=32,
                          kv_heads=4, head_dim=128, layers=4, vocab=1024),
    "olmoe-1b-7b": dict(family="olmoe", hidden=2048, intermediate=1024, experts=64, topk=8, heads=16, kv_heads=16,
                        head_dim=128, layers=4, vocab=1024),
    "gpt-oss-20b": dict(family="gpt_oss", hidden=2880, intermediate=2880, experts=32, topk=4, heads=64, kv_heads=8,
                        head_dim=64, layers=4, vocab=1024),
}

SUCCESSOR_PROBS = (0.55, 0.25, 0.15, 0.05)


def family_config(family: str, sizes: dict, seq: int):
    """The transformers config of a family with every routed layer an MoE layer."""
    common = dict(vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], num_hidden_layers=sizes["layers"],
                  num_attention_heads=sizes["heads"], num_key_value_heads=sizes["kv_heads"],
                  head_dim=sizes["head_dim"], num_experts_per_tok=sizes["topk"], max_position_embeddings=seq,
                  tie_word_embeddings=False, use_cache=False, pad_token_id=None, bos_token_id=None,
                  eos_token_id=None)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, moe_intermediate_size=sizes["intermediate"],
                                           num_experts=sizes["experts"], norm_topk_prob=True,
                                           decoder_sparse_step=1, mlp_only_layers=[])
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=sizes["intermediate"],
                                        num_experts=sizes["experts"])
    if family == "gpt_oss":
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(sizes["layers"])]
        return transformers.GptOssConfig(**common, intermediate_size=sizes["intermediate"],
                                         num_local_experts=sizes["experts"], layer_types=layer_types)
    raise ValueError(f"unknown family {family!r}")


def parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def model_config(args):
    sizes = dict(DIMS[args.dims])
    for key in ("layers", "hidden", "intermediate", "experts", "topk", "heads", "kv_heads", "head_dim", "vocab"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    config = family_config(sizes.pop("family"), sizes, args.seq)
    for item in args.model_config:
        key, sep, value = item.partition("=")
        if not sep or not hasattr(config, key):
            sys.exit(f"--model-config {item!r}: expected KEY=VALUE with KEY a field of {type(config).__name__}")
        setattr(config, key, parse_value(value))
    return config


def toy_language(vocab: int, steps: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """int64 [steps, batch, seq] from a random sparse bigram process (on the CPU); step i's batch depends
    on (seed, i) only, so runs of different lengths share their first steps."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.stack([torch.randperm(vocab, generator=gen)[:len(SUCCESSOR_PROBS)] for _ in range(vocab)])
    probs = torch.tensor(SUCCESSOR_PROBS).expand(batch, -1)
    tokens = torch.empty(steps, batch, seq, dtype=torch.int64)
    for step in range(steps):
        gen.manual_seed(seed * 1_000_003 + step + 1)
        tokens[step, :, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        choice = torch.multinomial(probs, seq, replacement=True, generator=gen)
        for s in range(1, seq):
            tokens[step, :, s] = successors[tokens[step, :, s - 1], choice[:, s]]
    return tokens


def build_model(config, args, device):
    torch.manual_seed(args.seed)
    model_class = {"qwen3_moe": transformers.Qwen3MoeForCausalLM, "olmoe": transformers.OlmoeForCausalLM,
                   "gpt_oss": transformers.GptOssForCausalLM}[config.model_type]
    with torch.device(device):
        model = model_class(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    return model.to(args.dtype)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(model, initial_state, impl, data, args, device) -> dict:
    """``args.steps`` AdamW steps of ``model`` from ``initial_state`` with ``impl`` experts."""
    model.load_state_dict(initial_state)
    model.set_experts_implementation(impl)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, step_s, fwd_bwd_s = [], [], []
    for step in range(args.steps):
        ids = data[step].to(device, non_blocking=True)
        synchronize(device)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        synchronize(device)
        backward_done = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        step_s.append(time.perf_counter() - start)
        fwd_bwd_s.append(backward_done - start)
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"[{impl}] step {step:4d} loss {losses[-1]:.4f} step {1e3 * step_s[-1]:.1f} ms", flush=True)
    timed = slice(min(args.warmup, args.steps - 1), None)
    run = dict(
        loss=losses, step_ms=[1e3 * t for t in step_s],
        median_step_ms=1e3 * statistics.median(step_s[timed]),
        median_fwd_bwd_ms=1e3 * statistics.median(fwd_bwd_s[timed]),
        timed_steps=len(step_s[timed]),
        final_loss=statistics.fmean(losses[-min(50, len(losses)):]),
    )
    if device.type == "cuda":
        run["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if impl == "pounce":
        run["workspaces"] = pt.workspace_stats()
    del opt
    model.zero_grad(set_to_none=True)
    pt.free_workspaces()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return run


def plot(run: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diff_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[3, 1])
    first = run["implementations"][0]
    for impl in run["implementations"]:
        curve = run["runs"][impl]
        ax.plot(curve["loss"], linewidth=1.0, linestyle="--" if impl == first else "-", zorder=3 - (impl != first),
                label=f"{impl}: median step {curve['median_step_ms']:.1f} ms, last 50 steps {curve['final_loss']:.3f}")
        if impl != first:
            diff_ax.plot([a - b for a, b in zip(run["runs"][first]["loss"], curve["loss"])], linewidth=0.8,
                         label=f"{first} - {impl}")
    ax.axhline(run["entropy_floor"], color="black", linewidth=0.5, linestyle=":", label="toy language's entropy")
    diff_ax.axhline(0, color="black", linewidth=0.5)
    diff_ax.set_ylabel("loss difference")
    diff_ax.set_xlabel("step")
    if len(run["implementations"]) > 1:
        diff_ax.legend(fontsize=8)
    ax.set_ylabel("training loss (nats/token)")
    cfg = run["config"]
    ax.set_title(f"{cfg['model_type']} ({cfg['dims']}), {cfg['layers']} layers, H={cfg['hidden']} "
                 f"E={cfg['experts']} k={cfg['topk']}, {cfg['tokens_per_step']} tokens/step on {cfg['device_name']}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", default="pounce,grouped_mm",
                        help=f"comma-separated experts implementations, of {', '.join(IMPLEMENTATIONS)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", choices=["bf16", "fp32"],
                        help="parameter dtype (default: bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--steps", type=int, help="training steps (default: 300 on cuda, 100 on cpu)")
    parser.add_argument("--batch", type=int, help="sequences per step (default: 8 on cuda, 4 on cpu)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default: 1024 on cuda, 32 on cpu)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the median step time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=1, help="print the loss every this many steps")
    parser.add_argument("--out", default="examples/out", help="folder for hf_finetune.json and hf_finetune.png")
    sizes = parser.add_argument_group("model config (override --dims)")
    sizes.add_argument("--dims", default="tiny", choices=sorted(DIMS), help="family and layer dimensions")
    sizes.add_argument("--layers", type=int)
    sizes.add_argument("--hidden", type=int)
    sizes.add_argument("--intermediate", type=int, help="each expert's intermediate size")
    sizes.add_argument("--experts", type=int)
    sizes.add_argument("--topk", type=int)
    sizes.add_argument("--heads", type=int)
    sizes.add_argument("--kv-heads", type=int)
    sizes.add_argument("--head-dim", type=int)
    sizes.add_argument("--vocab", type=int)
    sizes.add_argument("--model-config", action="append", default=[], metavar="KEY=VALUE",
                       help="any other config field (VALUE read as JSON where it parses), repeatable")
    args = parser.parse_args(argv)
    args.impls = [impl for impl in args.impls.split(",") if impl]
    unknown = [impl for impl in args.impls if impl not in IMPLEMENTATIONS]
    if unknown or not args.impls:
        parser.error(f"--impls {','.join(args.impls)}: choose from {', '.join(IMPLEMENTATIONS)}")
    on_cuda = args.device == "cuda"
    args.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if on_cuda else "fp32")]
    args.steps = args.steps or (300 if on_cuda else 100)
    args.batch = args.batch or (8 if on_cuda else 4)
    args.seq = args.seq or (1024 if on_cuda else 32)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available() or not pounce.build_info()["cuda"]:
            sys.exit("--device cuda needs a GPU and pounce built with CUDA (pip install . where nvcc is found)")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")

    config = model_config(args)
    model = build_model(config, args, device)
    initial_state = copy.deepcopy(model.state_dict())
    data = toy_language(config.vocab_size, args.steps, args.batch, args.seq, args.seed)
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    num_experts = experts[0].gate_up_proj.shape[0]
    intermediate = experts[0].down_proj.shape[1 if experts[0].is_transposed else 2]  # [E,I,H] or [E,H,I]
    print(f"{config.model_type} ({args.dims}): {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{len(experts)} experts modules of {num_experts} x intermediate {intermediate}, "
          f"top-{config.num_experts_per_tok}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters ({str(args.dtype)[6:]}), "
          f"{args.batch} x {args.seq} tokens/step on {device}", flush=True)

    runs = {impl: train(model, initial_state, impl, data, args, device) for impl in args.impls}

    run = dict(
        config=dict(
            dims=args.dims, model_type=config.model_type, layers=config.num_hidden_layers, hidden=config.hidden_size,
            intermediate=intermediate, experts=num_experts, topk=config.num_experts_per_tok, vocab=config.vocab_size,
            batch=args.batch, seq=args.seq, tokens_per_step=args.batch * args.seq, steps=args.steps,
            warmup=args.warmup, lr=args.lr, dtype=str(args.dtype)[6:], seed=args.seed, device=device.type,
            device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            model_config=config.to_dict(), torch=torch.__version__, transformers=transformers.__version__,
            pounce=pounce.build_info(),
        ),
        implementations=args.impls,
        entropy_floor=-sum(p * math.log(p) for p in SUCCESSOR_PROBS),
        runs=runs,
    )
    if len(args.impls) > 1:
        first, *others = args.impls
        run["speedup"] = {f"{first}_vs_{o}": runs[o]["median_step_ms"] / runs[first]["median_step_ms"] for o in others}
        run["max_abs_loss_diff"] = {o: max(abs(a - b) for a, b in zip(runs[first]["loss"], runs[o]["loss"]))
                                    for o in others}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "hf_finetune.json", "w") as f:
        json.dump(run, f, indent=1)
    for impl in args.impls:
        r = runs[impl]
        print(f"{impl:>10}: median step {r['median_step_ms']:.2f} ms "
              f"(forward+backward {r['median_fwd_bwd_ms']:.2f} ms, "
              f"{r['timed_steps']} steps after {args.warmup} warm-up), first loss {r['loss'][0]:.5f}, "
              f"last 50 steps {r['final_loss']:.4f}")
    for name, value in run.get("speedup", {}).items():
        print(f"{name}: {value:.2f}x")
    print(f"wrote {out / 'hf_finetune.json'}")
    try:
        plot(run, out / "hf_finetune.png")
        print(f"wrote {out / 'hf_finetune.png'}")
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)")
    return run


if __name__ == "__main__":
    main()
