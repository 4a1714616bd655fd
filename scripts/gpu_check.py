"""`make gpu-check`: every method a few steps on a GPU, against the same steps on the CPU.

For a machine with one CUDA GPU, PyTorch, mpi4py and h5py, but maybe no Horovod and no
network. It reports what the machine has, then runs every method at np 2 (and a few at np 1)
on each engine in `--engines`: first torch (torch.distributed: NCCL for CUDA tensors, Gloo for
CPU ones; nothing to build), then Horovod where it is installed, or where its sdist is carried
in vendor/ and `--budget` leaves time to build it (with NCCL) and run. Two ranks sharing the
one GPU exchange through host memory (HVD_LOWCOMM_SHARE_GPUS=1: NCCL refuses two ranks on one
device). Each run's test loss is compared with the same steps on the CPU (the torch engine's),
a resumed GPU run must be the run that stopped, and a table with one row per engine, rank count
and method is printed and written to --out. Without a GPU it says so and exits 1.

    python scripts/gpu_check.py                                  # on the GPU machine (make gpu-check)
    python scripts/gpu_check.py --device testdev --engines torch # a dry run on this CPU (the tests' second device)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOROVOD_SDIST = ROOT / "vendor" / "horovod-0.28.1.tar.gz"
ONE_RANK = ["ddp", "dad", "local"]  # one rank: the device's own code paths, no exchange
ENGINES = ("torch", "horovod")
# Horovod's build from the sdist with NCCL: what the budget must still hold to try it.
HOROVOD_BUILD_SECONDS = 360
# A GPU's kernels round differently from the CPU's: six steps apart, losses agree to this share.
LOSS_TOLERANCE = 0.02


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda, or testdev for a dry run on the CPU (default: cuda)")
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (default: 6)")
    parser.add_argument("--out", default="gpu-check", help="directory for results.md, results.json and runs")
    parser.add_argument(
        "--mpirun",
        default="mpirun --allow-run-as-root --oversubscribe",
        help="launcher and its options (default: %(default)s)",
    )
    parser.add_argument(
        "--engines",
        default="torch,horovod",
        help="engines to check, in order (default: %(default)s; horovod is skipped, and said so, "
        "where it is neither installed nor buildable in the budget's time left)",
    )
    parser.add_argument(
        "--methods",
        default="",
        help="only these methods, comma-separated (default: every registered method)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=540,
        help="seconds the whole check may take; Horovod is built only if the time left holds its "
        "build and the torch engine's runs again (default: %(default)s)",
    )
    sys.path[:0] = [str(ROOT)]  # the checkout, where hvd_lowcomm is not installed
    argv = sys.argv[1:]
    if "run-one" in argv:  # inside a launch: what follows is the training program's command line
        at = argv.index("run-one")
        return run_one(parser.parse_args(argv[:at]).device, argv[at + 1 :])
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(machine_report(), flush=True)
    if args.device == "cuda" and not cuda_available():
        print("gpu-check: no CUDA GPU here (torch.cuda.is_available() is False); run it where one is", file=sys.stderr)
        return 1
    engines = [e for e in args.engines.split(",") if e]
    if not engines or any(e not in ENGINES for e in engines):
        parser.error(f"--engines takes a comma-separated list of {', '.join(ENGINES)}, got {args.engines!r}")
    every = registered_methods()
    chosen = [m for m in args.methods.split(",") if m] or every
    if any(m not in every for m in chosen):
        parser.error(f"--methods takes a comma-separated list of {', '.join(every)}, got {args.methods!r}")
    started = time.time()
    # the runs import hvd_lowcomm from the checkout, and a Horovod built here from out/site
    paths = (str(out / "site"), str(ROOT), os.environ.get("PYTHONPATH", ""))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    data = synthetic_dataset(out / "data.h5")
    rows, cpu_losses, skipped, torch_stage_seconds = [], {}, [], 0.0
    for engine in engines:
        engine_started = time.time()
        if engine == "horovod":
            why_not = ensure_horovod(out, args.budget - (time.time() - started), torch_stage_seconds)
            if why_not:
                skipped.append(f"horovod: {why_not}")
                print(f"gpu-check: horovod skipped: {why_not}", flush=True)
                continue
        for ranks, methods in ((1, ONE_RANK), (2, every)):
            for method in [m for m in methods if m in chosen]:
                rows.append(compare(args, engine, ranks, method, data, out, cpu_losses))
                print(format_row(rows[-1]), flush=True)
        rows.append(resume_check(args, engine, data, out))
        print(format_row(rows[-1]), flush=True)
        if engine == "torch":
            torch_stage_seconds = time.time() - engine_started
    table = "\n".join(
        [
            "| engine | ranks | method | device loss | cpu loss | rel. diff | seconds | ok |",
            "|---|---|---|---|---|---|---|---|",
            *map(format_row, rows),
        ]
    )
    table += "".join(f"\n\nskipped: {why}" for why in skipped)
    (out / "results.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    failed = [f"{r['method']} at np {r['ranks']} on {r['engine']}" for r in rows if not r["ok"]]
    print(
        f"\n{table}\n\ngpu-check: {'FAILED: ' + ', '.join(failed) if failed else 'every run agreed'} "
        f"in {time.time() - started:.0f} s (results in {out})"
    )
    return 1 if failed else 0


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def machine_report() -> str:
    """What this machine has that the check needs, one line each."""
    lines = [f"python {sys.version.split()[0]} ({sys.executable})"]
    try:
        import torch

        lines.append(
            f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs: "
            f"{[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}"
        )
    except ImportError as err:
        lines.append(f"torch: missing ({err})")
    for module in ("mpi4py", "h5py", "horovod"):
        try:
            lines.append(f"{module} {__import__(module).__version__}")
        except ImportError:
            lines.append(f"{module}: missing")
    try:
        from mpi4py import MPI

        lines.append(f"MPI library: {MPI.Get_library_version().splitlines()[0]}")
    except ImportError:
        pass
    for tool in ("mpirun", "mpicc", "nvcc", "cmake", "nvidia-smi"):
        lines.append(f"{tool}: {shutil.which(tool) or 'missing'}")
    return "gpu-check: this machine\n  " + "\n  ".join(lines)


def ensure_horovod(out: Path, seconds_left: float, torch_stage_seconds: float) -> str | None:
    """Horovod importable, or built from the carried sdist (C++17, NCCL from the nvidia-nccl
    package) into out/site, which the runs have on PYTHONPATH, when the time left holds the
    build and a stage as long as the torch engine's; else why not."""
    site = out / "site"
    sys.path[:0] = [str(site)]
    try:
        import horovod.torch as hvd  # noqa: F401

        print(f"gpu-check: horovod present (NCCL: {hvd.nccl_built()})", flush=True)
        return None
    except ImportError:
        pass
    if not HOROVOD_SDIST.is_file():
        return (
            f"not installed, and no {HOROVOD_SDIST.relative_to(ROOT)} to build it from (make vendor on a machine "
            f"with network)"
        )
    if seconds_left < HOROVOD_BUILD_SECONDS + torch_stage_seconds:
        return f"not installed, and {seconds_left:.0f} s left of --budget cannot hold its build and runs"
    start = time.time()
    build = Path(tempfile.mkdtemp(prefix="horovod-build-"))
    with tarfile.open(HOROVOD_SDIST) as archive:
        archive.extractall(build)
    source = build / "horovod-0.28.1"
    for cmake in (source / "CMakeLists.txt", source / "horovod" / "torch" / "CMakeLists.txt"):
        cmake.write_text(cmake.read_text().replace("CMAKE_CXX_STANDARD 14", "CMAKE_CXX_STANDARD 17"))
    env = {
        **os.environ,
        "HOROVOD_WITH_PYTORCH": "1",
        "HOROVOD_WITH_MPI": "1",
        "HOROVOD_WITHOUT_TENSORFLOW": "1",
        "HOROVOD_WITHOUT_MXNET": "1",
        "HOROVOD_CPU_OPERATIONS": "MPI",
        "MAKEFLAGS": f"-j{os.cpu_count()}",
    }
    nccl = nccl_home()
    if nccl and shutil.which("nvcc"):
        env.update(HOROVOD_GPU_OPERATIONS="NCCL", HOROVOD_NCCL_HOME=str(nccl))
    print(f"gpu-check: building horovod (GPU operations: {env.get('HOROVOD_GPU_OPERATIONS', 'none')})", flush=True)
    log = out / "horovod-build.log"
    with log.open("w") as sink:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--no-build-isolation",
                "--no-deps",
                "--target",
                str(site),
                str(source),
            ],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    if done.returncode:
        return f"its build failed; the log: {log}"
    print(f"gpu-check: horovod built in {time.time() - start:.0f} s", flush=True)
    return None


def nccl_home() -> Path | None:
    """The nvidia-nccl wheel's directory (include/nccl.h, lib/libnccl.so), or None."""
    try:
        import nvidia.nccl as package
    except ImportError:
        return None
    home = Path(list(package.__path__)[0])
    library = home / "lib" / "libnccl.so"
    if not library.exists() and (home / "lib" / "libnccl.so.2").exists():
        library.symlink_to("libnccl.so.2")
    return home if (home / "include" / "nccl.h").exists() else None


def synthetic_dataset(path: Path) -> Path:
    """A learnable 10-class image set (a class is the brightest of ten blocks), so that the
    check needs no downloaded data and no scikit-learn."""
    import numpy as np

    from data_prep.writer import write_dataset

    if path.exists():
        return path
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 1200)
    images = rng.integers(0, 120, (1200, 1, 10, 10), dtype=np.uint8)
    images[np.arange(1200), 0, labels, :] += 120
    write_dataset(path, (images[:1000], labels[:1000]), (images[1000:], labels[1000:]), 10, "gpu-check")
    return path


def run_training(args: argparse.Namespace, ranks: int, device: str, argv: list[str]) -> tuple[int, float, str]:
    """One launch of the training program; (exit status, seconds, what went wrong). Its whole
    output is appended to launch.log beside the run."""
    command = [
        *args.mpirun.split(),
        "-np",
        str(ranks),
        "-x",
        "HVD_LOWCOMM_SHARE_GPUS=1",
        "-x",
        "PYTHONPATH",
        sys.executable,
        str(Path(__file__).resolve()),
        "--device",
        device,
        "run-one",
        *argv,
    ]
    start = time.time()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HVD_LOWCOMM_SHARE_GPUS": "1"})
    output = done.stdout + done.stderr
    log = Path(argv[argv.index("--run.dir") + 1]) / argv[argv.index("--run.name") + 1] / "launch.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as sink:
        sink.write(output)
    return done.returncode, time.time() - start, f"{failure_line(output)} (whole output: {log})"


def failure_line(output: str) -> str:
    """The line of a failed launch that says what went wrong: a rank's error or signal, not the
    launcher's banner."""
    lines = [line.strip() for line in output.splitlines() if line.strip().strip("-=")]
    telling = [line for line in lines if any(word in line for word in ("rror", "signal", "Abort", "terminate"))]
    return (telling or lines or ["no output"])[-1]


def registered_methods() -> list[str]:
    """Every method name the registry knows, variants included: a new method is checked here
    without an edit."""
    from hvd_lowcomm.registry import method_names

    return method_names()


def run_one(device: str, argv: list[str]) -> int:
    """Inside the launch: the training program, on the tests' second device where asked; the
    process ends as `python -m hvd_lowcomm.train` ends (exit_process: no teardown of groups
    whose peers may have gone)."""
    if device == "testdev":
        register_second_device()
    from hvd_lowcomm.comm import runtime
    from hvd_lowcomm.train import main as train

    runtime.exit_process(train(argv))


def register_second_device() -> None:
    sys.path.insert(0, str(ROOT / "mpi_tests"))
    from second_device import register

    register()


def train_args(
    args: argparse.Namespace, engine: str, method: str, device: str, data: Path, run_dir: Path, name: str, *extra: str
) -> list[str]:
    return [
        "--method",
        method,
        "--comm.engine",
        engine,
        "--train.device",
        device,
        "--train.max_steps",
        str(args.steps),
        "--train.epochs",
        "1",
        "--data.path",
        str(data),
        "--run.dir",
        str(run_dir),
        "--run.name",
        name,
        "--run.progress",
        "false",
        *extra,
    ]


def compare(
    args: argparse.Namespace,
    engine: str,
    ranks: int,
    method: str,
    data: Path,
    out: Path,
    cpu_losses: dict[tuple[int, str], float],
) -> dict:
    """One method on the device, against its CPU run (made once, on the first engine checked:
    the engines agree on a seeded run to float32 rounding)."""
    losses, seconds, problems = {}, 0.0, []
    for device in (args.device, "cpu"):
        if device == "cpu" and (ranks, method) in cpu_losses:
            losses["cpu"] = cpu_losses[(ranks, method)]
            continue
        run_dir = out / "runs" / f"{engine}-np{ranks}-{device}"
        argv = train_args(args, engine, method, device, data, run_dir, method)
        status, spent, output = run_training(args, ranks, device, argv)
        seconds += spent if device != "cpu" else 0.0
        if status:
            problems.append(f"{device}: exit {status}: {output}")
            continue
        losses[device] = json.loads((run_dir / method / "summary.json").read_text())["final_test_loss"]
    if "cpu" in losses:
        cpu_losses[(ranks, method)] = losses["cpu"]
    got, expected = losses.get(args.device), losses.get("cpu")
    difference = abs(got - expected) / max(abs(expected), 1e-12) if got is not None and expected is not None else None
    return {
        "engine": engine,
        "ranks": ranks,
        "method": method,
        "device_loss": got,
        "cpu_loss": expected,
        "difference": difference,
        "seconds": seconds,
        "ok": difference is not None and difference <= LOSS_TOLERANCE,
        "problems": problems,
    }


def resume_check(args: argparse.Namespace, engine: str, data: Path, out: Path) -> dict:
    """ddp on the device: 2 x steps at once, and steps then a resume to 2 x steps; the models
    must match."""
    import torch

    run_dir = out / "runs" / f"{engine}-resume"
    whole = train_args(args, engine, "ddp", args.device, data, run_dir, "whole", "--train.lr_schedule", "constant")
    parts = train_args(args, engine, "ddp", args.device, data, run_dir, "parts", "--train.lr_schedule", "constant")
    steps = str(2 * args.steps)
    results = [
        run_training(args, 2, args.device, [*whole, "--train.max_steps", steps]),
        run_training(args, 2, args.device, parts),
        run_training(args, 2, args.device, [*parts, "--train.max_steps", steps, "--resume", "auto"]),
    ]
    problems = [f"exit {status}: {output}" for status, _, output in results if status]
    difference = None
    if not problems:
        if args.device == "testdev":  # its tensors load only where the device is registered
            register_second_device()
        a, b = (
            torch.load(
                run_dir / name / "model.pt",
                weights_only=args.device != "testdev",
                map_location="cpu" if args.device != "testdev" else None,
            )
            for name in ("whole", "parts")
        )
        difference = max(float((a[key].cpu() - b[key].cpu()).abs().max()) for key in a)
    return {
        "engine": engine,
        "ranks": 2,
        "method": "ddp resume",
        "device_loss": None,
        "cpu_loss": None,
        "difference": difference,
        "seconds": sum(r[1] for r in results),
        "ok": difference is not None and difference <= 1e-6,
        "problems": problems,
    }


def format_row(row: dict) -> str:
    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.4g}"

    return (
        f"| {row['engine']} | {row['ranks']} | {row['method']} | {number(row['device_loss'])} | "
        f"{number(row['cpu_loss'])} | "
        f"{number(row['difference'])} | {row['seconds']:.1f} | "
        f"{'yes' if row['ok'] else 'NO ' + '; '.join(row['problems'])} |"
    )


if __name__ == "__main__":
    sys.exit(main())
