"""Pounce for PyTorch: autograd, torch.compile and CUDA graphs over the pounce kernels.

- :class:`MoE`: an ``nn.Module`` holding this rank's routed experts (and the optional shared expert),
  per-expert ``state_dict`` entries, gradients in ``.grad`` (or fp32 ``main_grad``).
- :func:`moe`: the functional layer (a ``torch.autograd.Function`` over the custom ops
  ``pounce::moe_forward`` / ``pounce::moe_backward``, which have fake implementations, so
  ``torch.compile(fullgraph=True)`` captures it without a graph break).
- :func:`ep_group`: the pounce GPU group over a ``torch.distributed`` process group (the NCCL unique id
  goes through ``broadcast_object_list``).
- Workspaces are cached per (group, shape, config) and shared across layers; :func:`free_workspaces`
  releases them (collectively) and :func:`workspace_stats` counts forwards and context recomputes.

Streams: every op runs on ``torch.cuda.current_stream()``. CUDA graphs: run one step eagerly first
(the group and the workspace are created then), then capture; replays with new routing written into
the captured input tensors give the eager results.
"""
from ._module import MoE
from ._ops import MoEFunction, moe
from ._registry import (
    ep_group,
    free_workspaces,
    register_layer,
    unregister_layer,
    workspace_stats,
)

__all__ = [
    "MoE",
    "MoEFunction",
    "ep_group",
    "free_workspaces",
    "moe",
    "register_layer",
    "unregister_layer",
    "workspace_stats",
]
