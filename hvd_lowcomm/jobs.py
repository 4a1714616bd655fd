"""`python -m hvd_lowcomm.jobs`: Slurm and PBS job scripts from the package's templates
(hvd_lowcomm/templates/, also reachable as jobs/ at the top of the repository).

    python -m hvd_lowcomm.jobs render --scheduler slurm --nodes 4 --tasks-per-node 8 --time 02:00:00 \\
        --partition compute --venv .venv --config run.yaml -o job.sh [--submit]
    python -m hvd_lowcomm.jobs render --scheduler slurm --nodes 16 --gpus-per-node 4 \\
        --venv .venv --command "python my_train.py --lr 0.1" -o job.sh
    python -m hvd_lowcomm.jobs sweep --scheduler pbs --nodes 2,4,8,16 --methods ddp,dad,rank-dad \\
        --config run.yaml --out-dir jobs/sweep

A job runs one of two programs on every rank:
  --config run.yaml     the built-in training program (python -m hvd_lowcomm.train), on a run named
                        after the job that resumes from its checkpoint (--resume auto); the config, with
                        any --method and trailing overrides, is validated before a script is written,
                        so a job never starts with a bad config;
  --command "..."       your own program instead, e.g. "python my_train.py --lr 0.1" (see --command
                        below); it is not validated.
Either way the job passes the scheduler's warning signal (USR1/TERM) on to the ranks and, when
they then exit 0, requeues itself to continue.

With --gpus-per-node G there is one rank per GPU: --tasks-per-node defaults to G, and more ranks
per node than GPUs are refused.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import jinja2

from hvd_lowcomm import config as config_mod
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.metrics import write_csv

# Shipped inside the package (package data), so an installed wheel has them too.
TEMPLATES = Path(__file__).resolve().parent / "templates"
SCHEDULERS = {"slurm": ("slurm.sh.j2", "sbatch"), "pbs": ("pbs.sh.j2", "qsub"), "torque": ("pbs.sh.j2", "qsub")}
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?$")


class JobError(ConfigError):
    """A job option is wrong; the message says which and how to fix it."""


@dataclass
class JobSpec:
    scheduler: str
    config: str = ""  # the built-in training program's config...
    command: str = ""  # ...or the user's own program, run on every rank instead
    nodes: int = 1
    tasks_per_node: int = 1
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    time: str = "01:00:00"
    partition: str = ""
    account: str = ""
    job_name: str = "hvd_lowcomm"
    output: str = ""
    error: str = ""
    modules: list[str] = field(default_factory=list)
    venv: str = ""
    workdir: str = "."
    python: str = "python"
    launcher: str = "srun"
    mpirun_args: list[str] = field(default_factory=list)
    fusion_threshold: int = 64 * 1024 * 1024
    nccl_socket_ifname: str = ""
    env: list[tuple[str, str]] = field(default_factory=list)
    train_args: list[str] = field(default_factory=list)
    template: str = ""
    elastic: int = 0  # DiLoCo groups, each its own job under python -m hvd_lowcomm.elastic (0: one job)
    signal_seconds: int = 120  # Slurm's warning signal this long before the wall time (0: none)
    requeue: bool = True  # requeue a preempted job so it resumes from its checkpoint

    def validate(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise JobError(f"unknown scheduler {self.scheduler!r}: use one of {', '.join(SCHEDULERS)}")
        for name in ("nodes", "tasks_per_node", "cpus_per_task"):
            if getattr(self, name) < 1:
                raise JobError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.gpus_per_node < 0:
            raise JobError(f"--gpus-per-node must be >= 0, got {self.gpus_per_node}")
        if 0 < self.gpus_per_node < self.tasks_per_node:
            raise JobError(
                f"--tasks-per-node {self.tasks_per_node} with --gpus-per-node {self.gpus_per_node}: "
                f"each rank needs a GPU of its own; use --tasks-per-node {self.gpus_per_node} "
                f"(or --gpus-per-node {self.tasks_per_node})"
            )
        walltime_seconds(self.time)
        if self.launcher not in ("srun", "mpirun"):
            raise JobError(f"--launcher must be srun or mpirun, got {self.launcher!r}")
        if self.scheduler != "slurm" and self.launcher == "srun":
            raise JobError(f"srun is Slurm's launcher; a {self.scheduler} job needs --launcher mpirun")
        for name in ("job_name", "partition", "account", "output", "error"):
            if re.search(r"\s", getattr(self, name)):
                raise JobError(
                    f"--{name.replace('_', '-')} {getattr(self, name)!r} must not contain whitespace "
                    f"(it goes into a scheduler directive)"
                )
        for name, _ in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise JobError(f"--env {name!r}: not a valid environment variable name")
        if self.command and self.config:
            raise JobError(
                "--config and --command both given: --config is for the built-in training program; "
                "give your program its config inside the command, e.g. "
                "--command 'python my_train.py --config run.yaml'"
            )
        if self.elastic:
            if self.elastic < 2 or self.nodes % self.elastic:
                raise JobError(
                    f"--elastic {self.elastic}: give 2 or more groups that divide --nodes {self.nodes} "
                    f"(each group is a whole number of nodes)"
                )
            if self.scheduler == "slurm" and self.launcher != "srun":
                raise JobError(
                    "--elastic under Slurm runs each group as an srun step (--launcher srun): one mpirun per "
                    "group has no host list there and would put every group on the first node"
                )
            if self.config and config_mod.load(["--config", self.config, *self.train_args]).method != "diloco":
                raise JobError("--elastic runs DiLoCo groups: the config (or -- --method) must choose diloco")
        if self.command:
            program(self)  # refuses a command that cannot be launched as it is
            return
        if not self.config:
            raise JobError(
                "nothing to run: give --config run.yaml (the built-in training program) or "
                "--command 'python my_train.py ...' (your own)"
            )
        if not Path(self.config).is_file():
            raise JobError(f"config file {self.config} does not exist")
        # The same validation `python -m hvd_lowcomm.train` does at start.
        config_mod.load(["--config", self.config, *self.train_args])


def program(spec: JobSpec) -> list[str]:
    """The command every rank runs, as words: the user's --command, or the training program on a
    run named after the job, which resumes from its checkpoint if it has one."""
    if not spec.command:
        # A batch job's output goes to a file, where a progress bar is only noise (yours win after).
        return [
            spec.python,
            "-m",
            "hvd_lowcomm.train",
            "--config",
            spec.config,
            "--run.name",
            spec.job_name,
            "--resume",
            "auto",
            "--run.progress",
            "false",
            *spec.train_args,
        ]
    try:
        words = shlex.split(spec.command)
    except ValueError as err:
        raise JobError(f"--command {spec.command!r}: {err}; quote it as you would on a shell line") from None
    if not words:
        raise JobError("--command is empty: give the program to run, e.g. --command 'python my_train.py'")
    # The launcher execs one program: shell syntax would reach it as plain arguments.
    operators = [word for word in words if not word.strip(";&|<>")]
    if operators:
        raise JobError(
            f"--command {spec.command!r}: {operators[0]!r} is shell syntax, and the command runs "
            f"under {spec.launcher} without a shell; put it in a script and give --command 'bash my_job.sh'"
        )
    if Path(words[0]).name in ("srun", "mpirun", "mpiexec"):
        raise JobError(
            f"--command {spec.command!r}: the job launches it with {spec.launcher} already; give the "
            f"program alone, e.g. --command {shlex.join(words[1:]) or 'python my_train.py'!r}"
        )
    return [*words, *spec.train_args]


def elastic_launch(spec: JobSpec) -> str:
    """The elastic launcher's command line for an --elastic job: one group per nodes/groups nodes,
    each an srun step (Slurm) or an mpirun on its share of the hosts (the template adds PBS's
    --hostfile); the coordinator on --nccl-socket-ifname's interface when given."""
    per_group = spec.nodes // spec.elastic
    if spec.launcher == "srun":
        step = ["--mpi=pmix", "--cpu-bind=cores", "-N", str(per_group)]
        step += ["--gpus-per-task=1"] if spec.gpus_per_node else []
    else:
        step = ["--map-by", f"ppr:{spec.tasks_per_node}:node", "--bind-to", "core", *spec.mpirun_args]
    words = [spec.python, "-m", "hvd_lowcomm.elastic", "--groups", str(spec.elastic)]
    words += ["--ranks-per-group", str(per_group * spec.tasks_per_node), "--launcher", spec.launcher]
    words += [f"--launcher-args={shlex.join(step)}"]
    words += ["--interface", spec.nccl_socket_ifname] if spec.nccl_socket_ifname else []
    return shlex.join(words)


def walltime_seconds(text: str) -> int:
    """Slurm-style [D-]HH:MM:SS (also MM, HH:MM) -> seconds; errors name the accepted forms."""
    match = _TIME.match(text.strip())
    if not match:
        raise JobError(f"--time {text!r} is not a wall time: use HH:MM:SS, D-HH:MM:SS or minutes")
    days, first, second, third = match.groups()
    if days is None and second is None:  # plain minutes
        seconds = int(first) * 60
    else:
        hours, minutes, secs = int(first), int(second or 0), int(third or 0)
        if minutes >= 60 or secs >= 60:
            raise JobError(f"--time {text!r}: minutes and seconds must be below 60")
        seconds = ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + secs
    if seconds <= 0:
        raise JobError(f"--time {text!r} must be longer than zero")
    return seconds


def hhmmss(seconds: int) -> str:
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def render(spec: JobSpec) -> str:
    """The job script for `spec`, after validating it and its training config."""
    spec.validate()
    template_name, _ = SCHEDULERS[spec.scheduler]
    search = [str(TEMPLATES)]
    if spec.template:
        if not Path(spec.template).is_file():
            raise JobError(f"template {spec.template} does not exist")
        search.insert(0, str(Path(spec.template).resolve().parent))
        template_name = Path(spec.template).name
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(search),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=False,
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    seconds = walltime_seconds(spec.time)
    suffix = "-%j" if spec.scheduler == "slurm" else ""
    values = {
        **asdict(spec),
        "time": hhmmss(seconds),
        "walltime": hhmmss(seconds),
        "output": spec.output or f"{spec.job_name}{suffix}.out",
        "error": spec.error or f"{spec.job_name}{suffix}.err",
        "train_command": shlex.join(program(spec)),  # quoted word by word: runs exactly as given
        "elastic_launch": elastic_launch(spec) if spec.elastic else "",
        "run_dir": ""
        if spec.command
        else str(Path(config_mod.load(["--config", spec.config, *spec.train_args]).run.dir) / spec.job_name),
    }
    try:
        return env.get_template(template_name).render(**values)
    except jinja2.TemplateError as err:
        raise JobError(f"template {template_name}: {err}") from None


def write_script(text: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def submit(spec: JobSpec, path: Path) -> int:
    _, command = SCHEDULERS[spec.scheduler]
    if shutil.which(command) is None:
        print(
            f"jobs: {command} not found on this machine; the script is written: submit it on the cluster's "
            f"login node with `{command} {path}`",
            file=sys.stderr,
        )
        return 1
    return subprocess.run([command, str(path)]).returncode


# ---------------------------------------------------------------------------------------------
# command line


def _add_job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheduler", required=True, help="slurm, pbs (PBS Pro select syntax) or torque")
    parser.add_argument(
        "--config",
        default="",
        help="training config (YAML) for the built-in training program, python -m hvd_lowcomm.train "
        "(or give --command)",
    )
    parser.add_argument(
        "--command",
        default="",
        help="your own program instead, as one string, e.g. --command 'python my_train.py --lr 0.1': "
        "split into words like a shell line and run on every rank under srun/mpirun as it is "
        "(no shell: pipes, && and $VARIABLES need a script, --command 'bash my_job.sh'). The "
        "job passes USR1/TERM on to it and requeues when it then exits 0, so it should "
        "checkpoint on the signal and resume when started again",
    )
    parser.add_argument(
        "--tasks-per-node",
        type=int,
        default=None,
        help="MPI ranks per node (default: --gpus-per-node, one rank per GPU; without GPUs 1)",
    )
    parser.add_argument(
        "--cpus-per-task", type=int, default=1, help="cores per rank; sets OMP_NUM_THREADS (default: 1)"
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=0,
        help="GPUs per node; each rank takes one, the GPU of its local rank (default: 0, CPU only)",
    )
    parser.add_argument("--time", default="01:00:00", help="wall time, HH:MM:SS or D-HH:MM:SS (default: 01:00:00)")
    parser.add_argument("--partition", default="", help="Slurm partition / PBS queue")
    parser.add_argument("--account", default="", help="account to charge")
    parser.add_argument("--job-name", default="hvd_lowcomm", help="job name (default: hvd_lowcomm)")
    parser.add_argument("--output", default="", help="stdout file (default: <job-name>[-%%j].out)")
    parser.add_argument("--error", default="", help="stderr file (default: <job-name>[-%%j].err)")
    parser.add_argument(
        "--module",
        action="append",
        default=[],
        dest="modules",
        help="environment module to load (repeatable), e.g. --module openmpi/4.1",
    )
    parser.add_argument("--venv", default="", help="virtual environment to activate, e.g. .venv")
    parser.add_argument("--workdir", default=str(Path.cwd()), help="directory the job runs in (default: here)")
    parser.add_argument(
        "--python", default="python", help="Python interpreter of the built-in training program (default: python)"
    )
    parser.add_argument(
        "--launcher",
        default=None,
        choices=("srun", "mpirun"),
        help="srun --mpi=pmix (Slurm default) or mpirun (PBS, or Slurm without PMIx)",
    )
    parser.add_argument("--mpirun-args", default="", help="extra mpirun arguments, e.g. '--mca btl ^openib'")
    parser.add_argument(
        "--fusion-threshold",
        type=int,
        default=64 * 1024 * 1024,
        help="HOROVOD_FUSION_THRESHOLD in bytes (default: 64 MiB)",
    )
    parser.add_argument(
        "--nccl-socket-ifname",
        default="",
        help="NCCL_SOCKET_IFNAME, the network interface NCCL uses, e.g. ib0 (other NCCL variables: --env)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment variable for the job (repeatable)",
    )
    parser.add_argument("--template", default="", help="your site's own template (Jinja2; may include _body.sh.j2)")
    parser.add_argument(
        "--signal-seconds",
        type=int,
        default=120,
        help="Slurm: send the warning signal (USR1) this many seconds before the wall time, so "
        "the run checkpoints and stops cleanly; 0: none (default: 120)",
    )
    parser.add_argument(
        "--elastic",
        type=int,
        default=0,
        metavar="GROUPS",
        help="run DiLoCo in GROUPS groups, each its own job under python -m hvd_lowcomm.elastic: "
        "a failed group is relaunched and heals while the others train on (Slurm: --no-kill)",
    )
    parser.add_argument(
        "--no-requeue",
        dest="requeue",
        action="store_false",
        help="do not requeue a preempted job (it still checkpoints; resubmit it yourself)",
    )


def _spec(args: argparse.Namespace, train_args: list[str], **changes: object) -> JobSpec:
    env = []
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep:
            raise JobError(f"--env {item!r}: use NAME=VALUE")
        env.append((name, value))
    launcher = args.launcher or ("srun" if args.scheduler == "slurm" else "mpirun")
    # One rank per GPU unless told otherwise: each rank drives a GPU of its own.
    tasks_per_node = args.tasks_per_node if args.tasks_per_node is not None else max(args.gpus_per_node, 1)
    spec = JobSpec(
        scheduler=args.scheduler,
        config=args.config,
        command=args.command,
        tasks_per_node=tasks_per_node,
        cpus_per_task=args.cpus_per_task,
        gpus_per_node=args.gpus_per_node,
        time=args.time,
        partition=args.partition,
        account=args.account,
        job_name=args.job_name,
        output=args.output,
        error=args.error,
        modules=args.modules,
        venv=args.venv,
        workdir=args.workdir,
        python=args.python,
        launcher=launcher,
        mpirun_args=shlex.split(args.mpirun_args),
        fusion_threshold=args.fusion_threshold,
        nccl_socket_ifname=args.nccl_socket_ifname,
        env=env,
        train_args=train_args,
        template=args.template,
        elastic=args.elastic,
        signal_seconds=args.signal_seconds,
        requeue=args.requeue,
    )
    return replace(spec, **changes)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    # Every level's --help shows the two forms and what follows --.
    text = dict(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Arguments after -- are added to the command the job runs (e.g. -- --train.epochs 5).",
    )
    parser = argparse.ArgumentParser(prog="python -m hvd_lowcomm.jobs", **text)
    commands = parser.add_subparsers(dest="subcommand", required=True)
    one = commands.add_parser("render", help="write one job script", **text)
    _add_job_arguments(one)
    one.add_argument("--nodes", type=int, default=1, help="nodes (default: 1)")
    one.add_argument("-o", "--out", required=True, help="where to write the script")
    one.add_argument("--submit", action="store_true", help="submit it with sbatch/qsub after writing")
    many = commands.add_parser("sweep", help="one script per node count and method, with a manifest", **text)
    _add_job_arguments(many)
    many.add_argument("--nodes", required=True, help="comma-separated node counts, e.g. 2,4,8,16")
    many.add_argument("--methods", default="", help="comma-separated methods (default: the config's)")
    many.add_argument("--out-dir", required=True, help="directory for the scripts and manifest.csv")
    args = parser.parse_args(argv)
    try:
        if args.subcommand == "render":
            path = write_script(render(_spec(args, train_args, nodes=args.nodes)), Path(args.out))
            print(f"wrote {path}")
            return submit(_spec(args, train_args), path) if args.submit else 0
        return sweep(args, train_args)
    except ConfigError as err:
        print(f"jobs: error: {err}", file=sys.stderr)
        return 2


def sweep(args: argparse.Namespace, train_args: list[str]) -> int:
    try:
        node_counts = [int(n) for n in args.nodes.split(",") if n]
    except ValueError:
        raise JobError(f"--nodes {args.nodes!r}: give comma-separated whole numbers, e.g. 2,4,8") from None
    methods = [m for m in args.methods.split(",") if m] or [None]
    if args.command and methods != [None]:
        raise JobError(
            "--methods sets the built-in training program's --method; with --command, put the method "
            "in your command and sweep --nodes only"
        )
    out_dir = Path(args.out_dir)
    rows = []
    for method in methods:
        for nodes in node_counts:
            name = f"{args.job_name}-{method or 'run'}-n{nodes}"
            method_args = ["--method", method] if method else []
            spec = _spec(args, [*method_args, *train_args], nodes=nodes, job_name=name)
            path = write_script(render(spec), out_dir / f"{name}.sh")
            rows.append(
                {
                    "script": path.name,
                    "scheduler": spec.scheduler,
                    "method": method or ("(command)" if spec.command else "(config)"),
                    "nodes": nodes,
                    "tasks_per_node": spec.tasks_per_node,
                    "ranks": nodes * spec.tasks_per_node,
                    "config": spec.config,
                    "command": shlex.join(program(spec)),
                }
            )
    write_csv(out_dir / "manifest.csv", rows)
    print(f"wrote {len(rows)} scripts and manifest.csv to {out_dir}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
