"""--train.max_time across ranks: every rank stops at the same step, the learning-rate schedule
reaches its floor, and evaluation does not count against the budget."""

from __future__ import annotations

import json

import pytest
import torch

from hvd_lowcomm.budget import RunLength
from conftest import RANK, SIZE


def on_every_rank(values: list[float]) -> torch.Tensor:
    """Every rank's `values`, one row per rank."""
    from hvd_lowcomm.comm.traffic import meter

    return meter.allgather(torch.tensor([values], dtype=torch.float64), "test.gather")


def test_ranks_with_different_clocks_agree_on_one_length_and_the_same_evaluations(world):
    pace = 0.01 * (1 + RANK)  # each rank's own step time: the slowest rank's decides
    now = [0.0]
    length = RunLength(100_000, max_time=4.0, eval_every_seconds=0.5, clock=lambda: now[0])
    step, evaluated = 0, []
    while step < length.total:
        now[0] += pace
        step += 1
        length.after_step(step)
        if length.evaluation_due(step):
            evaluated.append(step)
    rows = on_every_rank([step, len(evaluated), sum(evaluated)])
    assert (rows == rows[0]).all(), rows  # the same length and evaluation steps everywhere
    slowest = 0.01 * SIZE
    assert step == pytest.approx(4.0 / slowest, rel=0.01)  # what fits at the slowest rank's pace


@pytest.mark.skipif(SIZE < 2, reason="agreement needs several ranks")
def test_a_time_budget_ends_every_rank_at_one_step_with_the_schedule_at_its_floor(shared_tmp):
    from hvd_lowcomm.comm.traffic import meter
    from hvd_lowcomm.train import main

    budget = 3.0
    argv = [
        "--train.epochs",
        "10000",  # never the bound: the budget ends the run
        "--train.max_time",
        str(budget),
        "--run.eval_every_seconds",
        "0.5",
        "--data.path",
        str(shared_tmp / "digits.h5"),
        "--run.dir",
        str(shared_tmp),
        "--run.name",
        "budget",
        "--run.log_every",
        "1",
        "--run.progress",
        "false",
    ]
    assert main(argv) == 0
    steps = on_every_rank([meter.step])
    assert (steps == steps[0]).all(), steps
    if RANK == 0:
        summary = json.loads((shared_tmp / "budget" / "summary.json").read_text())
        records = [json.loads(line) for line in (shared_tmp / "budget" / "metrics.jsonl").read_text().splitlines()]
        lrs = [r["lr"] for r in records if "lr" in r]
        evaluations = [r for r in records if "test_loss" in r and "train_seconds" in r]
        assert summary["steps"] == steps[0][0] == summary["planned_steps"]
        assert lrs[0] == pytest.approx(1e-3) and lrs[-1] < 0.05 * lrs[0]  # the decay ran (near) to its floor
        # the training clock stops near the budget; evaluations ran beside it, off that clock
        assert 0.7 * budget <= summary["train_seconds"] <= 1.3 * budget, summary["train_seconds"]
        gaps = [r["seconds"] - r["train_seconds"] for r in evaluations]  # the wall clock's lead
        assert len(evaluations) >= 4 and all(b > a for a, b in zip(gaps, gaps[1:])), gaps  # grows by each evaluation
        assert summary["seconds"] - summary["train_seconds"] >= gaps[-1]
