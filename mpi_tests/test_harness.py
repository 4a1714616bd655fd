"""The test harness itself: a test failing on one rank must fail the mpirun, not hang it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import RANK, SIZE, clean_env, mpirun

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(SIZE != 1 or RANK != 0, reason="launches its own mpirun; run from the 1-rank suite")
def test_a_test_failing_on_one_rank_fails_the_whole_run_without_hanging(tmp_path):
    (tmp_path / "test_fails_on_rank_1.py").write_text(
        "import torch\n"
        "from hvd_lowcomm.comm.traffic import meter\n"
        "def test_rank_1_fails(world):\n"
        "    assert world.comm.Get_rank() != 1, 'deliberate failure on rank 1'\n"
        "    meter.allreduce(torch.ones(1), 'rank-1-never-joins')  # rank 0 would wait forever\n"
    )
    start = time.monotonic()
    proc = subprocess.run(
        mpirun(
            2,
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "mpi_tests.conftest",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ),
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=REPO,
        timeout=180,
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "[rank 1] FAILED" in proc.stderr and "deliberate failure on rank 1" in proc.stderr
    assert time.monotonic() - start < 120
