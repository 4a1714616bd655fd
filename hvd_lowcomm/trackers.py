"""Experiment trackers beside the run's own files: `--run.loggers tensorboard,wandb`.

Rank 0 writes; every step, epoch and summary record's numbers go to each tracker under
`<kind>/<key>` (train loss of a step as `step/loss`, validation loss as `epoch/test_loss`)
at the record's training step.

    tensorboard   event files in <run dir>/tensorboard (torch.utils.tensorboard's writer;
                  `tensorboard --logdir runs`)
    wandb         Weights & Biases, offline in <run dir>/wandb unless WANDB_MODE says otherwise
                  (`wandb sync` uploads it later from a login node)

A tracker's run id is kept in <run dir>/trackers.json, so a resumed run (--resume) continues
the same tracker run instead of starting another. Each tracker needs the [trackers] extra.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from hvd_lowcomm.config import LOGGERS, ConfigError

IDS_FILE = "trackers.json"


class Tracker:
    def log(self, kind: str, record: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorBoard(Tracker):
    def __init__(self, run_dir: Path, config: dict[str, Any], ids: dict[str, str]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        if "tensorboard" not in ids:  # the configuration once, as text
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)
        ids["tensorboard"] = str(run_dir / "tensorboard")

    def log(self, kind: str, record: dict[str, Any], step: int) -> None:
        for key, value in numbers(record).items():
            self.writer.add_scalar(f"{kind}/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB(Tracker):
    def __init__(self, run_dir: Path, config: dict[str, Any], ids: dict[str, str]) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "hvd_lowcomm"),
            name=run_dir.name,
            dir=str(run_dir),
            config=config,
            id=ids.get("wandb"),
            resume="allow",
            mode=os.environ.get("WANDB_MODE", "offline"),
            settings=wandb.Settings(quiet=True),
        )
        ids["wandb"] = self.run.id

    def log(self, kind: str, record: dict[str, Any], step: int) -> None:
        values = {f"{kind}/{key}": value for key, value in numbers(record).items()}
        if kind == "summary":
            self.run.summary.update(values)
        else:
            self.run.log({**values, "trainer/step": step})

    def close(self) -> None:
        self.run.finish()


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB}
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # what each needs installed
assert set(TRACKERS) == set(LOGGERS) == set(PACKAGES)


def check_installed(names: list[str]) -> None:
    """Refuse, before training, a logger whose package is not installed."""
    missing = [name for name in names if importlib.util.find_spec(PACKAGES[name]) is None]
    if missing:
        raise ConfigError(
            f"run.loggers {', '.join(missing)} needs the {', '.join(PACKAGES[n] for n in missing)} "
            f"package: pip install 'hvd_lowcomm[trackers]', or drop it from run.loggers"
        )


def open_trackers(names: list[str], run_dir: Path, config: dict[str, Any]) -> list[Tracker]:
    """The trackers named, continuing the runs recorded in run_dir (a resumed run)."""
    check_installed(names)
    path = run_dir / IDS_FILE
    ids: dict[str, str] = json.loads(path.read_text()) if path.is_file() else {}
    trackers = [TRACKERS[name](run_dir, config, ids) for name in names]
    if trackers:
        path.write_text(json.dumps(ids, indent=2) + "\n")
    return trackers


def numbers(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric values (booleans, strings and structures left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("type", "time", "step")
    }
