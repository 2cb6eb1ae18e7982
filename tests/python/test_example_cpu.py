"""examples/train_moe.py as a smoke test on the CPU backend: both models (pounce and the PyTorch baseline)
start from the same loss, train, and the run's JSON is written."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("pounce", reason="the pounce Python module is not built (needs nanobind; run tools/setup.sh)")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_train_moe_on_cpu(tmp_path):
    sys.path.insert(0, str(EXAMPLES))
    try:
        import train_moe
    finally:
        sys.path.remove(str(EXAMPLES))
    args = ["--device", "cpu", "--steps", "12", "--layers", "1", "--hidden", "64", "--intermediate", "64",
            "--shared-intermediate", "64", "--experts", "4", "--heads", "2", "--vocab", "64", "--seq", "16",
            "--batch", "4", "--warmup", "2", "--lr", "1e-2", "--log-every", "100", "--out", str(tmp_path)]
    runs = train_moe.main(args)
    pounce_loss, baseline_loss = runs["pounce"]["loss"], runs["baseline"]["loss"]
    assert abs(pounce_loss[0] - baseline_loss[0]) < 0.02, (pounce_loss[0], baseline_loss[0])
    assert pounce_loss[-1] < pounce_loss[0] - 0.2 and baseline_loss[-1] < baseline_loss[0] - 0.2
    with open(tmp_path / "train_moe.json") as f:
        run = json.load(f)
    assert len(run["pounce"]["loss"]) == 12 and run["config"]["ranks"] == 1


def test_train_moe_fp8_on_cpu(tmp_path):
    """--precision fp8: the third run trains from the same start and its final loss is compared with BF16's."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import train_moe
    finally:
        sys.path.remove(str(EXAMPLES))
    args = ["--device", "cpu", "--precision", "fp8", "--fp8-tolerance", "0.05", "--steps", "10", "--layers", "1",
            "--hidden", "128", "--intermediate", "128", "--experts", "4", "--heads", "2", "--vocab", "64",
            "--seq", "16", "--batch", "4", "--warmup", "2", "--lr", "1e-2", "--log-every", "100",
            "--out", str(tmp_path)]
    runs = train_moe.main(args)
    bf16_loss, fp8_loss = runs["pounce"]["loss"], runs["pounce_fp8"]["loss"]
    assert abs(fp8_loss[0] - bf16_loss[0]) < 0.02, (fp8_loss[0], bf16_loss[0])
    assert fp8_loss[-1] < fp8_loss[0] - 0.2
    with open(tmp_path / "train_moe.json") as f:
        run = json.load(f)
    assert run["fp8_final_loss_rel_diff"] <= 0.05 and len(run["pounce_fp8"]["loss"]) == 10
