#!/usr/bin/env python3
"""Plots the loss curves that examples/train_moe.py wrote: ``python examples/plot_loss.py RUN.json [OUT.png]``.

Needs matplotlib (``pip install matplotlib``); train_moe.py calls it itself when matplotlib is there.
"""
from __future__ import annotations

import json
import sys


def smooth(values, window):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(run: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diff_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[3, 1])
    window = max(1, len(run["steps"]) // 30)
    colors = {"pounce": "tab:orange", "baseline": "tab:blue", "pounce_fp8": "tab:green"}
    for name in ("baseline", "pounce", "pounce_fp8"):
        if name not in run:
            continue
        ax.plot(run["steps"], run[name]["loss"], color=colors[name], alpha=0.25, linewidth=0.8)
        label = f"{run[name]['label']} (last 50 steps {run[name]['final_loss']:.3f})"
        ax.plot(run["steps"], smooth(run[name]["loss"], window), color=colors[name], label=label)
    ax.set_ylabel("training loss (nats/token)")
    ax.set_yscale("log")
    ax.legend()
    cfg = run["config"]
    ax.set_title(f"{cfg['layers']}-layer MoE transformer, H={cfg['hidden']} E={cfg['experts']} k={cfg['topk']}, "
                 f"EP {cfg['ranks']} on {cfg['gpu']}, {cfg['tokens_per_rank']} tokens/rank/step", fontsize=10)
    delta = [a - b for a, b in zip(run["pounce"]["loss"], run["baseline"]["loss"])]
    diff_ax.plot(run["steps"], delta, color="tab:gray", linewidth=0.8, label="pounce - baseline")
    if "pounce_fp8" in run:
        fp8_delta = [a - b for a, b in zip(run["pounce_fp8"]["loss"], run["pounce"]["loss"])]
        diff_ax.plot(run["steps"], fp8_delta, color="tab:green", linewidth=0.8, label="pounce FP8 - pounce")
        diff_ax.legend(fontsize=8)
    diff_ax.axhline(0, color="black", linewidth=0.5)
    diff_ax.set_ylabel("loss difference")
    diff_ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    with open(argv[1]) as f:
        run = json.load(f)
    path = argv[2] if len(argv) > 2 else argv[1].rsplit(".", 1)[0] + ".png"
    plot(run, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
