"""A second device on the CPU, `testdev`, for tests that catch device mistakes without a GPU.

PyTorch's hooks for Python backends (PrivateUse1, torch.utils.backend_registration) make
`testdev:0` a device; its tensors hold a CPU tensor and compute on the CPU, but behave as a GPU's
do where that matters for correctness:

- an op that mixes them with a CPU tensor (other than a 0-dim one, which CUDA also takes) fails
  with CUDA's message, and so does a CPU generator given to a factory on the device;
- `.cpu()` / `.to("cpu")` returns a plain CPU tensor, `.to(DEVICE)` a device one;
- Horovod and mpi4py cannot read them (they have no host storage), so collectives must stage
  them through host memory, as a CPU-built Horovod needs for CUDA tensors.

    from second_device import DEVICE, register
    register()
    model.to(DEVICE)
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch.utils._pytree import tree_map

NAME = "testdev"
_libraries: list[torch.library.Library] = []  # registrations live as long as their Library object

torch.utils.rename_privateuse1_backend(NAME)
DEVICE = torch.device(NAME, 0)


class DeviceTensor(torch.Tensor):
    """A tensor on DEVICE whose numbers live in a CPU tensor (`host`)."""

    host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor) -> "DeviceTensor":
        tensor = torch.Tensor._make_wrapper_subclass(
            cls,
            host.shape,
            strides=host.stride(),
            storage_offset=host.storage_offset(),
            dtype=host.dtype,
            device=DEVICE,
            layout=host.layout,
            requires_grad=host.requires_grad,
        )
        tensor.host = host
        return tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def data(self) -> torch.Tensor:
        return DeviceTensor(self.host.detach())

    @data.setter
    def data(self, value: torch.Tensor) -> None:  # `param.data = t`: the wrapper takes t's numbers and shape
        if not isinstance(value, DeviceTensor):  # on a GPU this would move the tensor to the CPU unnoticed
            raise RuntimeError(f"a tensor on {DEVICE} given a CPU tensor as its .data")
        torch._C.TensorBase.data.__set__(self, value)
        self.host = value.host

    def __repr__(self, **kwargs) -> str:
        return f"DeviceTensor({self.host!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen: set[str] = set()

        def to_host(x):
            if isinstance(x, DeviceTensor):
                seen.add("device")
                return x.host
            if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0:
                seen.add("cpu tensor")
            if isinstance(x, torch.Generator) and x.device.type == "cpu":
                seen.add("cpu generator")
            if isinstance(x, torch.device) and x.type == NAME:
                return torch.device("cpu")
            return x

        host_args, host_kwargs = tree_map(to_host, args), tree_map(to_host, kwargs)
        target = kwargs.get("device")
        if func is torch.ops.aten._to_copy.default and target is not None and torch.device(target).type == "cpu":
            return func(*host_args, **host_kwargs)  # to the host: a plain CPU tensor
        if func not in _CROSSING_OPS and "device" in seen and seen & {"cpu tensor", "cpu generator"}:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, "
                f"{DEVICE} and cpu! ({func}: {', '.join(sorted(seen - {'device'}))})"
            )
        out = func(*host_args, **host_kwargs)
        if func is torch.ops.aten.copy_.default:
            return args[0]
        return tree_map(lambda x: DeviceTensor(x) if isinstance(x, torch.Tensor) else x, out)


# Ops that take tensors of two devices on a GPU too: copies, and indexing with CPU indices.
_CROSSING_OPS = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default, torch.ops.aten.index.Tensor}


class _Event:
    """An event on the device's streams: recorded work is done when an op returns."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: "_Stream | None" = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def record(self, stream: "_Stream | None" = None) -> None:
        pass


class _Stream:
    """A stream of the device, as torch.cuda's: its work is done when an op returns (the device
    computes on the host), so waiting on it returns at once. torch.distributed.checkpoint saves
    through the stream of any device that is available; FSDP2 makes streams of its own and
    orders them by events."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: "_Stream") -> None:
        pass

    def wait_event(self, event: _Event) -> None:
        pass

    def record_event(self, event: _Event | None = None) -> _Event:
        return event or _Event()

    def query(self) -> bool:
        return True


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    return (tensor.host if isinstance(tensor, DeviceTensor) else tensor).untyped_storage()


def _alloc_storage(tensor: torch.Tensor) -> None:
    size = tensor.numel() * tensor.itemsize
    if (storage := _storage(tensor)).size() != size:
        storage.resize_(size)


def _free_storage(tensor: torch.Tensor) -> None:
    if (storage := _storage(tensor)).size() != 0:
        storage.resize_(0)


def _let_fsdp_resize_storage() -> None:
    """FSDP2 frees and regrows the storage of gathered parameters through tensor.untyped_storage(),
    which a wrapper tensor has none of: its two helpers resize the host tensor's storage instead
    (torch.cuda tensors own theirs; this device's own the host tensor's)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    for module in (_fsdp_param, _fsdp_param_group):
        for name, helper in (("alloc_storage", _alloc_storage), ("free_storage", _free_storage)):
            if hasattr(module, name):
                setattr(module, name, helper)


def _backend_module() -> types.ModuleType:
    module = types.ModuleType(f"torch.{NAME}")
    stream = _Stream()
    module.current_stream = lambda device=None: stream
    module.stream = lambda chosen: contextlib.nullcontext()
    module.Stream = _Stream
    module.Event = _Event
    module.is_available = lambda: True
    module.device_count = lambda: 1
    module.current_device = lambda: 0
    module.set_device = lambda device: None
    module.is_initialized = lambda: True
    module._is_in_bad_fork = lambda: False
    module.synchronize = lambda device=None: None
    module.manual_seed = lambda seed: None
    module.manual_seed_all = lambda seed: None
    module.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
    return module


def _factory_kernel(op):
    """torch.zeros(..., device=DEVICE) and the like: made on the host, held by a DeviceTensor; a
    CPU generator is refused as CUDA refuses it."""

    def kernel(*args, **kwargs):
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator) and generator.device.type == "cpu":
            raise RuntimeError(f"Expected a '{NAME}' device type for generator but found 'cpu'")
        kwargs = {**kwargs, "device": torch.device("cpu")}
        kwargs.pop("pin_memory", None)
        return DeviceTensor(op(*args, **kwargs))

    return kernel


def _copy_from(source: torch.Tensor, destination: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    destination.host.copy_(source.host if isinstance(source, DeviceTensor) else source)
    return destination


def _factories():
    """Every aten overload that makes a tensor from a device argument alone (no tensor input)."""
    skipped = ("sparse", "quantized", "cudnn", "mkldnn", "nested", "_make_dep_token", "from_file")
    for full in torch._C._dispatch_get_all_op_names():
        if not full.startswith("aten::") or any(s in full for s in skipped):
            continue
        name, _, overload = full[len("aten::") :].partition(".")
        try:
            op = getattr(getattr(torch.ops.aten, name), overload or "default")
        except (AttributeError, RuntimeError):
            continue
        schema = op._schema
        if len(schema.returns) != 1 or "Tensor" not in str(schema.returns[0].type):
            continue
        if any(a.name == "device" for a in schema.arguments) and not any(
            "Tensor" in str(a.type) for a in schema.arguments
        ):
            yield full[len("aten::") :], op


def register() -> torch.device:
    """Make DEVICE usable in this process (idempotent); returns it."""
    if _libraries:
        return DEVICE
    module = _backend_module()
    torch.utils.backend_registration._setup_privateuseone_for_python_backend(backend_module=module)
    library = torch.library.Library("aten", "IMPL")
    for qualified, op in _factories():
        library.impl(qualified, _factory_kernel(op), "PrivateUse1")
    library.impl("_copy_from", _copy_from, "PrivateUse1")
    _libraries.append(library)
    _let_fsdp_resize_storage()
    return DEVICE
