"""The `sil` Method the built-in loop drives (registered on import); its cost is the
partitioned methods' (hvd_lowcomm.methods.partition.partitioned_cost)."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
from tqdm import tqdm

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.traffic import meter
from hvd_lowcomm.registry import register
from hvd_lowcomm.methods.mp import Partitioned
from hvd_lowcomm.methods.partition import CONV_CUT_EVIDENCE, FORWARD, Layout, partitioned_cost, shallow_partitions
from hvd_lowcomm.schedule import scheduled_lr
from hvd_lowcomm.methods.sil.algorithm import SIL, refuse_language_models
from hvd_lowcomm.methods.sil.options import SILOptions


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
