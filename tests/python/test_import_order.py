"""pounce and torch import in either order (each in a fresh interpreter, so neither is loaded already).

torch's wheel ships its own NCCL under the soname pounce._C links (libnccl.so.2); loaded after pounce._C, torch
failed with "undefined symbol: ncclCommResume". pounce/__init__.py imports torch first where it is installed.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="torch is not installed: nothing to import beside pounce")


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))


@pytest.mark.parametrize("code", [
    "import pounce, torch; import pounce.torch",
    "import torch, pounce; import pounce.torch",
    "import pounce.torch; import torch; torch.zeros(1)",
])
def test_either_import_order(code):
    result = run_python(code)
    assert result.returncode == 0, f"{code!r} failed:\n{result.stderr[-2000:]}"
