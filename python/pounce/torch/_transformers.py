"""Pounce as an experts backend of Hugging Face transformers (5.x): ``experts_implementation="pounce"``.

transformers 5 stores a MoE block's experts as one module decorated with ``@use_experts_implementation``
whose ``forward(hidden_states [T,H], top_k_index [T,k], top_k_weights [T,k])`` dispatches through
``ExpertsInterface`` on ``config._experts_implementation``. :func:`register_transformers` adds "pounce"
there (importing :mod:`pounce.torch` does it once transformers' MoE integration is imported), so

    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="pounce")
    model.set_experts_implementation("pounce")   # or switch a loaded model

runs every experts module through :func:`pounce.torch.moe`. The adapter reads the module's weights as
transformers lays them out:

- Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, DeepSeek-V3 (SwiGLU): ``gate_up_proj [E,2I,H]`` (gate rows then
  up rows) and ``down_proj [E,H,I]``. The halves of gate_up_proj go to the kernels as views when the C++
  layer reads expert-strided weights (``pounce.supports_expert_stride``), else as contiguous copies;
  either way gate_up_proj's gradient is produced as one tensor (see ``_ops.py``).
- GPT-OSS: ``gate_up_proj [E,H,2I]`` transposed with gate and up columns interleaved, ``down_proj
  [E,I,H]``, expert biases, and its activation ``(clamp(u,-l,l)+1) * g' * sigmoid(alpha g')``, ``g' =
  min(g, l)`` (pounce's gpt_oss activation with the model's alpha and limit). Pounce takes no biases yet,
  so the adapter folds them in exactly: x gets a column of ones (hidden padded by 64, pounce's hidden
  step) and each gate/up row its bias in that column, and the down bias is added outside as
  ``sum_j w_j b_down[e_j]``. That costs a re-laid copy of the weights per step (the layout needs one
  anyway until pounce reads transposed, interleaved weights) and 64/H more GEMM work.

Shared experts. The experts interface sees only the routed experts, so a block's shared expert runs
in transformers' code by default. ``configure_transformers(model, fuse_shared_experts=True)`` moves
DeepSeek-V3's ungated ``shared_experts`` into pounce's fused kernel (pounce's shared expert, intermediate
Is). Qwen2-MoE's shared expert is scaled by ``sigmoid(x . w_gate)``, a gate pounce's shared expert does
not have, so it stays in transformers' code.

EP. ``configure_transformers(model, group=..., max_tokens=...)`` (a torch.distributed process group, a
:class:`pounce.Group`, or a DeviceMesh dimension's group) keeps only this rank's ``E/R`` experts of
every experts module (call it after loading the weights) and runs pounce's dispatch over the group:
every rank passes its own tokens and the global expert ids. ``max_tokens`` (tokens per rank and call)
must then be given, since every rank sizes its workspace alike; on one rank it grows with the input.

After each forward an experts module holds ``last_tokens_per_expert`` (int64 [E], this rank's
(token, slot) pairs per global expert, no host sync).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types
from typing import Optional

import torch
from torch import Tensor, nn

import pounce

from . import _ops, _registry

_HIDDEN_PAD = 64  # pounce's hidden step: the ones column of the bias fold and its zero padding


class _ExpertsState:
    """What the adapter keeps on one experts module (as ``module._pounce``)."""

    def __init__(self, *, group=None, max_tokens: Optional[int] = None, share_workspace=None, num_experts=None):
        self.group = group
        self.num_ranks = _registry.group_size(group)
        self.rank = _registry.group_rank(group)
        self.max_tokens = max_tokens
        self.share_workspace = share_workspace
        self.num_experts = num_experts  # global E; None: the module's own (no EP)
        self.shared: tuple = ()  # (mlp,) when the shared expert runs inside pounce
        self.layers: dict[tuple, int] = {}
        self.grown = 0

    def layer_for(self, shape: tuple, tokens: int, activation: pounce.Activation, device) -> int:
        hidden, intermediate, num_experts, num_topk, shared_intermediate = shape
        if self.max_tokens is not None:
            max_tokens = self.max_tokens
        elif self.num_ranks > 1:
            raise pounce.PounceError(
                "pounce: an experts module under EP needs max_tokens (tokens per rank and call): every rank "
                "sizes its workspace alike; pass it to pounce.torch.configure_transformers"
            )
        else:
            max_tokens = max(128, 1 << max(tokens - 1, 0).bit_length())
            if self.grown and max_tokens <= self.grown:
                max_tokens = self.grown
        key = (shape, max_tokens, int(activation.kind.value), activation.clamp_limit, activation.alpha)
        if key not in self.layers:
            if self.max_tokens is None and self.grown:
                # The smaller workspaces go; a backward still pending on one allocates and recomputes.
                for old in self.layers.values():
                    _registry.layer(old).slot = None
            self.layers[key] = _registry.register_layer(
                hidden=hidden, intermediate=intermediate, num_experts=num_experts, num_topk=num_topk,
                max_tokens=max_tokens, shared_intermediate=shared_intermediate,
                config=pounce.Config(activation=activation), group=self.group,
                share_workspace=self.share_workspace,
            )
            self.grown = max(self.grown, max_tokens)
        return self.layers[key]

    def close(self) -> None:
        for handle in self.layers.values():
            _registry.unregister_layer(handle)
        self.layers = {}

    def __del__(self):
        self.close()


def _state(module: nn.Module) -> _ExpertsState:
    state = module.__dict__.get("_pounce")
    if state is None:
        state = _ExpertsState()
        module.__dict__["_pounce"] = state
    return state


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU") or act is nn.functional.silu


def _activation(module: nn.Module) -> pounce.Activation:
    """SwiGLU for transformers' default gate with a SiLU, GPT-OSS's own gate from its alpha and limit."""
    from transformers.integrations import moe as hf_moe

    default_gate = getattr(hf_moe, "_default_apply_gate", None)
    if type(module)._apply_gate is default_gate:
        if not _is_silu(getattr(module, "act_fn", None)):
            raise NotImplementedError(
                f"pounce: {type(module).__name__} uses the activation {type(module.act_fn).__name__}; pounce's "
                f"experts run SwiGLU (silu) or GPT-OSS's activation"
            )
        return pounce.Activation.swiglu()
    if hasattr(module, "alpha") and hasattr(module, "limit") and not module.is_concatenated:
        return pounce.Activation(pounce.ActivationKind.gpt_oss, float(module.limit), float(module.alpha))
    raise NotImplementedError(
        f"pounce: {type(module).__name__} has its own _apply_gate, which pounce does not know; known are "
        f"SwiGLU and GPT-OSS's"
    )


def _check_supported(module: nn.Module) -> None:
    if not getattr(module, "has_gate", True):
        raise NotImplementedError(f"pounce: {type(module).__name__} has no gate projection; pounce runs gated experts")
    if getattr(module, "has_post_expert_norm", False):
        raise NotImplementedError(f"pounce: {type(module).__name__} normalises each expert's output; pounce does not")
    if getattr(module, "_is_expert_parallel", False):
        raise NotImplementedError(
            "pounce: this experts module is sharded by transformers' own expert parallelism; load the model "
            "without it and pass the EP group to pounce.torch.configure_transformers(model, group=...)"
        )
    if module.has_bias and not module.is_transposed:
        raise NotImplementedError(
            f"pounce: {type(module).__name__} has expert biases in the [E,2I,H] layout, which the adapter does "
            f"not fold yet (only GPT-OSS's layout)"
        )


def _gate_up_rows(module: nn.Module):
    """Non-transposed layouts: the fused [E,2I,H] weight, or (gate, up) [E,I,H] when interleaved."""
    gate_up = module.gate_up_proj
    if module.is_concatenated:
        return gate_up, None
    return gate_up[:, 0::2], gate_up[:, 1::2]


def _gpt_oss_weights(module: nn.Module, x: Tensor):
    """GPT-OSS's layout folded into pounce's: x [T,H+64] with a ones column, gate/up [E,I,H+64] with the
    biases in that column, down [E,H+64,I] with zero padding rows."""
    gate_up, bias = module.gate_up_proj, module.gate_up_proj_bias  # [E,H,2I], [E,2I]
    if module.is_concatenated:
        intermediate = gate_up.shape[2] // 2
        gate, up = gate_up[..., :intermediate], gate_up[..., intermediate:]
        gate_b, up_b = bias[:, :intermediate], bias[:, intermediate:]
    else:
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
        gate_b, up_b = bias[:, 0::2], bias[:, 1::2]
    num_experts, _, intermediate = gate.shape
    pad = gate.new_zeros((num_experts, intermediate, _HIDDEN_PAD - 1))

    def rows(w, b):  # [E,H,I] and [E,I] -> [E,I,H+64]
        return torch.cat((w.transpose(1, 2), b.unsqueeze(-1).to(w.dtype), pad), dim=2)

    down = module.down_proj.transpose(1, 2)  # [E,I,H] -> [E,H,I]
    down = torch.cat((down, down.new_zeros((num_experts, _HIDDEN_PAD, intermediate))), dim=1)
    tokens = x.shape[0]
    ones = x.new_ones((tokens, 1))
    x_aug = torch.cat((x, ones, x.new_zeros((tokens, _HIDDEN_PAD - 1))), dim=1)
    return x_aug, rows(gate, gate_b), rows(up, up_b), down


def _down_bias_term(module: nn.Module, idx: Tensor, weights: Tensor) -> Tensor:
    """sum_j w[t,j] b_down[idx[t,j]] ([T,H] fp32); -1 slots add nothing."""
    bias = module.down_proj_bias
    valid = idx >= 0
    picked = bias[idx.clamp(min=0)].float()  # [T,k,H]
    return (picked * (weights * valid).unsqueeze(-1)).sum(dim=1)


@torch._dynamo.assume_constant_result
def _layer_handle(module: nn.Module, tokens: int, hidden: int, num_topk: int) -> int:
    """The pounce layer of this call (host-side set-up: torch.compile calls it while tracing and bakes
    the handle into the graph, as for MoE's own layer handle)."""
    _check_supported(module)
    state = _state(module)
    activation = _activation(module)
    num_experts = state.num_experts or module.gate_up_proj.shape[0]
    if module.is_transposed:
        if not module.has_bias:
            raise NotImplementedError("pounce: transposed experts without biases are not mapped yet")
        shape = (hidden + _HIDDEN_PAD, module.down_proj.shape[1], num_experts, num_topk, 0)
    else:
        shared_intermediate = state.shared[0].gate_proj.weight.shape[0] if state.shared else 0
        shape = (hidden, module.down_proj.shape[2], num_experts, num_topk, shared_intermediate)
    return state.layer_for(shape, tokens, activation, module.down_proj.device)


@torch._dynamo.assume_constant_result
def _global_experts(module: nn.Module) -> int:
    return _state(module).num_experts or module.gate_up_proj.shape[0]


def experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """transformers' experts forward through pounce: out [T,H] in hidden_states' dtype."""
    _ops.check_float("hidden_states", hidden_states)
    _ops.check_float("top_k_weights", top_k_weights)
    tokens, hidden = hidden_states.shape
    layer = _layer_handle(self, tokens, hidden, top_k_index.shape[-1])
    num_experts = _global_experts(self)
    x = hidden_states.to(torch.bfloat16)
    idx = top_k_index
    weights = top_k_weights.float()
    if self.is_transposed:  # GPT-OSS: biases folded in, see the module docstring
        x_aug, w_gate, w_up, w_down = _gpt_oss_weights(self, x)
        out = _ops.moe(x_aug, idx, weights, w_gate, w_up, w_down, layer=layer)[:, :hidden]
        out = out.float() + _down_bias_term(self, idx, weights)
    else:
        shared = self.__dict__["_pounce"].shared
        ws = (None, None, None)
        if shared:
            ws = (shared[0].gate_proj.weight, shared[0].up_proj.weight, shared[0].down_proj.weight)
        gate_up, up = _gate_up_rows(self)
        if up is None:
            out = _ops.moe(x, idx, weights, w_down=self.down_proj, w_gate_up=gate_up, ws_gate=ws[0], ws_up=ws[1],
                           ws_down=ws[2], layer=layer)
        else:
            out = _ops.moe(x, idx, weights, gate_up.contiguous(), up.contiguous(), self.down_proj, *ws, layer=layer)
    self.last_tokens_per_expert = _ops.tokens_per_expert(idx, num_experts)
    return out.to(hidden_states.dtype)


# -- registration ---------------------------------------------------------------------------------------

_registered = {"done": False}


def register_transformers() -> bool:
    """Registers "pounce" in transformers' ExpertsInterface. False when transformers (5.x, with the
    experts interface) is not installed."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register("pounce", experts_forward)
    _registered["done"] = True
    return True


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Registers "pounce" as soon as transformers' MoE integration module has been executed, so that
    importing pounce.torch does not import transformers (seconds) for users who never do."""

    _target = "transformers.integrations.moe"

    def find_spec(self, name, path, target=None):
        if name != self._target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):
            run(module)
            register_transformers()

        spec.loader = types.SimpleNamespace(
            create_module=loader.create_module, exec_module=exec_module,
            **{name_: getattr(loader, name_) for name_ in ("get_code", "get_source", "get_filename", "is_package")
               if hasattr(loader, name_)},
        )
        return spec


def register_on_import() -> None:
    """At import of pounce.torch: register now when transformers' MoE module is loaded, else once it is."""
    if "transformers.integrations.moe" in sys.modules:
        register_transformers()
    elif importlib.util.find_spec("transformers") is not None:
        if not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _RegisterAfterImport())


# -- model-level options ---------------------------------------------------------------------------------


def _experts_modules(model: nn.Module):
    for name, module in model.named_modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and hasattr(module, "is_transposed"):
            yield name, module


def _fused_shared_forward(block: nn.Module, hidden_states: Tensor) -> Tensor:
    """DeepSeek-V3's MoE block with the shared experts inside pounce (the experts call adds them)."""
    if block.experts.config._experts_implementation != "pounce":
        return type(block).forward(block, hidden_states)
    shape = hidden_states.shape
    _, topk_weights, topk_indices = block.gate(hidden_states)
    flat = hidden_states.view(-1, shape[-1])
    return block.experts(flat, topk_indices, topk_weights).view(*shape)


def _fusable_shared(block: nn.Module):
    """The block's ungated SwiGLU shared expert, or None."""
    mlp = getattr(block, "shared_experts", None)
    if mlp is None or hasattr(block, "shared_expert_gate") or not hasattr(block, "gate"):
        return None
    if not all(isinstance(getattr(mlp, p, None), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj")):
        return None
    if any(getattr(mlp, p).bias is not None for p in ("gate_proj", "up_proj", "down_proj")):
        return None
    return mlp if _is_silu(getattr(mlp, "act_fn", None)) else None


def configure_transformers(
    model: nn.Module,
    *,
    group=None,
    max_tokens: Optional[int] = None,
    share_workspace: Optional[bool] = None,
    fuse_shared_experts: bool = False,
) -> dict:
    """Options of the "pounce" experts of a transformers model (call after loading the weights).

    ``group``: the EP group (a torch.distributed process group, a 1-D DeviceMesh such as ``mesh["ep"]``,
    or a :class:`pounce.Group`); every experts module then keeps only this rank's experts (its
    ``gate_up_proj``/``down_proj`` become the local slices). ``max_tokens``: tokens per rank and call
    (required under EP). ``share_workspace``: as for :class:`pounce.torch.MoE` (None: a workspace per
    layer within the budget; True: one shared workspace and a forward recompute before each backward,
    the right choice under transformers' gradient checkpointing, which recomputes the layer anyway).
    ``fuse_shared_experts``: run DeepSeek-V3-style ungated shared experts inside pounce. Returns counts:
    ``{"experts": modules configured, "shared_inside": blocks whose shared expert moved in}``.
    """
    group = _registry.as_group(group)
    num_ranks = _registry.group_size(group)
    rank = _registry.group_rank(group)
    counts = {"experts": 0, "shared_inside": 0}
    experts_names = set()
    for name, module in _experts_modules(model):
        experts_names.add(name)
        global_experts = module.gate_up_proj.shape[0]
        if num_ranks > 1:
            if module.has_bias:
                raise NotImplementedError(
                    "pounce: expert biases under EP need pounce's own bias support; run GPT-OSS on one rank"
                )
            if global_experts % num_ranks:
                raise pounce.PounceError(
                    f"pounce: {name} has {global_experts} experts, not divisible by the EP group's {num_ranks} ranks"
                )
            local = global_experts // num_ranks
            lo = rank * local
            with torch.no_grad():
                for pname in ("gate_up_proj", "down_proj"):
                    param = getattr(module, pname)
                    setattr(module, pname, nn.Parameter(param[lo:lo + local].clone(),
                                                        requires_grad=param.requires_grad))
        old = module.__dict__.pop("_pounce", None)
        if old is not None:
            old.close()
        state = _ExpertsState(group=group, max_tokens=max_tokens, share_workspace=share_workspace,
                              num_experts=global_experts)
        module.__dict__["_pounce"] = state
        counts["experts"] += 1
    if fuse_shared_experts:
        for name, block in model.named_modules():
            experts = getattr(block, "experts", None)
            if experts is None or "_pounce" not in experts.__dict__:
                continue
            mlp = _fusable_shared(block)
            if mlp is None or experts.is_transposed:
                continue
            experts.__dict__["_pounce"].shared = (mlp,)  # a tuple: not registered as a submodule twice
            block.forward = types.MethodType(_fused_shared_forward, block)
            counts["shared_inside"] += 1
    return counts
