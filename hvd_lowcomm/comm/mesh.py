"""Sharding inside groups: a DeviceMesh made from hvd_lowcomm's groups, for PyTorch's FSDP2.

    hl.init(engine="torch")
    mesh = hl.device_mesh(group_size=4)       # ("replicate", "shard"): groups of 4 ranks shard one copy
    for block in model.blocks:
        hl.fully_shard(block, mesh)           # torch's fully_shard, its collectives metered
    hl.fully_shard(model, mesh)
    # or, the same on any model: hl.shard_model(model, mesh)

The mesh's dimensions are process groups made from the same MPI splits as the methods' groups
(`runtime.split_world`): "shard" holds the ranks of one group (contiguous ranks, a node's when
the group is a node), "replicate" the ranks at the same position in every group. With one group
(group_size 0 or the world) the mesh is 1-D, ("shard",): plain FSDP over every rank; with
several, fully_shard on the 2-D mesh is HSDP (shards reduce-scattered inside a group,
all-reduced across groups).

`fully_shard` routes FSDP2's all-gathers and reduce-scatters through custom comms that record
each call in the traffic meter (its all-reduce across groups through FSDP2's all-reduce hook),
so FSDP's bytes are counted with every other method's. `shard_model` applies it as torchtitan
does: each repeated block on its own (a transformer's layers), then the rest as the root. FSDP2
runs on torch.distributed process groups: the torch engine only.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.runtime import Group
from hvd_lowcomm.comm.traffic import collectives_take, meter
from hvd_lowcomm.config import ConfigError

try:  # FSDP2 with custom comms; the defaults subclassed are torch's own (no public name yet)
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    MISSING = ""
except ImportError as missing:  # said when sharding is asked for, not when the package loads
    DefaultAllGather = DefaultReduceScatter = object  # type: ignore[assignment,misc]
    MISSING = (
        f"sharding needs a torch whose FSDP2 takes custom collectives (fully_shard's "
        f"set_custom_all_gather; torch {torch.__version__} has not: {missing}): pip install -U torch"
    )

# The groups (shard, replicate or None) of each mesh made here, by the mesh's id: what the
# metered comms record a call's group as. Kept beside the mesh, not on it, so a DTensor's pickle
# (torch.save of a sharded model's state_dict) holds torch's objects alone; an entry goes with its mesh.
_mesh_groups: dict[int, tuple[Group | None, Group | None]] = {}

# The parameters fully_shard replaced by their shards, by id: an optimiser built on them before
# sharding would step tensors the model no longer uses (see refuse_unsharded_parameters).
_replaced: dict[int, weakref.ref] = {}
_step_guard: Any = None  # the optimiser-step hook that checks for them, registered at the first shard


def _remember(mesh: DeviceMesh, groups: tuple[Group | None, Group | None]) -> DeviceMesh:
    key = id(mesh)
    _mesh_groups[key] = groups
    weakref.finalize(mesh, _mesh_groups.pop, key, None)
    return mesh


def device_mesh(group_size: int = 0, device: torch.device | str | None = None, replicate: bool = True) -> DeviceMesh:
    """A DeviceMesh whose "shard" dimension is this rank's group of `group_size` contiguous ranks
    (0: every rank) and whose "replicate" dimension, when there are several groups, the ranks at
    its position in the others; collective, call on every rank after init(engine="torch").
    `replicate` False: the group's own 1-D mesh, for a method that joins the groups itself
    (DiLoCo, PowerSGD across groups): FSDP then exchanges nothing between groups."""
    if MISSING:
        raise ConfigError(MISSING)
    if runtime.engine().name != "torch":
        raise ConfigError(
            "sharding (FSDP2) runs on torch.distributed process groups, not Horovod's: "
            "hvd_lowcomm.init(engine='torch'), or --comm.engine torch"
        )
    world = runtime.world()
    size = group_size or world.size
    if size < 1 or world.size % size:
        raise ConfigError(
            f"sharding groups of {size} ranks do not divide {world.size} ranks: choose a group size "
            f"that divides the rank count (0: every rank in one group)"
        )
    device_type = torch.device(device).type if device is not None else runtime.device().type
    if size == world.size:
        return _remember(DeviceMesh.from_group(dist.group.WORLD, device_type, mesh_dim_names=("shard",)), (world, None))
    shard, _ = runtime.split_world(group_size=size, label="shard")
    if not replicate:
        return _remember(
            DeviceMesh.from_group(shard.process_set, device_type, mesh_dim_names=("shard",)), (shard, None)
        )
    if device_type == "cuda" and not collectives_take(torch.device("cuda")):
        raise ConfigError(
            "HSDP (sharding groups smaller than the world) all-reduces across groups with NCCL, which "
            "refuses ranks that share a GPU: give each rank its own GPU, or shard over every rank "
            "(group size 0)"
        )
    replicate, _ = runtime.split_by_position(world.size // size, label="replicate")
    layout = torch.arange(world.size).view(world.size // size, size)
    columns = replicate.process_set if replicate.size < world.size else dist.group.WORLD  # groups of one rank
    mesh = DeviceMesh.from_group(
        [columns, shard.process_set], device_type, mesh=layout, mesh_dim_names=("replicate", "shard")
    )
    return _remember(mesh, (shard, replicate))


def groups_of(mesh: DeviceMesh) -> tuple[Group | None, Group | None]:
    """(this rank's shard group, its replicate group or None) of a mesh made by device_mesh."""
    if id(mesh) not in _mesh_groups:
        raise ValueError(
            "this DeviceMesh was not made by hvd_lowcomm.device_mesh: its groups are not known "
            "(make it with hvd_lowcomm.device_mesh)"
        )
    return _mesh_groups[id(mesh)]


def columns_across_groups(parameters: Any) -> Group | None:
    """For parameters sharded on a group's own mesh (device_mesh(g, replicate=False)): the ranks
    at this rank's position in every group, which hold the same shards, for a method that
    joins the groups itself; None where nothing is sharded so. Collective over every rank."""
    mesh = next((p.device_mesh for p in parameters if isinstance(p, DTensor)), None)
    if mesh is None:
        return None
    shard, replicate = groups_of(mesh)
    if replicate is not None or shard is None or shard.size == runtime.size():
        return None  # HSDP's mesh replicates across groups itself; one group has none to join
    column, _ = runtime.split_by_position(runtime.size() // shard.size, label="column")
    return column


def _staged(output_tensor: torch.Tensor, input_tensor: torch.Tensor, collective: Callable[..., Any]) -> Any:
    """`collective(output, input)` on host copies where the group's backend cannot take the
    device's tensors (ranks sharing a GPU, which NCCL refuses; see traffic.collectives_take),
    the result copied back; else on the tensors themselves."""
    if input_tensor.device.type != "cuda" or collectives_take(input_tensor.device):
        return collective(output_tensor, input_tensor)
    host_output = torch.empty(output_tensor.shape, dtype=output_tensor.dtype)
    collective(host_output, input_tensor.cpu(), async_op=False)
    output_tensor.copy_(host_output)
    return None  # done: FSDP2 waits on its stream's event, not on a Work


class MeteredAllGather(DefaultAllGather):
    """FSDP2's all-gather of a module's parameters, recorded in the meter."""

    def __init__(self, group: Group | None, name: str) -> None:
        self.group, self.name = group, name

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> Any:
        meter.record("allgather", self.name, output_tensor.numel() * output_tensor.element_size(), self.group)
        gather = super().__call__
        return _staged(
            output_tensor,
            input_tensor,
            lambda out, inp, async_op=async_op: gather(out, inp, group, async_op),
        )


class MeteredReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter of a module's gradients, recorded in the meter."""

    def __init__(self, group: Group | None, name: str) -> None:
        self.group, self.name = group, name

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        meter.record("reduce_scatter", self.name, input_tensor.numel() * input_tensor.element_size(), self.group)
        scatter = super().__call__
        return _staged(
            output_tensor,
            input_tensor,
            lambda out, inp, async_op=async_op: scatter(out, inp, group, op, async_op),
        )


def fully_shard(module: torch.nn.Module, mesh: DeviceMesh, **options: Any) -> torch.nn.Module:
    """torch's ``fully_shard(module, mesh=mesh, **options)``, its collectives recorded in the meter
    under the module's class name; `mesh` from device_mesh. Returns the module (now an FSDPModule)."""
    shard, replicate = groups_of(mesh)
    before = list(module.parameters())
    sharded = torch_fully_shard(module, mesh=mesh, **options)
    _remember_replaced(p for p in before if not isinstance(p, DTensor))
    name = f"fsdp/{type(module).__name__}"
    sharded.set_custom_all_gather(MeteredAllGather(shard, name))
    sharded.set_custom_reduce_scatter(MeteredReduceScatter(shard, name))
    if replicate is not None:  # HSDP: the shard's all-reduce across groups, seen once it is done

        def record_allreduce(reduced: torch.Tensor) -> None:
            meter.record("allreduce", name, reduced.numel() * reduced.element_size(), replicate)

        sharded.set_all_reduce_hook(record_allreduce)
    return sharded


def _remember_replaced(parameters: Any) -> None:
    """Note the parameters fully_shard replaced, and check every optimiser step from now on."""
    global _step_guard
    for param in parameters:
        key = id(param)
        _replaced[key] = weakref.ref(param, lambda _, key=key: _replaced.pop(key, None))
    if _step_guard is None:
        _step_guard = register_optimizer_step_pre_hook(refuse_unsharded_parameters)


def refuse_unsharded_parameters(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before any optimiser's step: refuse one that holds parameters a module had before
    fully_shard replaced them by their shards (built before shard_model, as DDP's tutorial
    builds it before DDP(model)): its steps would change tensors the model no longer uses, and
    the model would train nothing."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            held = _replaced.get(id(param))
            if held is not None and held() is param:
                raise ConfigError(
                    "this optimiser holds a parameter from before the model was sharded: fully_shard "
                    "(hvd_lowcomm.shard_model) replaces every parameter by its shard, so its steps would "
                    "change nothing the model uses. Shard first, then build the optimiser: "
                    "shard_model(model, mesh); optimizer = torch.optim.AdamW(model.parameters(), ...)"
                )


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules shard_model shards one by one before the root, outermost first: children of
    one parent that repeat its other children's class (a transformer's blocks, an MLP's layers)
    and hold parameters, none of them shared with a module outside (a tied weight stays in the
    root, which gathers it once for both)."""
    names_of: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        names_of[id(p)] = names_of.get(id(p), 0) + 1

    def unit(child: torch.nn.Module, siblings: list[torch.nn.Module]) -> bool:
        params = list(child.parameters())
        inside = {}
        for _, p in child.named_parameters(remove_duplicate=False):
            inside[id(p)] = inside.get(id(p), 0) + 1
        return (
            bool(params)
            and sum(type(s) is type(child) for s in siblings) > 1
            and all(names_of[key] == count for key, count in inside.items())
        )

    units: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        children = list(module.children())
        for child in children:
            if unit(child, children):
                units.append(child)
            else:
                visit(child)

    visit(model)
    return units


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, **options: Any) -> torch.nn.Module:
    """`fully_shard` on each of `shard_units(model)`, then on `model` (the root: what is left);
    `options` go to every call. Returns the model."""
    for unit in shard_units(model):
        fully_shard(unit, mesh, **options)
    return fully_shard(model, mesh, **options)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a tensor: its shard of a DTensor (an FSDP2 parameter or
    gradient), else all of it."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A sharded model's and its optimiser's state by parameter name, as DTensors (the
    optimiser's made first where it has not stepped yet): what torch.distributed.checkpoint
    saves, and loads in place onto any layout."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def load_sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Put back a sharded_state(...) tree that torch.distributed.checkpoint loaded in place."""
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def local_shards(tree: Any) -> Any:
    """`tree` (a sharded state dict) with every DTensor as this rank's shard of it."""
    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: local_shards(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_shards(v) for v in tree)
    return tree


def with_shards(own: Any, shards: Any) -> Any:
    """`own` (this rank's sharded state dict) with the values of `shards` (another rank's
    `local_shards` of the same layout): DTensors keep their layout and take the shard."""
    if isinstance(own, DTensor):
        own.to_local().copy_(shards)
        return own
    if isinstance(own, dict):
        return {k: with_shards(own[k], shards[k]) if k in own else shards[k] for k in shards}
    if isinstance(own, (list, tuple)) and len(own) == len(shards):
        return type(own)(with_shards(a, b) for a, b in zip(own, shards))
    return shards


def full_state_dict(model: torch.nn.Module) -> dict[str, Any] | None:
    """A sharded model as one ordinary state dict on global rank 0 (None elsewhere); collective."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if runtime.rank() == 0 else None
