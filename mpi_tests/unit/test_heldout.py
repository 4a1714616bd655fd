"""The held-out suite's verdicts: which defaults held, and `--method auto` choosing only those."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from hvd_lowcomm import config, costmodel, heldout


ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "heldout" / "results.csv"
FIELDS = ["set", "split", "method", "metric", "vs_ddp", "bytes_vs_ddp", "vs_fp32_diloco", "bytes_vs_fp32_diloco"]


def row(name, split, method, metric, value, ratio=0.1):
    return dict(zip(FIELDS, [name, split, method, metric, str(value), str(ratio), "", ""]))


ROWS = [row("a", "judged", "powersgd", "loss_pct", 1.9), row("b", "judged", "powersgd", "acc_points", -0.9),
        row("c", "chosen", "powersgd", "loss_pct", 9.0),  # a set defaults were chosen on does not judge them
        row("a", "judged", "rank-dad", "loss_pct", -3.0), row("b", "judged", "rank-dad", "acc_points", -1.2)]


def test_a_method_held_only_within_both_bounds_on_every_judged_set():
    measured = {m.method: m for m in heldout.summarize(ROWS)}
    assert measured["powersgd"].held and measured["powersgd"].sets == 2
    assert measured["powersgd"].worst_set == "a" and measured["powersgd"].worst == "+1.9 % loss"
    assert not measured["rank-dad"].held and measured["rank-dad"].worst == "-1.2 points"


@pytest.fixture
def summary(tmp_path, monkeypatch):
    path = tmp_path / "heldout.csv"
    heldout.write_summary(ROWS, path)
    monkeypatch.setattr(heldout, "SUMMARY", path)
    return path


def test_auto_chooses_exact_methods_and_compressions_that_held(summary):
    assert set(costmodel.quality_keeping_methods()) == {"ddp", "ddp-fp16", "dad", "powersgd"}
    assert costmodel.left_out("rank-dad") == "failed on 2 held-out sets (worst: -1.2 points on b)"
    # options other than those measured are not vouched for by the measurement
    changed = config.load(["--powersgd.error_target", "0.3"])
    assert costmodel.left_out("powersgd", changed) == "not measured on the held-out suite at these options"
    assert "powersgd" not in costmodel.quality_keeping_methods(changed)


def test_the_committed_summary_is_the_committed_results_summarised(tmp_path):
    with open(RESULTS) as f:
        rows = list(csv.DictReader(f))
    heldout.write_summary(rows, tmp_path / "expected.csv")
    assert (tmp_path / "expected.csv").read_text() == heldout.SUMMARY.read_text()
    # every set in the results is the suite's, on the side of the split the suite puts it
    from benchmarks.heldout import SETS
    assert {r["set"]: r["split"] for r in rows} == {r["set"]: SETS[r["set"]].split for r in rows}
