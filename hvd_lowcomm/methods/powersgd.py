"""`powersgd`: low-rank gradient compression (Vogels, Karimireddy, Jaggi, NeurIPS 2019) with the
semantics of PyTorch's DDP communication hook (torch/distributed/algorithms/ddp_comm_hooks/
powerSGD_hook.py), as a Horovod-style optimizer wrapper.

Each step, once `start_iter` steps of plain allreduce are done:
1. Split the gradients: a tensor viewed as an n × m matrix (n = its first dimension) with
   r' = min(n, m, rank) is compressed if (n + m)·r'·min_compression_rate < n·m; the rest
   (biases, small layers) is allreduced (averaged) as is.
2. Error feedback: M <- M + e, what compression dropped on this rank at earlier steps.
3. Q: the previous step's Q (warm start), else a random matrix drawn from the same seed on
   every rank; orthogonalise.
4. P = M Q; allreduce P (sum); orthogonalise P.
5. Q = Mᵀ P; allreduce Q (sum); divide by the number of ranks.
6. M̂ = P Qᵀ, the same rank-r' approximation of the mean gradient on every rank; e <- M - M̂.

Difference from the hook, without effect on the update: error feedback is kept for compressed
matrices only. The hook also stores (local - mean) for uncompressed tensors, which averages to
zero over ranks and so never changes the allreduced result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.runtime import Group
from hvd_lowcomm.comm.traffic import FLOAT_BYTES, meter
from hvd_lowcomm.config import Config, ConfigError, make_options, option
from hvd_lowcomm.costmodel import Link, LayerSample, MethodCost, Prediction, Profile, RunAssumptions, wire
from hvd_lowcomm.methods import register
from hvd_lowcomm.methods.base import GradientExchange, wrap_optimizer
from hvd_lowcomm.methods.ddp import DataParallel


@dataclass
class PowerSGDOptions:
    """PowerSGD (Vogels et al. 2019): rank-r P Qᵀ approximations of gradients, error feedback."""

    # PyTorch's hook defaults to rank 1 (1-4 typical); 2 kept this project's MLPs within a
    # point of DDP's accuracy where 1 did not.
    rank: int = option(2, "columns of P and Q per compressed matrix")
    # PyTorch: 1000 (its docs suggest ~10 % of training); runs here are hundreds of steps.
    start_iter: int = option(10, "steps of plain allreduce before compression starts")
    min_compression_rate: float = option(2.0, "compress a matrix only if (n+m)*rank*rate < n*m")
    error_feedback: bool = option(True, "add back what compression dropped at earlier steps")
    warm_start: bool = option(True, "reuse the previous step's Q")

    def validate(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"powersgd.rank must be >= 1, got {self.rank}")
        if self.start_iter < 0:
            raise ConfigError(f"powersgd.start_iter must be >= 0, got {self.start_iter}")
        if self.min_compression_rate <= 0:
            raise ConfigError(f"powersgd.min_compression_rate must be > 0, got {self.min_compression_rate}")


def compresses(n: int, m: int, options: PowerSGDOptions) -> tuple[bool, int]:
    """Whether an n × m gradient is compressed, and at which rank r' = min(n, m, rank)."""
    rank = min(n, m, options.rank)
    return (n + m) * rank * options.min_compression_rate < n * m, rank


class PowerSGDState:
    """Everything PowerSGD carries from step to step (checkpoint it with `state_dict`), with its
    hyper-parameters, `options` (a PowerSGDOptions: every knob's default and meaning is there):

        state = PowerSGDState(rank=2, start_iter=0)     # keywords of PowerSGDOptions
        state = PowerSGDState(options, seed=7)          # or the options themselves

    `seed` seeds the random Q, identically on every rank.
    """

    def __init__(self, options: PowerSGDOptions | None = None, seed: int = 0, **kwargs: Any) -> None:
        self.options = make_options(PowerSGDOptions, "powersgd", options, **kwargs)
        self.seed = seed
        self.iter = 0
        self.errors: dict[str, torch.Tensor] = {}
        self.qs: dict[str, torch.Tensor] = {}
        self.numel_before = 0   # gradient numbers per compressed step, before / after compression
        self.numel_after = 0

    def compression_rate(self) -> float:
        return self.numel_before / self.numel_after if self.numel_after else 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"iter": self.iter, "errors": dict(self.errors), "qs": dict(self.qs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iter, self.errors, self.qs = state["iter"], dict(state["errors"]), dict(state["qs"])


def orthogonalise(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning `matrix`'s columns (QR; also safe when they are dependent)."""
    return torch.linalg.qr(matrix, mode="reduced").Q


class _PowerSGDExchange(GradientExchange):
    """Mixed into the user's optimiser class by PowerSGDOptimizer."""

    def __init__(self, params: Any, named_parameters: list[tuple[str, torch.nn.Parameter]],
                 state: PowerSGDState, group: Group | None) -> None:
        super().__init__(params)
        self.powersgd = state
        self._named = named_parameters
        self._group = group

    def _exchange(self) -> None:
        state = self.powersgd
        grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)) for name, p in self._named}
        if state.iter < state.options.start_iter:
            self._assign(grads, self._average([(f"allreduce.{n}", g) for n, g in grads.items()]))
            state.iter += 1
            return

        matrices, plain, ranks = {}, {}, {}
        for name, grad in grads.items():
            n = grad.shape[0] if grad.dim() else 1
            compress, rank = compresses(n, grad.numel() // n, state.options)
            state.numel_before += grad.numel()
            if compress:
                matrices[name], ranks[name] = grad.reshape(n, -1), rank
                state.numel_after += (n + grad.numel() // n) * rank
            else:
                plain[name] = grad
                state.numel_after += grad.numel()
        if state.options.error_feedback:  # M = gradient + error, built in the error buffer (no new n×m tensor)
            for name, m in matrices.items():
                error = state.errors.get(name)
                matrices[name] = error.add_(m) if error is not None and error.shape == m.shape else m.clone()

        qs = {name: self._start_q(name, m.shape[1], ranks[name], m) for name, m in matrices.items()}
        size = self._group.size if self._group is not None else runtime.size()
        # The uncompressed gradients travel with the P round (summed, then averaged here): one
        # Horovod cycle fewer per step than an allreduce of their own.
        summed = meter.allreduce_many([*((f"powersgd.P.{n}", m @ qs[n]) for n, m in matrices.items()),
                                       *((f"allreduce.{n}", g) for n, g in plain.items())], self._group, op="sum")
        ps = {n: orthogonalise(p) for n, p in zip(matrices, summed)}
        averaged = {n: value / size for n, value in zip(plain, summed[len(matrices):])}
        # Qᵀ = Pᵀ M rather than Q = Mᵀ P: the same numbers, but M is read along its rows (the
        # order it is stored in, instead of a strided transpose), and the result is contiguous,
        # as Horovod wants it.
        summed_qs = meter.allreduce_many([(f"powersgd.Q.{n}", ps[n].T @ m) for n, m in matrices.items()],
                                         self._group, op="sum")
        approximations = {}
        for (name, m), q_t in zip(matrices.items(), summed_qs):
            q = q_t.T / size
            approximations[name] = ps[name] @ q.T
            if state.options.error_feedback:
                state.errors[name] = m.sub_(approximations[name])  # M is this step's buffer
            if state.options.warm_start:
                state.qs[name] = q
        self._assign(grads, {**averaged, **approximations})
        state.iter += 1

    def _start_q(self, name: str, m: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        state = self.powersgd
        if state.options.warm_start and name in state.qs and state.qs[name].shape == (m, rank):
            return orthogonalise(state.qs[name])
        generator = torch.Generator().manual_seed(state.seed * 1_000_003 + state.iter)
        return orthogonalise(torch.randn(m, rank, generator=generator, dtype=like.dtype).to(like.device))

    def _average(self, named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        results = meter.allreduce_many(named, self._group, op="average")
        return {name.split(".", 1)[1]: value for (name, _), value in zip(named, results)}

    def _assign(self, grads: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
        for name, param in self._named:
            param.grad = new[name].reshape(grads[name].shape)


def PowerSGDOptimizer(optimizer: torch.optim.Optimizer,
                      named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                      state: PowerSGDState | None = None, group: Group | None = None) -> torch.optim.Optimizer:
    """Wrap `optimizer` so step() applies the PowerSGD-compressed mean gradient over `group`.

    Use it like Horovod's DistributedOptimizer; `opt.powersgd` is the PowerSGDState (error
    buffers, Q matrices, step count) to checkpoint.
    """
    named = [(n, p) for n, p in named_parameters if p.requires_grad]
    return wrap_optimizer(optimizer, _PowerSGDExchange, named, state or PowerSGDState(), group)


def powersgd_kernels(sample: LayerSample, options: PowerSGDOptions, cfg: Config) -> dict[str, Any]:
    """One compression cycle of the layer's gradient as the exchange runs it: error feedback, P =
    M Q, orthogonalisation, the new error (M and the error in the error buffer)."""
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(sample.fan_out, sample.fan_in, generator=generator)
    error = torch.randn(sample.fan_out, sample.fan_in, generator=generator)
    q = torch.randn(sample.fan_in, min(sample.fan_out, sample.fan_in, options.rank), generator=generator)

    def cycle() -> None:
        m = error.add_(grad)
        p = orthogonalise(m @ q)
        m.sub_(p @ (p.T @ m))
    return {"powersgd": cycle}


def predict_powersgd(profile: Profile, p: int, link: Link, options: PowerSGDOptions, cfg: Config,
                     assumptions: RunAssumptions) -> Prediction:
    """A compressed step (after start_iter): P with the uncompressed gradients in one allreduce,
    then Q; each compressed layer's cycle as the method's own work; nothing overlaps backward."""
    compressed_p = compressed_q = plain = 0
    own = 0.0
    for layer in profile.layers:
        n, m = layer.fan_out, layer.fan_in
        compress, r = compresses(n, m, options)
        if compress:
            compressed_p, compressed_q = compressed_p + n * r, compressed_q + m * r
            plain += layer.params - n * m
            own += layer.kernels["powersgd"]
        else:
            plain += layer.params
    plain += profile.other_params
    comm = sum(link.allreduce(FLOAT_BYTES * numbers, p, p) for numbers in (compressed_p + plain, compressed_q)
               if numbers)
    sent = sum(wire("allreduce", FLOAT_BYTES * numbers, p) for numbers in (compressed_p, compressed_q, plain))
    return Prediction("powersgd", p, profile.step_seconds, own, comm, 0.0, sent)


@register("powersgd", options=PowerSGDOptions, cost=MethodCost(predict_powersgd, powersgd_kernels), drop_in=True)
class PowerSGD(DataParallel):
    """Gradients compressed to rank-r factors before they are averaged (PowerSGD)."""

    honours_compression = False  # its own compression

    def distribute(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
        state = PowerSGDState(self.options, seed=self.cfg.train.seed)
        return PowerSGDOptimizer(optimizer, model.named_parameters(), state)

    def epoch_metrics(self) -> dict[str, Any]:
        return {"powersgd_compression_rate": self.optimizer.powersgd.compression_rate()}

    summary_metrics = epoch_metrics

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "powersgd": self.optimizer.powersgd.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.optimizer.powersgd.load_state_dict(state["powersgd"])

    def state_owner(self) -> int:
        return runtime.rank()  # error-feedback buffers are each rank's own
