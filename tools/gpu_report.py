#!/usr/bin/env python3
"""Summaries of tools/gpu.sh's jobs, computed from the JSON the tools write (gtest's --gtest_output=json,
`pounce bench --out` and `pounce run --json` records, examples/train_moe.py's train_moe.json, pytest's
junit XML), never from text logs. Standard library only: it runs here and on the GPU machine.

  gpu_report.py gtest REPORT.json...       per run: passed/failed/skipped, the failures; whether the runs agree
  gpu_report.py bench RECORDS.json...      the records as a table
  gpu_report.py run RUN.json...            `pounce run` reports: check, bitwise repeat, times
  gpu_report.py ab OUT LABEL_A LABEL_B     B against A over $OUT/ab_r<round>_<A|B>.json; writes $OUT/ab.json
  gpu_report.py finish OUT RUN_ID JOB      packs $OUT to what the device tool brings back, then the step table
"""
import json
import re
import statistics
import sys
import tarfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

# The device tool brings back at most this many files from $OUT (its README, "Limits").
MAX_FILES_BACK = 8


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def table(rows, header):
    """Left-aligned columns; every cell a string."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header] + rows)


def fmt(value, pattern):
    return pattern % value if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


# ---- gtest ----------------------------------------------------------------------------------------------

def gtest_outcomes(doc):
    """{Suite.Test: (outcome, first failure lines)} of one gtest JSON report."""
    outcomes = {}
    for suite in doc.get("testsuites", []):
        for test in suite.get("testsuite", []):
            name = f"{suite.get('name')}.{test.get('name')}"
            failures = test.get("failures") or []
            if test.get("status") == "NOTRUN":
                outcome = "disabled"
            elif test.get("result") == "SKIPPED":
                outcome = "skipped"
            elif failures:
                outcome = "failed"
            else:
                outcome = "passed"
            message = " | ".join(failures[0].get("failure", "").strip().splitlines()[:3]) if failures else ""
            outcomes[name] = (outcome, message)
    return outcomes


def gtest_counts(outcomes):
    counts = {k: 0 for k in ("passed", "failed", "skipped", "disabled")}
    for outcome, _ in outcomes.values():
        counts[outcome] += 1
    return counts


def gtest_line(doc):
    c = gtest_counts(gtest_outcomes(doc))
    return f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped, {c['disabled']} disabled"


def is_bitwise(name, message):
    return "bitwise" in name.lower() or "bitwise" in message.lower()


def cmd_gtest(paths):
    runs = []
    for path in paths:
        label = Path(path).stem
        doc = load_json(path)
        if not isinstance(doc, dict) or "testsuites" not in doc:
            print(f"{label}: no gtest report in {path} (the binary crashed, was stopped or never ran)")
            runs.append(None)
            continue
        outcomes = gtest_outcomes(doc)
        failures = [(n, m) for n, (o, m) in outcomes.items() if o == "failed"]
        bitwise = sum(is_bitwise(n, m) for n, m in failures)
        print(f"{label}: {gtest_line(doc)} ({doc.get('time', '?')})"
              + (f"; {bitwise} of the failures are bitwise checks" if failures else ""))
        for name, message in failures[:12]:
            print(f"  FAILED {name}: {message[:200]}")
        runs.append(outcomes)
    present = [r for r in runs if r is not None]
    if len(present) > 1:
        names = sorted(set().union(*present))
        differ = [n for n in names if len({r.get(n, ("absent",))[0] for r in present}) > 1]
        if differ:
            print(f"the runs disagree on {len(differ)} test(s) (outcome per run):")
            for n in differ[:12]:
                print(f"  {n}: " + ", ".join(r.get(n, ("absent",))[0] for r in present))
        else:
            print(f"the {len(present)} runs agree on every test's outcome")
    failed = any(r is None or any(o == "failed" for o, _ in r.values()) for r in runs)
    return 1 if failed or not runs else 0


# ---- pounce bench records -------------------------------------------------------------------------------

def bench_rows(records):
    rows = []
    for r in records:
        rows.append([r.get("impl", "?"), r.get("pass", "?"), r.get("preset", "?"), str(r.get("ranks", "?")),
                     str(r.get("tokens_per_rank", "?")), fmt(r.get("median_ms"), "%.3f"),
                     fmt(r.get("tflops"), "%.1f"), fmt(r.get("speedup_vs_baseline"), "%.2fx"),
                     fmt(r.get("late_speedup_vs_baseline"), "%.2fx"), fmt(r.get("sm_clock_mhz"), "%.0f"),
                     fmt(r.get("power_w"), "%.0f"), (r.get("error") or "")[:60]])
    return rows


BENCH_HEADER = ["impl", "pass", "preset", "ranks", "T/rank", "median ms", "TFLOP/s", "speedup", "late x",
                "SM MHz", "W/GPU", "error"]


def bench_line(records):
    ours = [r for r in records if r.get("impl") != "baseline"]
    errors = sum(1 for r in records if r.get("error"))
    speedups = [r["speedup_vs_baseline"] for r in ours if isinstance(r.get("speedup_vs_baseline"), (int, float))]
    line = f"{len(records)} records, {errors} not measured"
    if speedups:
        line += f", speedup {min(speedups):.2f}x..{max(speedups):.2f}x"
    return line


def cmd_bench(paths):
    status = 0
    for path in paths:
        records = load_json(path)
        if not isinstance(records, list):
            print(f"{path}: no records (pounce bench did not finish)")
            status = 1
            continue
        print(f"== {Path(path).name}: {bench_line(records)}")
        print(table(bench_rows(records), BENCH_HEADER))
        status |= any(r.get("error") for r in records)
    return status


# ---- pounce run reports ---------------------------------------------------------------------------------

def run_line(doc):
    timing, check = doc.get("timing", {}), doc.get("check", {})
    bitwise = check.get("bitwise_repeat")
    return (f"{'PASS' if doc.get('passed') else 'FAIL'}, forward {fmt(timing.get('forward_ms'), '%.3f')} ms, "
            f"backward {fmt(timing.get('backward_ms'), '%.3f')} ms, repeat "
            f"{'bitwise equal' if bitwise else 'DIFFERS' if bitwise is False else 'not checked'}")


def cmd_run(paths):
    status = 0
    for path in paths:
        doc = load_json(path)
        if not isinstance(doc, dict) or doc.get("command") != "run":
            print(f"{path}: no pounce run report")
            status = 1
            continue
        print(f"{doc.get('preset')} ({doc.get('config', {}).get('kernel_path')}): {run_line(doc)}")
        status |= not doc.get("passed")
    return status


# ---- A/B ------------------------------------------------------------------------------------------------

def cmd_ab(out, label_a, label_b):
    out = Path(out)
    sides = {"A": {}, "B": {}}  # side -> round -> records
    for path in sorted(out.glob("ab_r*_*.json")):
        m = re.fullmatch(r"ab_r(\d+)_([AB])\.json", path.name)
        records = load_json(path) if m else None
        if isinstance(records, list):
            sides[m.group(2)][int(m.group(1))] = [r for r in records if r.get("impl") != "baseline"]
    impls = {s: {r.get("impl") for rs in sides[s].values() for r in rs} for s in sides}
    # Settings that choose another --impl each are compared impl against impl, as the same configuration.
    by_impl = impls["A"] == impls["B"]

    def key(r):
        return (r.get("preset"), r.get("pass"), r.get("ranks"), r.get("tokens_per_rank"),
                r.get("impl") if by_impl else "")

    values = {}  # key -> side -> round -> (median, late median)
    for side, rounds in sides.items():
        for rnd, records in rounds.items():
            for r in records:
                values.setdefault(key(r), {"A": {}, "B": {}})[side][rnd] = (r.get("median_ms"), r.get("late_median_ms"))
    results, rows = [], []
    for k, v in sorted(values.items(), key=lambda kv: [str(x) for x in kv[0]]):
        paired = sorted(set(v["A"]) & set(v["B"]))
        ratios, late = [], []
        for rnd in paired:
            (a, a_late), (b, b_late) = v["A"][rnd], v["B"][rnd]
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0:
                ratios.append(b / a)
            if isinstance(a_late, (int, float)) and isinstance(b_late, (int, float)) and a_late > 0:
                late.append(b_late / a_late)
        a_ms = [x for x, _ in v["A"].values() if isinstance(x, (int, float))]
        b_ms = [x for x, _ in v["B"].values() if isinstance(x, (int, float))]
        result = {"preset": k[0], "pass": k[1], "ranks": k[2], "tokens_per_rank": k[3], "impl": k[4] or None,
                  "a_ms": a_ms, "b_ms": b_ms, "ratio": statistics.median(ratios) if ratios else None,
                  "late_ratio": statistics.median(late) if late else None, "rounds": len(ratios)}
        results.append(result)
        rows.append([str(k[0]), str(k[1]), f"{k[2]}x{k[3]}", k[4] or "",
                     fmt(statistics.median(a_ms) if a_ms else None, "%.3f"),
                     fmt(statistics.median(b_ms) if b_ms else None, "%.3f"),
                     fmt(result["ratio"], "%.4f"), fmt(result["late_ratio"], "%.4f"), str(len(ratios))])
    with open(out / "ab.json", "w") as f:
        json.dump({"a": label_a, "b": label_b, "results": results}, f, indent=1)
    print(f"A = {label_a!r}, B = {label_b!r}; B/A = time ratio (below 1: B faster), median over the rounds "
          "of each round's pair of processes")
    print(table(rows, ["preset", "pass", "ranks x T", "impl", "A ms", "B ms", "B/A", "late B/A", "rounds"]))
    return 0 if results and all(r["ratio"] is not None for r in results) else 1


# ---- the step table -------------------------------------------------------------------------------------

def pytest_line(paths):
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for path in paths:
        try:
            root = ElementTree.parse(path).getroot()
        except (OSError, ElementTree.ParseError):
            return f"unreadable {path.name}"
        for suite in [root] if root.tag == "testsuite" else root.iter("testsuite"):
            for k in totals:
                totals[k] += int(suite.get(k, 0))
    bad = totals["failures"] + totals["errors"]
    passed = totals["tests"] - bad - totals["skipped"]
    ranks = f" (rank files: {len(paths)})" if len(paths) > 1 else ""
    return f"{passed} passed, {bad} failed, {totals['skipped']} skipped{ranks}"


def step_result(out, name, rc):
    """One line on what the step's JSON (or pytest XML) says."""
    doc = load_json(out / f"{name}.json")
    if isinstance(doc, dict) and "testsuites" in doc:
        line = gtest_line(doc)
        return line + ("; the sanitizer reported errors" if rc == 99 and name.startswith("sanitize") else "")
    if isinstance(doc, list):
        return bench_line(doc)
    if isinstance(doc, dict) and doc.get("command") == "run":
        return run_line(doc)
    if isinstance(doc, dict) and "max_abs_loss_diff" in doc:
        return (f"final loss pounce {fmt(doc.get('pounce', {}).get('final_loss'), '%.4f')}, baseline "
                f"{fmt(doc.get('baseline', {}).get('final_loss'), '%.4f')}, max |diff| "
                f"{fmt(doc.get('max_abs_loss_diff'), '%.4f')}")
    xmls = [p for p in [out / f"{name}.xml"] + sorted(out.glob(f"{name}_rank*.xml")) if p.exists()]
    if xmls:
        return pytest_line(xmls)
    return f"see {name}.log" if rc not in (0, None) else ""


def step_status(rc):
    if rc is None:
        return "skipped (deadline)"
    if rc == 0:
        return "ok"
    return f"rc {rc} (time limit)" if rc in (124, 137) else f"rc {rc}"


def pack(out, job):
    """Keeps the device tool's bring-back limit: past MAX_FILES_BACK files, every file goes into
    logs_<JOB>.tar.gz and the summaries and records stay beside it."""
    files = sorted(p for p in out.iterdir() if p.is_file())
    tars = [p for p in files if p.name.startswith("logs_") and p.name.endswith(".tar.gz")]
    rest = [p for p in files if p not in tars]
    if len(files) <= MAX_FILES_BACK or not rest:
        return ""

    def rank(p):  # what stays outside the archive first: the summaries, the records, the CSV exports
        order = ["steps.jsonl", "ab.json"]
        if p.name in order:
            return (order.index(p.name), p.name)
        if p.suffix == ".json":
            return (2 if p.name.startswith("bench") else 3, p.name)
        return ({".csv": 4, ".png": 5, ".xml": 5}.get(p.suffix, 6), p.name)

    room = MAX_FILES_BACK - len(tars) - 1
    keep = set(sorted(rest, key=rank)[:max(room, 0)])
    archive = out / f"logs_{job}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for p in rest:
            tar.add(p, arcname=p.name)
    for p in rest:
        if p not in keep:
            p.unlink()
    return (f"{len(rest)} files of {out} are in {archive.name} (tar -xzf to read them); beside it: "
            + " ".join(sorted(p.name for p in keep)))


def cmd_finish(out, run_id, job):
    out = Path(out)
    steps = []
    try:
        with open(out / "steps.jsonl") as f:
            steps = [s for s in map(json.loads, filter(str.strip, f)) if s.get("run") == run_id]
    except OSError:
        pass
    rows = [[s["name"], step_status(s.get("rc")), str(s.get("seconds", "")), step_result(out, s["name"], s.get("rc"))]
            for s in steps]
    packed = pack(out, job)
    if packed:
        print(packed)
    print(f"== tools/gpu.sh {job}: {len(steps)} steps, logs and JSON in {out}")
    if rows:
        print(table(rows, ["step", "status", "s", "result"]))
    return 0


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    command, args = argv[1], argv[2:]
    commands = {"gtest": lambda: cmd_gtest(args), "bench": lambda: cmd_bench(args), "run": lambda: cmd_run(args),
                "ab": lambda: cmd_ab(*args), "finish": lambda: cmd_finish(*args)}
    if command not in commands:
        print(__doc__)
        return 2
    return commands[command]()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
