"""`sil`: partitioned training with synthetic intermediate labels (Karadağ & Topaloğlu, arXiv 2403.11204).

The sequential model is cut into K partitions held by K groups of ranks (hvd_lowcomm.methods.partition).
For every cut a fixed code per class is drawn, S ∈ R^{classes × cut width}, S ~ κ·U(0, 1) (or
κ·N(0, 1)) (at a C×H×W cut, which only an explicit `cuts` gives, one value per channel: the
partition's per-channel means are matched to it), from one seed that rank 0 draws and broadcasts
once; every rank regenerates the
same codes. Then each partition trains on its own, data parallel inside its group:

    first partition     x        -> S_1[y]      (MSE)
    middle partition k  input_k  -> S_{k+1}[y]  (MSE)
    last partition      input    -> y           (cross-entropy)

where a later partition's input is, in `parallel` mode, the code of the cut before it (plus
Gaussian noise of std `noise`·κ, so that it learns to decode the imperfect outputs the
previous partition will give it at inference, not only the exact codes): all partitions train
at the same time and exchange nothing; in
`sequential` mode, the real outputs of the previous partition, frozen after its epochs and
sent once for the whole training set (counted by the meter), so partition k trains after
partition k-1. Optional recovery epochs then train the joined network end to end, as model
parallelism does (activations forward, gradients back). Inference always uses the joined
network: ŷ = argmax f_K(...f_1(x)), codes play no part.

Every partition must be able to learn its map on its own: two weight layers with a
non-linearity between them (hvd_lowcomm.methods.partition.can_learn); the default cut guarantees it and
a model too shallow for it is refused. At every evaluation a partition that feeds a cut reports
how well its outputs hit the codes (`code_accuracy`: the nearest code is the true class's) and
their spread across samples against the codes' spread across classes (`cut_spread`); outputs
that barely vary across samples for their size mean the partition no longer depends on its
input (`collapsed`), which is warned.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from hvd_lowcomm import task
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.traffic import meter
from hvd_lowcomm.config import ConfigError, TrainConfig, make_options
from hvd_lowcomm.methods.partition import (
    Layout,
    joined_state_dict,
    parameter_dtype,
    pipeline_evaluate,
    pipeline_train_step,
    token_vocabulary,
)
from hvd_lowcomm.methods.grouped import OptimizerDoor
from hvd_lowcomm.methods.sil.options import SILOptions


def class_codes(
    seed: int, cut: int, classes: int, shape: tuple[int, ...], kappa: float, distribution: str
) -> torch.Tensor:
    """The fixed code of every class at cut `cut`: classes × shape, the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 1_000 + cut)
    draw = torch.rand if distribution == "uniform" else torch.randn
    return kappa * draw(classes, *shape, generator=generator)


# Where the refusal points for the measurement behind it.
LANGUAGE_MODEL_EVIDENCE = 'docs: transformers, "What each method does to a transformer"'


def refuse_language_models(model: torch.nn.Module) -> None:
    """SIL cannot train a model with a label per position (a language model): a regression onto
    the next token's code (MSE) drives each position's output to the mean of the codes of the
    plausible next tokens, which the last partition, trained on single codes, decodes as one of
    them with confidence; the joined network is then worse than guessing."""
    if isinstance(model, torch.nn.Sequential) and len(model) and token_vocabulary(model[0]) is not None:
        raise ConfigError(
            f"sil cannot train a language model: its partitions learn toward one random code per label, and a "
            f"position whose next token is uncertain learns the average of several codes, which the last partition "
            f"decodes as one token with confidence (measured: {LANGUAGE_MODEL_EVIDENCE}). Use mp (a pipeline of "
            f"blocks, trained end to end) or diloco for a language model"
        )


class SIL:
    """SIL for a user's own `nn.Sequential` model and training loop::

        sil = hvd_lowcomm.SIL(model, input_shape=(1, 28, 28), num_classes=10)   # cut, codes
        opt = torch.optim.Adam(sil.module.parameters(), lr=1e-3)               # this rank's part
        sampler = DistributedSampler(train_set, sil.data_replicas, sil.data_rank)
        for x, y in loader:
            sil.step(opt, x, y)                # toward the codes; nothing leaves the group
        correct, count, _ = sil.evaluate(test_batches)   # the joined network (collective)

    The world is split into `partitions` groups of contiguous ranks; this rank keeps only its
    partition (`module`; the others' tensors are released). `cuts` are where partitions 2..K
    start: indices or child names of the Sequential; None chooses a cut that gives every
    partition two weight layers with a non-linearity between them, balanced by parameters.
    Ranks at the same position in their groups (`data_rank` of `data_replicas`) must read the
    same samples when activations pass between them (`evaluate`, `recovery_step`). With
    `from_codes` False a later partition learns from the `x` it is given (sequential SIL: the
    previous partition's real outputs) instead of the previous cut's codes.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        input_shape: tuple[int, ...],
        num_classes: int,
        partitions: int = SILOptions.partitions,
        cuts: list[int | str] | None = None,
        kappa: float = SILOptions.kappa,
        code_distribution: str = SILOptions.code_distribution,
        noise: float = SILOptions.noise,
        seed: int = TrainConfig.seed,
        from_codes: bool = True,
    ) -> None:
        options = make_options(
            SILOptions,
            "sil",
            partitions=partitions,
            cuts=_cut_indices(model, cuts or []),
            kappa=kappa,
            code_distribution=code_distribution,
            noise=noise,
        )
        refuse_language_models(model)
        self.kappa, self.noise, self.from_codes = kappa, noise, from_codes
        self.layout = Layout(model, options, tuple(input_shape), need_depth=True)
        self.module = self.layout.module
        code_seed = torch.tensor([np.random.default_rng(seed).integers(2**31 - 1)], dtype=torch.int64)
        with meter.in_phase("setup"):
            meter.broadcast_(code_seed, 0, "sil.code_seed")  # drawn once on rank 0, regenerated everywhere
        self.code_seed = int(code_seed.item())
        self.codes = {
            cut: class_codes(self.code_seed, cut, num_classes, self.layout.shapes[cut][:1], kappa, code_distribution)
            for cut in range(1, partitions)
        }
        self.generator = torch.Generator().manual_seed(self.code_seed + runtime.rank())
        self.diagnostics: dict[str, Any] = {}
        self.stepping = False  # inside step() or recovery_step(): they step the optimiser themselves
        self.doors: dict[int, OptimizerDoor] = {}  # per optimiser step() was given: its own step() refuses

    def _code_as_input(self, codes: torch.Tensor, cut: int) -> torch.Tensor:
        """Codes (batch × channels) shaped as the activation at `cut`: spread over the positions
        of a C×H×W cut (the per-channel means the previous partition learned)."""
        spatial = self.layout.shapes[cut][1:]
        return codes.reshape(*codes.shape, *[1] * len(spatial)).expand(*codes.shape, *spatial)

    def _as_code(self, out: torch.Tensor) -> torch.Tensor:
        """A partition's output as it is compared with the codes: its per-channel mean over the
        positions of a C×H×W cut. Matching random codes position by position would ask every
        position, which sees only part of the input, to know the class, and trained far worse
        (docs: sil, "Where it cuts")."""
        return out.flatten(2).mean(2) if out.dim() > 2 else out

    @property
    def index(self) -> int:
        """This rank's partition (0-based)."""
        return self.layout.index

    @property
    def data_rank(self) -> int:
        return self.layout.group.rank_of(runtime.rank())

    @property
    def data_replicas(self) -> int:
        return self.layout.group.size

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This partition's own objective: the first maps x, a later one the previous cut's
        codes (with noise), onto the next cut's codes (MSE); the last onto y (cross-entropy)."""
        if torch.is_grad_enabled() and not self.stepping and self.data_replicas > 1:
            raise ConfigError(
                "sil.loss() outside sil.step(): a loop that steps on it itself would skip the average of "
                f"the gradients over this partition's {self.data_replicas} ranks, which then drift apart; "
                "call sil.step(opt, x, y) (or take the loss under torch.no_grad() to look at it)"
            )
        k = self.layout.index
        inputs = x
        if k > 0 and self.from_codes:
            inputs = self._code_as_input(self.codes_on(k, y.device)[y], k)
            if self.noise:  # drawn on the host: the same numbers whatever the device
                noise = torch.randn(inputs.shape, generator=self.generator).to(inputs.device, non_blocking=True)
                inputs = inputs + self.noise * self.kappa * noise
        if inputs is not x:  # codes are float32; the partition may hold bfloat16 weights
            inputs = inputs.to(x.device, parameter_dtype(self.module))
        out = self.module(inputs)
        if self.layout.last:
            return task.loss(out, y)
        return F.mse_loss(self._as_code(out).float(), self.codes_on(k + 1, out.device)[y.to(out.device)])

    def codes_on(self, cut: int, device: torch.device) -> torch.Tensor:
        """The class codes of `cut` on `device` (moved there once)."""
        if self.codes[cut].device != device:
            self.codes[cut] = self.codes[cut].to(device)
        return self.codes[cut]

    def step(self, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
        """One step of this partition: its loss, gradients averaged in its group, optimiser
        step; returns the local loss."""
        with self._own_step(optimizer):
            optimizer.zero_grad()
            with self.layout.timed("forward"):
                loss = self.loss(x, y)
            with self.layout.timed("backward"):
                loss.backward()
            self.layout.average_gradients()
            optimizer.step()
        return loss.item()

    @contextlib.contextmanager
    def _own_step(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Around SIL's own step of `optimizer`, whose step() refuses anywhere else from now on:
        a loop that calls it after sil.step() would step twice per batch."""
        door = self.doors.get(id(optimizer))
        if door is None:
            door = self.doors[id(optimizer)] = OptimizerDoor(
                optimizer,
                "sil.step(opt, x, y)",
                shut="SIL steps this optimiser itself in sil.step(opt, x, y) and sil.recovery_step(...): "
                "a step of the loop's own would step twice per batch; remove optimizer.step() from the loop",
            )
        self.stepping = True
        try:
            with door.own_step():
                yield
        finally:
            self.stepping = False

    def start_recovery(self, optimizer: torch.optim.Optimizer) -> None:
        """Call once before the first recovery step: forgets the optimiser's state (Adam's
        moments). They were built on this partition's own objective (for all but the last a
        regression onto the codes), whose gradients differ in scale from the ones the joined
        network's cross-entropy sends back through the cut; carried over, they would set the
        size of every recovery step for about 1/(1 - beta2) steps, most of a short recovery."""
        optimizer.state.clear()

    def recovery_step(self, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
        """One end-to-end step of the joined network (model parallel: activations forward,
        gradients back); the loss on the last partition, 0.0 elsewhere."""
        with self._own_step(optimizer):
            return pipeline_train_step(self.layout, optimizer, x, y)

    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int, float]:
        """(correct, count, loss sum) of the joined network on the last partition (zeros
        elsewhere); collective over partitions. A partition that feeds a cut also measures its
        outputs against the next cut's codes (`diagnostics`: code_accuracy, cut_spread,
        collapsed)."""
        with meter.in_phase("eval"):
            return self._evaluate(batches)

    def _evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int, float]:
        if self.layout.last:
            return pipeline_evaluate(self.layout, batches)
        hits, rows, spread, size = 0, 0, [], []

        def observe(out: torch.Tensor, y: torch.Tensor) -> None:
            nonlocal hits, rows
            out = self._as_code(out).float()
            codes = self.codes_on(self.layout.index + 1, out.device).flatten(1)
            hits += (torch.cdist(out, codes).argmin(1) == y.to(out.device)).sum().item()
            rows += len(y)
            if len(y) > 1:
                spread.append(out.std(0).mean().item())
                size.append(out.pow(2).mean().sqrt().item())

        counts = pipeline_evaluate(self.layout, batches, observe)
        spread_mean, size_mean = (sum(v) / max(len(v), 1) for v in (spread, size))
        # Collapsed: the outputs barely vary across samples for their size (or are all zero),
        # i.e. the partition maps every input to about the same point.
        self.diagnostics = {
            "code_accuracy": hits / max(rows, 1),
            "cut_spread": spread_mean / max(self.codes[self.layout.index + 1].flatten(1).std(0).mean().item(), 1e-12),
            "collapsed": spread_mean <= COLLAPSED_SPREAD * size_mean,
            "spread": spread_mean,
            "size": size_mean,
        }
        return counts

    def joined_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's ordinary state dict on global rank 0 (None elsewhere); collective."""
        return joined_state_dict(self.layout)


def _cut_indices(model: torch.nn.Module, cuts: list[int | str]) -> list[int]:
    """Cut points given as child indices or names of a Sequential, as indices."""
    names = [name for name, _ in model.named_children()]
    indices = []
    for cut in cuts:
        if isinstance(cut, str) and not cut.isdigit():
            if cut not in names:
                raise ConfigError(f"SIL cut {cut!r} is not a child of the model; its children: {', '.join(names)}")
            indices.append(names.index(cut))
        else:
            indices.append(int(cut))
    return indices


# A partition whose outputs vary across samples by less than this share of their size has
# collapsed onto one point (a trained one varies about half its size, an untrained one too).
COLLAPSED_SPREAD = 0.02
