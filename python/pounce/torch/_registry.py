"""Layers, EP groups and workspaces on the host side of the custom ops.

A *layer* is an int handle (it is what the custom ops take, so torch.compile bakes a constant into the
graph) naming a shape, a config, an EP group and how the layer gets its workspace. The group and the
workspace are resolved when the layer first runs, on the device of its input.

A workspace holds every buffer of the worst case and the forward context that backward reads (2.4 GiB
for Qwen3-30B-A3B's layer at 8192 tokens). Each :class:`Slot` remembers which forward call its context
belongs to (the *ticket*, see ``_ops.py``), and backward rebuilds the context with
``recompute_forward_context`` when another forward ran in between. Hence the choice per layer:

- a workspace of its own (``share_workspace=False``): backward never recomputes; costs one workspace
  (``pounce.bytes_required``) per layer;
- one workspace shared by the layers of equal (group, shape, config) (``share_workspace=True``, i.e.
  activation checkpointing of the experts): one workspace in all; each layer but the last recomputes its
  forward before its backward (about a third of the layer's forward+backward time);
- ``share_workspace=None`` (the default): a workspace of its own while the private workspaces on that
  device total at most the budget (:func:`set_workspace_budget`; default a fifth of the GPU's memory,
  no limit on the CPU), shared past it (with a one-time warning).
"""
from __future__ import annotations

import enum
import itertools
import warnings
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


_PRECISIONS = {"bf16": pounce.Precision.bf16, "fp8": pounce.Precision.fp8}


def parse_precision(value) -> pounce.Precision:
    """'bf16' | 'fp8' (or a pounce.Precision) -> pounce.Precision; anything else a PounceError (a ValueError)."""
    if isinstance(value, pounce.Precision):
        return value
    if isinstance(value, str) and value in _PRECISIONS:
        return _PRECISIONS[value]
    raise pounce.PounceError(f"pounce: argument 'precision' = {value!r} is unknown; pass 'bf16' or 'fp8'")


class Slot:
    """One pounce.Workspace and the ticket (data_ptr) of the forward whose context it holds."""

    __slots__ = ("workspace", "group", "resident", "forwards", "recomputes", "shared", "bytes", "device")

    def __init__(self, workspace: pounce.Workspace, group: pounce.Group, *, shared: bool, nbytes: int, device):
        self.workspace = workspace
        self.group = group  # keeps id(group) in the cache key unique
        self.resident = None
        self.forwards = 0
        self.recomputes = 0
        self.shared = shared
        self.bytes = nbytes
        self.device = device


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
    share_workspace: bool | None  # None: private within the budget, else shared
    slot: Slot | None = None
    check_errors: bool = True  # pounce.check_errors (no host sync) before each forward, after each backward

    def shape(self, num_ranks: int) -> pounce.Shape:
        return pounce.Shape(num_ranks=num_ranks, **{name: getattr(self, name) for name in _SHAPE_FIELDS[:-1]})

    def resolve(self, device: torch.device) -> Slot:
        if self.slot is None:
            group = resolve_group(self.group, device)
            shape = self.shape(group.num_ranks)
            share = self.share_workspace
            if share is None:
                share = not _fits_budget(shape, self.config, device)
            self.slot = workspace_slot(group, shape, self.config, share=share, device=device)
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
    share_workspace: bool | None = None,
    precision=None,
    check_errors: bool = True,
) -> int:
    """A layer handle for :func:`pounce.torch.moe`. Checks the shape now; allocates on first use.

    ``group``: a :class:`pounce.Group`, a ``torch.distributed`` process group or a 1-D DeviceMesh such as
    ``mesh["ep"]`` (its ranks form the EP group), or ``None`` (the default process group when one is initialised, else a single rank).
    ``share_workspace``: False gives the layer a workspace of its own (no recompute before backward, at
    the memory of a whole workspace), True shares one per (group, shape, config) (backward recomputes
    the forward when another layer ran in between: activation checkpointing), None (default) is private
    within the budget of :func:`set_workspace_budget`, shared past it. ``precision``: 'bf16' or 'fp8'
    (overrides ``config.precision``; None keeps it); an fp8 layer takes ``fp8_cache=`` in :func:`moe`.
    ``check_errors``: True (default) runs :func:`pounce.check_errors` on the layer's workspace, without a
    host sync, before each forward and after each backward, so a failure the GPU recorded (a timed-out
    peer wait, an expert id out of range) is raised naming the layer; False leaves it to the C++ check at
    the workspace's next call (docs/pytorch.md).
    """
    group = as_group(group)
    config = config if config is not None else pounce.Config()
    if precision is not None:
        config = copy_config(config)
        config.precision = parse_precision(precision)
    layer_ = Layer(
        hidden, intermediate, num_experts, num_topk, max_tokens, shared_intermediate, config, group, share_workspace,
        check_errors=check_errors,
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


# Bytes of private workspaces a device may hold under share_workspace=None; None = the default.
_budget: dict[str, int | None] = {"bytes": None}
_warned_budget = set()


def set_workspace_budget(nbytes: int | None) -> None:
    """Bytes of private (per-layer) workspaces each device may hold for layers with
    ``share_workspace=None``; None restores the default (a fifth of the GPU's memory; no limit on the
    CPU). Takes effect for layers that have not run yet (and after :func:`free_workspaces`)."""
    if nbytes is not None and nbytes < 0:
        raise pounce.PounceError(f"pounce: workspace budget {nbytes} is negative; pass bytes >= 0 or None")
    _budget["bytes"] = nbytes


def _default_budget(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory // 5


def _fits_budget(shape: pounce.Shape, config: pounce.Config, device: torch.device) -> bool:
    budget = _budget["bytes"] if _budget["bytes"] is not None else _default_budget(device)
    if budget is None:
        return True
    held = sum(slot.bytes for slot in _private_slots() if slot.device == device)
    need = pounce.bytes_required(shape, config).total
    if held + need <= budget:
        return True
    if device not in _warned_budget:
        _warned_budget.add(device)
        warnings.warn(
            f"pounce: per-layer workspaces on {device} would exceed the budget of {budget / 2**30:.1f} GiB; "
            f"the layers past it share one workspace and recompute their forward before backward "
            f"(pounce.torch.set_workspace_budget raises it)",
            stacklevel=3,
        )
    return False


def _private_slots() -> list[Slot]:
    seen, slots = set(), []
    for layer_ in _layers.values():
        slot = layer_.slot
        if slot is not None and not slot.shared and id(slot) not in seen:
            seen.add(id(slot))
            slots.append(slot)
    return slots


def workspace_slot(group, shape, config, *, share: bool = True, device=None) -> Slot:
    """The cached workspace for (group, shape, config); a fresh one when ``share`` is False."""
    key = (id(group), _shape_key(shape), _config_key(config))
    if share and key in _slots:
        return _slots[key]
    nbytes = pounce.bytes_required(shape, config).total
    with _device_scope(device):
        slot = Slot(pounce.Workspace(group, shape, config), group, shared=share, nbytes=nbytes, device=device)
    if share:
        _slots[key] = slot
    return slot


def free_workspaces() -> None:
    """Frees every workspace now, shared and per layer (collective on GPUs: call it on every rank, e.g.
    before ``dist.destroy_process_group()``). Layers allocate again on their next call."""
    for layer_ in _layers.values():
        layer_.slot = None
    _slots.clear()
    _warned_budget.clear()
    from . import _ops

    _ops.free_scratch()


def check_layer_errors(handle: int, slot: Slot, when: str, *, stream: int = 0, synchronize: bool = False):
    """pounce.check_errors on the layer's workspace; its PounceError raised again naming the layer."""
    layer_ = layer(handle)
    try:
        pounce.check_errors(slot.workspace, stream, synchronize)
    except pounce.PounceError as error:
        message = str(error).removeprefix("pounce: ")
        raise pounce.PounceError(
            f"pounce: layer {handle} (hidden={layer_.hidden}, intermediate={layer_.intermediate}, "
            f"num_experts={layer_.num_experts}): a call on its workspace failed on the GPU (found {when}): "
            f"{message}"
        ) from error


def check_errors(module=None, *, synchronize: bool = False) -> None:
    """Raises the failure the GPU recorded on the workspace of ``module`` (a :class:`pounce.torch.MoE` or a
    :func:`register_layer` handle), or of every layer that has run (None), as a PounceError naming the
    layer: :func:`pounce.check_errors` on the current stream of the workspace's device. The layers check
    themselves before each forward and after each backward, but not while a CUDA graph is captured: after a
    graph's replay call this with ``synchronize=True`` (it waits for the stream, so the replay's kernels
    are certainly checked). Without it, one read of host-mapped memory per workspace."""
    handles = list(_layers) if module is None else [getattr(module, "layer", module)]
    checked = set()
    for handle in handles:
        slot = layer(handle).slot
        if slot is None or id(slot) in checked:
            continue
        checked.add(id(slot))
        cuda = slot.device is not None and slot.device.type == "cuda"
        stream = torch.cuda.current_stream(slot.device).cuda_stream if cuda else 0
        with _device_scope(slot.device):
            check_layer_errors(handle, slot, "by check_errors", stream=stream, synchronize=synchronize)


def workspace_stats() -> list[dict]:
    """Per workspace in use: shape, whether layers share it, its bytes, the layers on it, forwards run
    and context recomputes done (for tests and tuning). Shared ones first."""
    users: dict[int, int] = {}
    for layer_ in _layers.values():
        if layer_.slot is not None:
            users[id(layer_.slot)] = users.get(id(layer_.slot), 0) + 1
    stats = []
    for slot in list(_slots.values()) + _private_slots():
        stats.append({
            "shape": _shape_key(slot.workspace.shape), "shared": slot.shared, "bytes": slot.bytes,
            "layers": users.get(id(slot), 0), "forwards": slot.forwards, "recomputes": slot.recomputes,
        })
    return stats


# ---------------------------------------------------------------------------------------------------
# EP groups
# ---------------------------------------------------------------------------------------------------


def as_group(group, argument: str = "group"):
    """``group`` with a DeviceMesh replaced by its process group: a 1-D mesh (``mesh["ep"]`` of a
    ("dp", "ep") mesh) stands for the ranks along its dimension; a mesh of more dimensions is refused,
    since which of them is the EP group is the caller's choice. Other values pass unchanged."""
    if isinstance(group, pounce.Group) or group is None or not _is_device_mesh(group):
        return group
    if group.ndim != 1:
        names = group.mesh_dim_names
        dims = f" with dimensions {names}" if names else ""
        raise pounce.PounceError(
            f"pounce: argument '{argument}' is a {group.ndim}-D DeviceMesh{dims}; pass the 1-D mesh of its EP "
            f"dimension, e.g. {argument}=mesh['ep'] (and give the other dimensions to FSDP/DDP)"
        )
    return group.get_group()


def _is_device_mesh(value) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(value, DeviceMesh)


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
    """The pounce GPU group over the ranks of a torch.distributed process group or 1-D DeviceMesh
    (default: WORLD).

    Collective over the process group: rank 0 draws an NCCL unique id, ``broadcast_object_list`` sends
    it, every rank joins the communicator on its current CUDA device. Cached per process group and
    device.
    """
    process_group = as_group(process_group, "process_group")
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
    if group_size(group) > 1:
        raise pounce.PounceError(
            "pounce: a torch.distributed group (or DeviceMesh) of more than one rank runs EP on GPUs only; the "
            "CPU backend's ranks are threads of one process: pass the handles of pounce.Group.create_cpu(R) "
            "(one per rank, each driven from its own thread), or an EP group of one rank"
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
