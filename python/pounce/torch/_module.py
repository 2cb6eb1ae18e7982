"""pounce.torch.MoE: the routed experts (and optional shared expert) of one MoE layer as an nn.Module."""
from __future__ import annotations

import math
import weakref
from typing import Optional, Union

import torch
from torch import Tensor, nn

import pounce

from . import _fp8, _ops, _registry


def _activation(activation) -> pounce.Activation:
    if isinstance(activation, pounce.Activation):
        return activation
    if activation == "swiglu":
        return pounce.Activation.swiglu()
    if activation in ("gpt_oss", "gpt-oss"):
        return pounce.Activation.gpt_oss()
    raise pounce.PounceError(
        f"pounce: activation {activation!r} is unknown; pass 'swiglu', 'gpt_oss' or a pounce.Activation"
    )


def _is_dtensor(tensor) -> bool:
    return torch.distributed.is_available() and isinstance(tensor, torch.distributed.tensor.DTensor)


def _is_fsdp_module(module: nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _local_rows(param, e: Optional[int], value: Tensor):
    """(this rank's part of ``param[e]`` (or of ``param``), the matching part of ``value``) for a DTensor
    parameter, as FSDP2 leaves them: its local shard holds rows offset.. of the gathered tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = param.to_local()
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    if e is None:
        return local, value[index]
    if not offset[0] <= e < offset[0] + shape[0]:
        return local[:0], value.new_empty((0,) + tuple(value.shape))  # expert e is another dp rank's shard
    return local[e - offset[0]], value[index[1:]]


class MoE(nn.Module):
    """The layer after the router: ``out = shared(x) + sum_j topk_weights[:, j] * expert[topk_idx[:, j]](x)``.

    Holds this rank's ``El = num_experts / R`` routed experts as stacked parameters ``w_gate``/``w_up``
    ``[El, I, H]`` and ``w_down [El, H, I]`` (nn.Linear's out x in layout) and, when
    ``shared_intermediate > 0``, the shared expert ``ws_gate``/``ws_up [Is, H]``, ``ws_down [H, Is]``.
    Expert ``e`` (global id) lives on rank ``e // El``. In ``state_dict`` every expert is its own entry
    under its global id, as Hugging Face MoE models name them: ``experts.{e}.gate_proj.weight`` ``[I, H]``,
    ``experts.{e}.up_proj.weight``, ``experts.{e}.down_proj.weight`` ``[H, I]``,
    ``shared_expert.{gate,up,down}_proj.weight``; loading takes this rank's experts from a full
    checkpoint and ignores the others'.

    ``activation``: 'swiglu' (default), 'gpt_oss' (clamp 7, alpha 1.702) or a :class:`pounce.Activation`
    (overrides ``config.activation``). ``group``: a :class:`pounce.Group`, a torch.distributed process
    group (its ranks are the EP group), or None (the default process group when initialised, else one
    rank). ``max_tokens`` bounds the tokens per rank and call (the workspace is sized for it).
    Parameters are ``dtype`` (bf16, or fp32 master weights: the kernels read bf16 copies and the
    gradients arrive in fp32). Weight gradients land in ``.grad``; with ``accumulate_main_grad=True``
    they are added into each parameter's fp32 ``main_grad`` instead (:meth:`init_main_grad` allocates
    them) and ``.grad`` stays None.

    Workspaces (see :mod:`pounce.torch`): by default (``share_workspace=None``) each layer has its own
    while they fit the budget of :func:`pounce.torch.set_workspace_budget`, so backward never
    recomputes the forward; ``share_workspace=True`` shares one workspace among the layers of equal
    shape, config and group, and backward then recomputes the forward context when another layer ran
    forward in between (activation checkpointing of the experts); ``False`` always takes its own.

    ``forward(x [..., H], topk_idx [..., k], topk_weights [..., k])``: x of a float dtype (computed in
    bf16, returned in x's dtype; integer, bool and complex x raise ``TypeError``), topk_idx int32/int64
    global expert ids (-1 = unused slot), topk_weights used as given (not normalised). After each
    forward, ``last_tokens_per_expert`` holds int64 [E]: how many (token, slot) pairs of this rank's
    call went to each global expert, on the input's device, computed without a host sync (sum it over
    the EP group for the global load, e.g. for a load-balancing loss or an expert-bias update).

    Frozen experts: with ``requires_grad=False`` on the routed (or shared) weights, backward returns no
    gradient for them.

    ``precision``: 'bf16' or 'fp8' (overrides ``config.precision``; None keeps it, bf16 by default). With
    'fp8' the routed experts run block-scaled FP8 (docs/design.md §1; the shared expert stays bf16): the
    parameters stay ``dtype`` and their FP8 copies, both orientations, live in ``fp8_cache`` (a
    :class:`pounce.torch.Fp8Cache`, allocated once per device, not in ``state_dict``), re-quantized in the
    forward only after the weights changed (their ``_version``: once per optimizer step). After writing the
    weights in a way the version counter misses (through ``.data``), call ``fp8_cache.invalidate()``.

    ``check_errors``: True (default) raises a failure the GPU recorded on the layer's workspace (a timed-out
    peer wait, an expert id out of range; the failing call's outputs are not valid) as a PounceError
    naming the layer, checked without a host sync before each forward and after each backward (skipped
    during CUDA-graph capture: :func:`pounce.torch.check_errors` checks a replay); False turns it off
    (the workspace's next call still raises it, unnamed).

    ``load_state_dict`` reads, besides its own per-expert keys, transformers' layouts: the fused
    ``experts.gate_up_proj [E,2I,H]`` / ``experts.down_proj [E,H,I]`` of transformers 5, Mixtral's
    ``experts.{e}.w1/w3/w2.weight`` (gate, up, down) and DeepSeek's ``shared_experts.*_proj.weight``
    (taking this rank's experts from each).
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        num_topk: int,
        *,
        max_tokens: int,
        shared_intermediate: int = 0,
        group=None,
        activation: Union[str, pounce.Activation, None] = None,
        config: Optional[pounce.Config] = None,
        share_workspace: Optional[bool] = None,
        accumulate_main_grad: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
        init_seed: Optional[int] = None,
        precision: Union[str, pounce.Precision, None] = None,
        check_errors: bool = True,
    ):
        super().__init__()
        config = _registry.copy_config(config if config is not None else pounce.Config())
        if activation is not None:
            config.activation = _activation(activation)
        if precision is not None:
            config.precision = _registry.parse_precision(precision)
        self.hidden, self.intermediate = hidden, intermediate
        self.num_experts, self.num_topk = num_experts, num_topk
        self.shared_intermediate, self.max_tokens = shared_intermediate, max_tokens
        group = _registry.as_group(group)
        self.num_ranks = _registry.group_size(group)
        self.rank = _registry.group_rank(group)
        if num_experts % self.num_ranks != 0:
            raise pounce.PounceError(
                f"pounce: num_experts = {num_experts} is not divisible by the EP group's {self.num_ranks} ranks"
            )
        self.num_local_experts = num_experts // self.num_ranks
        self.accumulate_main_grad = accumulate_main_grad
        self.layer = _registry.register_layer(
            hidden=hidden,
            intermediate=intermediate,
            num_experts=num_experts,
            num_topk=num_topk,
            max_tokens=max_tokens,
            shared_intermediate=shared_intermediate,
            config=config,
            group=group,
            share_workspace=share_workspace,
            check_errors=check_errors,
        )
        weakref.finalize(self, _registry.unregister_layer, self.layer)

        El, I, H, Is = self.num_local_experts, intermediate, hidden, shared_intermediate
        factory = dict(dtype=dtype, device=device)
        self.w_gate = nn.Parameter(torch.empty(El, I, H, **factory))
        self.w_up = nn.Parameter(torch.empty(El, I, H, **factory))
        self.w_down = nn.Parameter(torch.empty(El, H, I, **factory))
        if Is > 0:
            self.ws_gate = nn.Parameter(torch.empty(Is, H, **factory))
            self.ws_up = nn.Parameter(torch.empty(Is, H, **factory))
            self.ws_down = nn.Parameter(torch.empty(H, Is, **factory))
        else:
            self.register_parameter("ws_gate", None)
            self.register_parameter("ws_up", None)
            self.register_parameter("ws_down", None)
        self.last_tokens_per_expert: Optional[Tensor] = None
        # Not buffers: derived from the weights, they belong in no state_dict, DDP must not broadcast them at
        # every forward, and .to(dtype)/.half() must not cast their fp32 scales.
        self.fp8_cache: Optional[_fp8.Fp8Cache] = None
        if config.precision == pounce.Precision.fp8:
            self.fp8_cache = _fp8.Fp8Cache(El, I, H, device=self.w_gate.device)
        self.reset_parameters(init_seed)

    @property
    def first_expert(self) -> int:
        """Global id of this rank's first expert."""
        return self.rank * self.num_local_experts

    def reset_parameters(self, seed: Optional[int] = None) -> None:
        """nn.Linear's default init per expert: uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) (kaiming_uniform
        with a = sqrt(5)). With ``seed`` every expert draws from its own generator seeded by (seed,
        global id), so the model is the same whatever the number of ranks."""

        def fill(weight: Tensor, fan_in: int, stream: int) -> None:
            bound = 1.0 / math.sqrt(fan_in)
            if seed is None:
                nn.init.uniform_(weight, -bound, bound)
                return
            generator = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + stream)
            values = torch.empty(weight.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
            weight.copy_(values)

        with torch.no_grad():
            for e in range(self.num_local_experts):
                g = self.first_expert + e
                fill(self.w_gate[e], self.hidden, 3 * g)
                fill(self.w_up[e], self.hidden, 3 * g + 1)
                fill(self.w_down[e], self.intermediate, 3 * g + 2)
            if self.ws_gate is not None:
                base = 3 * self.num_experts
                fill(self.ws_gate, self.hidden, base)
                fill(self.ws_up, self.hidden, base + 1)
                fill(self.ws_down, self.shared_intermediate, base + 2)

    @property
    def precision(self) -> str:
        """'bf16' or 'fp8'."""
        return "fp8" if self.fp8_cache is not None else "bf16"

    def _apply(self, fn, *args, **kwargs):
        """.to(device), .cuda(), .to_empty(): the FP8 cache follows the weights to their device (new, stale
        tensors there: the next forward quantizes)."""
        module = super()._apply(fn, *args, **kwargs)
        if self.fp8_cache is not None:
            self.fp8_cache.to(self.w_gate.device)
        return module

    def init_main_grad(self) -> None:
        """Allocates a zero fp32 ``main_grad`` next to every parameter (for accumulate_main_grad)."""
        for p in self.parameters():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)

    def forward(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor) -> Tensor:
        H, k = self.hidden, self.num_topk
        _ops.check_float("x", x)
        _ops.check_float("topk_weights", topk_weights)
        x2 = x.reshape(-1, H)
        if x2.dtype != torch.bfloat16:
            x2 = x2.to(torch.bfloat16)
        idx = topk_idx.reshape(-1, k).contiguous()
        weights = topk_weights.reshape(-1, k)
        if weights.dtype != torch.float32:
            weights = weights.to(torch.float32)
        fsdp = _is_fsdp_module(self)
        main_grads = None
        if self.accumulate_main_grad:
            if fsdp:
                raise pounce.PounceError(
                    "pounce: accumulate_main_grad=True does not compose with FSDP2 (fully_shard reduce-scatters "
                    ".grad); pass accumulate_main_grad=False and fp32 gradients through "
                    "MixedPrecisionPolicy(reduce_dtype=torch.float32)"
                )
            main_grads = tuple(getattr(p, "main_grad", None) if p is not None else None for p in self._weights())
            if any(g is None for g, p in zip(main_grads, self._weights()) if p is not None):
                raise pounce.PounceError(
                    "pounce: accumulate_main_grad=True but a parameter has no main_grad; call init_main_grad()"
                )
        if fsdp and self.num_ranks > 1 and self.ws_gate is not None and self.ws_gate.requires_grad:
            raise pounce.PounceError(
                "pounce: under FSDP2 over the data-parallel mesh and EP over more than one rank, the shared "
                "expert is replicated over the EP ranks but its gradients are reduced over 'dp' only; build the "
                "MoE with shared_intermediate=0 and keep the shared expert as a module sharded over the whole "
                "mesh (docs/pytorch.md, EP x FSDP2)"
            )
        if fsdp and self.fp8_cache is not None:
            # FSDP2 all-gathers the weights into the same buffers at every forward and keeps their version
            # counters, so the cache cannot see an optimizer step: quantize every forward.
            self.fp8_cache.invalidate()
        out = _ops.moe(
            x2.contiguous(),
            idx,
            weights.contiguous(),
            self.w_gate,
            self.w_up,
            self.w_down,
            self.ws_gate,
            self.ws_up,
            self.ws_down,
            layer=self.layer,
            main_grads=main_grads,
            fp8_cache=self.fp8_cache,
        )
        self.last_tokens_per_expert = _ops.tokens_per_expert(idx, self.num_experts)
        if out.shape != x.shape:
            out = out.view(x.shape)  # a view: FSDP2 warns about in-place ops on a wrapped module's output
        return out.to(x.dtype)

    def _weights(self):
        return (self.w_gate, self.w_up, self.w_down, self.ws_gate, self.ws_up, self.ws_down)

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, intermediate={self.intermediate}, num_experts={self.num_experts}, "
            f"num_topk={self.num_topk}, shared_intermediate={self.shared_intermediate}, "
            f"experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1} of rank "
            f"{self.rank}/{self.num_ranks}, max_tokens={self.max_tokens}, precision={self.precision}"
        )

    # -- state_dict: one entry per expert ---------------------------------------------------------

    _PROJ = (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))
    _SHARED = (("ws_gate", "gate_proj"), ("ws_up", "up_proj"), ("ws_down", "down_proj"))
    _MIXTRAL = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))

    def _expert_keys(self, prefix: str):
        for e in range(self.num_local_experts):
            for name, proj in self._PROJ:
                yield f"{prefix}experts.{self.first_expert + e}.{proj}.weight", name, e
        if self.ws_gate is not None:
            for name, proj in self._SHARED:
                yield f"{prefix}shared_expert.{proj}.weight", name, None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        full = {}  # under FSDP2: each parameter all-gathered once over its data-parallel mesh
        for key, name, e in self._expert_keys(prefix):
            param = getattr(self, name)
            if _is_dtensor(param):
                if name not in full:
                    full[name] = param.full_tensor()
                param = full[name]
            value = param if e is None else param[e]
            destination[key] = value if keep_vars else value.detach()

    def _translated(self, state_dict, prefix: str) -> dict:
        """The entries of transformers' layouts under ``prefix``, renamed to this module's per-expert keys
        (the caller's dict is not changed). Fused tensors give a view per expert of this rank."""
        out = {}
        fused_gate_up = state_dict.get(f"{prefix}experts.gate_up_proj")
        fused_down = state_dict.get(f"{prefix}experts.down_proj")
        lo, hi = self.first_expert, self.first_expert + self.num_local_experts
        if fused_gate_up is not None and fused_gate_up.dim() == 3:
            I = fused_gate_up.shape[1] // 2
            for e in range(lo, min(hi, fused_gate_up.shape[0])):
                out[f"{prefix}experts.{e}.gate_proj.weight"] = fused_gate_up[e, :I]
                out[f"{prefix}experts.{e}.up_proj.weight"] = fused_gate_up[e, I:]
        if fused_down is not None and fused_down.dim() == 3:
            for e in range(lo, min(hi, fused_down.shape[0])):
                out[f"{prefix}experts.{e}.down_proj.weight"] = fused_down[e]
        for e in range(lo, hi):
            for legacy, proj in self._MIXTRAL:
                value = state_dict.get(f"{prefix}experts.{e}.{legacy}.weight")
                if value is not None:
                    out[f"{prefix}experts.{e}.{proj}.weight"] = value
        for _, proj in self._SHARED:
            value = state_dict.get(f"{prefix}shared_experts.{proj}.weight")
            if value is not None:
                out[f"{prefix}shared_expert.{proj}.weight"] = value
        return out

    def _is_known_layout_key(self, rest: str) -> bool:
        if rest in ("experts.gate_up_proj", "experts.down_proj"):
            return True
        parts = rest.split(".")
        if parts[0] == "shared_experts" and len(parts) == 3 and parts[2] == "weight":
            return self.ws_gate is not None and parts[1] in ("gate_proj", "up_proj", "down_proj")
        return len(parts) == 4 and parts[0] == "experts" and parts[1].isdigit() and parts[2] in ("w1", "w2", "w3") \
            and 0 <= int(parts[1]) < self.num_experts and parts[3] == "weight"

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        translated = self._translated(state_dict, prefix)
        if translated:
            state_dict = {**state_dict, **translated}
        expected = set()
        with torch.no_grad():
            for key, name, e in self._expert_keys(prefix):
                expected.add(key)
                if key not in state_dict:
                    missing_keys.append(key)
                    continue
                param = getattr(self, name)
                value = state_dict[key]
                shape = tuple(param.shape) if e is None else tuple(param.shape[1:])
                if tuple(value.shape) != shape:
                    error_msgs.append(
                        f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                        f"the shape in the current model is {shape}."
                    )
                    continue
                if _is_dtensor(param):  # under FSDP2: the rows of this rank's shard
                    target, value = _local_rows(param, e, value)
                else:
                    target = param if e is None else param[e]
                target.copy_(value)
        if strict:
            for key in state_dict:
                if not key.startswith(prefix) or key in expected:
                    continue
                rest = key[len(prefix):]
                if rest.startswith("experts.") and self._is_other_ranks_expert(rest):
                    continue  # a full checkpoint holds every rank's experts
                if self._is_known_layout_key(rest):
                    continue  # read through _translated
                unexpected_keys.append(key)

    def _is_other_ranks_expert(self, rest: str) -> bool:
        parts = rest.split(".")
        return len(parts) == 4 and parts[1].isdigit() and 0 <= int(parts[1]) < self.num_experts
