"""Pounce: the Mixture-of-Experts layer after the router, for Hopper GPUs joined by NVLink.

This package is the C++ API (``include/pounce/``) for Python; :mod:`pounce.torch` builds the PyTorch
layer (autograd, ``torch.compile``, ``nn.Module``) on top of it.

Tensors are passed as anything that speaks DLPack (numpy arrays on the CPU backend, torch tensors on
either backend) and are never copied or converted: wrong dtypes, shapes, devices or strides raise
:class:`PounceError` (a ``ValueError``) naming the argument. numpy has no bfloat16, so a ``uint16``
array stands for bf16 bit patterns (``pounce.bf16_bits`` makes one from float values).

Weights are grouped as ``routed = (w_gate [El,I,H], w_up [El,I,H], w_down [El,H,I])`` and
``shared = (gate [Is,H], up [Is,H], down [H,Is])`` (or ``None``); error messages name them
``routed.gate``, ``shared.down``, ... as the C++ structs do.

The CPU backend runs the exact reference over the R ranks of a group living in one process:
``Group.create_cpu(R)`` returns R handles, and rank r's calls must come from its own Python thread
(the calls release the GIL and meet inside the library, as GPUs meet at NVLink barriers).
"""
from __future__ import annotations

import importlib.util

# torch first, where it is installed: its wheel ships its own NCCL (libnccl.so.2), newer than the one pounce._C
# links. Loaded after pounce._C, torch would find pounce's NCCL already resolved under that name and fail
# (undefined symbol ncclCommResume); loaded first, both use torch's, which pounce's calls are compatible with.
if importlib.util.find_spec("torch") is not None:
    import torch  # noqa: F401

from . import _C
from ._C import (
    BLOCK_M,
    Activation,
    ActivationKind,
    Backend,
    CombineMode,
    KernelPath,
    Config,
    Group,
    Precision,
    Preset,
    PounceError,
    Shape,
    Workspace,
    WorkspaceBytes,
    backward,
    build_info,
    bytes_required,
    check_errors,
    find_preset,
    forward,
    presets,
    quantize_weights_fp8,
    recompute_forward_context,
)

__version__ = _C.__version__
# Capabilities of this build, for layers that adapt: weights (and fused gate/up gradients) as row-strided
# views read and written in place, and weight gradients left as None not computed.
supports_expert_stride = bool(getattr(_C, "supports_expert_stride", False))
supports_frozen_weight_grads = bool(getattr(_C, "supports_frozen_weight_grads", False))

__all__ = [
    "BLOCK_M",
    "Activation",
    "ActivationKind",
    "Backend",
    "CombineMode",
    "KernelPath",
    "Config",
    "Group",
    "Precision",
    "Preset",
    "PounceError",
    "Shape",
    "Workspace",
    "WorkspaceBytes",
    "backward",
    "bf16_bits",
    "bf16_to_float",
    "build_info",
    "bytes_required",
    "check_errors",
    "find_preset",
    "forward",
    "presets",
    "quantize_weights_fp8",
    "recompute_forward_context",
]


def bf16_bits(values):
    """float values -> uint16 numpy array of their bf16 bit patterns (round to nearest even)."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(np.asarray(values, dtype=np.float32))
    return np.where(nan, 0x7FC0, rounded).astype(np.uint16)


def bf16_to_float(bits):
    """uint16 numpy array of bf16 bit patterns -> float32 values."""
    import numpy as np

    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
