"""The learning-rate schedule of the built-in loop: linear warm-up, then constant or cosine."""

from __future__ import annotations

import math

from hvd_lowcomm.config import Config, ConfigError


def scheduled_lr(cfg: Config, step: int, total_steps: int, progress: float | None = None) -> float:
    """Learning rate for `step` (0-based) of `total_steps`: linear warm-up, then constant or
    cosine decay to zero at the end of the run. `progress`: how far the decay is (0 to 1),
    where a time budget plans it (hvd_lowcomm.budget); default: the steps after warm-up."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    if progress is None:
        progress = (step - t.warmup_steps) / max(1, total_steps - t.warmup_steps)
    return t.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# What a method driven by the built-in loop passes as `total_steps` to a library trainer: the
# loop calls set_total_steps() with the run's length before the first step.
SET_LATER = -1


def require_run_length(options: object, names: tuple[str, ...], total_steps: int | None, prefix: str) -> None:
    """Refuse, at construction, options given as fractions of a run whose length is unknown."""
    fractions = [n for n in names if 0 < getattr(options, n) < 1]
    if total_steps is None and fractions:
        raise ConfigError(
            f"{prefix}.{fractions[0]} = {getattr(options, fractions[0])} is a fraction of the run, "
            f"whose length is not given: pass total_steps=... (the run's steps) or give "
            f"{fractions[0]} as a number of steps"
        )


def run_steps(value: float, total_steps: int | None, option: str) -> int:
    """An option given in steps (>= 1, or 0) or as a fraction of the run's steps (< 1), so that
    a default fits a run of any length; `option` names it in the error."""
    if value >= 1 or value == 0:
        return int(value)
    if total_steps is None:
        raise ConfigError(
            f"{option} = {value} is a fraction of the run, whose length is not known here: call "
            f"set_total_steps(total_steps) first (or pass total_steps) or give a number of steps"
        )
    return round(value * total_steps)
