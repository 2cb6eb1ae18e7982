"""The custom ops ``pounce::moe_forward`` / ``pounce::moe_backward`` and the autograd.Function on top.

The ops are opaque to torch.compile (fake implementations give the output metadata), so a compiled
graph holds one node per pass and no graph break. They run on the current CUDA stream, allocate their
outputs through the caching allocator and read nothing back to the host, so a forward+backward step
can be captured in a CUDA graph and replayed with new routing written into the same input tensors.

Forward context. The workspace keeps the context of the last forward run in it; backward needs the
context of *its* forward. ``moe_forward`` returns, next to ``out``, a one-byte *ticket* tensor that
autograd saves for backward; the workspace's :class:`~pounce.torch._registry.Slot` records the data
pointer of the ticket of the forward whose context it holds. A ticket is alive from its forward to
its backward, so no other ticket can have its address in that time: ``moe_backward`` compares
addresses and, when another forward used the workspace in between (the other layers of the model,
another micro-batch), rebuilds the context with ``recompute_forward_context`` first. After backward
the slot forgets its ticket (backward may use the context's buffers). The decision is taken on the
host when the op runs, so a CUDA graph records the recomputes its captured order needs and replays
them, and torch.compile may order the ops as it likes.

Fused gate/up weights. ``moe(..., w_gate_up=[El,2I,H])`` (transformers' layout: gate rows then up rows)
passes the two halves as views when the C++ layer reads weights with an expert stride
(``pounce.supports_expert_stride``), else as contiguous copies. Backward allocates one ``d_w_gate_up``
and the kernels write the halves into it (views), or it concatenates the two halves once (copies), so
autograd never scatters half-size gradients into zero-filled full-size ones.

Frozen weights. When no routed (or no shared) weight requires grad, backward returns no gradient for
them and passes the set as None, so the layer launches none of its weight-gradient GEMMs
(``pounce.supports_frozen_weight_grads``). With a build that cannot skip them they go to one scratch set per
shape, dtype and device that every frozen layer reuses.

FP8. A layer of precision fp8 takes an :class:`~pounce.torch._fp8.Fp8Cache` (``fp8_cache=``): the forward first
runs ``pounce::quantize_fp8`` (which re-quantizes the weights into the cache only when they changed, see
``_fp8.py``), then passes the cache's twelve tensors to ``moe_forward``, and backward passes them to
``moe_backward`` (they are kept on ctx, not saved tensors: the quantize op of a later micro-batch's forward
declares a mutation of them, which autograd's saved-tensor version check would take for a change). The weights
still go in as bf16 (the layer checks them, and the CPU backend computes from them); their gradients come
back as in BF16.

Device errors. A GPU kernel records a failure (a timed-out peer wait, an expert id out of range) instead of
trapping. ``moe_forward`` (before its launch) and the backward ops (after theirs) run the non-blocking
``pounce.check_errors`` on the layer's workspace inside the op, so torch.compile sees no extra node, and raise
what finished calls recorded, naming the layer; ``register_layer(check_errors=False)`` turns it off. Skipped
while a CUDA graph is being captured: ``pounce.torch.check_errors(synchronize=True)`` checks a graph's
replays.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

import pounce

from . import _fp8, _registry

_BF16 = torch.bfloat16


def _stream(tensor: Tensor) -> int:
    return torch.cuda.current_stream(tensor.device).cuda_stream if tensor.is_cuda else 0


def _shared(ws_gate, ws_up, ws_down):
    if ws_gate is None and ws_up is None and ws_down is None:
        return None
    return _routed(ws_gate, ws_up, ws_down)


def _plain(tensor: Optional[Tensor]) -> Optional[Tensor]:
    """Without requires_grad: torch refuses __dlpack__ on such tensors (the importer would take a slow
    detour through torch.utils.dlpack on every call)."""
    return tensor.detach() if tensor is not None and tensor.requires_grad else tensor


def _routed(w_gate, w_up, w_down):
    return (_plain(w_gate), _plain(w_up), _plain(w_down))


def _like(tensor: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    return torch.empty_like(tensor, dtype=dtype, memory_format=torch.contiguous_format)


def _empty_grads(like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Three distinct empty tensors (an op's outputs must not alias) for a set without gradients."""
    return tuple(like.new_empty((0,)) for _ in range(3))


def supports_frozen_weight_grads() -> bool:
    """True when the C++ layer skips the weight gradients of a set passed as None (no GEMM, nothing written)."""
    return bool(getattr(pounce, "supports_frozen_weight_grads", False))


def supports_expert_stride() -> bool:
    """True when the C++ layer reads weight views whose experts are strided apart (the halves of a fused
    gate_up tensor) and writes their gradients in place."""
    return bool(getattr(pounce, "supports_expert_stride", False))


def split_gate_up(w_gate_up: Tensor) -> tuple[Tensor, Tensor]:
    """[El,2I,H] (gate rows then up rows) -> (gate, up) [El,I,H]: views when the C++ layer reads them in
    place, else contiguous copies."""
    intermediate = w_gate_up.shape[1] // 2
    gate, up = w_gate_up[:, :intermediate], w_gate_up[:, intermediate:]
    if supports_expert_stride():
        return gate, up
    return gate.contiguous(), up.contiguous()


# -- weight-gradient buffers --------------------------------------------------------------------------

_scratch: dict[tuple, tuple[Tensor, ...]] = {}


def _scratch_grads(weights, dtype: torch.dtype) -> tuple[Tensor, ...]:
    key = (tuple(tuple(w.shape) for w in weights), dtype, weights[0].device)
    if key not in _scratch:
        _scratch[key] = tuple(_like(w, dtype) for w in weights)
    return _scratch[key]


def free_scratch() -> None:
    """Drops the scratch gradients of frozen layers (they are allocated again when needed)."""
    _scratch.clear()


class _GradSet:
    """The gradients of one weight set (gate, up, down): what the kernels write and what the op returns.

    ``fused``: gate and up are the halves of one [El,2I,H] tensor; its gradient is returned whole in the
    gate slot and the up slot returns an empty tensor. ``wanted`` False: nothing is returned (three empty
    tensors), and nothing is computed where the layer skips a set passed as None (else scratch is written)."""

    def __init__(self, weights, dtype: torch.dtype, *, wanted: bool, fused: bool):
        self.concat = False
        if not wanted:
            self.written = None if supports_frozen_weight_grads() else _scratch_grads(weights, dtype)
            self.returned = _empty_grads(weights[0])
            return
        gate, up, down = weights
        if not fused:
            self.written = tuple(_like(w, dtype) for w in weights)
            self.returned = self.written
            return
        El, intermediate, hidden = gate.shape
        d_gate_up = gate.new_empty((El, 2 * intermediate, hidden), dtype=dtype)
        d_down = _like(down, dtype)
        if supports_expert_stride():
            self.written = (d_gate_up[:, :intermediate], d_gate_up[:, intermediate:], d_down)
        else:
            self.written = (_like(gate, dtype), _like(up, dtype), d_down)
            self.concat = True
        self.returned = (d_gate_up, gate.new_empty((0,), dtype=dtype), d_down)

    def finish(self) -> tuple[Tensor, Tensor, Tensor]:
        if self.concat:
            torch.cat((self.written[0], self.written[1]), dim=1, out=self.returned[0])
        return self.returned


def _fake_grad_set(weights, dtype, *, wanted: bool, fused: bool):
    if not wanted:
        return _empty_grads(weights[0])
    gate, up, down = weights
    if not fused:
        return tuple(_like(w, dtype) for w in weights)
    El, intermediate, hidden = gate.shape
    return (gate.new_empty((El, 2 * intermediate, hidden), dtype=dtype), gate.new_empty((0,), dtype=dtype),
            _like(down, dtype))


# -- device errors --------------------------------------------------------------------------------------


def _check_device_errors(handle: int, slot, x: Tensor, when: str) -> None:
    """pounce.check_errors on the layer's workspace, without a host sync (one read of host-mapped memory):
    raises the failure an earlier call's kernels recorded once they ended (that call's outputs are not
    valid), naming the layer. Not for a layer registered with ``check_errors=False``, nor while the stream
    is being captured (the check would not be part of the graph: :func:`pounce.torch.check_errors` checks a
    replay)."""
    if not _registry.layer(handle).check_errors or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    _registry.check_layer_errors(handle, slot, when)


# -- the ops --------------------------------------------------------------------------------------------


@torch.library.custom_op("pounce::moe_forward", mutates_args=())
def moe_forward(
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    ws_gate: Optional[Tensor],
    ws_up: Optional[Tensor],
    ws_down: Optional[Tensor],
    layer: int,
    fp8: List[Tensor],
) -> tuple[Tensor, Tensor]:
    """out [T,H] bf16 and the ticket of this forward's context (see the module docstring). ``fp8``: the
    twelve tensors of the layer's Fp8Cache, for a layer of precision fp8."""
    slot = _registry.layer(layer).resolve(x.device)
    routed_fp8 = _routed_fp8(slot, fp8)
    out = _like(x)
    ticket = torch.zeros((1,), dtype=torch.uint8, device=x.device)  # its address is what counts
    with _registry._device_scope(x.device):
        _check_device_errors(layer, slot, x, "before its forward")
        slot.resident = None  # a failing forward leaves no valid context behind
        pounce.forward(
            slot.workspace, _plain(x), topk_idx, _plain(topk_weights), _routed(w_gate, w_up, w_down), out,
            _shared(ws_gate, ws_up, ws_down), _stream(x), routed_fp8=routed_fp8,
        )
    slot.resident = ticket.data_ptr()
    slot.forwards += 1
    return out, ticket


@moe_forward.register_fake
def _moe_forward_fake(x, topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, layer, fp8):
    return _like(x), x.new_empty((1,), dtype=torch.uint8)


def _routed_fp8(slot, fp8: List[Tensor]):
    """The (data, scale) pairs for pounce's ``routed_fp8=``, after checking that the layer's precision wants
    them (the C++ layer would accept and ignore them on a bf16 layer). ``fp8`` empty: none given (the ops
    take a list, not an optional one: torch < 2.12's schema inference has no ``Tensor[]?``)."""
    fp8 = fp8 or None
    is_fp8 = slot.workspace.config.precision == pounce.Precision.fp8
    if is_fp8 and fp8 is None:
        raise pounce.PounceError(
            "pounce: argument 'fp8_cache' is missing but the layer's precision is fp8; pass "
            "fp8_cache=pounce.torch.Fp8Cache(num_local_experts, intermediate, hidden, device)"
        )
    if not is_fp8 and fp8 is not None:
        raise pounce.PounceError(
            "pounce: argument 'fp8_cache' is given but the layer's precision is bf16; register the layer with "
            "precision='fp8', or leave fp8_cache out"
        )
    return _fp8.pairs(fp8) if fp8 is not None else None


def _ensure_context(slot, ticket, x, topk_idx, topk_weights, routed, shared, routed_fp8) -> None:
    if slot.resident == ticket.data_ptr():
        return
    slot.resident = None
    pounce.recompute_forward_context(
        slot.workspace, x, topk_idx, topk_weights, routed, shared, _stream(x), routed_fp8=routed_fp8
    )
    slot.resident = ticket.data_ptr()
    slot.recomputes += 1


def _run_backward(
    layer, ticket, d_out, x, topk_idx, topk_weights, routed, shared, d_routed, d_shared, fp8, *, accumulate: bool
) -> tuple[Tensor, Tensor]:
    """pounce.backward on the layer's workspace, after rebuilding the context of the ticket's forward if
    another forward used the workspace since; the weight gradients go to (or are added into, with
    ``accumulate``) d_routed and d_shared. Returns (d_x, d_topk_weights)."""
    slot = _registry.layer(layer).resolve(x.device)
    routed_fp8 = _routed_fp8(slot, fp8)
    x, topk_weights, d_out = _plain(x), _plain(topk_weights), _plain(d_out)
    d_x = _like(x)
    d_topk_weights = _like(topk_weights)
    with _registry._device_scope(x.device):
        _ensure_context(slot, ticket, x, topk_idx, topk_weights, routed, shared, routed_fp8)
        slot.resident = None
        pounce.backward(
            slot.workspace, x, topk_idx, topk_weights, routed, d_out, d_x, d_topk_weights, d_routed, shared,
            d_shared, accumulate, _stream(x), routed_fp8=routed_fp8,
        )
        _check_device_errors(layer, slot, x, "after its backward")
    return d_x, d_topk_weights


@torch.library.custom_op("pounce::moe_backward", mutates_args=())
def moe_backward(
    d_out: Tensor,
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    ws_gate: Optional[Tensor],
    ws_up: Optional[Tensor],
    ws_down: Optional[Tensor],
    ticket: Tensor,
    layer: int,
    weight_grad_dtype: torch.dtype,
    routed_grads: bool,
    shared_grads: bool,
    fused_gate_up: bool,
    fp8: List[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down); the weight
    gradients in ``weight_grad_dtype`` (bf16 or fp32). A set without gradients (no shared expert,
    ``routed_grads``/``shared_grads`` False) returns three empty tensors; with ``fused_gate_up`` the
    routed set is (d_w_gate_up [El,2I,H], empty, d_w_down). ``fp8``: as for moe_forward."""
    routed, shared = _routed(w_gate, w_up, w_down), _shared(ws_gate, ws_up, ws_down)
    d_routed = _GradSet(routed, weight_grad_dtype, wanted=routed_grads, fused=fused_gate_up)
    d_shared = _GradSet(shared, weight_grad_dtype, wanted=shared_grads, fused=False) if shared else None
    d_x, d_topk_weights = _run_backward(
        layer, ticket, d_out, x, topk_idx, topk_weights, routed, shared, d_routed.written,
        d_shared.written if d_shared else None, fp8, accumulate=False,
    )
    return (d_x, d_topk_weights) + d_routed.finish() + (d_shared.finish() if d_shared else _empty_grads(d_x))


@moe_backward.register_fake
def _moe_backward_fake(
    d_out, x, topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, ticket, layer,
    weight_grad_dtype, routed_grads, shared_grads, fused_gate_up, fp8,
):
    shared = _shared(ws_gate, ws_up, ws_down)
    d_routed = _fake_grad_set((w_gate, w_up, w_down), weight_grad_dtype, wanted=routed_grads, fused=fused_gate_up)
    d_shared = _fake_grad_set(shared, weight_grad_dtype, wanted=shared_grads, fused=False) if shared else None
    return (_like(x), _like(topk_weights)) + d_routed + (d_shared or _empty_grads(x))


@torch.library.custom_op(
    "pounce::moe_backward_accumulate",
    mutates_args=("main_w_gate", "main_w_up", "main_w_down", "main_ws_gate", "main_ws_up", "main_ws_down"),
)
def moe_backward_accumulate(
    d_out: Tensor,
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    ws_gate: Optional[Tensor],
    ws_up: Optional[Tensor],
    ws_down: Optional[Tensor],
    ticket: Tensor,
    layer: int,
    main_w_gate: Tensor,
    main_w_up: Optional[Tensor],
    main_w_down: Tensor,
    main_ws_gate: Optional[Tensor],
    main_ws_up: Optional[Tensor],
    main_ws_down: Optional[Tensor],
    fp8: List[Tensor],
) -> tuple[Tensor, Tensor]:
    """(d_x, d_topk_weights); the weight gradients are added into the fp32 ``main_*`` tensors
    (Megatron-style main_grad) instead of being returned. ``main_w_up`` None: ``main_w_gate`` is the
    main_grad of a fused [El,2I,H] gate_up weight. ``fp8``: as for moe_forward."""
    routed = _routed(w_gate, w_up, w_down)
    if main_w_up is not None:
        targets, halves = (main_w_gate, main_w_up, main_w_down), None
    else:
        intermediate = w_gate.shape[1]
        halves = (main_w_gate[:, :intermediate], main_w_gate[:, intermediate:])
        if supports_expert_stride():
            targets = halves + (main_w_down,)
            halves = None
        else:  # accumulate into contiguous copies, written back below
            targets = (halves[0].contiguous(), halves[1].contiguous(), main_w_down)
    result = _run_backward(
        layer, ticket, d_out, x, topk_idx, topk_weights, routed, _shared(ws_gate, ws_up, ws_down), targets,
        _shared(main_ws_gate, main_ws_up, main_ws_down), fp8, accumulate=True,
    )
    if halves is not None:
        halves[0].copy_(targets[0])
        halves[1].copy_(targets[1])
    return result


@moe_backward_accumulate.register_fake
def _moe_backward_accumulate_fake(d_out, x, topk_idx, topk_weights, *args):
    return _like(x), _like(topk_weights)


# -- argument checks ------------------------------------------------------------------------------------

_WEIGHT_NAMES = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")


def check_float(name: str, tensor: Tensor) -> None:
    """Integer, bool and complex tensors are refused (a silent cast would hide a wrong argument)."""
    if not tensor.is_floating_point():
        raise TypeError(
            f"pounce: argument '{name}' is {tensor.dtype}; pass a floating-point tensor (bf16, or fp32/fp16, "
            f"cast to bf16 by pounce.torch.MoE)"
        )


def check_devices(x: Tensor, named: dict) -> None:
    """Every tensor on x's device and materialised (meta tensors hold no data)."""
    for name, tensor in named.items():
        if tensor is None:
            continue
        if tensor.is_meta:
            raise pounce.PounceError(
                f"pounce: argument '{name}' is on the meta device (its values were never materialised); "
                f"move the module with .to_empty(device=...) and load the weights, or build it on a real device"
            )
        if tensor.device != x.device:
            raise pounce.PounceError(
                f"pounce: argument '{name}' is on {tensor.device} but x is on {x.device}; put every tensor on "
                f"one device"
            )


def _check_inputs(x, topk_idx, topk_weights, weights) -> None:
    if x.is_meta:
        raise pounce.PounceError("pounce: argument 'x' is on the meta device; pass a tensor with values")
    check_float("x", x)
    check_float("topk_weights", topk_weights)
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"pounce: argument 'topk_idx' is {topk_idx.dtype}; pass int32 or int64 expert ids")
    for name, weight in zip(_WEIGHT_NAMES, weights):
        if weight is not None:
            check_float(name, weight)
    check_devices(x, dict(topk_idx=topk_idx, topk_weights=topk_weights, **dict(zip(_WEIGHT_NAMES, weights))))


def _as_bf16(weight: Optional[Tensor]) -> Optional[Tensor]:
    if weight is None or weight.dtype == _BF16:
        return weight
    return weight.to(_BF16)


def _any_grad(ctx, *indices) -> bool:
    return any(ctx.needs_input_grad[i] for i in indices)


class MoEFunction(torch.autograd.Function):
    """Autograd over the ops. Weights may be bf16 or fp32 (master weights): the kernels read bf16
    copies and the gradients come back in the weights' own dtype, accumulated in fp32 and rounded
    once. With ``main_grads`` (six fp32 tensors, or three routed + three None) the weight gradients
    are added into them and the weights get no ``.grad``. With ``fused_gate_up`` the w_gate slot holds
    one [El,2I,H] tensor (gate rows then up rows) and w_up is None. ``fp8_cache``: the Fp8Cache of a layer
    of precision fp8 (quantized from the weights as given, masters included, when they changed)."""

    @staticmethod
    def forward(
        ctx, x, topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, layer, main_grads,
        fused_gate_up, fp8_cache=None,
    ):
        fp8 = []
        if fp8_cache is not None:
            fp8 = list(fp8_cache.tensors)
            if fused_gate_up:
                intermediate = w_gate.shape[1] // 2
                sources = (w_gate[:, :intermediate], w_gate[:, intermediate:], w_down)
            else:
                sources = (w_gate, w_up, w_down)
            torch.ops.pounce.quantize_fp8(*sources, fp8, fp8_cache.handle)
        if fused_gate_up:
            wg, wu = split_gate_up(_as_bf16(w_gate))
        else:
            wg, wu = _as_bf16(w_gate), _as_bf16(w_up)
        wd = _as_bf16(w_down)
        sg, su, sd = _as_bf16(ws_gate), _as_bf16(ws_up), _as_bf16(ws_down)
        out, ticket = torch.ops.pounce.moe_forward(x, topk_idx, topk_weights, wg, wu, wd, sg, su, sd, layer, fp8)
        ctx.save_for_backward(x, topk_idx, topk_weights, wg, wu, wd, sg, su, sd, ticket)
        ctx.fp8 = fp8
        ctx.layer = layer
        ctx.weight_grad_dtype = w_gate.dtype
        ctx.has_shared = ws_gate is not None
        ctx.fused_gate_up = fused_gate_up
        ctx.routed_grads = _any_grad(ctx, 3, 4, 5)
        ctx.shared_grads = ctx.has_shared and _any_grad(ctx, 6, 7, 8)
        # Not saved tensors: other micro-batches' backwards add into them in between.
        ctx.main_grads = main_grads
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, topk_idx, topk_weights, wg, wu, wd, sg, su, sd, ticket = ctx.saved_tensors
        d_out = d_out.contiguous()
        if ctx.main_grads is not None:
            main = list(ctx.main_grads)
            if ctx.fused_gate_up:
                main[1] = None
            d_x, d_topk_weights = torch.ops.pounce.moe_backward_accumulate(
                d_out, x, topk_idx, topk_weights, wg, wu, wd, sg, su, sd, ticket, ctx.layer, *main, ctx.fp8
            )
            return d_x, None, d_topk_weights, None, None, None, None, None, None, None, None, None, None
        grads = torch.ops.pounce.moe_backward(
            d_out, x, topk_idx, topk_weights, wg, wu, wd, sg, su, sd, ticket, ctx.layer, ctx.weight_grad_dtype,
            ctx.routed_grads, ctx.shared_grads, ctx.fused_gate_up, ctx.fp8,
        )
        d_x, d_topk_weights = grads[:2]
        weight_grads = list(grads[2:])
        if ctx.fused_gate_up:
            weight_grads[1] = None
        if not ctx.routed_grads:
            weight_grads[0:3] = [None] * 3
        if not ctx.shared_grads:
            weight_grads[3:6] = [None] * 3
        for i in range(6):  # a weight of a set with gradients that itself is frozen
            if not ctx.needs_input_grad[3 + i]:
                weight_grads[i] = None
        return (d_x, None, d_topk_weights, *weight_grads, None, None, None, None)


def moe(
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    w_gate: Optional[Tensor] = None,
    w_up: Optional[Tensor] = None,
    w_down: Optional[Tensor] = None,
    ws_gate: Optional[Tensor] = None,
    ws_up: Optional[Tensor] = None,
    ws_down: Optional[Tensor] = None,
    *,
    layer: int,
    main_grads: Optional[tuple] = None,
    w_gate_up: Optional[Tensor] = None,
    fp8_cache: Optional[_fp8.Fp8Cache] = None,
) -> Tensor:
    """The MoE layer after the router, differentiable in x, topk_weights and every weight.

    x [T,H] bf16; topk_idx [T,k] int32/int64 (global expert ids, -1 = unused slot); topk_weights [T,k]
    fp32 (used as given); w_gate/w_up [El,I,H], w_down [El,H,I] (this rank's experts) and the optional
    shared ws_gate/ws_up [Is,H], ws_down [H,Is], bf16 or fp32. Instead of w_gate and w_up, ``w_gate_up``
    [El,2I,H] (gate rows then up rows, transformers' fused layout) gets its gradient as one tensor.
    ``layer`` from :func:`pounce.torch.register_layer`. Every tensor must be contiguous: wrong inputs
    raise :class:`pounce.PounceError` naming the argument, and integer, bool or complex tensors where
    floats belong raise ``TypeError``. Returns out [T,H] bf16.

    A layer of precision fp8 (``register_layer(..., precision="fp8")``) takes ``fp8_cache``, a
    :class:`pounce.torch.Fp8Cache` of the routed weights' shape on their device, one per layer and set of
    weights, created outside compiled code: the weights are quantized into it when they changed (their
    ``_version``, storage or layout), so once per optimizer step. fp32 masters and the row-strided halves of
    ``w_gate_up`` are quantized from a dense bf16 copy (``pounce.quantize_weights_fp8`` reads dense bf16).
    """
    fused = w_gate_up is not None
    if fused:
        if w_gate is not None or w_up is not None:
            raise pounce.PounceError("pounce: pass either w_gate_up or w_gate and w_up, not both")
        w_gate = w_gate_up
    elif w_gate is None or w_up is None:
        raise pounce.PounceError("pounce: argument 'w_gate'/'w_up' is missing; pass them, or w_gate_up")
    if w_down is None:
        raise pounce.PounceError("pounce: argument 'w_down' is missing")
    _check_inputs(x, topk_idx, topk_weights, (w_gate, w_up, w_down, ws_gate, ws_up, ws_down))
    if fp8_cache is not None:
        _fp8.check_cache(fp8_cache, w_gate.shape[1], w_down, fused)
        check_devices(x, dict(fp8_cache=fp8_cache.tensors[0]))
    return MoEFunction.apply(
        x, topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, layer, main_grads, fused,
        fp8_cache,
    )


def tokens_per_expert(topk_idx: Tensor, num_experts: int) -> Tensor:
    """int64 [E]: how many (token, slot) pairs of this call name each global expert (-1 slots not
    counted), computed on topk_idx's device without a host sync."""
    flat = topk_idx.reshape(-1).to(torch.int64) + 1  # -1 -> bin 0, dropped below
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_idx.device)
    counts.scatter_add_(0, flat.clamp(0, num_experts), torch.ones_like(flat))
    return counts[1:]
