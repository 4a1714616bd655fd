"""The learning-rate schedule of the built-in loop: linear warm-up, then constant or cosine."""
from __future__ import annotations

import math

from hvd_lowcomm.config import Config


def scheduled_lr(cfg: Config, step: int, total_steps: int) -> float:
    """Learning rate for `step` (0-based) of `total_steps`: linear warm-up, then constant or
    cosine decay to zero at the end of the run."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    progress = (step - t.warmup_steps) / max(1, total_steps - t.warmup_steps)
    return t.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
