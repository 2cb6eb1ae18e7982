#!/usr/bin/env python3
"""Chart `pounce plan`'s sweep over EP sizes (its --json file) as a PNG.

Left: the predicted forward and backward time per layer against the EP size (log2 axis, tokens per rank
held), each point coloured by the resource that binds it. Right: the forward's overlapped terms (tensor
cores, NVLink, communication SMs, NIC, HBM) against the EP size, with the pass itself, so the crossovers
show where a link starts to bind.

  ./build/pounce plan --preset deepseek-v3 --tokens 8192 --json plan.json
  python3 bench/plot_plan.py plan.json -o plan.png

`pounce plan --chart plan.png` runs this script itself. Needs matplotlib (pip install matplotlib); without it
the script says so and exits with status 2, and the JSON stays usable.
"""
from __future__ import annotations

import argparse
import json
import sys

RESOURCE_COLORS = {"tensor cores": "tab:blue", "NVLink": "tab:green", "comm SMs": "tab:purple",
                   "NIC": "tab:red", "HBM": "tab:orange"}
TERMS = [("tensor_ms", "tensor cores"), ("nvlink_ms", "NVLink"), ("comm_sm_ms", "comm SMs"),
         ("nic_ms", "NIC"), ("hbm_ms", "HBM")]


def load_sweep(path):
    with open(path) as f:
        value = json.load(f)
    sweep = value.get("sweep") if isinstance(value, dict) else None
    if not sweep:
        raise SystemExit(f"{path}: no 'sweep' list (write it with `pounce plan --json FILE`, without --no-sweep)")
    return value, sweep


def title_of(value, sweep):
    first = sweep[0]
    return (f"{value.get('preset', 'custom')}: {first['tokens_per_rank']} tokens per rank, {first['precision']}, "
            f"{first['gpus_per_node']} GPUs per node, NVLink {first['nvlink_gbps']:.0f} GB/s, "
            f"NIC {first['nic_gbps']:.0f} GB/s (pounce plan's model, uncalibrated beyond one node)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", help="the JSON that `pounce plan --json` wrote")
    p.add_argument("-o", "--out", required=True, help="PNG to write")
    args = p.parse_args(argv)
    value, sweep = load_sweep(args.plan)
    try:
        import matplotlib
    except ImportError:
        print("plot_plan.py: matplotlib is not installed (pip install matplotlib); no chart written",
              file=sys.stderr)
        return 2
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    eps = [s["ep"] for s in sweep]
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 6))
    for pass_name, marker in (("forward", "o"), ("backward", "^")):
        key = pass_name + "_suggested"
        ms = [s[key]["ms"] for s in sweep]
        left.plot(eps, ms, color="0.6", linewidth=1)
        left.scatter(eps, ms, marker=marker, s=60, zorder=3,
                     c=[RESOURCE_COLORS.get(s[key]["binding"], "black") for s in sweep])
        for ep, s in zip(eps, sweep):  # forward's labels above its points, backward's below
            left.annotate(f"{s[key]['tflops']:.0f}", (ep, s[key]["ms"]), textcoords="offset points",
                          xytext=(0, 7 if pass_name == "forward" else -13), ha="center", fontsize=7)
    left.set_xscale("log", base=2)
    left.set_xticks(eps, [str(e) for e in eps])
    left.set_xlabel("EP size (GPUs)")
    left.set_ylabel("predicted ms per layer (labels: TFLOP/s per GPU)")
    left.grid(True, alpha=0.3)
    handles = [Line2D([], [], marker="o", linestyle="", color="0.3", label="forward"),
               Line2D([], [], marker="^", linestyle="", color="0.3", label="backward")]
    handles += [Line2D([], [], marker="s", linestyle="", color=c, label=f"binds: {r}")
                for r, c in RESOURCE_COLORS.items()]
    left.legend(handles=handles, fontsize=8)

    for key, name in TERMS:
        right.plot(eps, [s["forward_suggested"][key] for s in sweep], marker=".", label=name,
                   color=RESOURCE_COLORS[name])
    right.plot(eps, [s["forward_suggested"]["ms"] for s in sweep], color="black", linewidth=2,
               label="forward pass")
    right.set_xscale("log", base=2)
    right.set_xticks(eps, [str(e) for e in eps])
    right.set_xlabel("EP size (GPUs)")
    right.set_ylabel("forward terms, ms (the pass: exposed + the largest)")
    right.grid(True, alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(title_of(value, sweep), fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
