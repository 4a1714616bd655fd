"""Checkpoints, resume, preemption, failure and non-finite steps, for every method."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import RANK, SIZE, clean_env, mpirun
from hvd_lowcomm import checkpoint
from hvd_lowcomm.train import main as train_main

# Each method with options that make the interruption fall somewhere interesting: inside an AB
# group phase, in SIL with noisy codes (a per-rank generator), rank-dAD's random starts and
# error feedback, PowerSGD's adaptive ranks.
METHODS = {
    "ddp": ["--model.dropout", "0.1"],
    "ddp-fp16": ["--method", "ddp", "--comm.compression", "fp16"],
    # adaptive ranks measured every 3 steps: the stop falls between a measurement and the next
    "powersgd": ["--powersgd.start_iter", "2", "--powersgd.adapt_every", "3"],
    "dad": [],
    # adaptive ranks and error feedback, both each rank's own, after a short exact start
    "rank-dad": ["--rank-dad.start_iter", "3"],
    # the stop falls inside the exact start: the resumed run must end it where the whole run does
    "rank-dad-exact-start": ["--method", "rank-dad", "--rank-dad.start_iter", "14"],
    "edad": [],
    "ab": [
        "--ab.groups",
        "2",
        "--ab.warmup",
        "6",
        "--ab.sync_every",
        "8",
        "--ab.full_rank_steps",
        "3",
        "--ab.rebound_steps",
        "2",
    ],
    "mp": [],
    "sil": ["--sil.noise", "0.1"],
    # the stop at step 11 falls inside a cycle of each fragment, with outer momentum to restore
    "diloco": ["--diloco.sync_every", "4", "--diloco.fragments", "2"],
    "diloco-int8": ["--method", "diloco", "--diloco.sync_every", "5", "--diloco.compression", "int8"],
    "diloco-sparse": [
        "--method",
        "diloco",
        "--diloco.sync_every",
        "5",
        "--diloco.compression",
        "sparse",
        "--diloco.sparse.error_decay",
        "0.9",
        "--diloco.sparse.keep_unsent",
        "false",
    ],
    # the groups' models hold their unsent parts (the default), with an exchange in flight at the stop
    "diloco-sparse-keeps-unsent": [
        "--method",
        "diloco",
        "--diloco.sync_every",
        "5",
        "--diloco.compression",
        "sparse",
        "--diloco.sync_delay",
        "2",
        "--diloco.update_alpha",
        "0.5",
    ],
    # a group per rank: beyond 2 groups (np 4) the owners' error feedback is restored too
    "diloco-sparse-by-owner": [
        "--method",
        "diloco",
        "--diloco.groups",
        str(SIZE),
        "--diloco.sync_every",
        "5",
        "--diloco.compression",
        "sparse",
    ],
    "diloco-lowrank": [
        "--method",
        "diloco",
        "--diloco.sync_every",
        "5",
        "--diloco.compression",
        "lowrank",
        "--diloco.lowrank.rank",
        "2",
    ],
    # exchanges start at steps 5, 10, ... and land 2 steps later: the stop at 11 has one in flight
    "diloco-delay": [
        "--method",
        "diloco",
        "--diloco.sync_every",
        "5",
        "--diloco.sync_delay",
        "2",
        "--diloco.update_alpha",
        "0.5",
        "--diloco.compression",
        "int8",
    ],
    # eager: the stop at 11 has the exchange started at 10 in flight, and this group's part of it
    "diloco-eager": [
        "--method",
        "diloco",
        "--diloco.sync_every",
        "5",
        "--diloco.eager",
        "true",
        "--diloco.compression",
        "sparse",
    ],
}


def _train(shared_tmp, name, *args):
    argv = [
        "--data.path",
        str(shared_tmp / "digits.h5"),
        "--run.dir",
        str(shared_tmp / "runs"),
        "--run.name",
        name,
        "--run.progress",
        "false",
        "--train.lr_schedule",
        "constant",
        "--train.lr",
        "0.003",
        *args,
    ]
    assert train_main(argv) == 0


def _model(shared_tmp, name):
    return torch.load(shared_tmp / "runs" / name / "model.pt")


@pytest.mark.parametrize("label", list(METHODS))
def test_resume_gives_the_same_parameters_as_an_uninterrupted_run(shared_tmp, label, capsys):
    args = METHODS[label] if "--method" in METHODS[label] else ["--method", label, *METHODS[label]]
    if label.startswith(("ab", "diloco")) and SIZE == 1:
        pytest.skip("two groups need two ranks")
    if label.startswith("diloco"):
        # Batch 16: no epoch ends inside the 26 steps at np 2 or 4 (at batch 32 and np 4 the stop
        # at step 11 is an epoch end, whose evaluation's trial sync restores the same state in
        # both runs, so a state the checkpoint misses would not show).
        args = [*args, "--data.batch_size", "16"]
    if label in ("mp", "sil") and SIZE == 1:
        pytest.skip("two partitions need two ranks")
    _train(shared_tmp, "whole", "--train.max_steps", "26", *args)
    _train(shared_tmp, "parts", "--train.max_steps", "11", *args)
    _train(shared_tmp, "parts", "--train.max_steps", "26", "--resume", "auto", *args)
    assert "resumed from" in capsys.readouterr().out or RANK != 0
    if RANK == 0:
        whole, parts = _model(shared_tmp, "whole"), _model(shared_tmp, "parts")
        assert whole.keys() == parts.keys()
        for key in whole:
            torch.testing.assert_close(parts[key], whole[key], rtol=0, atol=1e-6, msg=f"{label}: {key}")
        summaries = [json.loads((shared_tmp / "runs" / n / "summary.json").read_text()) for n in ("whole", "parts")]
        assert summaries[0]["steps"] == summaries[1]["steps"] == 26
        # Traffic totals continue across the restart: the resumed run reports the whole run's bytes.
        assert summaries[1]["train_wire_bytes"] == pytest.approx(summaries[0]["train_wire_bytes"], rel=1e-9)


def test_corrupt_newest_checkpoint_is_reported_and_the_previous_one_used(world, shared_tmp, capsys):
    _train(shared_tmp, "c", "--train.max_steps", "20", "--run.checkpoint_every", "6", "--run.keep_checkpoints", "5")
    root = shared_tmp / "runs" / "c" / "checkpoints"
    if RANK == 0:
        assert [p.name for p in checkpoint.checkpoints(root)] == [
            "step-00000006",
            "step-00000012",
            "step-00000018",
            "step-00000020",
        ]
        victim = root / "step-00000020" / f"rank-{SIZE - 1:05d}.pt"
        victim.write_bytes(victim.read_bytes()[:100])  # cut off, like a full disk
        (root / "step-00000018" / "manifest.json").unlink()  # never finished
    world.comm.Barrier()
    capsys.readouterr()
    _train(shared_tmp, "c", "--train.max_steps", "24", "--resume", "auto")
    out = capsys.readouterr().out
    if RANK == 0:
        assert "step-00000020 is unusable (rank-" in out and "does not match its checksum" in out
        assert "step-00000018 is unusable (no readable manifest.json" in out
        assert "resumed from" in out and "step-00000012 at step 12" in out
        summary = json.loads((shared_tmp / "runs" / "c" / "summary.json").read_text())
        assert summary["steps"] == 24


def test_resume_refuses_a_checkpoint_from_another_method(world, shared_tmp, capsys):
    _train(shared_tmp, "m", "--train.max_steps", "3")
    capsys.readouterr()
    argv = [
        "--data.path",
        str(shared_tmp / "digits.h5"),
        "--run.dir",
        str(shared_tmp / "runs"),
        "--run.name",
        "m",
        "--resume",
        "auto",
        "--method",
        "dad",
    ]
    assert train_main(argv) == 2
    if RANK == 0:
        assert "was written by ddp; resume it with --method ddp" in capsys.readouterr().err


only_from_the_1_rank_suite = pytest.mark.skipif(
    SIZE != 1 or RANK != 0, reason="launches its own mpirun; run from the 1-rank suite"
)


def _launch(tmp_path, name, *args, np_=2):
    command = mpirun(
        np_,
        sys.executable,
        "-m",
        "hvd_lowcomm.train",
        "--data.path",
        str(tmp_path / "digits.h5"),
        "--run.dir",
        str(tmp_path / "runs"),
        "--run.name",
        name,
        "--run.progress",
        "false",
        "--run.log_every",
        "1",
        *args,
    )
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(), start_new_session=True
    )


def _wait_for_steps(tmp_path, name, proc, steps):
    """Block until the run has logged `steps` step records (it is then mid-training)."""
    metrics = tmp_path / "runs" / name / "metrics.jsonl"
    deadline = time.monotonic() + 300  # a hang guard: start-up is slow when the machine is busy
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if metrics.exists() and metrics.read_text().count('"type": "step"') >= steps:
            return
        time.sleep(0.2)
    raise AssertionError("the run never got going")


def _rank_pids(name):
    """Process ids of the training ranks (not mpirun) of run `name`."""
    out = subprocess.run(["pgrep", "-f", f"hvd_lowcomm.train .*--run.name {name} "], capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    return [p for p in pids if "mpirun" not in open(f"/proc/{p}/cmdline").read()]


@pytest.fixture
def digits_copy(tmp_path):
    from data_prep import prepare_bundled

    prepare_bundled("digits", tmp_path / "digits.h5")
    return tmp_path


@only_from_the_1_rank_suite
@pytest.mark.parametrize("target, sig", [("one rank", signal.SIGTERM), ("mpirun", signal.SIGUSR1)])
def test_preemption_signal_checkpoints_exits_zero_and_resume_continues(digits_copy, target, sig):
    tmp_path = digits_copy
    proc = _launch(tmp_path, "p", "--train.epochs", "200", "--run.checkpoint_every", "0")
    _wait_for_steps(tmp_path, "p", proc, 5)
    start = time.monotonic()
    os.kill(_rank_pids("p")[-1] if target == "one rank" else proc.pid, sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert time.monotonic() - start < 30
    assert f"stopped by {sig.name}" in out or "stopped by a signal on another rank" in out
    run = tmp_path / "runs" / "p"
    assert (run / "PREEMPTED").exists()
    saved = checkpoint.checkpoints(run / "checkpoints")[-1]
    stopped_at = json.loads((saved / "manifest.json").read_text())["step"]
    assert stopped_at >= 5
    # A digits step takes milliseconds, so the signal may land epochs after the 5th step (it
    # did, under load: step 48): resume to the end of the epoch after the one it stopped in.
    epochs = stopped_at // 23 + 2
    resumed = _launch(tmp_path, "p", "--train.epochs", str(epochs), "--resume", "auto")
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    assert f"at step {stopped_at} " in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == epochs * 23 and not (run / "PREEMPTED").exists()


@only_from_the_1_rank_suite
def test_killed_rank_ends_the_job_and_the_last_checkpoint_resumes(digits_copy):
    tmp_path = digits_copy
    proc = _launch(tmp_path, "k", "--train.epochs", "200", "--run.checkpoint_every", "4")
    _wait_for_steps(tmp_path, "k", proc, 10)
    start = time.monotonic()
    os.kill(_rank_pids("k")[0], signal.SIGKILL)
    proc.communicate(timeout=90)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    last = checkpoint.checkpoints(tmp_path / "runs" / "k" / "checkpoints")[-1]
    assert checkpoint.problem(last) is None
    resumed = _launch(tmp_path, "k", "--train.epochs", "1", "--resume", "auto")
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    assert f"resumed from {last}" in out


def _nan_dataset(tmp_path):
    from data_prep import write_dataset

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    x[37, 2] = np.nan  # one bad sample
    x_test = rng.normal(size=(40, 6)).astype(np.float32)
    write_dataset(tmp_path / "nan.h5", (x, y), (x_test, (x_test[:, 0] > 0).astype(np.int64)), 2, "nan test")


@only_from_the_1_rank_suite
def test_nan_stops_the_run_naming_step_and_layer_or_is_skipped_and_counted(tmp_path):
    _nan_dataset(tmp_path)
    common = [
        "--data.path",
        str(tmp_path / "nan.h5"),
        "--run.dir",
        str(tmp_path / "runs"),
        "--run.progress",
        "false",
        "--train.epochs",
        "2",
        "--data.batch_size",
        "10",
    ]
    proc = subprocess.run(
        mpirun(2, sys.executable, "-m", "hvd_lowcomm.train", "--run.name", "stop", *common),
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
    )
    assert proc.returncode != 0
    assert "non-finite training at step" in proc.stderr and "gradient of layer '1.weight' is not finite" in proc.stderr
    proc = subprocess.run(
        mpirun(
            2,
            sys.executable,
            "-m",
            "hvd_lowcomm.train",
            "--run.name",
            "skip",
            "--train.skip_nonfinite",
            "true",
            *common,
        ),
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "runs" / "skip" / "summary.json").read_text())
    assert summary["skipped_nonfinite_steps"] == 2  # the bad sample is in one batch per epoch
    model = torch.load(tmp_path / "runs" / "skip" / "model.pt")
    assert all(torch.isfinite(v).all() for v in model.values())
    assert summary["final_test_acc"] > 0.5
