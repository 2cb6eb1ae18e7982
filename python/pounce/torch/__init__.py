"""Pounce for PyTorch: autograd, torch.compile and CUDA graphs over the pounce kernels.

- :class:`MoE`: an ``nn.Module`` holding this rank's routed experts (and the optional shared expert),
  per-expert ``state_dict`` entries (and transformers' layouts on load), gradients in ``.grad`` (or fp32
  ``main_grad``), ``last_tokens_per_expert`` after each forward.
- :func:`moe`: the functional layer (a ``torch.autograd.Function`` over the custom ops
  ``pounce::moe_forward`` / ``pounce::moe_backward``, which have fake implementations, so
  ``torch.compile(fullgraph=True)`` captures it without a graph break).
- transformers: importing this package registers ``experts_implementation="pounce"`` in transformers'
  experts interface (once transformers is imported; :func:`register_transformers` does it explicitly);
  :func:`configure_transformers` sets the EP group, max_tokens, the workspace policy and moves
  DeepSeek-style shared experts inside pounce.
- FP8: ``MoE(..., precision="fp8")`` keeps bf16 (or fp32 master) parameters and runs the routed experts on
  their block-scaled FP8 copies, held in an :class:`Fp8Cache` and re-quantized only after the weights changed
  (``_version``: once per optimizer step); the functional :func:`moe` takes ``fp8_cache=`` for a layer
  registered with ``precision="fp8"``.
- :func:`ep_group`: the pounce GPU group over a ``torch.distributed`` process group (the NCCL unique id
  goes through ``broadcast_object_list``).

Workspaces and recompute. A workspace holds every buffer of a forward/backward pair and the forward
context backward reads. Each layer chooses (``share_workspace``):

==============  =========================================  ==============================================
choice          memory                                     time
==============  =========================================  ==============================================
``None``        one workspace per layer while they fit     no recompute while within the budget
(default)       :func:`set_workspace_budget` (a fifth of
                the GPU's memory; no limit on the CPU),
                shared past it (warned once)
``False``       one workspace per layer                    no recompute: backward reads its forward's
                (``pounce.bytes_required``: 2.4 GiB for    context
                Qwen3-30B-A3B's layer at 8192 tokens)
``True``        one workspace for all layers of equal      each layer but the last recomputes its forward
                shape, config and group                    before backward (~1/3 of its fwd+bwd time):
                                                           activation checkpointing of the experts
==============  =========================================  ==============================================

:func:`workspace_stats` lists every workspace with its layers, forwards and recomputes;
:func:`free_workspaces` releases them (collectively).

Streams: every op runs on ``torch.cuda.current_stream()``. CUDA graphs: run one step eagerly first
(the group and the workspace are created then), then capture; replays with new routing written into
the captured input tensors give the eager results.

Device errors: a failure the GPU recorded (a timed-out peer wait, an expert id out of range) is raised by
the layer's next forward or backward that finds it (``MoE(..., check_errors=True)``, no host sync); after a
CUDA graph's replay, :func:`check_errors` with ``synchronize=True`` checks it.
"""
from ._fp8 import Fp8Cache
from ._module import MoE
from ._ops import MoEFunction, moe, tokens_per_expert
from ._registry import (
    check_errors,
    ep_group,
    free_workspaces,
    register_layer,
    set_workspace_budget,
    unregister_layer,
    workspace_stats,
)
from ._transformers import configure_transformers, register_on_import, register_transformers

register_on_import()

__all__ = [
    "Fp8Cache",
    "MoE",
    "MoEFunction",
    "check_errors",
    "configure_transformers",
    "ep_group",
    "free_workspaces",
    "moe",
    "register_layer",
    "register_transformers",
    "set_workspace_budget",
    "tokens_per_expert",
    "unregister_layer",
    "workspace_stats",
]
