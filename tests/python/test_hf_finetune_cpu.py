"""examples/hf_finetune.py on the CPU backend: a tiny random-init Qwen3-MoE trained with the "pounce" and
"grouped_mm" experts from the same weights on the same data; both start from the same loss, both
learn, and the run's JSON holds both curves and their timings."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("pounce", reason="the pounce Python module is not built (needs nanobind; run tools/setup.sh)")
try:
    from transformers.integrations.moe import ExpertsInterface  # noqa: F401
except ImportError:
    pytest.skip("transformers has no experts interface (needs transformers 5)", allow_module_level=True)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 30


def test_hf_finetune_on_cpu(tmp_path):
    sys.path.insert(0, str(EXAMPLES))
    try:
        import hf_finetune
    finally:
        sys.path.remove(str(EXAMPLES))
    args = ["--device", "cpu", "--impls", "pounce,grouped_mm", "--steps", str(STEPS), "--warmup", "5",
            "--layers", "1", "--batch", "4", "--seq", "32", "--lr", "3e-3", "--log-every", "10", "--out", str(tmp_path)]
    hf_finetune.main(args)
    with open(tmp_path / "hf_finetune.json") as f:
        run = json.load(f)
    assert run["implementations"] == ["pounce", "grouped_mm"]
    assert run["config"]["model_type"] == "qwen3_moe" and run["config"]["tokens_per_step"] == 4 * 32
    pounce_run, grouped = run["runs"]["pounce"], run["runs"]["grouped_mm"]
    for name, curve in (("pounce", pounce_run), ("grouped_mm", grouped)):
        assert len(curve["loss"]) == STEPS and len(curve["step_ms"]) == STEPS, name
        assert curve["timed_steps"] == STEPS - 5 and curve["median_step_ms"] > 0, name
        first, last = curve["loss"][0], sum(curve["loss"][-5:]) / 5
        assert last < first - 0.3, f"{name}: loss {first:.4f} -> {last:.4f} (mean of the last 5 steps)"
    # Same init weights and data: the first step's losses differ only by the experts' rounding.
    assert abs(pounce_run["loss"][0] - grouped["loss"][0]) <= 1e-4 * abs(grouped["loss"][0]), \
        (pounce_run["loss"][0], grouped["loss"][0])
    assert sum(w["recomputes"] for w in pounce_run["workspaces"]) == 0  # a workspace per layer, no recompute
