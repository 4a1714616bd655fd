"""Predictions from a profile, and the choices made from them: `predict`, `choose`, `break_even`,
and which methods keep quality (the held-out suite's verdicts)."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Any


from hvd_lowcomm import heldout, time_to_quality
from hvd_lowcomm.config import Config, ConfigError, apply_presets, default_config
from hvd_lowcomm.metrics import human_bytes
from hvd_lowcomm.registry import specs
from hvd_lowcomm.costmodel.network import Link
from hvd_lowcomm.costmodel.method_cost import Prediction, RunAssumptions
from hvd_lowcomm.costmodel.profile import Profile


def predict(
    profile: Profile,
    method: str,
    ranks: int,
    link: Link,
    cfg: Config | None = None,
    assumptions: RunAssumptions = RunAssumptions(),
) -> Prediction:
    """The step of `method` on `ranks` ranks, each with the profile's batch, with the options of
    `cfg` (the defaults if None) and the presets the method's name implies."""
    spec = specs().get(method)
    if spec is None or spec.cost is None:
        raise ConfigError(f"the cost model predicts {', '.join(predicted_methods())}; not {method!r}")
    cfg = _with_presets(spec, cfg)
    prediction = spec.cost.predict(profile, ranks, link, cfg.method_options.get(spec.section), cfg, assumptions)
    return replace(prediction, method=method, ranks=ranks)


def _with_presets(spec: Any, cfg: Config | None) -> Config:
    """cfg (the defaults if None) with the presets the method's name implies (a copy if any)."""
    if spec.presets:
        cfg = copy.deepcopy(cfg or default_config())
        apply_presets(cfg, spec.presets)
    return cfg or default_config()


def predicted_methods() -> list[str]:
    """Every registered method with a cost, in registration order."""
    return [name for name, spec in specs().items() if spec.cost is not None]


def drop_in_methods() -> tuple[str, ...]:
    """The methods `--method auto` may choose among: same model, same training, only the exchange differs."""
    return tuple(name for name, spec in specs().items() if spec.drop_in and spec.cost is not None)


def quality_risk(method: str, cfg: Config | None = None) -> str | None:
    """What `method` with cfg's options may lose against ddp (MethodCost.quality): "" nothing,
    a sentence for an error-targeted compression, None for one without a target."""
    spec = specs()[method]
    cfg = _with_presets(spec, cfg)
    if spec.cost is None or spec.cost.quality is None:
        return None
    return spec.cost.quality(cfg.method_options.get(spec.section), cfg)


def measured_quality(method: str, cfg: Config | None = None) -> heldout.Measured | None:
    """The held-out suite's verdict on `method`, when cfg runs it with the options that were
    measured (its defaults); None when it was not measured so."""
    spec = specs()[method]
    measured = heldout.measured().get(method)
    if measured is None or spec.options is None:
        return measured
    ran = (cfg or default_config()).method_options.get(spec.section)
    return measured if ran is None or ran == _with_presets(spec, None).method_options.get(spec.section) else None


def left_out(method: str, cfg: Config | None = None) -> str | None:
    """Why `--method auto` does not choose `method` (None: it may). An exact exchange always
    may; a compression only with an error target; both it and fp16's rounding only where their
    defaults held on every judged set of the held-out suite, at the options they were measured with."""
    risk = quality_risk(method, cfg)
    if risk is None:
        return "a fixed rank, or no error feedback: no bound on what it loses"
    if not specs()[method].cost.judged:
        return None
    measured = measured_quality(method, cfg)
    if measured is None:
        return "not measured on the held-out suite at these options"
    return None if measured.held else measured.risk()


def quality_keeping_methods(cfg: Config | None = None) -> tuple[str, ...]:
    """The drop-in methods `--method auto` chooses among: exact ones, and roundings and
    compressions to an error target whose defaults held on the held-out suite."""
    return tuple(m for m in drop_in_methods() if left_out(m, cfg) is None)


def _at_defaults(method: str, cfg: Config | None) -> bool:
    """Whether cfg runs `method` with the options its measurements were made with (its defaults)."""
    spec = specs()[method]
    ran = (cfg or default_config()).method_options.get(spec.section)
    return spec.options is None or ran is None or ran == _with_presets(spec, None).method_options.get(spec.section)


def time_held_methods(cfg: Config | None = None) -> tuple[str, ...]:
    """Methods that change how the model trains (not drop-in) yet reached ddp's quality on every
    judged set of the time-to-quality suite, at the options measured: `--method auto` weighs
    them by their time to that quality."""
    return tuple(
        m
        for m, multiple in time_to_quality.steps_multiples().items()
        if m in specs() and m not in drop_in_methods() and math.isfinite(multiple) and _at_defaults(m, cfg)
    )


def auto_candidates(cfg: Config | None = None) -> tuple[str, ...]:
    """What `--method auto` chooses among: the quality-keeping drop-in methods and those that
    held at equal time."""
    return quality_keeping_methods(cfg) + time_held_methods(cfg)


def steps_multiple(method: str, cfg: Config | None = None) -> float:
    """The steps `method` needs for ddp's quality, as a multiple of ddp's: 1 for an exact
    exchange, the time-to-quality suite's measurement at the measured options, else 1 (a
    rounding or compression that held at equal steps: one that ran out of time before the
    target was measured in time, not in steps). A method that is no drop-in is a candidate
    only where it was measured (time_held_methods)."""
    if quality_risk(method, cfg) == "":
        return 1.0
    measured = time_to_quality.steps_multiples().get(method)
    if measured is None or not math.isfinite(measured) or not _at_defaults(method, cfg):
        return 1.0
    # a drop-in exchange approximates ddp's gradient: fewer steps than ddp's is a run's noise
    return max(measured, 1.0) if method in drop_in_methods() else measured


def break_even(
    profile: Profile,
    method: str,
    ranks: int,
    network: Link,
    cfg: Config | None = None,
    assumptions: RunAssumptions = RunAssumptions(),
) -> float:
    """The network bandwidth (bytes/s) below which `method` steps faster than ddp, the rest of
    `network` (latency, nodes, their own links) as given: inf when it is faster at every bandwidth
    from 100 Mbit/s to 10 Tbit/s, 0 when it is faster at none."""

    def gain(bandwidth: float) -> float:
        link = replace(network, bandwidth=bandwidth)
        return (
            predict(profile, "ddp", ranks, link, cfg, assumptions).step
            - predict(profile, method, ranks, link, cfg, assumptions).step
        )

    low, high = 100e6 / 8, 10e12 / 8
    if gain(low) <= 0:
        return 0.0
    if gain(high) > 0:
        return math.inf
    for _ in range(16):  # bisection in log space: to 1 part in 10^4 (high / low = 10^5 ^ (1 / 2^16))
        middle = math.sqrt(low * high)
        low, high = (middle, high) if gain(middle) > 0 else (low, middle)
    return math.sqrt(low * high)


# A method must beat ddp by this share to be chosen over it: within it, ddp (which changes
# nothing about the gradient) wins the tie.
MIN_GAIN = 0.05


def choose(
    profile: Profile, ranks: int, link: Link, cfg: Config | None = None, candidates: tuple[str, ...] | None = None
) -> tuple[str, list[Prediction], str]:
    """The candidate (default: auto_candidates) with the shortest predicted time to ddp's
    quality, its step × its steps multiple (ddp unless another is MIN_GAIN sooner), every
    prediction (soonest first), and why (with what quality risk remains)."""
    if candidates is None:
        candidates = auto_candidates(cfg)

    def to_quality(q: Prediction) -> float:  # in ddp's steps: the same count for every method
        return q.step * steps_multiple(q.method, cfg)

    predictions = sorted((predict(profile, m, ranks, link, cfg) for m in candidates), key=to_quality)
    best, ddp = predictions[0], next((q for q in predictions if q.method == "ddp"), None)
    if ddp is not None and to_quality(best) > (1 - MIN_GAIN) * to_quality(ddp):
        best = ddp
    multiple = steps_multiple(best.method, cfg)
    why = (
        f"{best.method}: predicted {best.step * 1e3:.1f} ms per step on {ranks} ranks over {link.describe()} "
        f"(compute {best.compute * 1e3:.1f} ms, its own work {best.method_compute * 1e3:.1f} ms, "
        f"network {(best.communication - best.hidden) * 1e3:.1f} ms not hidden)"
        + (f", {multiple:.2f}x ddp's steps to ddp's quality (measured)" if multiple != 1 else "")
    )
    if ddp is not None and best.method != "ddp":
        why += f"; ddp would take {to_quality(ddp) / to_quality(best):.2f}x its time to that quality"
    else:
        runner = next((q for q in predictions if q.method != best.method), None)
        if runner is not None:
            why += (
                f"; the next best, {runner.method}, would take {to_quality(runner) / to_quality(best):.2f}x ddp's "
                f"time to its quality (a method is chosen over ddp only when {MIN_GAIN:.0%} sooner)"
            )
    risk, measured = quality_risk(best.method, cfg), measured_quality(best.method, cfg)
    timed = time_to_quality.measured().get(best.method)
    if best.method in time_held_methods(cfg) and timed is not None:  # it trains differently: judged in time
        why += (
            f". Quality: it trains the model its own way; given ddp's training time it reached ddp's final "
            f"loss on all {timed.sets} judged sets of the time-to-quality suite"
        )
        return best.method, predictions, why
    why += f". Quality: {risk or 'the same gradient as ddp'}" + (f"; {measured.risk()}" if measured and risk else "")
    return best.method, predictions, why


def format_predictions(predictions: list[Prediction], cfg: Config | None = None) -> str:
    """One line per prediction: the step and its parts, bytes, and the time to ddp's quality
    (step × steps multiple) as a multiple of ddp's where ddp is among them."""
    ddp = next((q for q in predictions if q.method == "ddp"), None)
    lines = [
        f"{'method':<10} {'step ms':>9} {'compute':>9} {'own work':>9} {'network':>9} {'hidden':>8} {'sent/rank':>10}"
        f" {'x steps':>8} {'to quality':>10}"
    ]
    for q in predictions:
        multiple = steps_multiple(q.method, cfg)
        relative = q.step * multiple / ddp.step if ddp is not None else math.nan
        lines.append(
            f"{q.method:<10} {q.step * 1e3:>9.1f} {q.compute * 1e3:>9.1f} {q.method_compute * 1e3:>9.1f} "
            f"{q.communication * 1e3:>9.1f} {q.hidden * 1e3:>8.1f} {human_bytes(q.bytes_per_rank):>10}"
            f" {multiple:>8.2f} {relative:>9.2f}x"
        )
    return "\n".join(lines)
