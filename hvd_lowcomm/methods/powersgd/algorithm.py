"""`powersgd`: low-rank gradient compression (Vogels, Karimireddy, Jaggi, NeurIPS 2019) with the
semantics of PyTorch's DDP communication hook (torch/distributed/algorithms/ddp_comm_hooks/
powerSGD_hook.py), as a Horovod-style optimizer wrapper.

The first `start_iter` steps send the plain mean gradient (in `factor_dtype`, see step 5); each
step after them:
1. Split the gradients: a tensor viewed as an n × m matrix (n = its first dimension) is
   compressed if (n + m)·r·min_compression_rate < n·m at its smallest rank r; the rest
   (biases, small layers) is allreduced (averaged) as is.
2. Error feedback: M <- M + e, what compression dropped on this rank at earlier steps.
3. Q: the previous step's Q (warm start), else a random matrix drawn from the same seed on
   every rank; orthogonalise.
4. P = M Q; allreduce P (sum); orthogonalise P.
5. Q = Mᵀ P; allreduce Q (sum); divide by the number of ranks.
   P and Q travel in `factor_dtype`: float32 by default, as PyTorch's hook sends them. With
   float16 (half the bytes) each matrix is scaled by a power of two that keeps its sum in range
   (hvd_lowcomm.comm.half_wire), and the uncompressed gradients and the start_iter steps' plain
   means ride in float16 too, as Horovod's fp16 compression sends them.
6. M̂ = P Qᵀ, the same rank-r approximation of the mean gradient on every rank; e <- M - M̂.

Adaptive rank (the default, `rank 0`): every `adapt_every` steps a few random probe columns S
ride with step 4 (M [Q | S] in the same allreduce), which estimates the energy of the mean M̄
that P Qᵀ misses, ‖(I - P Pᵀ) M̄‖², beside the energy it keeps, ‖Q‖² (hvd_lowcomm.methods.
adaptive_rank). A matrix whose approximation misses more than `error_target` of its energy
doubles its rank; one whose leading components alone would miss at most half of that shrinks
to them; every rank agrees on the new ranks with one small allreduce (max), and Q keeps its
leading directions (warm start) across the change. With error feedback M̄ includes what
earlier steps dropped, so a rank too small for a layer shows up as missed energy that grows.

Difference from the hook, without effect on the update: error feedback is kept for compressed
matrices only. The hook also stores (local - mean) for uncompressed tensors, which averages to
zero over ranks and so never changes the allreduced result.
"""

from __future__ import annotations

from dataclasses import replace
import math
from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.half_wire import HalfSums
from hvd_lowcomm.comm.mesh import columns_across_groups, local_part
from hvd_lowcomm.comm.runtime import Group
from hvd_lowcomm.comm.traffic import meter
from hvd_lowcomm.config import make_options
from hvd_lowcomm.methods.adaptive_rank import next_rank, probe_residual, probes, smallest_rank_within
from hvd_lowcomm.methods.drop_in import (
    GradientExchange,
    HorovodArguments,
    NamedParameters,
    dense_gradient,
    horovod_arguments,
    wrap_optimizer,
)
from hvd_lowcomm.methods.powersgd.options import PowerSGDOptions, compresses, highest_rank


class PowerSGDState:
    """Everything PowerSGD carries from step to step (checkpoint it with `state_dict`), with its
    hyper-parameters, `options` (a PowerSGDOptions: every knob's default and meaning is there):

        state = PowerSGDState()                         # adaptive rank per matrix (the default)
        state = PowerSGDState(rank=2, start_iter=0)     # keywords of PowerSGDOptions
        state = PowerSGDState(options, seed=7)          # or the options themselves

    `seed` seeds the random Q and probes, identically on every rank. `ranks` holds each
    compressed matrix's current rank, `kept_energy` the share of its energy P Qᵀ kept at its
    last measurement.
    """

    def __init__(self, options: PowerSGDOptions | None = None, seed: int = 0, **kwargs: Any) -> None:
        self.options = make_options(PowerSGDOptions, "powersgd", options, **kwargs)
        self.seed = seed
        self.iter = 0
        self.errors: dict[str, torch.Tensor] = {}
        self.qs: dict[str, torch.Tensor] = {}
        self.ranks: dict[str, int] = {}
        self.kept_energy: dict[str, float] = {}
        self.next_measurement = self.options.start_iter  # then every adapt_every steps
        self.half_sums = HalfSums("powersgd")  # P's and Q's scales on the wire (factor_dtype float16)
        self.numel_before = 0  # gradient numbers per compressed step, before / after compression
        self.numel_after = 0
        self.said_nothing_pays = False  # told the user, once, that no gradient was worth compressing

    def compression_rate(self) -> float:
        return self.numel_before / self.numel_after if self.numel_after else 1.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "iter": self.iter,
            "errors": dict(self.errors),
            "qs": dict(self.qs),
            "ranks": dict(self.ranks),
            "kept_energy": dict(self.kept_energy),
            "next_measurement": self.next_measurement,
            "wire": self.half_sums.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iter, self.errors, self.qs = state["iter"], dict(state["errors"]), dict(state["qs"])
        self.ranks, self.kept_energy = dict(state.get("ranks", {})), dict(state.get("kept_energy", {}))
        self.next_measurement = state.get("next_measurement", self.iter)
        self.half_sums.load_state_dict(state.get("wire", {}))


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether no tensor holds an inf or a NaN (one check for all of them)."""
    flags = [torch.isfinite(t).all() for t in tensors]
    return bool(torch.stack(flags).all()) if flags else True


def orthogonalise(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning `matrix`'s columns (QR; also safe when they are dependent)."""
    return torch.linalg.qr(matrix, mode="reduced").Q


class _PowerSGDExchange(GradientExchange):
    """Mixed into the user's optimiser class by PowerSGDOptimizer."""

    def __init__(
        self, params: Any, named_parameters: NamedParameters | None, state: PowerSGDState, arguments: HorovodArguments
    ) -> None:
        super().__init__(params)
        self.powersgd = state
        self._set_up_exchange(arguments, named_parameters, "PowerSGDOptimizer")

    def _exchange(self) -> None:
        state, options = self.powersgd, self.powersgd.options
        # float32 whatever the parameters' dtype: QR takes no bfloat16, and the error buffers must
        # keep what bfloat16 would round away
        # a sharded model's: this rank's rows of each gradient (FSDP reduce-scattered them in the group)
        grads = {name: local_part(dense_gradient(p)).float() for name, p in self.named_parameters()}
        size = self.group.size if self.group is not None else runtime.size()
        if state.iter < options.start_iter:
            # The plain mean until compression starts, in factor_dtype on the wire too, each
            # tensor under its own scale (as P and Q): each of these steps sends a whole gradient,
            # so on a short run they are a large share of PowerSGD's bytes.
            summed, _ = self._sum([(f"powersgd.warmup.{n}", g) for n, g in grads.items()], [], size)
            means = {n: total / size for n, total in zip(grads, summed)}
            self._assign(grads, means)
            finite = all_finite(summed)  # a step a GradScaler skips (inf or NaN) does not count
            if finite and state.iter == options.start_iter - 1 and options.adaptive:
                self._start_from(means)
            state.iter += finite
            return

        matrices, plain, ranks = {}, {}, {}
        for name, grad in grads.items():
            n = grad.shape[0] if grad.dim() else 1
            compress, first_rank = compresses(n, grad.numel() // n, options)
            state.numel_before += grad.numel()
            if compress:
                matrices[name] = grad.reshape(n, -1)
                ranks[name] = state.ranks.setdefault(name, first_rank)
                state.numel_after += (n + grad.numel() // n) * ranks[name]
            else:
                plain[name] = grad
                state.numel_after += grad.numel()
        if not matrices and not state.said_nothing_pays:
            state.said_nothing_pays = True
            runtime.announce(
                f"PowerSGDOptimizer: no gradient is a matrix large enough for its factors to pay "
                f"((n+m)*rank*min_compression_rate {options.min_compression_rate:g} < n*m), so every "
                f"gradient is sent whole, as ddp sends it: PowerSGD saves bytes on wider layers"
            )
        gradients = dict(matrices)
        # A non-finite gradient (a GradScaler's overflow) must not reach the error buffers.
        feed_back = options.error_feedback and all_finite(matrices.values())
        if feed_back:  # M = gradient + error, built in the error buffer (no new n×m tensor)
            for name, m in matrices.items():
                error = state.errors.get(name)
                matrices[name] = error.add_(m) if error is not None and error.shape == m.shape else m.clone()

        measuring = bool(matrices) and state.iter >= state.next_measurement
        generator = torch.Generator().manual_seed(state.seed * 1_000_003 + state.iter)
        qs = {name: self._start_q(name, m.shape[1], ranks[name], m, generator) for name, m in matrices.items()}
        payloads = {name: m @ q for (name, m), q in zip(matrices.items(), qs.values())}
        if measuring:  # the probes ride in the P round: M [Q | S]
            payloads = {
                name: torch.cat([payloads[name], m @ probes(m.shape[1], generator, m)], 1)
                for name, m in matrices.items()
            }
        # The uncompressed gradients travel with the P round (summed, then averaged here): one
        # Horovod cycle fewer per step than an allreduce of their own.
        summed, summed_plain = self._sum(
            [(f"powersgd.P.{n}", payload) for n, payload in payloads.items()],
            [(f"allreduce.{n}", g) for n, g in plain.items()],
            size,
        )
        if not all_finite([*summed, *summed_plain]):  # the same sums on every rank: all skip alike
            self._skip(grads, gradients, matrices, feed_back, dict(zip(plain, summed_plain)), size)
            return
        ps = {n: orthogonalise(p[:, : ranks[n]]) for n, p in zip(matrices, summed)}
        probed = {n: p[:, ranks[n] :] / size for n, p in zip(matrices, summed)}  # M̄ S
        averaged = {n: value / size for n, value in zip(plain, summed_plain)}
        # Qᵀ = Pᵀ M rather than Q = Mᵀ P: the same numbers, but M is read along its rows (the
        # order it is stored in, instead of a strided transpose), and the result is contiguous,
        # as Horovod wants it.
        summed_qs, _ = self._sum([(f"powersgd.Q.{n}", ps[n].T @ m) for n, m in matrices.items()], [], size)
        approximations, new_qs = {}, {}
        for (name, m), q_t in zip(matrices.items(), summed_qs):
            q = q_t.T / size
            approximations[name] = ps[name] @ q.T
            if options.error_feedback:
                state.errors[name] = m.sub_(approximations[name]) if feed_back else m - approximations[name]
            new_qs[name] = q
        if measuring:
            new_qs = self._measure(new_qs, ps, probed, matrices)
        if options.warm_start:
            state.qs.update(new_qs)
        self._assign(grads, {**averaged, **approximations})
        state.iter += 1

    def _skip(
        self,
        grads: dict[str, torch.Tensor],
        gradients: dict[str, torch.Tensor],
        matrices: dict[str, torch.Tensor],
        fed_back: bool,
        plain_sums: dict[str, torch.Tensor],
        size: int,
    ) -> None:
        """A rank's gradient was inf or NaN (a GradScaler's overflow, which then skips the
        step): the compressed gradients become NaN so that the scaler sees it, and PowerSGD's
        state is left as before the step (its error buffers given back their error)."""
        if fed_back:
            for name, m in matrices.items():
                self.powersgd.errors[name] = m.sub_(gradients[name])
        nan = {name: torch.full_like(m, math.nan) for name, m in matrices.items()}
        self._assign(grads, {**{n: total / size for n, total in plain_sums.items()}, **nan})

    def _measure(
        self,
        qs: dict[str, torch.Tensor],
        ps: dict[str, torch.Tensor],
        probed: dict[str, torch.Tensor],
        matrices: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """Each matrix's kept energy and, when adaptive, its next rank: P Qᵀ may miss
        error_target of the error-fed mean M̄'s energy (kept: ‖Q‖², missed: the probes' estimate
        of ‖(I - P Pᵀ) M̄‖²). The ranks are agreed by one small allreduce (max: every rank
        computes from the same allreduced numbers, but an MPI reduction need not give every rank
        the same last bit). Returns the Qs to warm-start from: their leading directions first,
        so that a shrink keeps the strongest ones."""
        state, options = self.powersgd, self.powersgd.options
        proposed, sorted_qs = {}, {}
        for name, q in qs.items():
            u, sigma, _ = torch.linalg.svd(q, full_matrices=False)  # Q = U Σ Vᵀ: kept energies σ²
            sorted_qs[name] = u * sigma
            energies, missed = sigma.pow(2), probe_residual(ps[name], probed[name])
            kept = float(energies.sum())
            state.kept_energy[name] = kept / (kept + missed) if kept + missed > 0 else 1.0
            n, m = matrices[name].shape
            proposed[name] = (
                next_rank(
                    state.ranks[name],
                    energies,
                    missed,
                    options.error_target * (kept + missed),
                    min(options.min_rank, n, m),
                    highest_rank(n, m, options),
                )
                if options.adaptive
                else state.ranks[name]
            )
        changed = False
        if options.adaptive:
            agreed = meter.allreduce_ints(list(proposed.values()), "powersgd.ranks", self.group, op="max")
            for name, rank in zip(proposed, agreed):
                changed |= rank != state.ranks[name]
                state.ranks[name] = rank
        # Measure again at once after a change (a doubling may not be enough), else adapt_every on.
        state.next_measurement = state.iter + (1 if changed else options.adapt_every)
        return sorted_qs

    def _start_from(self, means: dict[str, torch.Tensor]) -> None:
        """Each matrix's first rank and Q from the last plain mean (the same on every rank): its
        SVD's fewest components within error_target, and their right singular vectors. Growing
        from min_rank instead leaves the first compressed steps far below the rank they need,
        and the error fed back from them lasts."""
        state, options = self.powersgd, self.powersgd.options
        proposed = {}
        for name, mean in means.items():
            n = mean.shape[0] if mean.dim() else 1
            if not compresses(n, mean.numel() // n, options)[0]:
                continue
            matrix = mean.reshape(n, -1)
            _, sigma, vh = torch.linalg.svd(matrix.float(), full_matrices=False)
            highest = highest_rank(*matrix.shape, options)
            energies = sigma.pow(2)
            wanted = smallest_rank_within(energies, float(energies.sum()), options.error_target)
            proposed[name] = max(min(options.min_rank, *matrix.shape), min(wanted, highest))
            state.qs[name] = (vh[:highest].T * sigma[:highest]).to(mean.dtype)
        if proposed:
            agreed = meter.allreduce_ints(list(proposed.values()), "powersgd.ranks", self.group, op="max")
            state.ranks.update(zip(proposed, agreed))

    def _start_q(self, name: str, m: int, rank: int, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The warm-start Q (its first `rank` columns, topped up with random ones after a rank
        grew), else a random one; orthonormal."""
        state = self.powersgd
        warm = state.qs.get(name) if state.options.warm_start else None
        if warm is None or warm.shape[0] != m:
            warm = like.new_zeros(m, 0)
        fresh = torch.randn(m, rank - min(rank, warm.shape[1]), generator=generator, dtype=like.dtype).to(like.device)
        return orthogonalise(torch.cat([warm[:, :rank], fresh], 1))

    def _sum(
        self, factors: list[tuple[str, torch.Tensor]], exact: list[tuple[str, torch.Tensor]], size: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Sums over the group of `factors` (each under its own scale in float16) and `exact`
        (the uncompressed gradients, under one), both in factor_dtype on the wire, in one
        Horovod cycle."""
        if self.powersgd.options.factor_dtype == "float16" and size > 1:
            if not exact:
                return self.powersgd.half_sums.allreduce(factors, [], self.group)
            # The uncompressed gradients go as one tensor, under one scale: float16's relative
            # precision does not depend on a number's size, the scale only keeps the largest in
            # range (20 binades below it stay normal).
            flat = torch.cat([t.reshape(-1) for _, t in exact])
            sums, _ = self.powersgd.half_sums.allreduce(factors + [("powersgd.uncompressed", flat)], [], self.group)
            pieces = sums.pop().split([t.numel() for _, t in exact])
            return sums, [piece.view_as(t) for piece, (_, t) in zip(pieces, exact)]
        outs = meter.allreduce_many(factors + exact, self.group, op="sum")
        return outs[: len(factors)], outs[len(factors) :]

    def _assign(self, grads: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
        for name, param in self.named_parameters():
            grad = new[name].reshape(grads[name].shape).to(param.dtype)
            param.grad = (
                DTensor.from_local(grad, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
                if isinstance(param, DTensor)
                else grad
            )


def PowerSGDOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: NamedParameters | None = None,
    compression: Any = None,
    backward_passes_per_step: int = 1,
    op: Any = None,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
    *,
    state: PowerSGDState | None = None,
    group: Group | None = None,
    model: torch.nn.Module | None = None,
) -> torch.optim.Optimizer:
    """Wrap `optimizer` so step() applies the PowerSGD-compressed mean gradient over the ranks.

    Takes `hvd.DistributedOptimizer`'s arguments (hvd_lowcomm.methods.drop_in): compression
    none, or fp16, which sends P, Q and the rest in float16 (factor_dtype float16);
    `state` (a PowerSGDState) holds PowerSGD's own options. Use it like Horovod's
    DistributedOptimizer; `opt.powersgd` is the PowerSGDState (error buffers, Q matrices, step
    count) to checkpoint. `model`, when given, is where DDP's accumulation flags are read too
    (`model.require_backward_grad_sync`, `with model.no_sync():`). A model sharded over groups
    (`shard_model(model, device_mesh(g, replicate=False))`): FSDP reduce-scatters inside each
    group, and PowerSGD compresses each rank's gradient shard across the groups.
    """
    state = state or PowerSGDState()
    if named_parameters is not None and group is None:
        named_parameters = list(named_parameters)
        group = columns_across_groups(p for _, p in named_parameters)
    arguments = horovod_arguments(
        "PowerSGDOptimizer",
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        sparse_as_dense,
        process_set,
        group,
        compressors=("none", "fp16"),
        model=model,
        why_not_compressed="its own low-rank factors are its compression",
    )
    if arguments.compression == "fp16":
        state.options = replace(state.options, factor_dtype="float16")
    return wrap_optimizer(optimizer, _PowerSGDExchange, named_parameters, state, arguments)
