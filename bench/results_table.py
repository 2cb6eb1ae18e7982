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
When the FP8 results (--fp8-results: `pounce bench --precision fp8` on one GPU) exist, a third table puts each
preset and pass's FP8 record beside the BF16 `fused` record measured just before it in the same run: both times,
the FP8 record's speed-up over BF16 (speedup_vs_bf16) and TFLOP/s, and the SM clock and power of each (the two
runs can hold different clocks), then the command the records were measured with. FP8 runs the staged kernels
(kernel_path; records older than that field ran them too): the fused FP8 kernels are not built yet.
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
FP8_RESULTS = ROOT / "bench" / "results" / "ep1_fp8.json"
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


def provenance(rows: list) -> tuple:
    """The GPUs, commits and dates `rows` were measured on, each joined into one caption string."""
    return (" / ".join(sorted({str(r.get("gpu", "?")) for r in rows})),
            ", ".join(sorted({str(r.get("commit", "?")) for r in rows})),
            ", ".join(sorted({str(r.get("date", ""))[:10] for r in rows})))


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


def fp8_table(records: list, source: str) -> list:
    """Lines of the FP8 table from `records` (EP1, `pounce bench --precision fp8`): each FP8 record beside the
    BF16 record of the same impl measured in the same run, or none when there is no such pair."""
    def at(r, precision):
        return (r.get("ranks") == 1 and r.get("tokens_per_rank") == TOKENS and r.get("pass") in PASSES
                and r.get("impl") == IMPL and r.get("precision", "bf16") == precision
                and isinstance(r.get("median_ms"), (int, float)))

    bf16 = {(r["preset"], r["pass"]): r for r in records if at(r, "bf16")}
    pairs = sorted(((r, bf16[(r["preset"], r["pass"])]) for r in records
                    if at(r, "fp8") and (r["preset"], r["pass"]) in bf16),
                   key=lambda p: (PRESET_ORDER.index(p[0]["preset"]) if p[0]["preset"] in PRESET_ORDER
                                  else len(PRESET_ORDER), p[0]["preset"], list(PASSES).index(p[0]["pass"])))
    if not pairs:
        return []

    def telemetry(r):
        return f"{number(r.get('sm_clock_mhz'), '{:.0f}')}, {number(r.get('power_w'), '{:.0f}')}"

    lines = ["", f"FP8 on one GPU (EP1, {TOKENS} tokens), beside the BF16 layer measured just before it in the same "
                 f"run (from {source}):", "",
             "| preset | pass | BF16 fused ms | FP8 ms | FP8 vs BF16 | FP8 TFLOP/s | BF16 MHz, W | FP8 MHz, W |",
             "|---|---|---|---|---|---|---|---|"]
    for fp8, ref in pairs:
        lines.append(f"| {fp8['preset']} | {PASSES[fp8['pass']]} | {milliseconds(ref['median_ms'])} | "
                     f"{milliseconds(fp8['median_ms'])} | {number(fp8.get('speedup_vs_bf16'), '{:.2f}x')} | "
                     f"{number(fp8.get('tflops'), '{:.0f}')} | {telemetry(ref)} | {telemetry(fp8)} |")
    rows = [r for pair in pairs for r in pair]
    # Records written before kernel_path existed (commit d025d34) ran FP8 on the stage kernels as well.
    paths = sorted({str(fp8.get("kernel_path", "staged")) for fp8, _ in pairs})
    kernels = ("FP8 ms is the staged FP8 kernels: the fused FP8 kernels are not built yet." if paths == ["staged"]
               else f"FP8 ms is the {' / '.join(paths)} FP8 kernels.")
    clocked = [(fp8, ref) for fp8, ref in pairs
               if all(isinstance(r.get(k), (int, float)) for r in (fp8, ref) for k in ("sm_clock_mhz", "power_w"))]
    clocks = ""
    if clocked:
        fp8, ref = max(clocked, key=lambda p: abs(p[0]["sm_clock_mhz"] - p[1]["sm_clock_mhz"]))
        slow, fast = sorted((ref, fp8), key=lambda r: r["sm_clock_mhz"])
        if fast["sm_clock_mhz"] - slow["sm_clock_mhz"] >= 0.05 * fast["sm_clock_mhz"]:
            throttled = slow["power_w"] >= 0.95 * fast["power_w"]  # as much power at a lower clock: the power limit
            clocks = (f"; {fp8['preset']}'s {slow['precision'].upper()} run ran "
                      f"{'power-throttled ' if throttled else ''}at {slow['sm_clock_mhz']:.0f} MHz")
    gpus, commits, dates = provenance(rows)
    caption = (f"1 x {gpus}, {TOKENS} tokens, the same inputs for both; median of "
               f"{span(r['iters'] for r in rows if 'iters' in r)} timed runs. {kernels} FP8: routed experts in "
               f"block-scaled E4M3 (docs/design.md §1), weights quantized once, untimed. MHz, W: SM clock and power "
               f"during each precision's timed runs{clocks}. Commit {commits}, {dates}.")
    commands = sorted({str(r["command"]) for r in rows if r.get("command")})
    return lines + ["", *textwrap.wrap(caption, 110, break_long_words=False, break_on_hyphens=False),
                    *(f"Measured with `{c}`." for c in commands)]


def block(records: list, source: str, peer_records: list = (), peer_source: str = "", fp8_records: list = (),
          fp8_source: str = "") -> str:
    """The marker block for `records` (a results file's list), naming `source`, the side-by-side table of
    `peer_records` (EP1) when they hold peers, and the FP8 table of `fp8_records` (EP1) when they hold FP8
    records."""
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
    gpus, commits, dates = provenance(rows)
    caption = (f"{RANKS} x {gpus}, EP{RANKS}, {PRECISION}, {TOKENS} tokens per rank, `pounce bench` defaults "
               f"(fused forward, backward by shape); median of {span(r['iters'] for r in rows if 'iters' in r)} timed runs "
               f"after warm-up, inputs rotated past L2. TFLOP/s counts useful work (docs/design.md §7). The "
               f"baseline is PyTorch's all_to_all_single + torch._grouped_mm (bench/baselines/). Commit "
               f"{commits}, {dates}. Regenerate: `{COMMAND}`.")
    lines += ["", *textwrap.wrap(caption, 110, break_long_words=False, break_on_hyphens=False)]
    lines += peer_table(list(peer_records), peer_source)
    lines += fp8_table(list(fp8_records), fp8_source)
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
    p.add_argument("--fp8-results", type=Path, default=FP8_RESULTS,
                   help="EP1 results file of `pounce bench --precision fp8` whose records make the FP8 table, "
                        "when it exists (default: %(default)s)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--write", metavar="README", type=Path, help="replace the README's block")
    what.add_argument("--check", metavar="README", type=Path, help="exit 1 when the README's block differs")
    args = p.parse_args(argv)

    records = json.loads(args.results.read_text())
    if not isinstance(records, list):
        raise SystemExit(f"{args.results}: expected a JSON list of records")
    results = args.results.resolve()
    source = str(results.relative_to(ROOT)) if results.is_relative_to(ROOT) else str(args.results)

    def optional(path: Path):
        """The records of `path` and the name to show for it, or none when it does not exist."""
        if not path.exists():
            return [], ""
        loaded = json.loads(path.read_text())
        resolved = path.resolve()
        return (loaded if isinstance(loaded, list) else [],
                str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path))

    peer_records, peer_source = optional(args.peers_results)
    fp8_records, fp8_source = optional(args.fp8_results)
    new_block = block(records, source, peer_records, peer_source, fp8_records, fp8_source)
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
