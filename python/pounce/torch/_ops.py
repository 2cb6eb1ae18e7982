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
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import pounce

from . import _registry

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


def _no_shared_grads(like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Three distinct empty tensors (an op's outputs must not alias) in place of the shared gradients."""
    return tuple(like.new_empty((0,)) for _ in range(3))


def _weight_grads(routed, shared, dtype: torch.dtype):
    """Outputs for the routed weights' gradients and the shared ones (None without a shared expert)."""
    d_routed = tuple(_like(w, dtype) for w in routed)
    d_shared = tuple(_like(w, dtype) for w in shared) if shared else None
    return d_routed, d_shared


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
) -> tuple[Tensor, Tensor]:
    """out [T,H] bf16 and the ticket of this forward's context (see the module docstring)."""
    slot = _registry.layer(layer).resolve(x.device)
    out = _like(x)
    ticket = torch.zeros((1,), dtype=torch.uint8, device=x.device)  # its address is what counts
    with _registry._device_scope(x.device):
        slot.resident = None  # a failing forward leaves no valid context behind
        pounce.forward(
            slot.workspace, _plain(x), topk_idx, _plain(topk_weights), _routed(w_gate, w_up, w_down), out,
            _shared(ws_gate, ws_up, ws_down), _stream(x),
        )
    slot.resident = ticket.data_ptr()
    slot.forwards += 1
    return out, ticket


@moe_forward.register_fake
def _moe_forward_fake(x, topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, layer):
    return _like(x), x.new_empty((1,), dtype=torch.uint8)


def _ensure_context(slot, ticket, x, topk_idx, topk_weights, routed, shared) -> None:
    if slot.resident == ticket.data_ptr():
        return
    slot.resident = None
    pounce.recompute_forward_context(slot.workspace, x, topk_idx, topk_weights, routed, shared, _stream(x))
    slot.resident = ticket.data_ptr()
    slot.recomputes += 1


def _run_backward(
    layer, ticket, d_out, x, topk_idx, topk_weights, routed, shared, d_routed, d_shared, *, accumulate: bool
) -> tuple[Tensor, Tensor]:
    """pounce.backward on the layer's workspace, after rebuilding the context of the ticket's forward if
    another forward used the workspace since; the weight gradients go to (or are added into, with
    ``accumulate``) d_routed and d_shared. Returns (d_x, d_topk_weights)."""
    slot = _registry.layer(layer).resolve(x.device)
    x, topk_weights, d_out = _plain(x), _plain(topk_weights), _plain(d_out)
    d_x = _like(x)
    d_topk_weights = _like(topk_weights)
    with _registry._device_scope(x.device):
        _ensure_context(slot, ticket, x, topk_idx, topk_weights, routed, shared)
        slot.resident = None
        pounce.backward(
            slot.workspace, x, topk_idx, topk_weights, routed, d_out, d_x, d_topk_weights, d_routed, shared,
            d_shared, accumulate, _stream(x),
        )
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
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down); the weight
    gradients in ``weight_grad_dtype`` (bf16 or fp32); the shared ones empty when there is none."""
    routed, shared = _routed(w_gate, w_up, w_down), _shared(ws_gate, ws_up, ws_down)
    d_routed, d_shared = _weight_grads(routed, shared, weight_grad_dtype)
    d_x, d_topk_weights = _run_backward(
        layer, ticket, d_out, x, topk_idx, topk_weights, routed, shared, d_routed, d_shared, accumulate=False
    )
    return (d_x, d_topk_weights) + d_routed + (d_shared or _no_shared_grads(d_x))


@moe_backward.register_fake
def _moe_backward_fake(
    d_out, x, topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, ticket, layer,
    weight_grad_dtype,
):
    shared = _shared(ws_gate, ws_up, ws_down)
    d_routed, d_shared = _weight_grads((w_gate, w_up, w_down), shared, weight_grad_dtype)
    return (_like(x), _like(topk_weights)) + d_routed + (d_shared or _no_shared_grads(x))


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
    main_w_up: Tensor,
    main_w_down: Tensor,
    main_ws_gate: Optional[Tensor],
    main_ws_up: Optional[Tensor],
    main_ws_down: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    """(d_x, d_topk_weights); the weight gradients are added into the fp32 ``main_*`` tensors
    (Megatron-style main_grad) instead of being returned."""
    return _run_backward(
        layer, ticket, d_out, x, topk_idx, topk_weights, _routed(w_gate, w_up, w_down),
        _shared(ws_gate, ws_up, ws_down), _routed(main_w_gate, main_w_up, main_w_down),
        _shared(main_ws_gate, main_ws_up, main_ws_down), accumulate=True,
    )


@moe_backward_accumulate.register_fake
def _moe_backward_accumulate_fake(d_out, x, topk_idx, topk_weights, *args):
    return _like(x), _like(topk_weights)


def _as_bf16(weight: Optional[Tensor]) -> Optional[Tensor]:
    if weight is None or weight.dtype == _BF16:
        return weight
    return weight.to(_BF16)


class MoEFunction(torch.autograd.Function):
    """Autograd over the ops. Weights may be bf16 or fp32 (master weights): the kernels read bf16
    copies and the gradients come back in the weights' own dtype, accumulated in fp32 and rounded
    once. With ``main_grads`` (six fp32 tensors, or three routed + three None) the weight gradients
    are added into them and the weights get no ``.grad``."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, layer, main_grads):
        wg, wu, wd = _as_bf16(w_gate), _as_bf16(w_up), _as_bf16(w_down)
        sg, su, sd = _as_bf16(ws_gate), _as_bf16(ws_up), _as_bf16(ws_down)
        out, ticket = torch.ops.pounce.moe_forward(x, topk_idx, topk_weights, wg, wu, wd, sg, su, sd, layer)
        ctx.save_for_backward(x, topk_idx, topk_weights, wg, wu, wd, sg, su, sd, ticket)
        ctx.layer = layer
        ctx.weight_grad_dtype = w_gate.dtype
        ctx.has_shared = ws_gate is not None
        # Not saved tensors: other micro-batches' backwards add into them in between.
        ctx.main_grads = main_grads
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, topk_idx, topk_weights, wg, wu, wd, sg, su, sd, ticket = ctx.saved_tensors
        d_out = d_out.contiguous()
        if ctx.main_grads is not None:
            d_x, d_topk_weights = torch.ops.pounce.moe_backward_accumulate(
                d_out, x, topk_idx, topk_weights, wg, wu, wd, sg, su, sd, ticket, ctx.layer, *ctx.main_grads
            )
            return d_x, None, d_topk_weights, None, None, None, None, None, None, None, None
        grads = torch.ops.pounce.moe_backward(
            d_out, x, topk_idx, topk_weights, wg, wu, wd, sg, su, sd, ticket, ctx.layer, ctx.weight_grad_dtype
        )
        d_x, d_topk_weights, d_wg, d_wu, d_wd, d_sg, d_su, d_sd = grads
        if not ctx.has_shared:
            d_sg, d_su, d_sd = None, None, None
        return d_x, None, d_topk_weights, d_wg, d_wu, d_wd, d_sg, d_su, d_sd, None, None


def moe(
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    ws_gate: Optional[Tensor] = None,
    ws_up: Optional[Tensor] = None,
    ws_down: Optional[Tensor] = None,
    *,
    layer: int,
    main_grads: Optional[tuple] = None,
) -> Tensor:
    """The MoE layer after the router, differentiable in x, topk_weights and every weight.

    x [T,H] bf16; topk_idx [T,k] int32/int64 (global expert ids, -1 = unused slot); topk_weights [T,k]
    fp32 (used as given); w_gate/w_up [El,I,H], w_down [El,H,I] (this rank's experts) and the optional
    shared ws_gate/ws_up [Is,H], ws_down [H,Is], bf16 or fp32. ``layer`` from
    :func:`pounce.torch.register_layer`. Every tensor must be contiguous: wrong inputs raise
    :class:`pounce.PounceError` naming the argument. Returns out [T,H] bf16.
    """
    return MoEFunction.apply(
        x, topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, layer, main_grads
    )
