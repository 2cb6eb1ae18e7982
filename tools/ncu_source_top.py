#!/usr/bin/env python3
"""Reads Nsight Compute's source page (--page source --csv --print-source sass) and prints its header, the
samples per opcode, the instructions with the most warp-stall samples in address order (offsets from the
kernel's first instruction, as cuobjdump -sass numbers them) with their three largest stall reasons, and for
each REGION (LO-HI=LABEL, hex offsets) its share of the samples, its stall reasons and its opcodes.
Usage: ncu_source_top.py SOURCE.csv [TOP [REGION...]]."""
import collections
import csv
import sys


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    regions = sys.argv[3:]
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if "Source" in line and "," in line), 0)
    rows = list(csv.reader(lines[start:]))
    if not rows:
        print("no rows")
        return
    header = rows[0]
    print("columns:", " | ".join(header)[:3000])
    def col(*words):
        for i, name in enumerate(header):
            if all(w.lower() in name.lower() for w in words):
                return i
        return None
    src = col("source")
    samples = col("warp stall sampling", "all")
    not_issued = col("warp stall sampling", "not")
    executed = col("instructions executed")
    address = col("address")
    if samples is None or src is None:
        print("no sample column; first rows:")
        for r in rows[1:6]:
            print(r)
        return
    def num(r, i):
        try:
            return float(r[i].replace(",", "")) if i is not None and r[i] else 0.0
        except ValueError:
            return 0.0
    body = [r for r in rows[1:] if len(r) > samples and r[0] != header[0]]  # the header may repeat
    total = sum(num(r, samples) for r in body) or 1.0
    print(f"instructions {len(body)}, stall samples {total:.0f}")
    def opcode(r):
        words = r[src].split()
        op = words[1] if len(words) > 1 and words[0].startswith("@") else (words[0] if words else "?")
        return op.split(".")[0]
    def shares(counter, whole, n):
        return ", ".join(f"{k} {v / whole:.0%}" for k, v in counter.most_common(n))
    per_op = collections.Counter()
    for r in body:
        per_op[opcode(r)] += num(r, samples)
    print("samples per opcode:", shares(per_op, total, 25))
    # Per-reason columns, where the page has them (their "(Not Issued)" twins left out).
    reasons = [i for i, name in enumerate(header) if name.startswith("stall_") and "not issued" not in name.lower()]
    def offset(r):
        return int(r[address], 16) - base if address is not None else 0
    base = min((int(r[address], 16) for r in body), default=0) if address is not None else 0
    ranked = sorted(range(len(body)), key=lambda i: -num(body[i], samples))[:top]
    for i in sorted(ranked):
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


if __name__ == "__main__":
    main()
