"""Job scripts: directives, shell validity, a real (dry-)run, sweeps, bad input."""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import RANK, SIZE, clean_env
from hvd_lowcomm.jobs import main as jobs_main

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(SIZE != 1 or RANK != 0, reason="renders and runs scripts; 1-rank suite")


@pytest.fixture
def run_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"train: {{epochs: 1, max_steps: 3}}\ndata: {{path: {tmp_path / 'digits.h5'}}}\n"
                    f"run: {{dir: {tmp_path / 'runs'}, name: job, progress: false}}\n")
    return path


def render(tmp_path, *args: str) -> str:
    out = tmp_path / "job.sh"
    assert jobs_main(["render", *args, "-o", str(out)]) == 0
    return out.read_text()


def shell_checks(path: Path) -> None:
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (make install installs it)")
    proc = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_slurm_directives_match_the_inputs(tmp_path, run_yaml):
    text = render(tmp_path, "--scheduler", "slurm", "--nodes", "4", "--tasks-per-node", "8", "--gpus-per-node", "4",
                  "--cpus-per-task", "3", "--time", "1-02:00:00", "--partition", "gpu", "--account", "proj",
                  "--job-name", "exp1", "--module", "openmpi/4.1", "--venv", ".venv", "--nccl-socket-ifname", "ib0",
                  "--config", str(run_yaml))
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --cpus-per-task=3", "#SBATCH --time=26:00:00", "#SBATCH --partition=gpu",
                 "#SBATCH --account=proj", "#SBATCH --job-name=exp1", "#SBATCH --output=exp1-%j.out",
                 "module load openmpi/4.1", "source .venv/bin/activate", "export OMP_NUM_THREADS=3",
                 "export NCCL_SOCKET_IFNAME=ib0", "export HOROVOD_FUSION_THRESHOLD=67108864",
                 f"srun --mpi=pmix --cpu-bind=cores python -m hvd_lowcomm.train --config {run_yaml} "
                 f"--run.name exp1 --resume auto &", "#SBATCH --signal=B:USR1@120", "#SBATCH --requeue",
                 '    scontrol requeue "$SLURM_JOB_ID"'):
        assert line in text.splitlines(), line
    shell_checks(tmp_path / "job.sh")


@pytest.mark.parametrize("scheduler, resources", [
    ("pbs", "#PBS -l select=4:ncpus=16:mpiprocs=8:ngpus=2"),
    ("torque", "#PBS -l nodes=4:ppn=16:gpus=2"),
])
def test_pbs_directives_match_the_inputs(tmp_path, run_yaml, scheduler, resources):
    text = render(tmp_path, "--scheduler", scheduler, "--nodes", "4", "--tasks-per-node", "8", "--cpus-per-task", "2",
                  "--gpus-per-node", "2", "--time", "90", "--partition", "workq", "--config", str(run_yaml))
    for line in (resources, "#PBS -l walltime=01:30:00", "#PBS -q workq"):
        assert line in text.splitlines(), line
    shell_checks(tmp_path / "job.sh")


def _dry_run(script: Path, fake_scheduler_env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=300,
                          env={**clean_env(), **fake_scheduler_env})


@pytest.mark.parametrize("scheduler", ["slurm", "pbs"])
def test_a_rendered_script_really_runs_its_launch_line(tmp_path, run_yaml, scheduler):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("localhost\nlocalhost\n")
    fake = {"slurm": {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1"},
            "pbs": {"PBS_JOBID": "42.server", "PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": str(REPO)}}[scheduler]
    render(tmp_path, "--scheduler", scheduler, "--tasks-per-node", "2", "--launcher", "mpirun",
           "--mpirun-args", "--allow-run-as-root --oversubscribe", "--venv", str(REPO / ".venv"),
           "--workdir", str(REPO), "--config", str(run_yaml))
    proc = _dry_run(tmp_path / "job.sh", fake)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The run is named after the job, so a requeued job resumes it.
    summary = json.loads((tmp_path / "runs" / "hvd_lowcomm" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3


def test_outside_a_scheduler_the_script_stops_with_a_message(tmp_path, run_yaml):
    render(tmp_path, "--scheduler", "slurm", "--launcher", "mpirun", "--config", str(run_yaml))
    proc = _dry_run(tmp_path / "job.sh", {})
    assert proc.returncode != 0 and "not inside a Slurm job" in proc.stderr


def test_sweep_writes_one_script_per_node_count_and_method_with_a_manifest(tmp_path, run_yaml):
    assert jobs_main(["sweep", "--scheduler", "slurm", "--nodes", "2,4,8", "--methods", "ddp,dad",
                      "--tasks-per-node", "4", "--config", str(run_yaml), "--out-dir", str(tmp_path / "sweep"),
                      "--", "--train.epochs", "3"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "manifest.csv")))
    assert [(r["method"], r["nodes"], r["ranks"]) for r in rows] == [
        ("ddp", "2", "8"), ("ddp", "4", "16"), ("ddp", "8", "32"), ("dad", "2", "8"), ("dad", "4", "16"), ("dad", "8", "32")]
    for row in rows:
        text = (tmp_path / "sweep" / row["script"]).read_text()
        assert f"#SBATCH --nodes={row['nodes']}" in text
        assert f"--config {run_yaml} --run.name {row['script'][:-3]} --resume auto --method {row['method']} " \
               f"--train.epochs 3" in text
        assert subprocess.run(["bash", "-n", str(tmp_path / "sweep" / row["script"])]).returncode == 0


def test_a_sites_own_template_is_used(tmp_path, run_yaml):
    template = tmp_path / "site.sh.j2"
    template.write_text("#!/bin/bash\n#SITE nodes={{ nodes }}\n{% include '_body.sh.j2' %}\n{{ train_command }}\n")
    text = render(tmp_path, "--scheduler", "slurm", "--nodes", "3", "--template", str(template), "--config", str(run_yaml))
    assert "#SITE nodes=3" in text and f"python -m hvd_lowcomm.train --config {run_yaml}" in text


@pytest.mark.parametrize("args, message", [
    (["--scheduler", "slurm", "--nodes", "0"], "--nodes must be at least 1, got 0"),
    (["--scheduler", "slurm", "--time", "25:99"], "minutes and seconds must be below 60"),
    (["--scheduler", "slurm", "--time", "soon"], "--time 'soon' is not a wall time"),
    (["--scheduler", "lsf"], "unknown scheduler 'lsf': use one of slurm, pbs, torque"),
    (["--scheduler", "pbs", "--launcher", "srun"], "a pbs job needs --launcher mpirun"),
])
def test_bad_job_options_get_clear_errors(tmp_path, run_yaml, capsys, args, message):
    assert jobs_main(["render", *args, "--config", str(run_yaml), "-o", str(tmp_path / "x.sh")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.sh").exists()


def test_missing_or_invalid_training_config_is_rejected_before_writing(tmp_path, capsys):
    assert jobs_main(["render", "--scheduler", "slurm", "--config", str(tmp_path / "nope.yaml"), "-o", str(tmp_path / "x.sh")]) == 2
    assert "nope.yaml does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {epochs: 0}\n")
    assert jobs_main(["render", "--scheduler", "slurm", "--config", str(bad), "-o", str(tmp_path / "x.sh")]) == 2
    assert "train.epochs must be a positive integer, got 0" in capsys.readouterr().err
    assert not (tmp_path / "x.sh").exists()


def test_submit_without_the_scheduler_says_how_to_submit(tmp_path, run_yaml, capsys, monkeypatch):
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "sbatch").exists()))
    code = jobs_main(["render", "--scheduler", "slurm", "--config", str(run_yaml), "-o", str(tmp_path / "j.sh"), "--submit"])
    assert code == 1 and "sbatch not found" in capsys.readouterr().err
    assert (tmp_path / "j.sh").exists()  # the script stays, to be submitted elsewhere
