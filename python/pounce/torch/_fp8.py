"""FP8 weights of the PyTorch layer: block-scaled E4M3 copies of the routed weights, quantized once per change.

With ``precision="fp8"`` (docs/design.md §1) the layer's parameters stay bf16 (or fp32 master weights) and the
routed experts read FP8 copies of them in both orientations (forward ``x·Wᵀ`` and backward ``dy·W`` both read
K-major tiles). An :class:`Fp8Cache` holds those copies: twelve tensors allocated once, the (data, scale) pairs
of gate, up, down, gate_t, up_t, down_t in :func:`pounce.quantize_weights_fp8`'s layout (data uint8 holding the
e4m3 bits, scale fp32 ``[El, ceil(N/128), ceil(K/128)]``).

When to quantize. The op ``pounce::quantize_fp8`` runs in every forward, before ``pounce::moe_forward``, and
quantizes only when a weight changed since the cache's last quantization: another storage, offset, shape,
strides or dtype, or a bumped ``tensor._version`` (every in-place write bumps it: an optimizer step, a
``load_state_dict``, ``copy_`` under ``no_grad``). The check is on the host and reads nothing from the device,
so a training step quantizes once, after its optimizer step, however many micro-batches it runs. Writes the
version counter does not see (through ``.data``, or a CUDA-graph replay of an optimizer step) need
:meth:`Fp8Cache.invalidate`. The cache tensors go into the ops as arguments (``quantize_fp8`` declares that it
mutates them), so torch.compile orders the quantization before the forward and captures both without a graph
break.

CUDA graphs. While the stream is being captured the op always records the quantization (one stream-ordered
launch, into the same tensors), so every replay quantizes the weights as they are then: one quantization per
replayed step, never a stale copy. The capture itself executes nothing, so it leaves the cache marked stale
and the next eager forward quantizes again.

Dense bf16 sources. ``pounce.quantize_weights_fp8`` reads dense bf16 tensors; fp32 master weights and
row-strided views (the halves of a fused ``w_gate_up``) are quantized from a dense bf16 copy made for the
quantization (and dropped after it).
"""
from __future__ import annotations

import itertools
import weakref
from typing import List, Optional

import torch
from torch import Tensor

import pounce

_BLOCK = 128  # pounce's FP8 weight blocks: 128 x 128
_NAMES = ("gate", "up", "down", "gate_t", "up_t", "down_t")


def _blocks(n: int) -> int:
    return -(-n // _BLOCK)


def fp8_shapes(num_local_experts: int, intermediate: int, hidden: int) -> list[tuple[tuple, tuple]]:
    """(data shape, scale shape) of gate, up, down, gate_t, up_t, down_t (include/pounce/fp8.h)."""
    El, I, H = num_local_experts, intermediate, hidden
    rows_cols = ((I, H), (I, H), (H, I), (H, I), (H, I), (I, H))
    return [((El, n, k), (El, _blocks(n), _blocks(k))) for n, k in rows_cols]


def pairs(tensors) -> list[tuple[Tensor, Tensor]]:
    """The twelve cache tensors as the six (data, scale) pairs pounce takes."""
    return [(tensors[2 * i], tensors[2 * i + 1]) for i in range(6)]


_handles = itertools.count()
_caches: "weakref.WeakValueDictionary[int, Fp8Cache]" = weakref.WeakValueDictionary()


class Fp8Cache:
    """The FP8 copies of one layer's routed weights (``El`` experts, ``w_gate``/``w_up [El, I, H]``,
    ``w_down [El, H, I]``), in both orientations, allocated once on ``device``.

    ``tensors``: twelve tensors, (data uint8, scale fp32) for gate, up, down, gate_t, up_t, down_t.
    ``quantizations``: how many times the host quantized into it (a CUDA-graph replay is not counted).
    :class:`pounce.torch.MoE` with ``precision="fp8"`` owns one (``module.fp8_cache``); the functional
    :func:`pounce.torch.moe` takes one per layer (``fp8_cache=``). Create it outside compiled code.
    """

    def __init__(self, num_local_experts: int, intermediate: int, hidden: int, device=None):
        self.shape = (num_local_experts, intermediate, hidden)
        self.quantizations = 0
        self._key = None
        self.tensors = self._allocate(torch.device(device) if device is not None else torch.device("cpu"))
        self._register()

    def _register(self) -> None:
        self.handle = next(_handles)
        _caches[self.handle] = self

    def _allocate(self, device: torch.device) -> tuple[Tensor, ...]:
        tensors = []
        for data, scale in fp8_shapes(*self.shape):
            tensors.append(torch.zeros(data, dtype=torch.uint8, device=device))
            tensors.append(torch.ones(scale, dtype=torch.float32, device=device))
        return tuple(tensors)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def to(self, device) -> "Fp8Cache":
        """Moves the cache to ``device`` (new tensors there, marked stale) unless it is there already."""
        device = torch.device(device)
        if device != self.device:
            self.tensors = self._allocate(device)
            self._key = None
        return self

    def invalidate(self) -> None:
        """Marks the copies stale: the next forward quantizes (for weight writes ``_version`` does not see)."""
        self._key = None

    def as_pairs(self) -> list[tuple[Tensor, Tensor]]:
        """The six (data, scale) pairs (gate, up, down, gate_t, up_t, down_t)."""
        return pairs(self.tensors)

    # deepcopy and pickling give a cache of its own (own handle, stale), never one sharing this one's state
    def __getstate__(self):
        return {"shape": self.shape, "tensors": self.tensors, "quantizations": self.quantizations}

    def __setstate__(self, state):
        self.shape, self.tensors, self.quantizations = state["shape"], state["tensors"], state["quantizations"]
        self._key = None
        self._register()

    def __repr__(self) -> str:
        El, I, H = self.shape
        return f"Fp8Cache(num_local_experts={El}, intermediate={I}, hidden={H}, device={self.device}, " \
               f"quantizations={self.quantizations})"


def _source_key(weight: Tensor):
    """What identifies the values of a weight without reading them: its storage (held weakly, so a freed
    temporary never matches a new tensor at the same address), where and how the tensor views it, and the
    version counter that every in-place write bumps (shared by all views of a tensor). None when the tensor
    has no version counter (an inference tensor): such weights are quantized on every call."""
    try:
        version = weight._version
    except RuntimeError:
        return None
    return (weakref.ref(weight.untyped_storage()), weight.storage_offset(), tuple(weight.shape), weight.stride(),
            weight.dtype, weight.device, version)


def _dense_bf16(weight: Tensor) -> Tensor:
    weight = weight.detach()
    if weight.dtype != torch.bfloat16:
        weight = weight.to(torch.bfloat16)
    return weight.contiguous()


def _capturing(weight: Tensor) -> bool:
    return weight.is_cuda and torch.cuda.is_current_stream_capturing()


def cache_of(handle: int) -> Fp8Cache:
    try:
        return _caches[handle]
    except KeyError:
        raise pounce.PounceError(
            f"pounce: FP8 cache handle {handle} is unknown (its Fp8Cache was freed); keep the pounce.torch.Fp8Cache "
            f"alive while the layer runs"
        ) from None


@torch.library.custom_op("pounce::quantize_fp8", mutates_args=("fp8",))
def quantize_fp8(w_gate: Tensor, w_up: Tensor, w_down: Tensor, fp8: List[Tensor], cache: int) -> None:
    """Quantizes the routed weights (any float dtype, possibly row-strided views) into ``fp8`` (the twelve
    tensors of the Fp8Cache with handle ``cache``) when they changed since its last quantization, or
    always while a CUDA graph is being captured (see the module docstring)."""
    state = cache_of(cache)
    capturing = _capturing(w_gate)
    key = tuple(_source_key(w) for w in (w_gate, w_up, w_down))
    if not capturing and state._key is not None and state._key == key:
        return
    state._key = None  # a failing quantization leaves the cache stale
    stream = torch.cuda.current_stream(w_gate.device).cuda_stream if w_gate.is_cuda else 0
    pounce.quantize_weights_fp8(tuple(_dense_bf16(w) for w in (w_gate, w_up, w_down)), pairs(fp8), stream)
    state.quantizations += 1
    if not capturing and None not in key:
        state._key = key


@quantize_fp8.register_fake
def _quantize_fp8_fake(w_gate, w_up, w_down, fp8, cache):
    return None


def check_cache(fp8_cache: Optional[Fp8Cache], w_gate_rows: int, w_down: Tensor, fused: bool) -> None:
    """The cache matches the routed weights' shape: El, H, I from w_down [El, H, I]."""
    if not isinstance(fp8_cache, Fp8Cache):
        raise TypeError(
            f"pounce: argument 'fp8_cache' is {type(fp8_cache).__name__}; pass a pounce.torch.Fp8Cache"
        )
    El, H, I = w_down.shape
    if fp8_cache.shape != (El, I, H) or w_gate_rows != (2 * I if fused else I):
        raise pounce.PounceError(
            f"pounce: argument 'fp8_cache' holds {fp8_cache.shape[0]} experts of intermediate "
            f"{fp8_cache.shape[1]}, hidden {fp8_cache.shape[2]}, but the routed weights are [{El}, {I}, {H}] "
            f"(w_down [{El}, {H}, {I}]); create it as pounce.torch.Fp8Cache({El}, {I}, {H}, device)"
        )
