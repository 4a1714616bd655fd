"""A run's length in training time: `--train.max_time` and `--run.eval_every_seconds`.

The training clock is the wall clock since training started less the time spent evaluating
(what a method's speed decides). Ranks must stop at the same step and evaluate at the same
steps, and their clocks differ, so every decision is made in steps from figures all ranks
agreed on:

- After CALIBRATION_STEPS steps every rank contributes its training clock; the slowest rank's
  (an allreduce of one number, max) gives the step time, measured from the end of the first
  step so that one-time costs (allocation, first-call compilation) do not count. The run's
  length in steps follows: what fits in max_time at that rate, at most the epochs' and
  max_steps' bound. The method and the learning-rate schedule are given that length, so the
  schedule still ends at its floor when time, not the step count, ends the run.
- The plan is checked again where half of the time left should have passed, where the steps
  done have doubled, or after a twentieth of the budget, whichever is soonest (a handful of
  one-number allreduces per run), with the step time measured over every step so
  far (the exchanges of methods that synchronise every H steps included), or since the last
  check where that is slower, and the length revised: the schedule's decay continues from
  where it stands to its end at the new length.
- Evaluations every eval_every_seconds of training clock fall at the steps the agreed step
  time predicts.

A method whose ranks do not step together (sil in sequential mode) agrees at epoch ends only,
where its ranks meet: its length is planned after the first epoch.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from hvd_lowcomm.comm.traffic import meter

# Steps before the first plan: enough to measure a step's time past the first step's one-time
# costs, few enough that the plan comes early in any run.
CALIBRATION_STEPS = 10
# The plan is checked at least this often, as a share of the budget: a run that slows down
# is noticed while enough of the budget is left to end the decay on time.
CHECK_SHARE = 0.05
# Re-plans stop once fewer steps than this are left: the last ones change the length by little.
LAST_CHECK_STEPS = 3


class RunLength:
    """The run's length in steps, planned from the training clock where a time budget is set.

    `bound`: the length the epochs and max_steps allow; `max_time`: seconds of training clock
    (0: no time limit); `eval_every_seconds`: evaluations by training clock (0: none);
    `clock()`: this rank's training clock (a resumed run's includes the time before it);
    `lockstep`: ranks step together (checks may fall on any step; otherwise the loop calls
    `at_epoch_end`); `start_step`: the step the run starts (or resumes) at; `warmup`: the
    learning-rate schedule's warm-up steps; `agree`: the
    clock every rank uses from a rank's own (default: the slowest rank's, an allreduce)."""

    def __init__(
        self,
        bound: int,
        max_time: float,
        eval_every_seconds: float,
        clock: Callable[[], float],
        lockstep: bool = True,
        start_step: int = 0,
        warmup: int = 0,
        agree: Callable[[float], float] | None = None,
    ) -> None:
        self.bound, self.max_time, self.eval_every_seconds = bound, max_time, eval_every_seconds
        self.clock, self.lockstep, self.agree = clock, lockstep, agree or slowest_clock
        self.total = bound
        self.timed = max_time > 0 or eval_every_seconds > 0
        # Where the step time is measured from, (step, agreed clock): the end of this process's
        # first step where ranks step together, else its start (an epoch dwarfs step one's costs).
        self.origin: tuple[int, float] | None = None
        if self.timed and not lockstep:
            self.origin = (start_step, self.agree(clock()))
        self.start_step = start_step
        self.agreed: tuple[int, float] | None = None  # (step, agreed clock) at the last check
        self.step_seconds = 0.0  # agreed seconds per step since the origin
        self.next_check = start_step + CALIBRATION_STEPS if self.timed and lockstep else math.inf
        self.evaluations = 0  # evaluations by training clock so far
        self.plans: list[tuple[int, int]] = []  # (step, length) of each plan that changed it
        self.warmup = warmup  # the schedule's warm-up steps, before which nothing decays
        self.anchor: tuple[int, float] | None = None  # (step, schedule progress) where the last plan took over

    def after_step(self, step: int) -> bool:
        """Called by every rank of a lockstep method after `step` steps are done; returns
        whether the length changed (the loop then tells the method). Collective at checks."""
        if not self.timed or not self.lockstep:
            return False
        if step == self.start_step + 1:
            self.origin = (step, self.agree(self.clock()))
            return False
        return step >= self.next_check and self._check(step, self.agree(self.clock()))

    def at_epoch_end(self, step: int) -> bool:
        """A method whose ranks meet only at epoch ends checks the plan there. Collective."""
        return self.timed and not self.lockstep and self._check(step, self.agree(self.clock()))

    def _check(self, step: int, clock: float) -> bool:
        origin_step, origin_clock = self.origin or (self.start_step, 0.0)
        self.step_seconds = (clock - origin_clock) / max(step - origin_step, 1)
        if self.agreed is not None and step - self.agreed[0] >= CALIBRATION_STEPS:
            # a run that slowed down plans on its recent pace: a budget overrun costs more than ending early
            recent = (clock - self.agreed[1]) / (step - self.agreed[0])
            self.step_seconds = max(self.step_seconds, recent)
        self.agreed = (step, clock)
        before = self.total
        if self.max_time > 0:
            fits = step + max(0, math.floor((self.max_time - clock) / max(self.step_seconds, 1e-12)))
            self.total = max(step, min(self.bound, fits))
            left, done = self.total - step, step - self.start_step
            # next: where half the time left should have passed, the steps done so far have
            # doubled, or a CHECK_SHARE of the budget has passed, whichever is soonest
            share = math.ceil(CHECK_SHARE * self.max_time / max(self.step_seconds, 1e-12))
            sooner = min(math.ceil(left / 2), max(done, CALIBRATION_STEPS), max(share, CALIBRATION_STEPS))
            self.next_check = step + sooner if left >= 2 * LAST_CHECK_STEPS else math.inf
        else:  # evaluations by clock alone: the step time, refreshed as the run doubles
            self.next_check = step + max(step - self.start_step, CALIBRATION_STEPS)
        if self.total != before:
            if step > self.warmup:  # the decay continues from where it stands, to its end at the new length
                self.anchor = (step, self._progress(step, before))
            self.plans.append((step, self.total))
        return self.total != before

    def progress(self, step: int) -> float:
        """How far the learning-rate schedule's decay is at `step`, from 0 (after warm-up) to 1
        (the run's last step): continuous across plans, so a revised length bends the decay
        toward its new end instead of jumping."""
        return self._progress(step, self.total)

    def _progress(self, step: int, total: int) -> float:
        if self.anchor is None:
            return max(0.0, (step - self.warmup) / max(1, total - self.warmup))
        at, done = self.anchor
        return min(1.0, done + (1.0 - done) * (step - at) / max(1, total - at))

    def evaluation_due(self, step: int) -> bool:
        """Whether to evaluate after `step` steps: the agreed step time predicts the training
        clock crossed the next multiple of eval_every_seconds. The same answer on every rank."""
        if self.eval_every_seconds <= 0 or self.agreed is None:
            return False
        at_step, at_clock = self.agreed
        predicted = at_clock + (step - at_step) * self.step_seconds
        if predicted < (self.evaluations + 1) * self.eval_every_seconds:
            return False
        self.evaluations = math.floor(predicted / self.eval_every_seconds)
        return True

    def summary(self) -> dict[str, float | int]:
        """What the run's summary reports of the plan (nothing without a time limit)."""
        if not self.timed:
            return {}
        return {
            "max_time": self.max_time,
            "planned_steps": self.total,
            "agreed_step_seconds": self.step_seconds,
            "length_plans": len(self.plans),
        }


def slowest_clock(seconds: float) -> float:
    """The largest of every rank's `seconds` (an allreduce of one number). Collective."""
    with meter.in_phase("control"):
        (agreed,) = meter.allreduce_many([("budget.clock", torch.tensor([seconds], dtype=torch.float64))], op="max")
    return float(agreed[0])
