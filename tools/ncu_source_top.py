#!/usr/bin/env python3
"""Reads Nsight Compute's source page (--page source --csv --print-source sass) and prints its header, the
instructions with the most warp-stall samples (with their neighbours' addresses, so a region can be found
in cuobjdump -sass) and the samples per opcode. Usage: ncu_source_top.py SOURCE.csv [TOP]."""
import collections
import csv
import sys


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 60
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
    body = [r for r in rows[1:] if len(r) > samples]
    total = sum(num(r, samples) for r in body)
    print(f"instructions {len(body)}, stall samples {total:.0f}")
    per_op = collections.Counter()
    for r in body:
        text = r[src].strip()
        op = text.split()[0] if text else "?"
        if op.startswith("@") and len(text.split()) > 1:
            op = text.split()[1]
        per_op[op.split(".")[0]] += num(r, samples)
    print("samples per opcode:", ", ".join(f"{op} {v / total:.1%}" for op, v in per_op.most_common(25)))
    # Per-reason columns, where the page has them: the three largest of each listed instruction.
    reasons = [i for i, name in enumerate(header)
               if "stall" in name.lower() and i not in (samples, not_issued)]
    ranked = sorted(range(len(body)), key=lambda i: -num(body[i], samples))[:top]
    for i in sorted(ranked):
        r = body[i]
        where = r[address] if address is not None else str(i)
        print(f"{where:>8} {num(r, samples) / total:6.2%} not-issued {num(r, not_issued):8.0f} "
              f"exec {num(r, executed):10.0f}  {r[src].strip()[:90]}")
        if reasons:
            biggest = sorted(reasons, key=lambda c: -num(r, c))[:3]
            print("          " + ", ".join(f"{header[c]} {num(r, c):.0f}" for c in biggest if num(r, c) > 0))


if __name__ == "__main__":
    main()
