"""SIL's options (the partition options, and the codes, noise and schedule per partition)."""

from __future__ import annotations

from dataclasses import dataclass


from hvd_lowcomm.config import ConfigError, option
from hvd_lowcomm.methods.partition import PartitionOptions


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
