"""benchmarks.compare's tables and judgements: repeats, time to quality, counters against the meter."""

from __future__ import annotations

import math
from pathlib import Path

import pytest


def test_the_timer_slack_for_mpis_waits_is_set_and_restored():
    from benchmarks.timer_slack import MPI_WAIT_SLACK_NS, set_timer_slack

    slack = Path("/proc/self/timerslack_ns")  # this process's main thread, which runs the test
    default = int(slack.read_text())
    set_timer_slack(MPI_WAIT_SLACK_NS)
    assert int(slack.read_text()) == MPI_WAIT_SLACK_NS
    set_timer_slack(0)
    assert int(slack.read_text()) == default


def test_repeats_report_the_median_run_with_every_repeat_s_step_time():
    from benchmarks.compare import median_runs

    def run(variant, ms, acc=0.9):
        return {
            "variant": variant,
            "np": 2,
            "summary": {"step_seconds_mean": ms / 1000, "final_test_acc": acc},
            "step_ms_runs": [ms],
        }

    merged = median_runs([run("ddp", 40), run("dad", 70), run("ddp", 55), run("dad", 50), run("ddp", 45, acc=0.8)])
    by_method = {r["variant"]: r for r in merged}
    assert by_method["ddp"]["step_ms_runs"] == [40, 55, 45] and by_method["ddp"]["summary"]["final_test_acc"] == 0.8
    assert by_method["dad"]["summary"]["step_seconds_mean"] == 0.05  # of two, the faster: the lower median


def test_a_group_method_on_one_rank_groups_is_tabled_with_its_compression_and_ranks(tmp_path):
    # At np 2 every AB group is one rank: all its traffic is on the world set, yet it trains in groups.
    from benchmarks.compare import tabulate, write_tables

    def run(variant, extra):
        summary = {
            "final_test_acc": 0.9,
            "best_test_acc": 0.9,
            "train_wire_bytes_per_step": 100.0,
            "train_wire_bytes": 1000.0,
            "train_world_wire_bytes": 1000.0,
            "step_seconds_mean": 0.01,
            "peak_rss_bytes_max_rank": 1e8,
            "steps": 10,
            **extra,
        }
        epoch = {"epoch": 1, "seconds": 1.0, "test_acc": 0.9, "compression_ratio": extra.get("compression", "")}
        return {"variant": variant, "np": 2, "summary": summary, "epochs": [epoch], "measured": None}

    ab = {
        "inter_group_wire_bytes": 400.0,
        "train_wire_bytes": 400.0,
        "compression": 5.0,
        "rank/1.attn.q": 15,
        "rank/1.mlp.0": 5,
        "rank/2.mlp.2": 2,
    }
    rows = tabulate([run("ddp", {}), run("ab", ab)], wire_rate=None)
    table = write_tables(rows, tmp_path, "t")
    line = next(row for row in table.splitlines() if row.startswith("| 2 | ab | 400 B |"))
    assert "| 0.4000 | 5.00x |" in line and line.endswith("| – | 2–15 (median 5) |"), line
    assert not any(row.startswith("| 2 | ddp | 1000 B |") for row in table.splitlines())  # ddp trains in no groups
    # A method that never reaches 90 % of ddp's accuracy has no time to it: a dash, not "nan s".
    behind = {**run("ab", ab), "epochs": [{"epoch": 1, "seconds": 1.0, "test_acc": 0.1, "compression_ratio": 5.0}]}
    behind["summary"]["final_test_acc"] = 0.1
    table = write_tables(tabulate([run("ddp", {}), behind], wire_rate=None), tmp_path, "t")
    first = next(row for row in table.splitlines() if row.startswith("| 2 | ab | 10.00 % |"))
    assert "nan" not in table and first.endswith("| – | 100 MB |"), first


def test_counters_agree_within_the_share_or_horovod_s_coordination_while_not_computing():
    from benchmarks.compare import counters_agree, unmetered_allowance

    assert counters_agree(1.04e9, 1e9, 0, nodes=True)  # within 5 %
    assert not counters_agree(1.06e9, 1e9, 59e6, nodes=True)  # 60 MB over, 59 MB allowed
    assert counters_agree(1.06e9, 1e9, 61e6, nodes=True)
    assert counters_agree(0.94e9, 1e9, 61e6, nodes=True)  # either way
    assert counters_agree(1.09e6, 1e6, 0, nodes=False)  # 10 %: a loopback's share
    assert not counters_agree(1.11e6, 1e6, 0, nodes=False)

    # 12 steps of 1.5 s on 8 links, of which 0.5 s computing (forward, backward, the rest) and
    # 1 s blocked in communication; 30 s in all (evaluation included): 24 s not computing, at
    # an idle rate of 2 MB/s, and 64 kB per step and link.
    summary = {
        "steps": 12,
        "seconds": 30.0,
        "step_ms_forward": 100.0,
        "step_ms_backward": 300.0,
        "step_ms_other": 100.0,
        "step_ms_exchange": 1000.0,
    }
    measured = {"measured_bytes_per_node": [0] * 8, "idle_bytes_per_second": 2e6}
    assert unmetered_allowance(summary, measured) == 8 * 64e3 * 12 + 2e6 * 24
    # without a probe (an old set): the per-step part alone
    assert unmetered_allowance(summary, {"measured_bytes_per_node": [0] * 8}) == 8 * 64e3 * 12


def test_time_to_quality_and_quality_at_equal_time():
    from benchmarks.compare import time_to_quality

    def run(variant, points):  # (training seconds, accuracy) at each evaluation
        epochs = [{"seconds": t + 1, "train_seconds": t, "test_acc": a} for t, a in points]
        return {"variant": variant, "np": 2, "summary": {"final_test_acc": points[-1][1]}, "epochs": epochs}

    ddp = run("ddp", [(10, 0.80), (20, 0.90), (30, 0.95)])
    fast = run("fast", [(4, 0.85), (8, 0.945), (12, 0.96)])
    slow = run("slow", [(20, 0.50), (40, 0.60)])
    got = time_to_quality(fast, ddp, [ddp, fast, slow], (0.02, 1.0))
    assert got["target"] == pytest.approx(94.0) and got["seconds_to_target"] == 8
    assert got["time_to_target_ratio_to_ddp"] == pytest.approx(8 / 30)
    assert got["equal_time_seconds"] == 12  # the quickest run's end
    assert got["quality_at_equal_time"] == pytest.approx(96.0)
    assert got["ddp_quality_at_equal_time"] == pytest.approx(82.0)  # interpolated between 10 s and 20 s
    assert math.isnan(time_to_quality(slow, ddp, [ddp, slow], (0.02, 1.0))["seconds_to_target"])


def test_figures_that_do_not_exist_are_tabled_as_a_dash_not_nan():
    from benchmarks.compare import _table

    lines = _table(
        "c",
        ["method", "then", "ddp then", "Δ", "reached"],
        [["ab", "95.10 %", f"{float('nan'):.2f} %", f"{float('nan'):+.2f}", f"{float('nan'):.1f} s"]],
    )
    assert lines[-1] == "| ab | 95.10 % | – | – | – |"


def test_a_diloco_form_naming_no_compression_is_fp32_whatever_the_default():
    from benchmarks.diloco_forms import entry

    assert entry("none", 2, 10) == "diloco:groups=2,sync_every=10,compression=none"
    assert entry("nesterov", 4, 10) == "diloco:groups=4,sync_every=10,compression=none,outer_lr=0.7,outer_momentum=0.9"
    assert entry("sparse+density=0.05", 2, 10) == "diloco:groups=2,sync_every=10,compression=sparse,density=0.05"
    with pytest.raises(SystemExit, match="unknown form part 'int3'"):
        entry("int3", 2, 10)


def test_a_method_entry_s_keys_are_the_method_s_options_unless_they_name_a_section():
    from benchmarks.compare import Variant

    parsed = Variant.parse("diloco:compression=sparse,sparse.density=0.05,train.lr=0.01")
    assert parsed.overrides == (
        "--diloco.compression", "sparse", "--diloco.sparse.density", "0.05", "--train.lr", "0.01"
    )  # fmt: skip
    assert Variant.parse("ddp-fp16:comm.compression=none").overrides == ("--comm.compression", "none")
