"""Plain PyTorch reference of the whole EP group, differentiated by autograd (for the torch tests).

``group_reference(inputs, routed, shared, dtype)`` runs the layer for every rank's tokens with dense
per-expert loops: in float64 it is the truth, in bfloat16 (fp32 sums over the slots, as a careful
PyTorch user writes them) it is the noise an ordinary bf16 implementation has. docs/design.md §6 passes a
result when ``max|got - ref64| <= 2 * max|ref_bf16 - ref64| + atol`` (moe_reference.check_close).

inputs: per rank (x [T,H], topk_idx [T,k], topk_weights [T,k], d_out [T,H]); routed: the full
(w_gate [E,I,H], w_up [E,I,H], w_down [E,H,I]); shared: (gate [Is,H], up [Is,H], down [H,Is]) or None,
replicated: each rank differentiates its own copy, as data-parallel replicas do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def activation(g, u, kind="swiglu", limit=None, alpha=1.702):
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    if kind == "swiglu":
        return F.silu(g) * u
    return (u + 1) * (g * torch.sigmoid(alpha * g))


def _mlp(x, gate, up, down, act):
    return F.linear(activation(F.linear(x, gate), F.linear(x, up), **act), down)


def layer(x, topk_idx, topk_weights, routed, shared, act):
    """out [T,H] of one rank; sums over slots in fp32 (or fp64), ascending slots."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    if shared is not None:
        out = out + _mlp(x, *shared, act).to(acc)
    w_gate, w_up, w_down = routed
    for j in range(topk_idx.shape[1]):
        for e in torch.unique(topk_idx[:, j]).tolist():
            if e < 0:
                continue
            rows = torch.nonzero(topk_idx[:, j] == e).flatten()
            y = _mlp(x[rows], w_gate[e], w_up[e], w_down[e], act)
            out = out.index_add(0, rows, topk_weights[rows, j:j + 1].to(acc) * y.to(acc))
    return out.to(x.dtype)


def group_reference(inputs, routed, shared, dtype, act=None):
    """Returns per rank a dict with out, d_x, d_topk_weights, d_shared (list or None) and the full
    routed gradients (d_w_gate, d_w_up, d_w_down over all E experts) in float64."""
    act = act or {}
    leaves = [w.detach().to(dtype).requires_grad_() for w in routed]
    results, total = [], 0
    for x, topk_idx, topk_weights, d_out in inputs:
        x = x.detach().to(dtype).requires_grad_()
        weights = topk_weights.detach().to(torch.float32 if dtype != torch.float64 else dtype).requires_grad_()
        rank_shared = [w.detach().to(dtype).requires_grad_() for w in shared] if shared is not None else None
        out = layer(x, topk_idx, weights, leaves, rank_shared, act)
        total = total + (out.double() * d_out.double()).sum()
        results.append(dict(out=out, x=x, weights=weights, shared=rank_shared))
    if isinstance(total, torch.Tensor) and total.requires_grad:  # not when no rank has a token
        total.backward()

    def grad(leaf):  # a leaf that no token reached has no .grad: its gradient is zero
        return leaf.grad.double() if leaf.grad is not None else torch.zeros_like(leaf, dtype=torch.float64)

    report = []
    for r in results:
        report.append(dict(
            out=r["out"].detach().double(),
            d_x=grad(r["x"]),
            d_topk_weights=grad(r["weights"]),
            d_shared=[grad(w) for w in r["shared"]] if r["shared"] is not None else None,
            d_routed=[grad(w) for w in leaves],
        ))
    return report


def route_as(model, routing, record):
    """Forward hooks on every layer's router: ``record`` stores its top-k experts in ``routing[layer]``,
    else the router takes ``routing[layer]`` (the weights are its own probabilities of those experts,
    renormalised as Qwen3-MoE does, so the router still gets its gradient). The recorded experts live on
    the CPU, so one run's routing can be imposed on a model on another device. Returns the hook handles."""
    handles = []
    for layer_idx, layer in enumerate(model.model.layers):
        def hook(router, args, output, layer_idx=layer_idx):
            logits, _, idx = output
            if record:
                routing[layer_idx] = idx.detach().cpu()
                return None
            idx = routing[layer_idx].to(logits.device)
            probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float))
            probs = probs.gather(-1, idx)
            return logits, (probs / probs.sum(dim=-1, keepdim=True)).to(logits.dtype), idx

        handles.append(layer.mlp.gate.register_forward_hook(hook))
    return handles
