"""Layers, EP groups and workspaces on the host side of the custom ops.

A *layer* is an int handle (it is what the custom ops take, so torch.compile bakes a constant into the
graph) naming a shape, a config, an EP group and whether the layer shares its workspace. The group and
the workspace are resolved when the layer first runs, on the device of its input.

Workspaces are cached per (group, shape, config) and shared by every layer that asks for the same
triple: one workspace holds every buffer of the worst case (gigabytes at model sizes), so one per
layer would not fit. The workspace also holds the forward context that backward reads, so each
:class:`Slot` remembers which forward call its context belongs to (the *ticket*, see ``_ops.py``), and
backward rebuilds the context with ``recompute_forward_context`` when another forward ran in between.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import torch

import pounce

# The fields of pounce.Shape and pounce.Config, in constructor order. A Layer holds every shape field but
# num_ranks (its group decides that when the layer first runs).
_SHAPE_FIELDS = (
    "max_tokens", "hidden", "intermediate", "num_experts", "num_topk", "shared_intermediate", "num_ranks"
)
_CONFIG_FIELDS = (
    "forward_comm_sms",
    "backward_comm_sms",
    "minibatch_size",
    "macrobatch_size",
    "activation",
    "precision",
    "deterministic",
    "backend",
    "kernel_path",
    "backward_kernel_path",
    "combine",
)


def copy_config(config: pounce.Config) -> pounce.Config:
    return pounce.Config(**{name: getattr(config, name) for name in _CONFIG_FIELDS})


class Slot:
    """One pounce.Workspace and the ticket (data_ptr) of the forward whose context it holds."""

    __slots__ = ("workspace", "group", "resident", "forwards", "recomputes")

    def __init__(self, workspace: pounce.Workspace, group: pounce.Group):
        self.workspace = workspace
        self.group = group  # keeps id(group) in the cache key unique
        self.resident = None
        self.forwards = 0
        self.recomputes = 0


@dataclass
class Layer:
    hidden: int
    intermediate: int
    num_experts: int
    num_topk: int
    max_tokens: int
    shared_intermediate: int
    config: pounce.Config
    group: object  # None, a pounce.Group or a torch.distributed ProcessGroup
    share_workspace: bool
    slot: Slot | None = None

    def shape(self, num_ranks: int) -> pounce.Shape:
        return pounce.Shape(num_ranks=num_ranks, **{name: getattr(self, name) for name in _SHAPE_FIELDS[:-1]})

    def resolve(self, device: torch.device) -> Slot:
        if self.slot is None:
            group = resolve_group(self.group, device)
            shape = self.shape(group.num_ranks)
            self.slot = workspace_slot(group, shape, self.config, share=self.share_workspace, device=device)
        return self.slot


_layers: dict[int, Layer] = {}
_slots: dict[tuple, Slot] = {}
_groups: dict[tuple, pounce.Group] = {}
_next_layer = itertools.count()


def register_layer(
    *,
    hidden: int,
    intermediate: int,
    num_experts: int,
    num_topk: int,
    max_tokens: int,
    shared_intermediate: int = 0,
    config: pounce.Config | None = None,
    group=None,
    share_workspace: bool = True,
) -> int:
    """A layer handle for :func:`pounce.torch.moe`. Checks the shape now; allocates on first use.

    ``group``: a :class:`pounce.Group`, a ``torch.distributed`` process group (its ranks form the EP
    group), or ``None`` (the default process group when one is initialised, else a single rank).
    ``share_workspace=False`` gives the layer a workspace of its own (no recompute before backward,
    at the memory of a whole workspace).
    """
    config = config if config is not None else pounce.Config()
    layer_ = Layer(
        hidden, intermediate, num_experts, num_topk, max_tokens, shared_intermediate, config, group, share_workspace
    )
    layer_.shape(group_size(group)).validate()
    handle = next(_next_layer)
    _layers[handle] = layer_
    return handle


def layer(handle: int) -> Layer:
    try:
        return _layers[handle]
    except KeyError:
        raise pounce.PounceError(
            f"pounce: layer handle {handle} is unknown; create it with pounce.torch.register_layer"
        ) from None


def unregister_layer(handle: int) -> None:
    _layers.pop(handle, None)


def _key_part(value):
    if isinstance(value, pounce.Activation):
        return (int(value.kind.value), value.clamp_limit, value.alpha)
    return int(value.value) if isinstance(value, enum.Enum) else value


def _config_key(config: pounce.Config) -> tuple:
    return tuple(_key_part(getattr(config, name)) for name in _CONFIG_FIELDS)


def _shape_key(shape: pounce.Shape) -> tuple:
    return tuple(getattr(shape, name) for name in _SHAPE_FIELDS)


def workspace_slot(group, shape, config, *, share: bool = True, device=None) -> Slot:
    """The cached workspace for (group, shape, config); a fresh one when ``share`` is False."""
    key = (id(group), _shape_key(shape), _config_key(config))
    if share and key in _slots:
        return _slots[key]
    with _device_scope(device):
        slot = Slot(pounce.Workspace(group, shape, config), group)
    if share:
        _slots[key] = slot
    return slot


def free_workspaces() -> None:
    """Frees every cached workspace now (collective on GPUs: call it on every rank, e.g. before
    ``dist.destroy_process_group()``). Layers allocate again on their next call."""
    for layer_ in _layers.values():
        layer_.slot = None
    _slots.clear()


def workspace_stats() -> list[dict]:
    """Per cached workspace: shape, forwards run and context recomputes done (for tests and tuning)."""
    return [
        {"shape": key[1], "forwards": slot.forwards, "recomputes": slot.recomputes}
        for key, slot in _slots.items()
    ]


# ---------------------------------------------------------------------------------------------------
# EP groups
# ---------------------------------------------------------------------------------------------------


def _dist_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _group_query(group, attribute: str, query, alone: int) -> int:
    """`attribute` of a pounce.Group, else torch.distributed's `query` of the process group (None: the
    default group when initialised, else `alone`, a single rank's answer)."""
    if isinstance(group, pounce.Group):
        return getattr(group, attribute)
    if group is None:
        return query() if _dist_initialized() else alone
    return query(group)


def group_size(group) -> int:
    return _group_query(group, "num_ranks", torch.distributed.get_world_size, 1)


def group_rank(group) -> int:
    return _group_query(group, "rank", torch.distributed.get_rank, 0)


def ep_group(process_group=None) -> pounce.Group:
    """The pounce GPU group over the ranks of a torch.distributed process group (default: WORLD).

    Collective over the process group: rank 0 draws an NCCL unique id, ``broadcast_object_list`` sends
    it, every rank joins the communicator on its current CUDA device. Cached per process group and
    device.
    """
    pg = process_group if process_group is not None else torch.distributed.group.WORLD
    device = torch.cuda.current_device()
    key = ("nccl", id(pg), device)
    if key in _groups:
        return _groups[key]
    rank = torch.distributed.get_rank(pg)
    num_ranks = torch.distributed.get_world_size(pg)
    unique_id = [pounce.Group.new_unique_id() if rank == 0 else None]
    if num_ranks > 1:
        src = torch.distributed.get_global_rank(pg, 0)
        torch.distributed.broadcast_object_list(unique_id, src=src, group=pg)
    group = pounce.Group.create_nccl(rank, num_ranks, unique_id[0])
    _groups[key] = group
    _groups[key + ("pg",)] = pg  # keeps id(pg) unique while cached
    return group


def resolve_group(group, device: torch.device) -> pounce.Group:
    if isinstance(group, pounce.Group):
        return group
    if device.type == "cuda":
        with _device_scope(device):
            if group is None and not _dist_initialized():
                key = ("single", device.index)
                if key not in _groups:
                    _groups[key] = pounce.Group.create_nccl(0, 1, pounce.Group.new_unique_id())
                return _groups[key]
            return ep_group(group)
    if group is not None or group_size(None) > 1:
        raise pounce.PounceError(
            "pounce: a torch.distributed group runs on GPUs only; for the CPU backend pass the handles of "
            "pounce.Group.create_cpu(R) (one per rank, each driven from its own thread)"
        )
    if "cpu" not in _groups:
        _groups["cpu"] = pounce.Group.create_cpu(1)[0]
    return _groups["cpu"]


class _NullScope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _device_scope(device):
    if device is not None and device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return _NullScope()
