#!/usr/bin/env python3
"""Reads Nsight Compute's CSV exports (tools/gpu.sh ncu writes them) and prints what they say.

  ncu_top.py metrics [--only M1,M2,...] RAW.csv...
                                           `ncu -i R --page raw --csv`: one column per profiled kernel launch,
                                           one row per metric (value and unit): the metrics named by --only
                                           (those given to ncu --metrics), else every one of the page
  ncu_top.py source SOURCE.csv [TOP [REGION...]]
                                           `ncu -i R --page source --csv --print-source sass`: the samples per
                                           opcode, the TOP instructions with the most warp-stall samples in
                                           address order (offsets from the kernel's first instruction, as
                                           cuobjdump -sass numbers them) with their three largest stall
                                           reasons, and each REGION's (LO-HI=LABEL, hex offsets) share
"""
import collections
import csv
import sys
from pathlib import Path


def csv_rows(path, is_header):
    """The CSV rows from the first that `is_header` accepts on (ncu may print lines before its header)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except OSError:
        return []
    start = next((i for i, r in enumerate(rows) if r and is_header(r)), None)
    return rows[start:] if start is not None else []


def number(text):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


# ---- metrics: the raw page ------------------------------------------------------------------------------

def cmd_metrics(paths, only=()):
    columns, labels, metrics, units = [], [], [], {}
    for path in paths:
        rows = csv_rows(path, lambda r: r[0].strip() == "ID")
        if len(rows) < 2:
            print(f"{path}: no kernel in the raw page")
            continue
        header = rows[0]
        body = rows[1:]
        if body and not body[0][0].strip():  # the units row
            units.update({h: u for h, u in zip(header, body[0]) if u})
            body = body[1:]
        name_col = header.index("Kernel Name") if "Kernel Name" in header else None
        for row in body:
            values = dict(zip(header, row))
            kernel = row[name_col] if name_col is not None else "?"
            labels.append(f"{Path(path).stem}: {kernel.removeprefix('void ').split('(')[0][:60]}")
            columns.append(values)
            metrics += [h for h in header if "__" in h and h not in metrics and (not only or h in only)]
    for i, label in enumerate(labels):
        print(f"[{i}] {label}")
    width = max((len(m) for m in metrics), default=0)
    print(" " * width + "".join(f"{f'[{i}]':>16}" for i in range(len(columns))) + "  unit")
    for m in metrics:
        print(m.ljust(width) + "".join(f"{c.get(m, '-'):>16}" for c in columns) + f"  {units.get(m, '')}")
    return 0 if columns else 1


# ---- source: the source page ----------------------------------------------------------------------------

def cmd_source(path, top=60, regions=()):
    rows = csv_rows(path, lambda r: any("Source" in c for c in r))
    if not rows:
        print(f"{path}: no source page")
        return 1
    header = rows[0]

    def col(*words):
        return next((i for i, name in enumerate(header) if all(w.lower() in name.lower() for w in words)), None)

    src, samples = col("source"), col("warp stall sampling", "all")
    not_issued, executed, address = col("warp stall sampling", "not"), col("instructions executed"), col("address")
    if samples is None or src is None:
        print("no warp-stall sample column; columns:", " | ".join(header)[:2000])
        return 1

    def num(r, i):
        return (number(r[i]) or 0.0) if i is not None and i < len(r) and r[i] else 0.0

    body = [r for r in rows[1:] if len(r) > samples and r[0] != header[0]]  # the header may repeat
    total = sum(num(r, samples) for r in body) or 1.0
    base = min((int(r[address], 16) for r in body), default=0) if address is not None else 0

    def offset(r):
        return int(r[address], 16) - base if address is not None else 0

    def opcode(r):
        words = r[src].split()
        op = words[1] if len(words) > 1 and words[0].startswith("@") else (words[0] if words else "?")
        return op.split(".")[0]

    def shares(counter, whole, n):
        return ", ".join(f"{k} {v / whole:.0%}" for k, v in counter.most_common(n))

    print(f"instructions {len(body)}, stall samples {total:.0f}")
    per_op = collections.Counter()
    for r in body:
        per_op[opcode(r)] += num(r, samples)
    print("samples per opcode:", shares(per_op, total, 25))
    # Per-reason columns, where the page has them (their "(Not Issued)" twins left out).
    reasons = [i for i, name in enumerate(header) if name.startswith("stall_") and "not issued" not in name.lower()]
    for i in sorted(sorted(range(len(body)), key=lambda i: -num(body[i], samples))[:top]):
        r = body[i]
        print(f"{offset(r):6x} {num(r, samples) / total:6.2%} not-issued {num(r, not_issued):8.0f} "
              f"exec {num(r, executed):10.0f}  {r[src].strip()[:90]}")
        biggest = sorted(reasons, key=lambda c: -num(r, c))[:3]
        print("          " + ", ".join(f"{header[c]} {num(r, c):.0f}" for c in biggest if num(r, c) > 0))
    for region in regions:
        span, _, label = region.partition("=")
        lo, hi = (int(v, 16) for v in span.split("-"))
        inside = [r for r in body if lo <= offset(r) < hi]
        whole = sum(num(r, samples) for r in inside) or 1.0
        why, ops = collections.Counter(), collections.Counter()
        for r in inside:
            ops[opcode(r)] += num(r, samples)
            for c in reasons:
                why[header[c][len("stall_"):]] += num(r, c)
        print(f"{label or span}: {len(inside)} instructions, {whole / total:.1%} of the samples; "
              f"reasons {shares(why, whole, 5)}; opcodes {shares(ops, whole, 6)}")
    return 0


def main(argv):
    if len(argv) >= 5 and argv[1:3] == ["metrics", "--only"]:
        return cmd_metrics(argv[4:], set(argv[3].split(",")))
    if len(argv) >= 3 and argv[1] == "metrics":
        return cmd_metrics(argv[2:])
    if len(argv) >= 3 and argv[1] == "source":
        return cmd_source(argv[2], int(argv[3]) if len(argv) > 3 else 60, argv[4:])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
