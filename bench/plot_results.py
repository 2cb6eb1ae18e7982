#!/usr/bin/env python3
"""Chart `pounce bench` records (bench/results/ep<R>_<precision>.json, or a run's own file) as a PNG.

Throughput (TFLOP/s per GPU, useful work as docs/design.md §7 counts it) against tokens per rank on a
log2 axis, one line per (impl, preset, pass): Pounce solid, the PyTorch baseline and the peers of the same
run (Liger's fused MoE, transformers' grouped_mm experts, the compute-only floor) dashed or dotted, each
Pounce point labelled with its speed-up over that baseline. When every line would be a single point (one
token count: a sweep of `pounce bench`), it draws grouped bars per (preset, pass) instead, each Pounce bar
labelled with its speed-up over the baseline and each peer and its fraction of the floor.

  python3 bench/plot_results.py bench/results/ep2_bf16.json -o ep2_bf16.png
  python3 bench/plot_results.py bench/results/ep2_bf16.json --impl fused,baseline --tokens 8192 -o ep2.png
  python3 bench/plot_results.py a.json b.json --preset qwen3-30b-a3b --pass forward,forward_backward -o q.png

Several files may be given; when two records measure the same (impl, preset, pass, ranks, tokens,
precision) the newest (by `date`) wins. Records without a number in `tflops` (not measured; they carry
an `error`) are left out and listed. Needs matplotlib (pip install matplotlib).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict

PASS_ORDER = ["forward", "backward", "forward_backward"]
PASS_MARKERS = {"forward": "o", "backward": "^", "forward_backward": "s"}
IMPL_STYLES = {"fused": "-", "fused-all": "-", "staged": "-", "baseline": "--", "liger": ":",
               "transformers": "-.", "floor": (0, (1, 3))}
PEERS = ["baseline", "liger", "transformers", "floor"]  # not Pounce; the bars' order after Pounce's
PEER_NAMES = {"baseline": "PyTorch baseline", "liger": "Liger fused MoE", "transformers": "transformers grouped_mm",
              "floor": "compute-only floor"}
PEER_HATCHES = {"baseline": "//", "liger": "..", "transformers": "xx", "floor": None}


def who(impl):
    return PEER_NAMES.get(impl, f"Pounce {impl}")


def load_records(paths):
    """All records of `paths` (each a JSON list), the newest per configuration, plus the unmeasured."""
    newest = {}
    unmeasured = []
    for path in paths:
        with open(path) as f:
            records = json.load(f)
        if not isinstance(records, list):
            raise SystemExit(f"{path}: expected a JSON list of records")
        for r in records:
            if not isinstance(r.get("tflops"), (int, float)):
                unmeasured.append(r)
                continue
            key = (r.get("impl"), r.get("preset"), r.get("pass"), r.get("ranks"), r.get("tokens_per_rank"),
                   r.get("precision", "bf16"))
            # ISO dates compare as text once the zone suffix (Z or +00:00) is cut off
            if key not in newest or str(r.get("date", ""))[:19] >= str(newest[key].get("date", ""))[:19]:
                newest[key] = r
    return list(newest.values()), unmeasured


def keep(records, field, allowed):
    if not allowed:
        return records
    return [r for r in records if str(r.get(field)) in allowed]


def series_of(records):
    """(impl, preset, pass, ranks) -> records sorted by tokens per rank, in a stable, readable order."""
    presets = list(OrderedDict.fromkeys(r["preset"] for r in records))

    def order(key):
        impl, preset, pss, ranks = key
        return (presets.index(preset), PASS_ORDER.index(pss) if pss in PASS_ORDER else 9,
                PEERS.index(impl) + 1 if impl in PEERS else 0, impl, ranks)

    series = {}
    for r in records:
        series.setdefault((r["impl"], r["preset"], r["pass"], r["ranks"]), []).append(r)
    return OrderedDict((k, sorted(series[k], key=lambda r: r["tokens_per_rank"]))
                       for k in sorted(series, key=order))


def describe(records):
    gpus = sorted({str(r.get("gpu", "?")) for r in records})
    ranks = sorted({r.get("ranks") for r in records})
    precisions = sorted({str(r.get("precision", "bf16")) for r in records})
    ranks_text = ", ".join(f"EP{n}" for n in ranks)
    return f"{' / '.join(gpus)}, {ranks_text}, {' / '.join(precisions)}"


def footnote(records, unmeasured=()):
    commits = sorted({str(r.get("commit", "?"))[:12] for r in records if r.get("impl") not in PEERS})
    dates = sorted({str(r.get("date", ""))[:10] for r in records})
    versions = sorted({f"{r['impl']}: {r['peer_version']}" for r in records
                       if r.get("impl") in PEERS and r.get("peer_version")})
    cannot = sorted({f"{r.get('impl')} on {r.get('preset')}" for r in unmeasured if r.get("unsupported")})
    return (f"TFLOP/s per GPU, useful work (docs/design.md §7); median of iterations, slowest rank per "
            f"iteration; baseline: all_to_all_single + torch._grouped_mm; peers on the same inputs, same run"
            + (f" ({'; '.join(versions)})" if versions else "") + ". "
            + (f"Cannot run: {', '.join(cannot)} (docs/benchmarks.md). " if cannot else "")
            + f"Pounce commit {', '.join(commits) or '-'}; {', '.join(dates)}")


def label(key, many_ranks):
    impl, preset, pss, ranks = key
    return f"{preset} {pss.replace('_', '+')}: {who(impl)}" + (f" (EP{ranks})" if many_ranks else "")


def plot_lines(ax, series):
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color_of = {}
    many_ranks = len({k[3] for k in series}) > 1
    tokens = sorted({r["tokens_per_rank"] for rs in series.values() for r in rs})
    for key, rs in series.items():
        impl, preset, pss, ranks = key
        color = color_of.setdefault((preset, pss, ranks), colors[len(color_of) % len(colors)])
        x = [r["tokens_per_rank"] for r in rs]
        y = [r["tflops"] for r in rs]
        baseline = impl in PEERS
        ax.plot(x, y, linestyle=IMPL_STYLES.get(impl, "-."), color=color, marker=PASS_MARKERS.get(pss, "o"),
                markerfacecolor="none" if baseline else color, linewidth=1.2 if baseline else 2.0,
                label=label(key, many_ranks))
        if not baseline:
            for r in rs:
                s = r.get("speedup_vs_baseline")
                if isinstance(s, (int, float)):
                    ax.annotate(f"{s:.2f}×", (r["tokens_per_rank"], r["tflops"]), textcoords="offset points",
                                xytext=(0, 7), ha="center", fontsize=7, color=color)
    ax.set_xscale("log", base=2)
    ax.set_xticks(tokens)
    ax.set_xticklabels([str(t) for t in tokens])
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("TFLOP/s per GPU")
    ax.set_ylim(0, max(r["tflops"] for rs in series.values() for r in rs) * 1.12)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def bar_note(impl, r):
    """TFLOP/s, and for Pounce its speed-up over the baseline (late: the later half of the runs, docs/design.md,
    Power) and over each other peer, and its fraction of the compute-only floor."""
    note = f"{r['tflops']:.0f}"
    if impl in PEERS:
        return note
    s, late = r.get("speedup_vs_baseline"), r.get("late_speedup_vs_baseline")
    if isinstance(s, (int, float)):
        note += f"\n{s:.2f}×"
    if isinstance(late, (int, float)):
        note += f"\nlate {late:.2f}×"
    short = {"liger": "L", "transformers": "T"}
    for peer, ratio in sorted((r.get("speedup_vs") or {}).items()):
        if peer in short and isinstance(ratio, (int, float)):
            note += f"\n{short[peer]} {ratio:.2f}×"
    if isinstance(r.get("floor_fraction"), (int, float)):
        note += f"\nfloor {100 * r['floor_fraction']:.0f}%"
    return note


def plot_bars(ax, series):
    import matplotlib.pyplot as plt

    groups = list(OrderedDict.fromkeys((k[1], k[2], k[3]) for k in series))
    impls = list(OrderedDict.fromkeys(k[0] for k in sorted(
        series, key=lambda k: PEERS.index(k[0]) + 1 if k[0] in PEERS else 0)))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    width = 0.8 / max(1, len(impls))
    many_ranks = len({g[2] for g in groups}) > 1
    for i, impl in enumerate(impls):
        xs, ys, notes = [], [], []
        for g, (preset, pss, ranks) in enumerate(groups):
            rs = series.get((impl, preset, pss, ranks))
            if not rs:
                continue
            r = rs[-1]
            xs.append(g + (i - (len(impls) - 1) / 2) * width)
            ys.append(r["tflops"])
            notes.append(bar_note(impl, r))
        bars = ax.bar(xs, ys, width, label=who(impl), color=colors[i % len(colors)],
                      hatch=PEER_HATCHES.get(impl) if impl in PEERS else None,
                      alpha=0.6 if impl in PEERS else 1.0)
        for bar, note in zip(bars, notes):
            ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), textcoords="offset points",
                        xytext=(0, 2), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{p}\n{s.replace('_', '+')}" + (f" EP{n}" if many_ranks else "")
                        for p, s, n in groups], fontsize=8)
    ax.set_ylabel("TFLOP/s per GPU")
    ax.set_ylim(0, max((b.get_height() for b in ax.patches), default=1) * 1.2)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="results files (JSON lists of records)")
    p.add_argument("-o", "--out", required=True, help="the PNG to write")
    p.add_argument("--preset", default="", help="comma list of presets to keep (default: all)")
    p.add_argument("--pass", dest="passes", default="", help="comma list of passes to keep (default: all)")
    p.add_argument("--impl", default="", help="comma list of impls to keep, baseline included (default: all)")
    p.add_argument("--tokens", default="", help="comma list of tokens per rank to keep (default: all)")
    p.add_argument("--kind", choices=["auto", "lines", "bars"], default="auto",
                   help="auto: lines when some line has two token counts, else bars")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records, unmeasured = load_records(args.results)
    split = lambda text: {s.strip() for s in text.split(",") if s.strip()}  # noqa: E731
    records = keep(records, "preset", split(args.preset))
    records = keep(records, "pass", split(args.passes))
    records = keep(records, "impl", split(args.impl))
    records = keep(records, "tokens_per_rank", split(args.tokens))
    for r in unmeasured:
        print(f"left out (not measured): {r.get('impl')} {r.get('preset')} {r.get('pass')} "
              f"T={r.get('tokens_per_rank')}: {r.get('error', 'no tflops')}", file=sys.stderr)
    if not records:
        raise SystemExit("no measured records left to plot")

    series = series_of(records)
    kind = args.kind
    if kind == "auto":
        kind = "lines" if any(len(rs) > 1 for rs in series.values()) else "bars"
    fig, ax = plt.subplots(figsize=(13, 6) if kind == "lines" else (max(8, 0.5 * len(series) + 3), 6))
    if kind == "lines":
        plot_lines(ax, series)
    else:
        plot_bars(ax, series)
    tokens = sorted({r["tokens_per_rank"] for r in records})
    at = f", {tokens[0]} tokens per rank" if kind == "bars" and len(tokens) == 1 else ""
    rivals = "its peers" if any(r.get("impl") in PEERS[1:] for r in records) else "PyTorch expert parallelism"
    ax.set_title(args.title or f"Pounce vs {rivals}: {describe(records)}{at}", fontsize=11)
    fig.text(0.01, 0.005, footnote(records, unmeasured), fontsize=6, color="0.35", ha="left", va="bottom",
             wrap=True)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(args.out, dpi=150)
    print(f"wrote {args.out}: {len(series)} {'lines' if kind == 'lines' else 'bar series'}, "
          f"{len(records)} records")


if __name__ == "__main__":
    main()
