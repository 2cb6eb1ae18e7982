#!/usr/bin/env python3
"""README.md's results table, written from the recorded `pounce bench` records (bench/results/).

  python3 bench/results_table.py                     # print the block
  python3 bench/results_table.py --write README.md   # replace the block between the markers
  python3 bench/results_table.py --check README.md   # exit 1 when the README's block is not that (ctest, cpu)

The table is the default configuration: EP2, bf16, 8192 tokens per rank, impl `fused` (`pounce bench`'s
default: the fused forward, the backward by shape); one row per preset and pass (forward,
forward+backward) with the median time, TFLOP/s per GPU and the speed-up over the PyTorch baseline
measured in the same run, as the records hold them (and the fraction of the compute-only floor reached, when
the records have the floor); then the GPU, commit and date the records come from. When the EP1 results
(--peers-results) hold peer records (`pounce bench --peers`: Liger's fused MoE, transformers' grouped_mm
experts, the compute-only floor) at the same tokens per rank, a second table puts Pounce and each peer side by
side on one GPU, with the ratios; a peer that cannot run a shape reads "cannot" (docs/benchmarks.md says why).
Standard library only.
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "ep2_bf16.json"
PEER_RESULTS = ROOT / "bench" / "results" / "ep1_bf16.json"
PEERS = {"baseline": "PyTorch", "liger": "Liger", "transformers": "transformers", "floor": "floor"}
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
COMMAND = "python3 bench/results_table.py --write README.md"

RANKS, PRECISION, TOKENS, IMPL = 2, "bf16", 8192, "fused"
PASSES = {"forward": "forward", "forward_backward": "forward+backward"}
PRESET_ORDER = ["qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b", "mixtral-8x7b"]


def milliseconds(ms: float) -> str:
    return f"{ms:.3f}" if ms < 10 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def number(value, pattern: str) -> str:
    return pattern.format(value) if isinstance(value, (int, float)) else "-"


def span(values) -> str:
    values = sorted(set(values))
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def peer_table(records: list, source: str) -> list:
    """Lines of the side-by-side table of Pounce and its peers on one GPU from `records` (EP1), or none."""
    def at(r, ranks=1):
        return (r.get("ranks") == ranks and r.get("tokens_per_rank") == TOKENS and r.get("pass") in PASSES
                and r.get("precision", "bf16") == PRECISION)

    def measured(r):
        return isinstance(r.get("median_ms"), (int, float))

    if not any(at(r) and r.get("impl") in PEERS and r.get("impl") != "baseline" for r in records):
        return []
    by = {(r["preset"], r["pass"], r["impl"]): r for r in records if at(r)}
    configs = sorted({(p, s) for p, s, i in by if i == IMPL and measured(by[(p, s, i)])},
                     key=lambda c: (PRESET_ORDER.index(c[0]) if c[0] in PRESET_ORDER else len(PRESET_ORDER),
                                    c[0], list(PASSES).index(c[1])))
    names = list(PEERS.values())
    lines = ["", f"On one GPU, side by side with the peers in the same run (ms; x: Pounce's speed-up over it; "
                 f"from {source}):", "",
             "| preset | pass | Pounce | " + " | ".join(names) + " | of the floor |",
             "|---|---|---|" + "---|" * len(names) + "---|"]
    versions = {}
    for preset, pss in configs:
        ours = by[(preset, pss, IMPL)]
        cells = []
        for impl in PEERS:
            r = by.get((preset, pss, impl))
            if r is None:
                cells.append("-")
            elif measured(r):
                versions.setdefault(impl, r.get("peer_version", ""))
                ratio = r["median_ms"] / ours["median_ms"]
                cells.append(f"{milliseconds(r['median_ms'])} ({ratio:.2f}x)")
            else:
                cells.append("cannot" if r.get("unsupported") else "-")
        lines.append(f"| {preset} | {PASSES[pss]} | {milliseconds(ours['median_ms'])} | " + " | ".join(cells)
                     + f" | {number(ours.get('floor_fraction'), '{:.0%}')} |")
    gpus = " / ".join(sorted({str(by[(p, s, IMPL)].get("gpu", "?")) for p, s in configs}))
    caption = (f"1 x {gpus}, bf16, {TOKENS} tokens per rank, the same inputs and routing for every column. "
               + "; ".join(f"{PEERS[i]}: {v}" for i, v in versions.items() if v)
               + ". Floor: the expert GEMMs alone on rows already grouped by expert (torch._grouped_mm).")
    return lines + ["", *textwrap.wrap(caption, 110, break_long_words=False, break_on_hyphens=False)]


def block(records: list, source: str, peer_records: list = (), peer_source: str = "") -> str:
    """The marker block for `records` (a results file's list), naming `source`, and the side-by-side table of
    `peer_records` (EP1) when they hold peers."""
    rows = [r for r in records
            if r.get("impl") == IMPL and r.get("pass") in PASSES and r.get("ranks") == RANKS
            and r.get("tokens_per_rank") == TOKENS and r.get("precision", "bf16") == PRECISION
            and isinstance(r.get("median_ms"), (int, float))]
    if not rows:
        raise SystemExit(f"{source}: no measured {IMPL} record at EP{RANKS}, {PRECISION}, {TOKENS} tokens per "
                         f"rank; record one (bench/README.md)")
    order = {p: i for i, p in enumerate(PRESET_ORDER)}
    rows.sort(key=lambda r: (order.get(r["preset"], len(order)), r["preset"], list(PASSES).index(r["pass"])))
    floor = any(isinstance(r.get("floor_fraction"), (int, float)) for r in rows)
    lines = [BEGIN,
             f"<!-- written by `{COMMAND}` from {source}; not edited by hand -->",
             "",
             "| preset | pass | median ms | TFLOP/s per GPU | vs PyTorch, same run |"
             + (" of the floor |" if floor else ""),
             "|---|---|---|---|---|" + ("---|" if floor else "")]
    for r in rows:
        lines.append(f"| {r['preset']} | {PASSES[r['pass']]} | {milliseconds(r['median_ms'])} | "
                     f"{number(r.get('tflops'), '{:.0f}')} | {number(r.get('speedup_vs_baseline'), '{:.2f}x')} |"
                     + (f" {number(r.get('floor_fraction'), '{:.0%}')} |" if floor else ""))
    gpus = " / ".join(sorted({str(r.get("gpu", "?")) for r in rows}))
    commits = ", ".join(sorted({str(r.get("commit", "?")) for r in rows}))
    dates = ", ".join(sorted({str(r.get("date", ""))[:10] for r in rows}))
    caption = (f"{RANKS} x {gpus}, EP{RANKS}, {PRECISION}, {TOKENS} tokens per rank, `pounce bench` defaults "
               f"(fused forward, backward by shape); median of {span(r['iters'] for r in rows if 'iters' in r)} timed runs "
               f"after warm-up, inputs rotated past L2. TFLOP/s counts useful work (docs/design.md §7). The "
               f"baseline is PyTorch's all_to_all_single + torch._grouped_mm (bench/baselines/). Commit "
               f"{commits}, {dates}. Regenerate: `{COMMAND}`.")
    lines += ["", *textwrap.wrap(caption, 110, break_long_words=False, break_on_hyphens=False)]
    lines += peer_table(list(peer_records), peer_source)
    return "\n".join(lines + [END])


def replaced(text: str, new_block: str, readme: str) -> str:
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < begin:
        raise SystemExit(f"{readme}: no {BEGIN} ... {END} block to write the table into")
    return text[:begin] + new_block + text[end + len(END):]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="results file (default: %(default)s)")
    p.add_argument("--peers-results", type=Path, default=PEER_RESULTS,
                   help="EP1 results file whose peer records make the side-by-side table (default: %(default)s)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--write", metavar="README", type=Path, help="replace the README's block")
    what.add_argument("--check", metavar="README", type=Path, help="exit 1 when the README's block differs")
    args = p.parse_args(argv)

    records = json.loads(args.results.read_text())
    if not isinstance(records, list):
        raise SystemExit(f"{args.results}: expected a JSON list of records")
    results = args.results.resolve()
    source = str(results.relative_to(ROOT)) if results.is_relative_to(ROOT) else str(args.results)
    peer_records, peer_source = [], ""
    if args.peers_results.exists():
        peer_records = json.loads(args.peers_results.read_text())
        resolved = args.peers_results.resolve()
        peer_source = str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(args.peers_results)
    new_block = block(records, source, peer_records if isinstance(peer_records, list) else [], peer_source)
    if args.write is None and args.check is None:
        print(new_block)
        return 0
    readme = args.write or args.check
    text = readme.read_text()
    new_text = replaced(text, new_block, str(readme))
    if args.write is not None:
        if new_text != text:
            readme.write_text(new_text)
        print(f"{readme}: results table {'written' if new_text != text else 'already current'} from {source}")
        return 0
    if new_text == text:
        return 0
    sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new_text.splitlines(True),
                                               f"{readme} (now)", f"{readme} (from {source})"))
    print(f"\n{readme}: the results table is not the one {source} gives; run `{COMMAND}`", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
