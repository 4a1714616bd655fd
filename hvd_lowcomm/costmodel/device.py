"""Devices the cost model counts compute for: accelerators' rates, this machine's measured ones,
and the meta-device counting of every op's FLOPs and bytes (`costing`, `median_seconds`)."""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

from hvd_lowcomm.config import ConfigError


def median_seconds(fn: Callable[[], Any], repeats: int = 3) -> float:
    """Seconds `fn` takes: the median of `repeats` timed runs after a warm-up; while `costing`
    for a device, its ops counted at that device's rates instead."""
    if _costing_for is not None:
        return _costing_for.seconds(count_ops(fn))
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


# ---------------------------------------------------------------------------------------------
# devices: compute counted at an accelerator's (or this machine's measured) rates


@dataclass(frozen=True)
class Accelerator:
    """A GPU's published rates (ACCELERATORS)."""

    bf16_tflops: float  # dense peak in bf16 (fp16 on the V100, which has no bf16)
    fp32_tflops: float  # dense peak in fp32 (without TF32, which PyTorch leaves off for products)
    memory_tbps: float  # memory bandwidth, TB/s
    nvlink_gbit: float  # between the GPUs of one node, each direction


# NVIDIA's data sheets for the SXM parts (A100 80GB, H100, H200, V100), without sparsity.
ACCELERATORS = {
    "a100": Accelerator(312, 19.5, 2.0, 2400),
    "h100": Accelerator(989, 67, 3.35, 3600),
    "h200": Accelerator(989, 67, 4.8, 3600),
    "v100": Accelerator(125, 15.7, 0.9, 1200),
}
# Model FLOPs utilisation: the share of the peak a training step reaches (memory-bound and small
# ops, waits: never all of it), for the step and the methods' kernels alike.
UTILISATION = 0.4
# The least an op costs: launching a GPU kernel (or dispatching a CPU op) takes microseconds
# however little it computes.
OP_SECONDS = 5e-6
# Without a device a profile is timed on this machine (small ops' overheads and all), unless that
# would take longer than this many seconds: then its ops are counted at this CPU's measured rates.
TIMING_LIMIT = 20.0


@dataclass(frozen=True)
class Device:
    """What the compute is costed on: the rates its work reaches."""

    name: str  # as a report says it
    step_rate: float  # flop/s of a training step's products, convolutions, attention
    kernel_rate: float  # flop/s of the methods' own kernels (fp32)
    memory_bandwidth: float = math.inf  # bytes/s

    def seconds(self, ops: list[tuple[float, float]]) -> float:
        """Each op (FLOPs, bytes) at the roofline: its FLOPs at kernel_rate or its bytes at the
        memory bandwidth, whichever takes longer, and never less than OP_SECONDS."""
        return sum(max(flops / self.kernel_rate, nbytes / self.memory_bandwidth, OP_SECONDS) for flops, nbytes in ops)


def compute_device(accelerator: str = "", tflops: float = 0.0, amp: str = "none") -> Device | None:
    """The device to cost a profile's compute on: an `accelerator` of ACCELERATORS, or 'cpu'
    (this machine's measured rates), at its peak for the run's precision (`amp` bf16: bf16,
    else fp32; the kernels in fp32) × UTILISATION; `tflops` (achieved TFLOP/s) replaces the
    step's rate, and without an accelerator is the kernels' rate too. None when neither is
    given: the compute is timed on this machine."""
    if not accelerator:
        return Device(f"{tflops:g} TFLOP/s", tflops * 1e12, tflops * 1e12) if tflops else None
    if accelerator == "cpu":
        device = measured_device("cpu", amp)
    elif accelerator in ACCELERATORS:
        a = ACCELERATORS[accelerator]
        peak = a.bf16_tflops if amp == "bf16" else a.fp32_tflops
        device = Device(
            f"{accelerator}: {UTILISATION:.0%} of its {peak:g} TFLOP/s {_precision(amp)} peak",
            UTILISATION * peak * 1e12,
            UTILISATION * a.fp32_tflops * 1e12,
            a.memory_tbps * 1e12,
        )
    else:
        raise ConfigError(
            f"accelerator {accelerator!r}: use one of {', '.join([*ACCELERATORS, 'cpu'])}, or give "
            f"the rate yours reaches (--tflops)"
        )
    return replace(device, name=f"{accelerator} at {tflops:g} TFLOP/s", step_rate=tflops * 1e12) if tflops else device


def _precision(amp: str) -> str:
    return "bf16" if amp == "bf16" else "fp32"


@functools.cache
def measured_device(where: str, amp: str) -> Device:
    """This machine's CPU, or the GPU `where` names, with its own rates timed: a square
    product's (in the run's precision for the step, fp32 for the kernels) and a large copy's."""
    place = torch.device(where)
    cpu = place.type == "cpu"  # (sizes: long enough to time, yet quick on a CPU's few cores)
    sync = (lambda: None) if cpu else torch.cuda.synchronize

    def seconds(fn: Callable[[], Any]) -> float:
        return median_seconds(lambda: (fn(), sync()))

    def product_rate(dtype: torch.dtype) -> float:
        n = 1024 if cpu else 8192
        a = torch.randn(n, n, device=place).to(dtype)
        return 2 * n**3 / seconds(lambda: a @ a)

    block = torch.empty(1 << (24 if cpu else 28), device=place)
    bandwidth = 2 * block.nbytes / seconds(block.clone)  # read and written once
    fp32 = product_rate(torch.float32)
    step = product_rate(torch.bfloat16) if amp == "bf16" else fp32
    return Device(
        f"{where}: {UTILISATION:.0%} of its measured {step / 1e12:.3g} TFLOP/s {_precision(amp)}",
        UTILISATION * step,
        UTILISATION * fp32,
        bandwidth,
    )


# ---------------------------------------------------------------------------------------------
# counting: every op on the meta device, its FLOPs and bytes recorded

_costing_for: Device | None = None  # while `costing`: the device median_seconds counts for


@contextlib.contextmanager
def costing(device: Device) -> Iterator[None]:
    """Inside, every op runs on the meta device (shapes, no data, no time) and median_seconds
    gives what its function's ops take on `device` (Device.seconds) instead of timing them."""
    global _costing_for
    outer, _costing_for = _costing_for, device
    try:
        with _MetaOps(), torch.no_grad():
            yield
    finally:
        _costing_for = outer


def count_ops(fn: Callable[[], Any]) -> list[tuple[float, float]]:
    """(FLOPs, bytes read and written) of every kernel `fn` launches, run on the meta device."""
    with _MetaOps() as counted, torch.no_grad():
        fn()
    return counted.ops


class _MetaOps(TorchDispatchMode):
    """Runs every op on the meta device: shapes, no data, no time (tensors and factories of
    other devices move there; random generators are dropped). Records (FLOPs, bytes) of each op
    that launches a kernel (not a view, not an allocation). A value read back (`.item()`,
    `if tensor:`) is 0: an iteration that stops once converged runs its full count."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[float, float]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _READ_BACK:
            dtype = args[0].dtype
            return False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0
        args, kwargs = tree_map(_on_meta, (args, dict(kwargs or {})))
        if "device" in kwargs:
            kwargs["device"] = torch.device("meta")
        if "generator" in kwargs:
            kwargs["generator"] = None
        out = func(*args, **kwargs)
        if not func.is_view and not func.__name__.startswith(("empty", "new_empty")):
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.ops.append((_flops(func, args, kwargs, out), float(sum(t.nbytes for t in tensors))))
        return out


_READ_BACK = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)


def _on_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not value.is_meta:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """An op's floating-point operations: torch's formulas (products, convolutions, attention)
    and the factorisations'; elementwise work has none here (its bytes cost it)."""
    packet = func._overloadpacket
    if packet in flop_registry:
        return float(flop_registry[packet](*args, **kwargs, out_val=out))
    if packet in _FACTORISATIONS:
        return _FACTORISATIONS[packet](*args, **kwargs)
    return 0.0


def _qr_flops(a: torch.Tensor, mode: str = "reduced") -> float:
    """Householder QR of each m × n matrix (l the longer side, k the shorter): 2lk² - 2k³/3, and
    as much again to form Q."""
    long, short = max(a.shape[-2:]), min(a.shape[-2:])
    return math.prod(a.shape[:-2]) * (2 * long * short**2 - 2 * short**3 / 3) * (1 if mode == "r" else 2)


def _svd_flops(a: torch.Tensor, full_matrices: bool = False, compute_uv: bool = True, **_: Any) -> float:
    """R-SVD of each m × n matrix (l, k as for QR): 2lk² + 2k³ for the singular values, 6lk² + 20k³
    with the thin factors, 4l²k + 22k³ with the full U (Golub and Van Loan, Matrix Computations)."""
    long, short = max(a.shape[-2:]), min(a.shape[-2:])
    each = (
        2 * long * short**2 + 2 * short**3
        if not compute_uv
        else 4 * long**2 * short + 22 * short**3
        if full_matrices
        else 6 * long * short**2 + 20 * short**3
    )
    return math.prod(a.shape[:-2]) * each


_FACTORISATIONS = {torch.ops.aten.linalg_qr: _qr_flops, torch.ops.aten._linalg_svd: _svd_flops}
