"""benchmarks.compare: side-by-side tables, and an emulated link whose bytes are measured outside."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import RANK, SIZE, clean_env, mpirun

REPO = Path(__file__).resolve().parent.parent
only_from_the_1_rank_suite = pytest.mark.skipif(SIZE != 1 or RANK != 0, reason="launches its own mpiruns")
needs_netns = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="needs root and iproute2")


def compare(out: Path, *args: str, hidden: str = "64") -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.compare",
            "--np",
            "2",
            "--data",
            str(out / "digits.h5"),
            "--hidden",
            hidden,
            "--epochs",
            "1",
            "--out",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=clean_env(),
        timeout=600,
    )


def compared_rows(out: Path, methods: str, max_steps: str) -> dict[str, dict[str, str]]:
    """Run compare (which must succeed) and return results.csv's rows by method."""
    proc = compare(out, "--methods", methods, "--", "--train.max_steps", max_steps)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {row["method"]: row for row in csv.DictReader(open(out / "results.csv"))}


def namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.startswith("hvdlc-")}


@only_from_the_1_rank_suite
def test_compare_writes_tables_plots_and_ratios_to_ddp(tmp_path):
    # a method entry with several options (rank-dAD's factors from the first step of this short run)
    entry = "rank-dad:rank=2,iterations=3,start_iter=0"
    rows = compared_rows(tmp_path, f"ddp,ddp-fp16,{entry}", "6")
    assert set(rows) == {"ddp", "ddp-fp16", entry}
    assert float(rows["ddp"]["bytes_ratio_to_ddp"]) == 1.0
    assert float(rows["ddp-fp16"]["bytes_ratio_to_ddp"]) == pytest.approx(0.5)
    assert float(rows[entry]["bytes_ratio_to_ddp"]) < 0.5
    for name in ("results.md", "accuracy_vs_epoch.png", "accuracy_vs_bytes.png", "step_time.png", "effective_rank.png"):
        assert (tmp_path / name).stat().st_size > 0, name


@only_from_the_1_rank_suite
@needs_netns
def test_link_bytes_measured_outside_agree_with_the_meter_and_namespaces_are_removed(tmp_path):
    before = namespaces()
    # Enough training traffic (1.2 MB per rank per step) that start-up noise (tens of kB) is small.
    proc = compare(
        tmp_path, "--methods", "ddp,dad", "--link", "1gbit", "--", "--train.max_steps", "20", hidden="512,512"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    for row in rows:
        assert abs(float(row["measured_vs_meter"])) <= 0.10, row
        assert row["agreement"] == "ok" and 0 < float(row["link_utilisation"]) <= 1.0
    assert "measured vs meter" in (tmp_path / "results.md").read_text()
    assert namespaces() == before


@only_from_the_1_rank_suite
@needs_netns
def test_a_failing_run_still_removes_its_namespace(tmp_path):
    before = namespaces()
    proc = compare(tmp_path, "--methods", "ddp", "--link", "1gbit", "--", "--model.name", "cnn", "--model.hidden", "0")
    assert proc.returncode != 0 and "run failed" in proc.stderr
    assert namespaces() == before


@only_from_the_1_rank_suite
def test_the_idle_probe_after_training_ends_with_the_trainers_error_and_does_not_idle():
    proc = subprocess.run(
        mpirun(
            2, sys.executable, "-m", "benchmarks.coordination", "--after-training", "--", "--method", "no-such-method"
        ),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=clean_env(),
    )
    assert proc.returncode == 2 and "no-such-method" in proc.stderr, proc.stdout + proc.stderr
    assert "IDLE" not in proc.stdout


@only_from_the_1_rank_suite
@needs_netns
def test_an_interrupted_comparison_ends_its_job_and_removes_its_network(tmp_path):
    from benchmarks.compare import TRAINING_STARTS

    before = namespaces()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.compare",
            "--methods",
            "ddp",
            "--np",
            "2",
            "--data",
            str(tmp_path / "digits.h5"),
            "--hidden",
            "64",
            "--epochs",
            "500",
            "--link",
            "1gbit",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log = tmp_path / "runs" / "np2-ddp.log"  # written as the job prints, so the trainer is seen to train
    deadline = time.monotonic() + 300
    while not (log.exists() and TRAINING_STARTS in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert log.exists() and TRAINING_STARTS in log.read_text(), "the run's log never showed it training"
    proc.send_signal(signal.SIGTERM)  # as a batch system's time limit would
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM, proc.stdout.read()
    assert TRAINING_STARTS in log.read_text()  # what the job printed before the end is kept
    ranks = subprocess.run(["pgrep", "-f", str(tmp_path / "runs")], capture_output=True, text=True).stdout
    assert ranks == "", f"ranks outlived the comparison: {ranks}"
    assert namespaces() == before


@only_from_the_1_rank_suite
def test_a_failing_method_leaves_the_others_in_the_table_and_the_exit_status_non_zero(tmp_path):
    proc = compare(tmp_path, "--methods", "ddp,ab:groups=3", "--", "--train.max_steps", "4")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "cannot split 2 ranks into 3 equal groups" in proc.stderr
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert [row["method"] for row in rows] == ["ddp"]
    assert (
        "Failed runs (exit non-zero, logs under runs/): ab:groups=3 on 2 ranks" in (tmp_path / "results.md").read_text()
    )


@only_from_the_1_rank_suite
def test_the_floor_the_bare_horovod_script_and_step_phases_are_tabled(tmp_path):
    rows = compared_rows(tmp_path, "local,ddp,horovod", "10")
    assert set(rows) == {"local", "ddp", "horovod"}
    assert float(rows["local"]["bytes_per_step"]) == 0 and float(rows["local"]["step_time_ratio_to_floor"]) == 1.0
    # the bare script sends what ddp's meter counts: every gradient, ring allreduce
    assert float(rows["horovod"]["bytes_per_step"]) == pytest.approx(float(rows["ddp"]["bytes_per_step"]))
    assert float(rows["horovod"]["step_time_ratio_to_ddp"]) > 0
    phases = [float(rows["ddp"][f"step_ms_{p}"]) for p in ("forward", "backward", "exchange", "other")]
    assert all(v >= 0 for v in phases) and sum(phases) == pytest.approx(float(rows["ddp"]["step_ms"]), rel=0.01)
    assert float(rows["ddp"]["floor_ms"]) == pytest.approx(float(rows["local"]["step_ms"]))
    assert "Where a step goes" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "step_phases.png").stat().st_size > 0


@only_from_the_1_rank_suite
def test_a_budget_gives_every_method_ddps_training_time_and_tables_the_no_communication_limit(tmp_path):
    import yaml

    refused = compare(tmp_path, "--methods", "local,diloco", "--budget", "1")
    assert refused.returncode != 0 and "--budget needs ddp" in refused.stderr
    budget = ("--budget", "1", "--epochs", "3", "--", "--train.max_steps", "40")
    proc = compare(tmp_path, "--methods", "local,diloco,ddp", *budget)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {row["method"]: row for row in csv.DictReader(open(tmp_path / "results.csv"))}
    ddp = json.loads((tmp_path / "runs" / "np2-ddp" / "summary.json").read_text())
    assert ddp["steps"] == 40  # ddp ran first, for its own length
    for method in ("local", "diloco"):
        train = yaml.safe_load((tmp_path / "runs" / f"np2-{method}" / "config.yaml").read_text())["train"]
        # ddp's training time is its clock at its last evaluation, as the tables measure it
        ddp_epochs = list(csv.DictReader(open(tmp_path / "runs" / "np2-ddp" / "epochs.csv")))
        ddp_seconds = float(ddp_epochs[-1]["train_seconds"])
        assert train["max_time"] == pytest.approx(ddp_seconds, abs=1e-3) and train["max_steps"] == -1
        summary = json.loads((tmp_path / "runs" / f"np2-{method}" / "summary.json").read_text())
        assert 0.5 * ddp["train_seconds"] <= summary["train_seconds"] <= 2.0 * ddp["train_seconds"], method
        limit = 40 * float(rows["local"]["step_ms"]) / 1000  # ddp's steps at local's step time
        assert float(rows[method]["limit_seconds"]) == pytest.approx(limit, rel=1e-6)
    table = (tmp_path / "results.md").read_text()
    assert "Equal time: every method but ddp trained for 1 × ddp's training time" in table
    assert (tmp_path / "accuracy_vs_time.png").stat().st_size > 0


@only_from_the_1_rank_suite
def test_repeated_runs_are_kept_apart_and_their_range_is_tabled(tmp_path):
    proc = compare(tmp_path, "--methods", "ddp", "--repeat", "2", "--", "--train.max_steps", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "runs" / "np2-ddp" / "summary.json").exists()
    assert (tmp_path / "runs" / "np2-ddp-r2" / "summary.json").exists()
    table = (tmp_path / "results.md").read_text()
    assert re.search(r"\| 2 \| ddp \|.*\| \d+\.\d \(\d+\.\d–\d+\.\d\) \|", table), table


@only_from_the_1_rank_suite
@needs_netns
def test_the_torch_engine_meets_across_emulated_nodes_where_no_host_name_resolves(tmp_path):
    # Each node's namespace has its own host name and a route only to the cluster's subnet: rank
    # 0's address and each rank's Gloo interface come from the rendezvous over MPI.
    proc = compare(
        tmp_path,
        "--methods",
        "ddp,diloco:compression=none",
        "--np",
        "4",
        "--nodes",
        "2",
        "--link",
        "1gbit",
        "--",
        "--train.max_steps",
        "8",
        "--comm.engine",
        "torch",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {row["method"]: row for row in csv.DictReader(open(tmp_path / "results.csv"))}
    assert set(rows) == {"ddp", "diloco:compression=none"} and all(r["agreement"] == "ok" for r in rows.values())
    log = (tmp_path / "runs" / "np4-ddp.log").read_text()
    assert "engine torch (as requested)" in log
    ddp = json.loads((tmp_path / "runs" / "np4-ddp" / "summary.json").read_text())
    assert ddp["nodes"] == 2 and ddp["train_between_nodes_bytes_all_ranks"] > 0


@only_from_the_1_rank_suite
@needs_netns
def test_emulated_nodes_keep_traffic_inside_a_node_off_the_links_and_groups_follow_the_nodes(tmp_path):
    before = namespaces()
    # 6 ranks as 3 nodes of 2: without nodes DiLoCo would make 2 groups of 3; here one per node.
    # Batch 8 gives 24 steps in the epoch (batch 32: 7), so Horovod's coordination beside the
    # training traffic weighs less. DiLoCo in fp32: the sparse default's few bytes would be
    # outweighed by the fixed overheads the meter does not count.
    proc = compare(
        tmp_path,
        "--methods",
        "ddp,diloco:sync_every=4,compression=none",
        "--np",
        "6",
        "--nodes",
        "3",
        "--link",
        "1gbit",
        "--batch-size",
        "8",
        "--",
        "--train.max_steps",
        "24",
        hidden="512,512",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {row["method"]: row for row in csv.DictReader(open(tmp_path / "results.csv"))}
    for row in rows.values():  # the links carried what the meter says left a node, nothing of what stayed inside
        assert abs(float(row["measured_vs_meter"])) <= 0.05, row
        # Horovod's coordination with every rank idle, probed for the run's process sets
        assert float(row["idle_coordination_bytes_per_s"]) > 0, row
    log = (tmp_path / "runs" / "np6-diloco-sync_every4-compressionnone.log").read_text()
    assert "3 groups of 2 rank(s)" in log
    # the idle probe ran in the run's own launch, after the trainer's summary (no launch of its own)
    assert log.index("metrics:") < log.index("IDLE") < log.index("DONE")
    ddp = json.loads((tmp_path / "runs" / "np6-ddp" / "summary.json").read_text())
    # A ring over 3 nodes of 2 leaves each node once: ranks 1, 3 and 5 send to the next node, 0, 2
    # and 4 to their neighbour inside it, so half of all ring bytes cross.
    assert ddp["nodes"] == 3
    assert ddp["train_between_nodes_bytes_all_ranks"] == pytest.approx(ddp["train_wire_bytes_all_ranks"] / 2)
    diloco = json.loads((tmp_path / "runs" / "np6-diloco-sync_every4-compressionnone" / "summary.json").read_text())
    assert diloco["train_between_nodes_bytes_all_ranks"] < ddp["train_between_nodes_bytes_all_ranks"] / 4
    # the process sets Horovod coordinates: the world, one group per node, the columns across them
    assert ddp["process_sets"] == [list(range(6))]
    assert sorted(map(tuple, diloco["process_sets"])) == [
        (0, 1),
        (0, 1, 2, 3, 4, 5),
        (0, 2, 4),
        (1, 3, 5),
        (2, 3),
        (4, 5),
    ]
    table = (tmp_path / "results.md").read_text()
    assert "Traffic between the 3 emulated nodes" in table and "Time to quality" in table
    assert (tmp_path / "accuracy_vs_time.png").stat().st_size > 0
    assert namespaces() == before


@only_from_the_1_rank_suite
def test_nodes_need_a_link_and_rank_counts_that_fill_them(tmp_path):
    proc = compare(tmp_path, "--methods", "ddp", "--nodes", "2")
    assert proc.returncode != 0 and "--nodes needs --link" in proc.stderr
    proc = compare(tmp_path, "--methods", "ddp", "--np", "3", "--nodes", "2", "--link", "1gbit")
    assert proc.returncode != 0 and "cannot be spread evenly over 2 nodes" in proc.stderr
