"""pytest under mpirun: every rank runs the same tests in the same order.

- Horovod/MPI start once per process, after collection, on every rank: a rank that skips every
  test of a run (a file of rank-0-only tests) must still join the others' MPI start.
- A test that fails on any rank aborts the whole MPI job (MPI_Abort), so the other ranks never
  wait forever in a collective the failing rank will not join, and mpirun exits non-zero.
- Only rank 0 shows pytest's normal report; other ranks print their failures themselves.
- Every rank gets its own pytest temporary directory; `shared_tmp` is one directory that all
  ranks see (rank 0 makes it and broadcasts its path).
- Tests under `mpi_tests/unit/` are the unit tier: pure functions under plain `pytest`, no
  mpirun (`make test-unit`). Run alone, importing MPI or Horovod fails them, and MPI is not
  started; the MPI suites (`make test-N`) leave them out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # imported where used: torch loads after the launcher is known
    import torch


def _launcher_rank_and_size() -> tuple[int, int]:
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if rank_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


RANK, SIZE = _launcher_rank_and_size()


UNIT_DIR = Path(__file__).parent / "unit"
MPI_MODULES = ("mpi4py", "horovod")


class RefuseMPI:
    """A meta-path finder that refuses MPI's and Horovod's modules: the unit tier must not need them."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".")[0] in MPI_MODULES:
            raise ImportError(f"{name}: a unit test must not need MPI or Horovod (move it to an MPI suite)")


def is_unit(item: pytest.Item) -> bool:
    return UNIT_DIR in Path(item.path).parents


@pytest.hookimpl(trylast=True)  # after the terminal reporter has registered itself
def pytest_configure(config: pytest.Config) -> None:
    paths = [Path(arg.split("::")[0]).resolve() for arg in config.args]
    if paths and all(path == UNIT_DIR or UNIT_DIR in path.parents for path in paths):
        sys.meta_path.insert(0, RefuseMPI())  # `make test-unit`: only the unit tier runs
    if config.option.basetemp is None:
        config.option.basetemp = os.path.join(tempfile.gettempdir(), f"hvd_lowcomm-pytest-{os.getppid()}-rank{RANK}")
    if RANK != 0:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed and SIZE > 1:
        print(
            f"\n[rank {RANK}] FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n"
            f"[rank {RANK}] aborting the MPI job so no rank hangs",
            file=sys.stderr,
            flush=True,
        )
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)


def pytest_collection_finish(session: pytest.Session) -> None:
    if SIZE > 1 and not all(is_unit(item) for item in session.items):
        from hvd_lowcomm.comm import failures, runtime

        capture = session.config.pluginmanager.get_plugin("capturemanager")

        def report_past_capture(text: str) -> None:
            """A rank that aborts inside a test (abort_on_error) never reaches pytest's report."""
            with capture.global_and_fixture_disabled():
                print(f"\n{text}", file=sys.stderr, end="", flush=True)

        if capture is not None:
            failures.report_failure = report_past_capture
        runtime.init(seed=0)


@pytest.fixture(scope="session", autouse=True)
def world(request: pytest.FixtureRequest):
    """MPI and Horovod, started once before the first test; not when only the unit tier runs,
    whose tests must not need them."""
    if all(is_unit(item) for item in request.session.items):
        return None
    from hvd_lowcomm.comm import runtime

    return runtime.init(seed=0)


@pytest.fixture(autouse=True)
def fresh_meter():
    from hvd_lowcomm.comm.traffic import meter

    meter.reset()
    yield meter


@pytest.fixture
def shared_tmp(world):
    """A directory every rank sees, removed after the test (all ranks done with it)."""
    path = tempfile.mkdtemp(prefix="hvd_lowcomm-shared-") if world.comm.Get_rank() == 0 else None
    path = Path(world.comm.bcast(path, root=0))
    yield path
    world.comm.Barrier()
    if world.comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def needs_ranks(minimum: int):
    """Skip a test that needs at least `minimum` ranks (decided the same way on every rank)."""
    return pytest.mark.skipif(SIZE < minimum, reason=f"needs mpirun -np >= {minimum}")


def skip_where_its_engine_is_not_running(method: str, argv: tuple[str, ...] | list[str] = ()) -> None:
    """Skip `method` (with options `argv`) in a suite whose job runs on another engine than the
    one it needs (fsdp: torch; make test-2-torch runs it), decided alike on every rank."""
    from hvd_lowcomm import config
    from hvd_lowcomm.comm import runtime
    from hvd_lowcomm.registry import specs

    cfg = config.load(list(argv) if "--method" in argv else ["--method", method, *argv])
    wanted = specs()[cfg.method].method.engine_needed(cfg) if cfg.method in specs() else None
    if wanted and runtime.initialized() and runtime.engine().name != wanted:
        pytest.skip(
            f"{method}{' with these options' if argv else ''} runs on the {wanted} engine, this job on "
            f"{runtime.engine().name} "
            f"(make test-2-torch runs it)"
        )


def clean_env() -> dict[str, str]:
    """Environment for a child process that must not think it is one of our MPI ranks, nor take
    this rank's network interface (set by the engine's rendezvous) for its own."""
    from hvd_lowcomm.comm.rendezvous import child_environment

    return {
        k: v
        for k, v in child_environment().items()
        if not k.startswith(("OMPI_", "PMIX_", "PMI_", "HOROVOD_", "OPAL_", "PRTE_"))
    }


def mpirun(np_: int, *command: str) -> list[str]:
    """An mpirun command line that works as root and with more ranks than cores."""
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np_), *command]


# Runs hvd_lowcomm.train once per argv of a JSON list, in order, in one MPI job: a job's start
# (torch, MPI, the engine's rendezvous) costs more than a run of a few steps.
# It ends as `python -m hvd_lowcomm.train` does (exit_process: no interpreter teardown, where a
# Gloo worker thread may abort the process).
TRAINER_RUNS = textwrap.dedent("""
    import json, sys
    from hvd_lowcomm.comm.runtime import exit_process
    from hvd_lowcomm.train import main
    for argv in json.loads(open(sys.argv[1]).read()):
        if main(argv) != 0:
            print(f"hvd_lowcomm.train failed: {argv}", file=sys.stderr)
            exit_process(1)
    exit_process(0)
""")


def trainer_runs(
    folder: Path, ranks: int, argvs: list[list[str]], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python -m hvd_lowcomm.train` with each of `argvs`, one after another in one job of
    `ranks` ranks (env: clean_env()); the job stops at the first run that fails."""
    script, plan = folder / "trainer_runs.py", folder / "trainer_runs.json"
    script.write_text(TRAINER_RUNS)
    plan.write_text(json.dumps(argvs))
    command = mpirun(ranks, "-x", "PYTHONPATH", sys.executable, str(script), str(plan))
    env = env or clean_env()
    env.setdefault("PYTHONPATH", "")
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=540)


def random_images(path: Path, seed: int) -> Path:
    """A tiny HDF5 image set (64 training and 16 test images of 28 × 28, 10 classes) of random
    pixels, for tools whose output shape, not accuracy, is under test."""
    import numpy as np

    from data_prep.writer import write_dataset

    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (64, 1, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 64)
    write_dataset(path, (images, labels), (images[:16], labels[:16]), 10, "test")
    return path


def member_parts(values: torch.Tensor, members: int) -> list[torch.Tensor]:
    """`values` cut into one equal part per column member, the last padded with zeros."""
    import torch

    part = -(-len(values) // members)
    return list(torch.cat([values, values.new_zeros(part * members - len(values))]).split(part))


@pytest.fixture(scope="module")
def mlp_profile():
    """The cost model's profile of a small MLP (64 inputs, three hidden layers of 256)."""
    from hvd_lowcomm.costmodel import profile_model
    from hvd_lowcomm.models import mlp

    return profile_model(mlp((64,), 10, [256, 256, 256]), (64,), 32, repeats=3)


@pytest.fixture
def run_yaml(tmp_path):
    """A training config of three steps on the digits, its run directory under tmp_path."""
    path = tmp_path / "run.yaml"
    path.write_text(
        f"train: {{epochs: 1, max_steps: 3}}\ndata: {{path: {tmp_path / 'digits.h5'}}}\n"
        f"run: {{dir: {tmp_path / 'runs'}, name: job, progress: false}}\n"
    )
    return path
