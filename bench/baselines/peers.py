"""The public MoE implementations Pounce is measured against beside the PyTorch baseline (docs/benchmarks.md).

torch_moe.py runs them with ``--peers``, in its own process, after the baseline of each configuration, on
the baseline's weights, input sets and routing, timed by its ``_time_iterations`` (CUDA events, median of
the per-iteration maximum over ranks, input sets rotated past L2):

  liger         liger-kernel's fused MoE (``liger_kernel.ops.fused_moe.LigerFusedMoEFunction``: Triton
                gather + grouped GEMM + SwiGLU, down projection, weighted gather-sum; backward recomputes).
                Weights as ``gate_up_proj [E,2I,H]`` (gate rows, then up rows) and ``down_proj [E,H,I]``.
  transformers  transformers 5's ``grouped_mm`` experts implementation: the model's own experts module
                (``Qwen3MoeExperts`` for SwiGLU, ``GptOssExperts`` for the GPT-OSS activation) built with
                ``experts_implementation="grouped_mm"``, called as the model's MoE block calls it.
  floor         the compute-only floor: the same expert GEMMs (torch._grouped_mm gate, up, down and the
                activation, plus the shared expert) on rows already grouped by expert; no routing, no
                permutes, no communication (at EP > 1 the rows are dispatched once, untimed).

A peer that cannot run a configuration gets a record saying why (``unsupported``: its design cannot;
otherwise the peer is not importable here); none is left out. ``unsupported_reason`` and ``parse_peers``
are pure and need no torch.
"""
from __future__ import annotations

import os

PEERS = ("liger", "transformers", "floor")

# What each peer is, for the records.
DESCRIPTIONS = {
    "liger": "Liger fused MoE (LigerFusedMoEFunction: Triton grouped GEMMs, one GPU's experts)",
    "transformers": "transformers experts_implementation=\"grouped_mm\" (the model's experts module)",
    "floor": "compute-only floor: torch._grouped_mm expert GEMMs on rows already grouped by expert",
}

AUTOTUNE_NOTE = ("Triton autotune cached on disk (TRITON_CACHE_AUTOTUNING=1): paid once, in the untimed "
                 "warm-up of the first configuration of each (H, I)")


def parse_peers(text):
    """``liger,transformers,floor``, ``all`` or empty -> the peers in PEERS order, without repeats."""
    names = [s.strip() for s in (text or "").split(",") if s.strip()]
    wanted = set()
    for name in names:
        if name == "all":
            wanted.update(PEERS)
        elif name in PEERS:
            wanted.add(name)
        else:
            raise ValueError(f"--peers: unknown peer {name!r}; choose from {', '.join(PEERS)} or all")
    return [p for p in PEERS if p in wanted]


def unsupported_reason(peer, cfg, ranks):
    """Why ``peer`` cannot run the configuration ``cfg`` (a torch_moe preset dict) on ``ranks`` ranks by its
    design, or None when it can. Pure."""
    act, limit, shared = cfg["activation"], cfg.get("limit"), cfg.get("shared_intermediate", 0)
    if peer == "floor":
        return None
    if ranks > 1:
        return (f"{peer} computes one GPU's experts and has no expert-parallel dispatch or combine; "
                f"EP{ranks} needs them (measure it at EP1)")
    if shared:
        owner = "liger-kernel's" if peer == "liger" else "transformers'"
        return (f"{owner} experts have no shared expert (Is {shared}); the routed experts alone are the shape "
                f"custom:{cfg['hidden']}:{cfg['intermediate']}:{cfg['experts']}:{cfg['topk']}")
    if peer == "liger":
        if act != "swiglu":
            return f"liger-kernel's fused MoE computes SwiGLU only, not the {act} activation"
        if limit is not None:
            return f"liger-kernel's fused MoE has no activation clamp (limit {limit})"
        return None
    if peer == "transformers":
        if act == "swiglu" and limit is not None:
            return f"transformers' SwiGLU experts have no activation clamp (limit {limit})"
        if act == "gptoss" and limit not in (None, 7.0):
            return f"transformers' GptOssExperts clamps at 7, not at {limit}"
        return None
    raise ValueError(f"unknown peer {peer!r}")


def _version(distribution):
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def availability(peer):
    """(version text, None) when ``peer`` imports here, else (None, the reason)."""
    import torch

    if peer == "floor":
        return f"torch {torch.__version__}", None
    if peer == "liger":
        # Before liger_kernel (and so triton's autotuner) is imported: autotune results go to the cache.
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
        try:
            from liger_kernel.ops.fused_moe import LigerFusedMoEFunction  # noqa: F401
        except Exception as error:  # noqa: BLE001 - any import failure means "not available"
            return None, f"liger_kernel's fused MoE does not import here: {type(error).__name__}: {error}"
        return f"liger-kernel {_version('liger-kernel')}, triton {_version('triton')}", None
    if peer == "transformers":
        try:
            import transformers
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        except Exception as error:  # noqa: BLE001
            return None, f"transformers does not import here: {type(error).__name__}: {error}"
        if "grouped_mm" not in ALL_EXPERTS_FUNCTIONS:
            return None, f"transformers {transformers.__version__} has no grouped_mm experts implementation"
        return f"transformers {transformers.__version__}", None
    raise ValueError(f"unknown peer {peer!r}")


# ---- the peers' layers -------------------------------------------------------------------------------
# Each build_* takes the baseline's weights and input sets (one rank's view) and returns
# (run(s) -> output tensor of set s, leaves whose .grad to reset, notes for the record).
# Weight copies in a peer's own layout are made here, once, untimed: a user holds the weights that way.


def _leaf(t):
    return t.detach().clone().requires_grad_()


def build_liger(w, sets, cfg):
    import torch
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    gate_up = _leaf(torch.cat([w["gate"], w["up"]], dim=1))  # [E, 2I, H]: gate rows, then up rows
    down = _leaf(w["down"])                                   # [E, H, I]
    idx32 = [idx.to(torch.int32) for _, idx, _, _ in sets]    # the router's ids as Liger takes them

    def run(s):
        x, _, weights, _ = sets[s]
        return LigerFusedMoEFunction.apply(x, gate_up, down, idx32[s], weights)

    return run, [gate_up, down], [AUTOTUNE_NOTE, "topk ids int32, topk_weights fp32 (as the baseline)"]


def _transformers_experts(cfg, w):
    """The model's experts module with experts_implementation="grouped_mm", on the baseline's weights."""
    import torch

    H, I, E, k = cfg["hidden"], cfg["intermediate"], cfg["experts"], cfg["topk"]
    notes = []
    with torch.device("meta"):  # no full-size CPU parameters; the real ones are set below
        if cfg["activation"] == "gptoss":
            from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
            from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

            config = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                  num_experts_per_tok=k, experts_implementation="grouped_mm")
            module = GptOssExperts(config)
        else:
            from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

            config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                    num_experts_per_tok=k, hidden_act="silu",
                                    experts_implementation="grouped_mm")
            module = Qwen3MoeExperts(config)
    if cfg["activation"] == "gptoss":
        # GptOssExperts: transposed [E,H,2I] with gate and up interleaved column by column, [E,I,H] down.
        gate_up = torch.stack([w["gate"], w["up"]], dim=2).reshape(E, 2 * I, H).transpose(1, 2)
        module.gate_up_proj = torch.nn.Parameter(gate_up.contiguous())
        module.down_proj = torch.nn.Parameter(w["down"].detach().transpose(1, 2).contiguous())
        # Pounce's bench and the baseline have no expert biases: leave them out rather than add zeros.
        module.has_bias = False
        module.gate_up_proj_bias = None
        module.down_proj_bias = None
        notes.append("GptOssExperts (alpha 1.702, limit 7) with has_bias=False: no expert biases, as the "
                     "baseline")
    else:
        module.gate_up_proj = torch.nn.Parameter(torch.cat([w["gate"], w["up"]], dim=1).detach().clone())
        module.down_proj = torch.nn.Parameter(w["down"].detach().clone())
        notes.append("Qwen3MoeExperts (gate_up_proj [E,2I,H], SwiGLU)")
    return module, notes


def build_transformers(w, sets, cfg):
    import torch

    module, notes = _transformers_experts(cfg, w)
    # transformers' routers hand the experts bf16 routing weights (the hidden states' dtype)
    weights = [wt.detach().to(x.dtype).requires_grad_() for x, _, wt, _ in sets]

    def run(s):
        x, idx, _, _ = sets[s]
        return module(x, idx, weights[s])

    notes.append("topk_weights cast to bf16 once, untimed, as transformers' routers give them")
    leaves = list(module.parameters()) + weights
    return run, leaves, notes


def build_floor(w, sets, cfg, group, ranks, shared):
    """The expert GEMMs alone on rows already grouped by local expert (and their d_out rows)."""
    import torch

    import torch_moe

    E, act, limit = cfg["experts"], cfg["activation"], cfg.get("limit")
    grouped = []  # per set: (xg, offs, dg rows, x for the shared expert)
    with torch.no_grad():
        for x, idx, _, dout in sets:
            rt = torch_moe._route(idx, E, ranks, group)

            def to_experts(rows):
                send = rows.index_select(0, rt["token_of_pair"])
                if ranks > 1:
                    recv = send.new_empty((rt["n_recv"], rows.shape[1]))
                    torch.distributed.all_to_all_single(recv, send, rt["out_splits"], rt["in_splits"],
                                                        group=group)
                    send = recv
                return send.index_select(0, rt["group_order"]).contiguous()

            grouped.append((to_experts(x.detach()).requires_grad_(), rt["offs"], to_experts(dout),
                            x.detach().clone().requires_grad_()))

    def run(s):
        xg, offs, _, x = grouped[s]
        y = torch_moe._experts(xg, offs, w["gate"], w["up"], w["down"], act, limit, torch_moe.GPTOSS_ALPHA,
                               False)
        if shared:
            return y, torch_moe.shared_expert(x, *shared, act, limit)
        return (y,)

    def grads(s):
        _, _, dg, x = grouped[s]
        return (dg,) if not shared else (dg, sets[s][3])

    leaves = [t for g in grouped for t in (g[0], g[3])]
    notes = ["rows grouped by local expert before timing (at EP>1 dispatched once, untimed)"]
    if shared:
        notes.append("includes the shared expert (F.linear, as the baseline)")
    return run, grads, leaves, notes
