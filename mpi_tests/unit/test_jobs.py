"""Job scripts: directives, GPU jobs, shell validity, a dry run, the user's own command, bad options."""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hvd_lowcomm.elastic.launch import group_command, group_hosts
from hvd_lowcomm.jobs import main as jobs_main

from conftest import clean_env
from test_jobs import REPO, _dry_run, render


def shell_checks(path: Path) -> None:
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (make install installs it)")
    proc = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_slurm_directives_match_the_inputs(tmp_path, run_yaml):
    text = render(
        tmp_path,
        "--scheduler",
        "slurm",
        "--nodes",
        "4",
        "--tasks-per-node",
        "4",
        "--gpus-per-node",
        "4",
        "--cpus-per-task",
        "3",
        "--time",
        "1-02:00:00",
        "--partition",
        "gpu",
        "--account",
        "proj",
        "--job-name",
        "exp1",
        "--module",
        "openmpi/4.1",
        "--venv",
        ".venv",
        "--nccl-socket-ifname",
        "ib0",
        "--config",
        str(run_yaml),
    )
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=3",
        "#SBATCH --time=26:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --job-name=exp1",
        "#SBATCH --output=exp1-%j.out",
        "module load openmpi/4.1",
        "source .venv/bin/activate",
        "export OMP_NUM_THREADS=3",
        "export NCCL_SOCKET_IFNAME=ib0",
        "export HOROVOD_FUSION_THRESHOLD=67108864",
        f"srun --mpi=pmix --cpu-bind=cores --gpus-per-task=1 python -m hvd_lowcomm.train --config {run_yaml} "
        f"--run.name exp1 --resume auto --run.progress false &",
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --requeue",
        '    scontrol requeue "$SLURM_JOB_ID"',
    ):
        assert line in text.splitlines(), line
    shell_checks(tmp_path / "job.sh")


@pytest.mark.parametrize(
    "scheduler, resources",
    [
        ("pbs", "#PBS -l select=4:ncpus=16:mpiprocs=8:ngpus=8"),
        ("torque", "#PBS -l nodes=4:ppn=16:gpus=8"),
    ],
)
def test_pbs_directives_match_the_inputs(tmp_path, run_yaml, scheduler, resources):
    text = render(
        tmp_path,
        "--scheduler",
        scheduler,
        "--nodes",
        "4",
        "--tasks-per-node",
        "8",
        "--cpus-per-task",
        "2",
        "--gpus-per-node",
        "8",
        "--time",
        "90",
        "--partition",
        "workq",
        "--config",
        str(run_yaml),
    )
    for line in (resources, "#PBS -l walltime=01:30:00", "#PBS -q workq"):
        assert line in text.splitlines(), line
    shell_checks(tmp_path / "job.sh")


def test_a_gpu_job_runs_one_task_per_gpu(tmp_path, run_yaml):
    text = render(tmp_path, "--scheduler", "slurm", "--nodes", "16", "--gpus-per-node", "4", "--config", str(run_yaml))
    for line in (
        "#SBATCH --nodes=16",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        f"srun --mpi=pmix --cpu-bind=cores --gpus-per-task=1 python -m hvd_lowcomm.train --config {run_yaml} "
        f"--run.name hvd_lowcomm --resume auto --run.progress false &",
    ):
        assert line in text.splitlines(), line
    # The NCCL variables are explained, and only those the options set are exported.
    assert "#   NCCL_IB_HCA " in text and "#   NCCL_DEBUG=WARN " in text and "export NCCL" not in text
    shell_checks(tmp_path / "job.sh")
    pbs = render(tmp_path, "--scheduler", "pbs", "--nodes", "16", "--gpus-per-node", "4", "--config", str(run_yaml))
    assert "#PBS -l select=16:ncpus=4:mpiprocs=4:ngpus=4" in pbs.splitlines()
    assert "(CUDA_VISIBLE_DEVICES under mpirun) takes the one of its local rank" in pbs
    shell_checks(tmp_path / "job.sh")
    cpu = render(tmp_path, "--scheduler", "slurm", "--nodes", "16", "--config", str(run_yaml))
    assert "#SBATCH --ntasks-per-node=1" in cpu.splitlines() and "gpus" not in cpu


def test_more_tasks_per_node_than_gpus_is_refused_and_fewer_are_allowed(tmp_path, run_yaml, capsys):
    args = [
        "render",
        "--scheduler",
        "slurm",
        "--gpus-per-node",
        "4",
        "--config",
        str(run_yaml),
        "-o",
        str(tmp_path / "x.sh"),
    ]
    assert jobs_main([*args, "--tasks-per-node", "8"]) == 2
    assert (
        "--tasks-per-node 8 with --gpus-per-node 4: each rank needs a GPU of its own; use --tasks-per-node 4 "
        "(or --gpus-per-node 8)" in capsys.readouterr().err
    )
    assert not (tmp_path / "x.sh").exists()
    assert jobs_main([*args, "--tasks-per-node", "2"]) == 0
    assert "#SBATCH --ntasks-per-node=2" in (tmp_path / "x.sh").read_text().splitlines()


def test_a_command_job_launches_the_users_program_with_the_same_preemption_handling(tmp_path):
    text = render(
        tmp_path,
        "--scheduler",
        "slurm",
        "--command",
        "python my_train.py --lr 0.1 --name 'two words'",
        "--",
        "--epochs",
        "3",
    )
    lines = text.splitlines()
    for line in (
        "srun --mpi=pmix --cpu-bind=cores python my_train.py --lr 0.1 --name 'two words' --epochs 3 &",
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --requeue",
        """trap 'signalled=1; kill -USR1 "$launcher" 2>/dev/null' USR1 TERM""",
        '    scontrol requeue "$SLURM_JOB_ID"',
    ):
        assert line in lines, line
    assert "hvd_lowcomm.train" not in text
    shell_checks(tmp_path / "job.sh")


USER_PROGRAM = """\
import os, signal, sys, time
out = sys.argv[1]
rank = os.environ["OMPI_COMM_WORLD_RANK"]
def checkpoint_and_stop(signum, frame):
    open(os.path.join(out, "checkpoint-" + rank), "w").close()
    sys.exit(0)
signal.signal(signal.SIGUSR1, checkpoint_and_stop)
open(os.path.join(out, "ready-" + rank), "w").close()
while True:
    time.sleep(0.1)
"""


def test_a_command_job_passes_the_signal_to_the_users_program_and_requeues(tmp_path):
    (tmp_path / "my_train.py").write_text(USER_PROGRAM)
    bin_dir = tmp_path / "bin"  # a stand-in scontrol records the requeue
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" > {tmp_path / "scontrol.args"}\n')
    (bin_dir / "scontrol").chmod(0o755)
    render(
        tmp_path,
        "--scheduler",
        "slurm",
        "--tasks-per-node",
        "2",
        "--launcher",
        "mpirun",
        "--mpirun-args",
        "--allow-run-as-root --oversubscribe",
        "--venv",
        str(REPO / ".venv"),
        "--workdir",
        str(tmp_path),
        "--command",
        f"python my_train.py {tmp_path}",
    )
    env = {
        **clean_env(),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "42",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "1",
    }
    job = subprocess.Popen(
        ["bash", str(tmp_path / "job.sh")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120  # a hang guard: mpirun starts slowly on a busy machine
    try:
        while len(list(tmp_path.glob("ready-*"))) < 2:
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "the program's ranks never started"
            time.sleep(0.2)
        job.send_signal(signal.SIGUSR1)  # what Slurm's --signal=B:USR1 sends the batch shell
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:  # a stuck job must not outlive the test
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, out + err
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-0", "checkpoint-1"]
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "42"]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--command", "python my_train.py && echo done"],
            "'&&' is shell syntax, and the command runs under srun without a shell; put it in a script",
        ),
        (
            ["--command", "srun python my_train.py"],
            "the job launches it with srun already; give the program alone, e.g. --command 'python my_train.py'",
        ),
        (["--command", "python 'my_train.py"], "No closing quotation"),
        (["--command", "python my_train.py", "--config", "run.yaml"], "--config and --command both given"),
        ([], "nothing to run: give --config run.yaml (the built-in training program) or --command"),
    ],
)
def test_a_program_that_cannot_run_as_given_is_refused_with_the_fix(tmp_path, capsys, args, message):
    assert jobs_main(["render", "--scheduler", "slurm", *args, "-o", str(tmp_path / "x.sh")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.sh").exists()


def test_outside_a_scheduler_the_script_stops_with_a_message(tmp_path, run_yaml):
    render(tmp_path, "--scheduler", "slurm", "--launcher", "mpirun", "--config", str(run_yaml))
    proc = _dry_run(tmp_path / "job.sh", {})
    assert proc.returncode != 0 and "not inside a Slurm job" in proc.stderr


def test_sweep_writes_one_script_per_node_count_and_method_with_a_manifest(tmp_path, run_yaml):
    assert (
        jobs_main(
            [
                "sweep",
                "--scheduler",
                "slurm",
                "--nodes",
                "2,4,8",
                "--methods",
                "ddp,dad",
                "--tasks-per-node",
                "4",
                "--config",
                str(run_yaml),
                "--out-dir",
                str(tmp_path / "sweep"),
                "--",
                "--train.epochs",
                "3",
            ]
        )
        == 0
    )
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "manifest.csv")))
    assert [(r["method"], r["nodes"], r["ranks"]) for r in rows] == [
        ("ddp", "2", "8"),
        ("ddp", "4", "16"),
        ("ddp", "8", "32"),
        ("dad", "2", "8"),
        ("dad", "4", "16"),
        ("dad", "8", "32"),
    ]
    for row in rows:
        text = (tmp_path / "sweep" / row["script"]).read_text()
        assert f"#SBATCH --nodes={row['nodes']}" in text
        assert (
            f"--config {run_yaml} --run.name {row['script'][:-3]} "
            f"--resume auto --run.progress false --method {row['method']} "
            f"--train.epochs 3" in text
        )
        assert subprocess.run(["bash", "-n", str(tmp_path / "sweep" / row["script"])]).returncode == 0


def test_a_sites_own_template_is_used(tmp_path, run_yaml):
    template = tmp_path / "site.sh.j2"
    template.write_text("#!/bin/bash\n#SITE nodes={{ nodes }}\n{% include '_body.sh.j2' %}\n{{ train_command }}\n")
    text = render(
        tmp_path, "--scheduler", "slurm", "--nodes", "3", "--template", str(template), "--config", str(run_yaml)
    )
    assert "#SITE nodes=3" in text and f"python -m hvd_lowcomm.train --config {run_yaml}" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--scheduler", "slurm", "--nodes", "0"], "--nodes must be at least 1, got 0"),
        (["--scheduler", "slurm", "--time", "25:99"], "minutes and seconds must be below 60"),
        (["--scheduler", "slurm", "--time", "soon"], "--time 'soon' is not a wall time"),
        (["--scheduler", "lsf"], "unknown scheduler 'lsf': use one of slurm, pbs, torque"),
        (["--scheduler", "pbs", "--launcher", "srun"], "a pbs job needs --launcher mpirun"),
    ],
)
def test_bad_job_options_get_clear_errors(tmp_path, run_yaml, capsys, args, message):
    assert jobs_main(["render", *args, "--config", str(run_yaml), "-o", str(tmp_path / "x.sh")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.sh").exists()


def test_missing_or_invalid_training_config_is_rejected_before_writing(tmp_path, capsys):
    assert (
        jobs_main(
            ["render", "--scheduler", "slurm", "--config", str(tmp_path / "nope.yaml"), "-o", str(tmp_path / "x.sh")]
        )
        == 2
    )
    assert "nope.yaml does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {epochs: 0}\n")
    assert jobs_main(["render", "--scheduler", "slurm", "--config", str(bad), "-o", str(tmp_path / "x.sh")]) == 2
    assert "train.epochs must be a positive integer, got 0" in capsys.readouterr().err
    assert not (tmp_path / "x.sh").exists()


def test_submit_without_the_scheduler_says_how_to_submit(tmp_path, run_yaml, capsys, monkeypatch):
    monkeypatch.setenv(
        "PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "sbatch").exists())
    )
    code = jobs_main(
        ["render", "--scheduler", "slurm", "--config", str(run_yaml), "-o", str(tmp_path / "j.sh"), "--submit"]
    )
    assert code == 1 and "sbatch not found" in capsys.readouterr().err
    assert (tmp_path / "j.sh").exists()  # the script stays, to be submitted elsewhere


@pytest.mark.parametrize("scheduler", ["slurm", "pbs"])
def test_an_elastic_job_runs_each_diloco_group_as_its_own_job(tmp_path, run_yaml, scheduler):
    args = ["--scheduler", scheduler, "--nodes", "4", "--tasks-per-node", "4", "--elastic", "2"]
    text = render(tmp_path, *args, "--config", str(run_yaml), "--", "--method", "diloco")
    launch = "python -m hvd_lowcomm.elastic --groups 2 --ranks-per-group 8 --launcher " + (
        "srun '--launcher-args=--mpi=pmix --cpu-bind=cores -N 2'" if scheduler == "slurm" else "mpirun"
    )
    assert launch in text and "-- python -m hvd_lowcomm.train" in text
    # a preemption: every group checkpoints after the same round; the requeued job resumes them all
    assert "--resume auto" in text and 'trap \'signalled=1; kill -USR1 "$launcher"' in text
    if scheduler == "slurm":
        assert "#SBATCH --no-kill" in text and "#SBATCH --signal=B:USR1@120" in text and "--requeue" in text
    else:
        assert '--hostfile "${PBS_NODEFILE:?not inside a PBS job}"' in text
    shell_checks(tmp_path / "job.sh")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "4", "--elastic", "3"], "--elastic 3: give 2 or more groups that divide --nodes 4"),
        (["--nodes", "4", "--elastic", "2", "--", "--method", "ddp"], "the config (or -- --method) must choose diloco"),
        (
            ["--nodes", "4", "--elastic", "2", "--launcher", "mpirun"],
            "--elastic under Slurm runs each group as an srun",
        ),
    ],
)
def test_an_elastic_job_that_cannot_run_is_refused(tmp_path, run_yaml, capsys, args, message):
    split = args.index("--") if "--" in args else len(args)
    argv = ["render", "--scheduler", "slurm", *args[:split], "--config", str(run_yaml), "-o", str(tmp_path / "x.sh")]
    assert jobs_main([*argv, *args[split:]]) == 2
    assert message in capsys.readouterr().err


def test_the_elastic_launcher_gives_each_group_its_share_of_the_hosts(tmp_path):
    hostfile = tmp_path / "nodes"
    hostfile.write_text("".join(f"n{i}\n" * 4 for i in range(4)))  # PBS_NODEFILE: a line per rank
    assert group_hosts(str(hostfile), 2, 8, 1) == ["--host", "n2:4,n3:4"]
    with pytest.raises(SystemExit, match="do not split into 3 groups"):
        group_hosts(str(hostfile), 3, 4, 0)


def test_groups_sharing_this_machine_are_not_bound_onto_the_same_cores(tmp_path):
    """mpirun binds each job's ranks from the first core on: groups that share the machine run
    unbound (a user's --bind-to stands); groups on hosts of their own keep mpirun's binding."""
    hostfile = tmp_path / "nodes"
    hostfile.write_text("n0\nn1\n")
    args = argparse.Namespace(launcher="mpirun", launcher_args="", ranks_per_group=1, groups=2, hostfile="")
    assert group_command(args, ["train"], 0) == ["mpirun", "-np", "1", "--bind-to", "none", "train"]
    bound = argparse.Namespace(**{**vars(args), "launcher_args": "--bind-to core"})
    assert group_command(bound, ["train"], 0) == ["mpirun", "-np", "1", "--bind-to", "core", "train"]
    own_hosts = argparse.Namespace(**{**vars(args), "hostfile": str(hostfile)})
    assert group_command(own_hosts, ["train"], 1) == ["mpirun", "-np", "1", "--host", "n1:1", "train"]
