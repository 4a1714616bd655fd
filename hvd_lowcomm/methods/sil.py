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

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from hvd_lowcomm import task
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.traffic import meter
from hvd_lowcomm.config import ConfigError, TrainConfig, make_options, option
from hvd_lowcomm.registry import register
from hvd_lowcomm.methods.mp import Partitioned
from hvd_lowcomm.methods.partition import (
    CONV_CUT_EVIDENCE,
    FORWARD,
    Layout,
    PartitionOptions,
    joined_state_dict,
    parameter_dtype,
    partitioned_cost,
    pipeline_evaluate,
    pipeline_train_step,
    shallow_partitions,
    token_vocabulary,
)
from hvd_lowcomm.schedule import scheduled_lr


@dataclass
class SILOptions(PartitionOptions):
    """SIL: partitions trained on their own toward synthetic intermediate labels."""

    mode: str = option(
        "parallel",
        "parallel: later partitions learn from codes, nothing exchanged; sequential: "
        "from the frozen previous partition's outputs, sent once",
        choices=("parallel", "sequential"),
    )
    # 1: the scale a ReLU (or BatchNorm + ReLU) layer's outputs already have. The first partition
    # has to move its outputs onto the codes, and an optimiser's steps are of a fixed size (Adam:
    # about lr per parameter), so larger codes need more steps: at kappa 5 a run with few steps
    # (several ranks per partition, few epochs) ends before its outputs reach them.
    kappa: float = option(1.0, "scale of the class codes (kappa * U(0,1) or kappa * N(0,1))")
    code_distribution: str = option("uniform", "distribution of the codes", choices=("uniform", "normal"))
    noise: float = option(
        0.3,
        "std of the Gaussian noise added to the codes a later partition learns from "
        "(parallel mode), as a fraction of kappa",
    )
    lr: list[float] = option([], "learning rate per partition (empty: train.lr for all)")
    batch_size: list[int] = option([], "batch size per partition (empty: data.batch_size for all)")
    epochs: list[int] = option([], "epochs per partition (empty: train.epochs for each)")
    recovery_epochs: int = option(0, "end-to-end epochs of the joined network at the end (sends activations)")
    # A fraction of train.lr, with a fresh optimiser state: recovery fine-tunes the joined network,
    # it does not retrain it (docs: sil, on sil.recovery_lr).
    recovery_lr: float = option(
        0.3,
        "recovery's peak learning rate, a fraction of train.lr (a cosine of "
        "its own over the recovery steps, as for fine-tuning)",
    )

    def validate(self) -> None:
        super().validate()
        if self.kappa <= 0:
            raise ConfigError(f"sil.kappa must be > 0, got {self.kappa}")
        if self.noise < 0 or self.recovery_epochs < 0:
            raise ConfigError("sil.noise and sil.recovery_epochs must be >= 0")
        if self.recovery_lr <= 0:
            raise ConfigError(f"sil.recovery_lr must be > 0 (a fraction of train.lr), got {self.recovery_lr}")
        for name in ("lr", "batch_size", "epochs"):
            values = getattr(self, name)
            if values and (len(values) != self.partitions or min(values) <= 0):
                raise ConfigError(
                    f"sil.{name} needs one positive value per partition ({self.partitions}), got {values}"
                )


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
        optimizer.zero_grad()
        with self.layout.timed("forward"):
            loss = self.loss(x, y)
        with self.layout.timed("backward"):
            loss.backward()
        self.layout.average_gradients()
        optimizer.step()
        return loss.item()

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


@register(
    "sil",
    options=SILOptions,
    cost=partitioned_cost("sil", exchanges_activations=False, need_depth=True, refuse=refuse_language_models),
)
class SyntheticIntermediateLabels(Partitioned):
    """SIL: each partition learns on its own toward random class codes at the cuts."""

    needs_deep_partitions = True

    def check_model(self, model: torch.nn.Module) -> None:
        refuse_language_models(model)
        super().check_model(model)

    def partition_warnings(self) -> list[str]:
        spatial = [k for k in range(1, self.layout.count) if len(self.layout.shapes[k]) > 1]
        conv = [
            f"sil.cuts {self.options.cuts} cut this model inside its convolutional part (cut {k}, a "
            f"{'x'.join(map(str, self.layout.shapes[k]))} activation; its codes are per-channel means): the "
            f"joined network classifies no better than the convolutions before the cut do on their own "
            f"({CONV_CUT_EVIDENCE}), so expect a large accuracy loss; mp, or a model with two or more fully "
            f"connected layers after its convolutions, avoids it"
            for k in spatial
        ]
        return conv + [
            f"sil.cuts {self.options.cuts} leave partition {k} ({self.layout.table[k]['layers']}) without "
            f"two weight layers and a non-linearity between them: on its own it is an affine map, which cannot "
            f"send each class onto its random code, so expect accuracy far below data-parallel training (leave "
            f"sil.cuts empty for a cut that avoids this)"
            for k in shallow_partitions(self.layout.table)
        ]

    def make_layout(self, model: torch.nn.Module) -> Layout:
        o = self.options
        self.sil = SIL(
            model,
            self.data.input_shape,
            self.data.num_classes,
            o.partitions,
            o.cuts,
            o.kappa,
            o.code_distribution,
            o.noise,
            self.cfg.train.seed,
            from_codes=o.mode == "parallel",
        )
        return self.sil.layout

    def setup(self, model: torch.nn.Module) -> None:
        super().setup(model)
        o, k = self.options, self.layout.index
        self.partition_epochs = o.epochs or [self.cfg.train.epochs] * o.partitions
        starts = (
            [1] * o.partitions
            if o.mode == "parallel"
            else [1 + sum(self.partition_epochs[:j]) for j in range(o.partitions)]
        )
        self.window = (starts[k], starts[k] + self.partition_epochs[k] - 1)
        self.starts = starts
        self.training_epochs = max(s + e - 1 for s, e in zip(starts, self.partition_epochs))
        self.lr_scale = (o.lr[k] / self.cfg.train.lr) if o.lr else 1.0
        self.stage = "idle"
        self.total_steps: int | None = None  # set by set_total_steps()
        self.stored_inputs: torch.Tensor | None = None
        self.train_split: Any = None

    @property
    def codes(self) -> dict[int, torch.Tensor]:
        return self.sil.codes

    @property
    def code_seed(self) -> int:
        return self.sil.code_seed

    @property
    def diagnostics(self) -> dict[str, Any]:
        return {k: v for k, v in self.sil.diagnostics.items() if k not in ("spread", "size")}

    lockstep = False  # in sequential mode some partitions idle while others train

    def epochs(self) -> int:
        return self.training_epochs + self.options.recovery_epochs

    def batches(self, split: Any, batch_size: int, shuffle: bool, device: torch.device) -> Any:
        if not shuffle:  # the test split: the joined network, batch by batch
            return super().batches(split, batch_size, shuffle, device)
        self.train_split = split
        sizes = self.options.batch_size
        return _SILBatches(
            self, super().batches(split, sizes[self.layout.index] if sizes else batch_size, True, device)
        )

    def start_epoch(self, epoch: int) -> None:
        if epoch > self.training_epochs:
            if self.stage != "recovery":  # not on resume: the checkpoint's stage is recovery already
                self.sil.start_recovery(self.optimizer)
            self.stage = "recovery"
        elif self.window[0] <= epoch <= self.window[1]:
            self.stage = "train"
        else:
            self.stage = "idle"
        if self.options.mode == "sequential":
            for cut in range(1, self.layout.count):
                if epoch == self.starts[cut]:
                    self._hand_over(cut)

    def set_total_steps(self, total_steps: int) -> None:
        # The loop's schedule spans training and recovery epochs together; recovery gets its
        # own, a fine-tuning cosine from recovery_lr × train.lr (the tail of the training
        # cosine would leave it a learning rate ~0).
        self.total_steps = total_steps
        self.training_steps = round(total_steps * self.training_epochs / self.epochs())

    def set_lr(self, lr: float) -> None:
        if self.options.recovery_epochs and self.total_steps:
            done, training = meter.step, self.training_steps
            lr = (
                scheduled_lr(self.cfg, done, training)
                if done < training
                else self.options.recovery_lr * scheduled_lr(self.cfg, done - training, self.total_steps - training)
            )
        super().set_lr(lr * self.lr_scale)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self.stage == "recovery":
            return self.sil.recovery_step(self.optimizer, x, y)
        return self.sil.step(self.optimizer, x, y)

    def _hand_over(self, cut: int) -> None:
        """Sequential mode: partition cut-1 (frozen now) sends its outputs for the whole training
        set, once; partition `cut` stores them as its inputs. Rank i of each group handles the
        samples i, i+g, i+2g, ... and the receiving group shares its pieces (allgather)."""
        layout, n = self.layout, len(self.train_split)
        position, g = layout.group.rank_of(runtime.rank()), layout.group.size
        mine = np.arange(n)[position::g]
        if layout.index == cut - 1:
            with torch.no_grad():
                inputs = self.train_split.read(mine)[0] if cut == 1 else self.stored_inputs[mine]
                outputs = torch.cat([self.model(chunk) for chunk in inputs.split(1024)])
            meter.send(outputs, layout.next, "sil.sequential_transfer", FORWARD)
        elif layout.index == cut:
            received = layout.receive(
                layout.previous, len(mine), layout.shapes[cut], FORWARD, "sil.sequential_transfer"
            )
            pieces = meter.allgather(received, "sil.sequential_share", layout.group)
            table = torch.empty(n, *layout.shapes[cut])
            offset = 0
            for p in range(g):
                rows = np.arange(n)[p::g]
                table[rows] = pieces[offset : offset + len(rows)]
                offset += len(rows)
            self.stored_inputs = table

    def evaluate(self, batches: Any) -> tuple[int, int, float]:
        """The joined network's counts; warns when a partition feeding a cut has collapsed."""
        counts = self.sil.evaluate(batches)
        d = self.sil.diagnostics
        leader = self.layout.group.rank_of(runtime.rank()) == 0
        if leader and self.stage != "idle" and d.get("collapsed"):  # any partition's leader, not only rank 0
            tqdm.write(
                f"warning: SIL partition {self.layout.index} has collapsed: its outputs are about the same "
                f"for every input (spread across samples {d['spread']:.3g}, size {d['size']:.3g}; nearest-code "
                f"accuracy {100 * d['code_accuracy']:.1f}%); lower its learning rate (--sil.lr, "
                f"--train.lr) or check that it has depth on both sides of the cut"
            )
        return counts

    def epoch_metrics(self) -> dict[str, Any]:
        return {**super().epoch_metrics(), "sil_stage": self.stage, **self.diagnostics}

    def state_dict(self) -> dict[str, Any]:
        # The codes follow from code_seed (recomputed in setup); the stage and, in sequential
        # mode, the inputs handed over by the previous partition are this partition's progress.
        return {
            **super().state_dict(),
            "sil": {"stage": self.stage, "code_seed": self.code_seed, "stored_inputs": self.stored_inputs},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.stage, self.stored_inputs = state["sil"]["stage"], state["sil"]["stored_inputs"]
        assert state["sil"]["code_seed"] == self.code_seed, "SIL codes differ from the checkpoint's"

    def local_state_dict(self) -> dict[str, Any]:
        return {"noise_generator": self.sil.generator.get_state()}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        self.sil.generator.set_state(state["noise_generator"])


class _SILBatches:
    """This rank's training batches under SIL: none while its partition is idle; in sequential
    mode a later partition's inputs come from the table its predecessor sent."""

    def __init__(self, method: SyntheticIntermediateLabels, inner: Any) -> None:
        self.method, self.inner = method, inner

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.inner.set_epoch(epoch, start)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        method = self.method
        if method.stage == "idle":
            return
        if method.stage == "train" and method.stored_inputs is not None:
            for indices in self.inner.batch_indices()[self.inner.start :]:
                _, y = self.inner.split.read(indices)
                yield method.stored_inputs[indices].to(self.inner.device), y.to(self.inner.device)
            return
        yield from self.inner
