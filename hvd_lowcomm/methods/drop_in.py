"""What every drop-in optimizer wrapper shares: Horovod's signature and DDP's semantics.

A user changes one line, `hvd.DistributedOptimizer(...)` to `hvd_lowcomm.PowerSGDOptimizer(...)`
(or DadOptimizer, DistributedOptimizer), and keeps the rest of their loop, whether it was
written for Horovod or for PyTorch's DistributedDataParallel:

- every wrapper takes `hvd.DistributedOptimizer`'s arguments (`HorovodArguments`) and honours
  each, or refuses it when it is built, saying why;
- the exchange runs when the backward pass that completes a step's gradient ends (DDP's
  rule), so `.grad` holds the pooled gradient when `loss.backward()` returns: clipping,
  `scaler.unscale_(opt)` and `scaler.step(opt)` act on what the optimizer applies, the same on
  every rank;
- accumulation: `backward_passes_per_step=k` (Horovod) exchanges at every k-th backward pass,
  `with opt.no_sync():` (DDP) or `opt.require_backward_grad_sync = False` holds the exchange
  back (a wrapper given the model, DadOptimizer, also reads them on the model, as nanoGPT
  writes them); either way one exchange per optimizer step. Undeclared accumulation (several
  backward passes, each exchanging) still gives the pooled gradient, at one exchange per pass,
  and rank 0 says once how to declare it;
- `synchronize()` / `skip_synchronize()` keep Horovod's meaning, and PyTorch's optimizer
  contract holds (`zero_grad(set_to_none=...)`, `state_dict`, `add_param_group`, state loaded
  into the optimizer before the wrap).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch.autograd import Variable

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.runtime import Group
from hvd_lowcomm.optimizers import as_one_optimizer
from hvd_lowcomm.config import ConfigError

NamedParameters = Iterable[tuple[str, torch.nn.Parameter]]


@dataclass(frozen=True)
class HorovodArguments:
    """`hvd.DistributedOptimizer`'s arguments as one wrapper honours them (see
    `horovod_arguments`): `compression` is "none", "fp16" or a Horovod compressor object,
    `op` "average" or "sum"."""

    compression: Any = "none"
    backward_passes_per_step: int = 1
    op: str = "average"
    gradient_predivide_factor: float = 1.0
    groups: Any = None  # Horovod's fusion groups: an int (num_groups) or lists of parameters
    group: Group | None = None  # the process set's ranks (None: all ranks)
    model: Any = None  # the model, whose DDP flags (require_backward_grad_sync, no_sync) count too


def horovod_arguments(
    wrapper: str,
    compression: Any = None,
    backward_passes_per_step: int = 1,
    op: Any = None,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
    group: Group | None = None,
    compressors: tuple[str, ...] = ("none",),
    why_not_compressed: str = "",
    model: Any = None,
) -> HorovodArguments:
    """Check Horovod's arguments for `wrapper` and normalise them; refuse what it cannot honour.

    `compressors`: the compressions the wrapper takes ("none", "fp16", or "any" for any
    Horovod compressor); `why_not_compressed` ends the refusal of the others. Every wrapper
    densifies sparse gradients (sparse_as_dense is always in effect) and sends all of a round's
    tensors in one fused Horovod cycle, so `groups` / `num_groups` only change how the ddp
    wrapper fuses its allreduces.
    """
    del sparse_as_dense  # accepted either way: gradients always travel dense
    kind = compression_kind(compression)
    if kind not in compressors and not (kind not in ("none", "fp16") and "any" in compressors):
        raise ConfigError(f"{wrapper} does not take compression={compression!r}: {why_not_compressed}")
    if backward_passes_per_step < 1:
        raise ConfigError(f"{wrapper}: backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    op_name = op_kind(op)
    if op_name not in ("average", "sum"):
        raise ConfigError(
            f"{wrapper} takes op=hvd.Average (the default) or hvd.Sum, not "
            f"{'hvd.Adasum' if op_name == 'adasum' else repr(op)}: Adasum and the other reductions are "
            f"not gradient means; for Adasum keep Horovod's own hvd.DistributedOptimizer"
        )
    if gradient_predivide_factor <= 0:
        raise ConfigError(f"{wrapper}: gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if gradient_predivide_factor != 1.0 and op_name != "average":
        raise ConfigError(f"{wrapper}: gradient_predivide_factor needs op=hvd.Average (as in Horovod)")
    if num_groups and groups is not None:
        raise ConfigError(f"{wrapper}: pass groups or num_groups, not both (as in Horovod)")
    if num_groups < 0:
        raise ConfigError(f"{wrapper}: num_groups must be >= 0, got {num_groups}")
    if process_set is not None and group is not None:
        raise ConfigError(f"{wrapper}: pass process_set (Horovod's) or group (hvd_lowcomm's), not both")
    if process_set is not None:
        group = runtime.group_of_process_set(process_set)
    return HorovodArguments(
        compression if kind not in ("none", "fp16") else kind,
        backward_passes_per_step,
        op_name,
        gradient_predivide_factor,
        groups if groups is not None else num_groups or None,
        group,
        model,
    )


class Compression:
    """Horovod's compression names (`hvd.Compression.fp16`), for a script that imports
    hvd_lowcomm in Horovod's place (`import hvd_lowcomm as hvd`, the torch engine)."""

    none = "none"
    fp16 = "fp16"


# Horovod's reduction names (hvd.Average, hvd.Sum, hvd.Adasum), likewise.
Average, Sum, Adasum = "average", "sum", "adasum"


def compression_kind(compression: Any) -> str:
    """ "none", "fp16" or "custom" for a compression given as a string, a Horovod compressor
    class (hvd.Compression.none / .fp16) or None."""
    if compression is None:
        return "none"
    if isinstance(compression, str):
        if compression not in ("none", "fp16"):
            raise ConfigError(
                f"compression must be 'none', 'fp16' or a Horovod compressor "
                f"(hvd.Compression.none / hvd.Compression.fp16), got {compression!r}"
            )
        return compression
    name = getattr(compression, "__name__", type(compression).__name__)
    return {"NoneCompressor": "none", "FP16Compressor": "fp16"}.get(name, "custom")


def op_kind(op: Any) -> str:
    """Horovod's reduction constant (or its name as a string) as a lower-case name."""
    if op is None:
        return "average"
    if isinstance(op, str):
        return op.lower()
    import horovod.torch as hvd

    names = {hvd.Average: "average", hvd.Sum: "sum", hvd.Adasum: "adasum"}
    return names.get(op, f"op {op!r}")


def parameter_names(
    param_groups: list[dict[str, Any]], named_parameters: NamedParameters | None, wrapper: str
) -> dict[torch.nn.Parameter, str]:
    """A name for every parameter the optimizer holds, the same on every rank: its name in
    `named_parameters`, else its position in the optimizer (as Horovod names unnamed ones)."""
    names: dict[torch.nn.Parameter, str] = {}
    for name, param in named_parameters or ():
        if name in names.values() and names.get(param) != name:
            raise ConfigError(f"{wrapper}: parameter names in named_parameters must be unique; {name!r} repeats")
        names.setdefault(param, name)
    position = 0
    for group in param_groups:
        for param in group["params"]:
            names.setdefault(param, f"noname.{position}")
            position += 1
    return names


def dense_gradient(param: torch.nn.Parameter) -> torch.Tensor:
    """The parameter's gradient as a dense tensor (zeros where backward gave it none: every
    rank must send the same tensors)."""
    if param.grad is None:
        return torch.zeros_like(param)
    return param.grad.to_dense() if param.grad.is_sparse else param.grad


class GradientExchange(torch.optim.Optimizer):
    """Base of the optimizer wrappers, mixed into the user's optimizer class (`wrap_optimizer`).

    The exchange (`_exchange()`, the subclass's) replaces every local gradient by the pooled
    one. It runs when the backward pass that completes a step ends (DDP's rule), found with the
    autograd engine's end-of-backward callback queued from the first gradient hook that fires.
    Then:

    - `synchronize()` is done already (a call does nothing); `step()` applies `.grad`;
    - gradients set by hand (no backward pass) are exchanged by `synchronize()` or `step()`, as
      in Horovod, except the zeros hvd.broadcast_optimizer_state steps on to create an empty
      optimizer's state: that step exchanges nothing;
    - `with opt.skip_synchronize(): opt.step()` steps without exchanging what is not yet;
    - a backward pass after an exchange that no step applied (a GradScaler skipped the step)
      starts a new step's gradient.
    """

    _exchange_enabled = True  # DDP's require_backward_grad_sync (no_sync() clears it)
    _should_synchronize = True
    _synchronized = False
    _pooled_by_backward = False  # the exchange of this step ran as its last backward pass ended
    _backward_passes = 0  # since the last exchange or step
    _end_queued = False  # the end-of-backward callback of the running pass is queued
    exchange_seconds = 0.0  # spent in exchanges (the built-in loop keeps it out of the backward time)
    backward_passes_per_step = 1
    op = "average"
    sums_natively = False  # op=Sum is the exchange's own (else: the mean times the group's size)
    group: Group | None = None
    _model: Any = None  # the model, where the wrapper knows it: DDP's flags are read on it too
    _said_undeclared = False  # rank 0 said once that backward passes exchanged one by one

    def _exchange(self) -> None:
        raise NotImplementedError

    def _set_up_exchange(
        self, arguments: HorovodArguments, named_parameters: NamedParameters | None, wrapper: str
    ) -> None:
        """Called by each subclass's __init__ after the optimizer's own."""
        self.backward_passes_per_step, self.op, self.group = (
            arguments.backward_passes_per_step,
            arguments.op,
            arguments.group,
        )
        self._names = parameter_names(self.param_groups, named_parameters, wrapper)
        self._wrapper = wrapper
        if arguments.model is not None:
            self._read_model_flags(arguments.model)
        self._hooks: dict[torch.nn.Parameter, int] = {}  # hooked parameters -> their tensor when hooked
        self._hook_parameters(p for group in self.param_groups for p in group["params"])

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) for every parameter the optimizer holds that requires a gradient,
        in the optimizer's order (one added without a name: by its position, as in Horovod)."""
        return [(self._names[p], p) for group in self.param_groups for p in group["params"] if p.requires_grad]

    # -- when the exchange runs ---------------------------------------------------------------
    def _hook_parameters(self, params: Iterable[torch.nn.Parameter]) -> None:
        for param in params:
            if param.requires_grad and not self._hooked(param):
                if param in self._hooks:  # swapped: the hooks it lists are no longer installed
                    stale = list((param._post_accumulate_grad_hooks or {}).values())
                    param._post_accumulate_grad_hooks = None
                    for hook in stale:
                        if getattr(hook, "exchange", None) is not self:
                            param.register_post_accumulate_grad_hook(hook)
                param.register_post_accumulate_grad_hook(self._gradient_hook(param))
                self._hooks[param] = param._cdata

    def _gradient_hook(self, param: torch.nn.Parameter) -> Any:
        # A closure that checks its parameter: a deep copy of the model keeps the hook
        def hook(grad_holder: torch.Tensor) -> None:
            if grad_holder is param:
                self._gradient_accumulated(param)

        hook.exchange = self
        return hook

    def _hooked(self, param: torch.nn.Parameter) -> bool:
        """Whether `param` still holds its gradient hook: under torch.__future__'s
        swap_module_params_on_conversion, load_state_dict and Module.to swap a parameter's
        tensor for another (a new _cdata), which has no hooks installed."""
        return self._hooks.get(param) == param._cdata

    def _gradient_accumulated(self, param: torch.nn.Parameter) -> None:
        """A parameter's gradient was accumulated into .grad by the running backward pass."""
        self._backward_running()

    def _backward_running(self) -> None:
        """Called from every hook a backward pass fires: queue the end-of-backward callback once."""
        if self._end_queued:
            return
        self._end_queued = True
        if self._synchronized:  # a new pass after an exchange no step applied starts a new step
            self._say_undeclared_accumulation()
            self._start_step()
        Variable._execution_engine.queue_callback(self._backward_ended)

    def _say_undeclared_accumulation(self) -> None:
        """A backward pass after an exchange with no step or zero_grad between: accumulation the
        wrapper was not told of. The gradients add up right; say once what saves the bytes."""
        if self._said_undeclared:
            return
        self._said_undeclared = True
        seen = (
            ""
            if self._model is not None
            else ("; a flag or no_sync() on the model is not seen by this wrapper, which was not given the model")
        )
        runtime.announce(
            f"hvd_lowcomm: {self._wrapper}: a backward pass after an exchange, before step(), exchanged "
            f"again: the gradient still adds up to the pooled one, at the bytes of one exchange per "
            f"pass. To exchange once per step, pass backward_passes_per_step=<passes>, or hold the "
            f"exchange back with `with opt.no_sync():` or opt.require_backward_grad_sync = False"
            f"{seen}"
        )

    def _backward_ended(self) -> None:
        self._end_queued = False
        self._backward_passes += 1
        if self.exchanges_this_pass():
            self._pool()
            self._pooled_by_backward = True

    def exchanges_this_pass(self) -> bool:
        """Whether the backward pass running (or just ended) completes the step's gradient."""
        model_syncs = self._model is None or getattr(self._model, "require_backward_grad_sync", True)
        return (
            self._exchange_enabled
            and model_syncs
            and self._backward_passes >= self.backward_passes_per_step - (1 if self._end_queued else 0)
        )

    def _read_model_flags(self, model: torch.nn.Module) -> None:
        """Honour DDP's accumulation idioms written on the model, as DDP's model wrapper does
        (nanoGPT: `model.require_backward_grad_sync = last_micro_step`; `with model.no_sync():`);
        a plain module gets the flag and no_sync() it lacks."""
        self._model = model
        if not hasattr(model, "require_backward_grad_sync"):
            model.require_backward_grad_sync = True
        if not hasattr(model, "no_sync"):
            model.no_sync = _model_no_sync(model)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's accumulation idiom: backward passes inside only accumulate locally; the first
        one after the block exchanges the accumulated gradient."""
        previous, self._exchange_enabled = self._exchange_enabled, False
        try:
            yield
        finally:
            self._exchange_enabled = previous

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's flag (nanoGPT sets it on the model): False holds the exchange back."""
        return self._exchange_enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._exchange_enabled = bool(value)

    # -- Horovod's interface ------------------------------------------------------------------
    def synchronize(self) -> None:
        """Replace every local gradient by the pooled one; nothing to do after the backward
        pass that completes the step (it pooled them)."""
        if not (self._synchronized and self._pooled_by_backward):
            self._pool()

    def _pool(self) -> None:
        device = runtime.device_of(p for group in self.param_groups for p in group["params"])
        start = runtime.clock(device)
        if self.group is None or runtime.rank() in self.group:
            self._exchange()
            if self.op == "sum" and not self.sums_natively:  # Horovod's op=Sum: the mean times the rank count
                size = self.group.size if self.group is not None else runtime.size()
                for group in self.param_groups:
                    for param in group["params"]:
                        if param.grad is not None:
                            param.grad.mul_(size)
        self._synchronized = True
        self._backward_passes = 0
        self.exchange_seconds += runtime.clock(device) - start

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        lost = [p for group in self.param_groups for p in group["params"] if p.requires_grad and not self._hooked(p)]
        if lost:  # their backward went unseen: hook them again, and pool what it left in .grad now
            self._hook_parameters(lost)
            self._backward_passes += any(p.grad is not None for p in lost)
        if self._should_synchronize and not self._synchronized and not self._making_state():
            self._pool()  # (fewer passes than backward_passes_per_step, or gradients set by hand)
        loss = super().step(closure)  # (a closure's backward pass exchanges as it ends)
        self._start_step()
        return loss

    def _making_state(self) -> bool:
        """Whether this step is hvd.broadcast_optimizer_state's: no backward pass, no state yet,
        every gradient zero."""
        return (
            not self._backward_passes
            and not self.state
            and all(p.grad is None or not p.grad.any() for group in self.param_groups for p in group["params"])
        )

    def _start_step(self) -> None:
        self._synchronized = self._pooled_by_backward = False
        self._backward_passes = 0

    # -- PyTorch's optimizer contract ---------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self._start_step()
        super().zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_hooks"):  # (not while the optimizer's own __init__ adds its groups)
            named = [(name, param) for param, name in self._names.items()]
            self._names = parameter_names(self.param_groups, named, "add_param_group")
            self._hook_parameters(param_group["params"])


def _model_no_sync(model: torch.nn.Module) -> Any:
    """DDP's `model.no_sync()` for a plain module: clears its require_backward_grad_sync inside."""

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        previous, model.require_backward_grad_sync = model.require_backward_grad_sync, False
        try:
            yield
        finally:
            model.require_backward_grad_sync = previous

    return no_sync


def wrap_optimizer(
    optimizer: torch.optim.Optimizer, exchange: type, *args: Any, **kwargs: Any
) -> torch.optim.Optimizer:
    """An instance of `optimizer`'s own class with `exchange` (a GradientExchange subclass)
    mixed in, over the same parameter groups and state: isinstance checks, LR schedulers and
    state loaded before the wrap keep working. A list or tuple of optimisers (Muon and
    AdamW) is wrapped as one (hvd_lowcomm.optimizers.CombinedOptimizer)."""
    optimizer = as_one_optimizer(optimizer)
    cls = type(optimizer.__class__.__name__, (exchange, optimizer.__class__), {})
    wrapped = cls(optimizer.param_groups, *args, **kwargs)
    wrapped.state = optimizer.state
    wrapped.defaults = optimizer.defaults
    return wrapped
