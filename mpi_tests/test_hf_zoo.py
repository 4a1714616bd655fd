"""benchmarks.hf_zoo: every wrapper on Hugging Face architectures, a failed launch costing one row."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import RANK, SIZE, clean_env

REPO = Path(__file__).resolve().parent.parent
only_from_the_1_rank_suite = pytest.mark.skipif(SIZE != 1 or RANK != 0, reason="launches its own mpiruns")


def zoo(out: Path, data: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.hf_zoo",
            "--data",
            str(data),
            "--out",
            str(out),
            "--np",
            "2",
            "--steps",
            "4",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=clean_env(),
        timeout=900,
    )


def byte_text(path: Path, with_tokens: bool = True) -> Path:
    with h5py.File(path, "w") as f:
        f.create_dataset(
            "train/tokens" if with_tokens else "train/other",
            data=np.random.default_rng(0).integers(32, 127, 20_000, dtype=np.uint8),
        )
    return path


@only_from_the_1_rank_suite
def test_every_method_gets_a_row_per_architecture_an_encoder_decoder_included(tmp_path):
    proc = zoo(tmp_path, byte_text(tmp_path / "text.h5"), "--archs", "gpt2,t5", "--methods", "ddp,powersgd,ab")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {(r["arch"], r["method"]): r for r in csv.DictReader(open(tmp_path / "results.csv"))}
    assert set(rows) == {(a, m) for a in ("gpt2", "t5") for m in ("ddp", "powersgd", "ab")}
    assert not any(r["error"] for r in rows.values())
    for arch in ("gpt2", "t5"):
        assert float(rows[arch, "ddp"]["bytes_vs_ddp"]) == 1.0
        # 4 steps are all inside PowerSGD's start_iter: plain means, in float32 as ddp's
        assert float(rows[arch, "powersgd"]["bytes_vs_ddp"]) == pytest.approx(1.0, abs=0.01)
    table = (tmp_path / "results.md").read_text()
    assert "| t5 |" in table and "FAILED" not in table


@only_from_the_1_rank_suite
def test_a_failing_launch_costs_its_method_s_row_and_the_exit_status(tmp_path):
    """Launches that cannot finish in time (2 s: not even Horovod starts) are ended with their
    ranks, each costs its own method's row, and the next launch goes on after it."""
    proc = zoo(tmp_path, byte_text(tmp_path / "text.h5"), "--archs", "gpt2", "--methods", "ddp,dad", "--timeout", "2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert [(r["method"], "more than 2 s" in r["error"]) for r in rows] == [("ddp", True), ("dad", True)]
    assert "FAILED" in (tmp_path / "results.md").read_text()
    leftovers = subprocess.run(["pgrep", "-f", f"hf_zoo --worker gpt2 .*{tmp_path}"], capture_output=True, text=True)
    assert leftovers.stdout == "", leftovers.stdout  # no rank outlives its launch


@only_from_the_1_rank_suite
def test_unknown_names_are_refused_before_anything_runs(tmp_path):
    proc = zoo(tmp_path, tmp_path / "absent.h5", "--archs", "gpt2,gpt5")
    assert proc.returncode != 0 and "unknown architectures gpt5" in proc.stderr
    proc = zoo(tmp_path, tmp_path / "absent.h5", "--methods", "powersgd,ddp")
    assert proc.returncode != 0 and "must start with ddp" in proc.stderr
    proc = zoo(tmp_path, tmp_path / "absent.h5")
    assert proc.returncode != 0 and "cannot read" in proc.stderr and "data_prep shakespeare" in proc.stderr
    proc = zoo(tmp_path, byte_text(tmp_path / "images.h5", with_tokens=False))
    assert proc.returncode != 0 and "holds no train/tokens" in proc.stderr
    assert not (tmp_path / "logs").exists()
