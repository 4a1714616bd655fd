"""Job scripts: directives, GPU jobs, shell validity, a real (dry-)run, the user's own command,
sweeps, bad input."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import RANK, SIZE, clean_env
from hvd_lowcomm.jobs import main as jobs_main

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(SIZE != 1 or RANK != 0, reason="renders and runs scripts; 1-rank suite")


def render(tmp_path, *args: str) -> str:
    out = tmp_path / "job.sh"
    assert jobs_main(["render", "-o", str(out), *args]) == 0  # args may end with -- and the program's own
    return out.read_text()


def _dry_run(script: Path, fake_scheduler_env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=300, env={**clean_env(), **fake_scheduler_env}
    )


@pytest.mark.parametrize("scheduler", ["slurm", "pbs"])
def test_a_rendered_script_really_runs_its_launch_line(tmp_path, run_yaml, scheduler):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("localhost\nlocalhost\n")
    fake = {
        "slurm": {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1"},
        "pbs": {"PBS_JOBID": "42.server", "PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": str(REPO)},
    }[scheduler]
    render(
        tmp_path,
        "--scheduler",
        scheduler,
        "--tasks-per-node",
        "2",
        "--launcher",
        "mpirun",
        "--mpirun-args",
        "--allow-run-as-root --oversubscribe",
        "--venv",
        str(REPO / ".venv"),
        "--workdir",
        str(REPO),
        "--config",
        str(run_yaml),
    )
    proc = _dry_run(tmp_path / "job.sh", fake)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The run is named after the job, so a requeued job resumes it.
    summary = json.loads((tmp_path / "runs" / "hvd_lowcomm" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
