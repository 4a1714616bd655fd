"""A time budget's plan (hvd_lowcomm.budget.RunLength) on a clock the test drives: the run's
length from the measured step time, its revisions, the schedule's decay and evaluations by
clock. The agreement across ranks is mpi_tests/test_budget.py's."""

from __future__ import annotations

import math

import pytest

from hvd_lowcomm.budget import CALIBRATION_STEPS, RunLength


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(length: RunLength, clock: FakeClock, step_seconds, first_step_seconds: float = 0.0) -> int:
    """Steps until the plan's length, the clock advancing `step_seconds(step)` per step (the
    first step `first_step_seconds` more); returns the steps taken."""
    step = 0
    while step < length.total:
        clock.now += step_seconds(step) + (first_step_seconds if step == 0 else 0.0)
        step += 1
        length.after_step(step)
    return step


def test_a_budget_plans_the_steps_that_fit_at_the_measured_step_time():
    clock = FakeClock()
    length = RunLength(10_000, max_time=10.0, eval_every_seconds=0, clock=clock, agree=lambda s: s)
    steps = run(length, clock, lambda step: 0.01, first_step_seconds=0.5)  # the first step's one-time cost
    # 0.51 s for the first step, then 0.01 s a step: 950 steps fit in 10 s (the first step's
    # one-time cost is not taken for the rate)
    assert steps == 950 and length.total == 950
    assert clock.now == pytest.approx(10.0, abs=0.011)
    assert length.step_seconds == pytest.approx(0.01)


def test_the_epochs_bound_ends_a_run_the_budget_would_let_go_on():
    clock = FakeClock()
    length = RunLength(300, max_time=100.0, eval_every_seconds=0, clock=clock, agree=lambda s: s)
    assert run(length, clock, lambda step: 0.01) == 300


def test_a_slower_second_half_shortens_the_plan_and_the_run_still_fits():
    clock = FakeClock()
    length = RunLength(10_000, max_time=10.0, eval_every_seconds=0, clock=clock, agree=lambda s: s)
    steps = run(length, clock, lambda step: 0.01 if step < 300 else 0.03)
    # 300 steps in 3 s, then 7 s at 0.03: about 533 steps; the plan made at step 10 said 1000
    assert len(length.plans) > 2 and length.plans[0][1] == 1000
    assert 500 <= steps <= 540 and clock.now <= 10.0 * 1.03


def test_the_decay_is_continuous_across_plans_and_ends_at_its_floor():
    clock = FakeClock()
    length = RunLength(10_000, max_time=10.0, eval_every_seconds=0, clock=clock, warmup=5, agree=lambda s: s)
    progress, step = [], 0
    while step < length.total:
        progress.append(length.progress(step))
        clock.now += 0.01 if step < 300 else 0.03
        step += 1
        length.after_step(step)
    assert progress[:6] == [0.0] * 6  # nothing decays in the warm-up
    jumps = [b - a for a, b in zip(progress, progress[1:])]
    assert min(jumps) >= 0 and max(jumps) < 0.01  # no jump where the length was revised
    assert progress[-1] == pytest.approx(1.0, abs=0.01)  # the last step at the schedule's floor


def test_evaluations_fall_at_the_predicted_multiples_of_the_interval():
    clock = FakeClock()
    length = RunLength(400, max_time=0.0, eval_every_seconds=0.5, clock=clock, agree=lambda s: s)
    due, step = [], 0
    while step < 400:
        clock.now += 0.01
        step += 1
        length.after_step(step)
        if length.evaluation_due(step):
            due.append(step)
    # every 0.5 s at 0.01 s a step: after steps 50, 100, ... (none before the step time is known)
    expected = list(range(50, 400, 50))  # (and at step 400, where the run ends, or just after it)
    assert len(due) >= len(expected) and all(abs(d - e) <= 1 for d, e in zip(due, expected)), due
    assert all(d >= CALIBRATION_STEPS for d in due)


def test_no_budget_keeps_the_bound_and_asks_nothing_of_the_other_ranks():
    asked = []
    length = RunLength(50, max_time=0.0, eval_every_seconds=0, clock=lambda: 0.0, agree=lambda s: asked.append(s) or s)
    assert not any(length.after_step(step) for step in range(1, 51))
    assert length.total == 50 and not asked and length.summary() == {}
    assert math.isinf(length.next_check)
