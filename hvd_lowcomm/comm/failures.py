"""A failure on any rank ends the whole MPI job, never leaves the others waiting in a
collective: `abort_on_error` turns an uncaught exception into MPI_Abort, which makes mpirun/srun
kill every rank and exit non-zero; `exit_process` ends a finished program cleanly."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import traceback
from typing import Callable, Iterator

from hvd_lowcomm.config import ConfigError


@contextlib.contextmanager
def abort_on_error() -> Iterator[None]:
    """Any exception inside ends the whole MPI job with a non-zero exit instead of a hang.

    The failing rank prints its traceback (prefixed with its rank) and calls MPI_Abort, which
    makes the launcher kill every other rank, wherever they are blocked.
    """
    try:
        yield
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _abort(int(exc.code) if isinstance(exc.code, int) else 1)
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the other ranks
        where = f"[rank {_safe_rank()}]"
        if isinstance(exc, (ConfigError, FloatingPointError)):  # the message says it all
            report_failure(f"{where} error: {exc}\n")
        else:
            text = "".join(traceback.format_exception(exc))
            report_failure("".join(f"{where} {line}\n" for line in text.rstrip().splitlines()))
        _abort(2 if isinstance(exc, ConfigError) else 1)


def _print_to_stderr(text: str) -> None:
    print(text, file=sys.stderr, end="", flush=True)


# How a failing rank shows why it ends the job; mpi_tests' conftest prints past pytest's capture,
# which MPI_Abort would otherwise discard with the traceback in it.
report_failure: Callable[[str], None] = _print_to_stderr


def exit_process(code: int) -> None:
    """End a finished program: its exit handlers and MPI_Finalize while Python still runs,
    then the process, without the interpreter's teardown, where a Gloo worker thread still
    alive (its process group referenced by a mesh or a module) may drop a tensor's last
    reference and abort the process (pytorch/pytorch#190489)."""
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()  # the torch engine's destroy_process_group, loggers, Horovod's shutdown
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _abort(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules and _mpi_size() > 1:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def _mpi_size() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size() if MPI.Is_initialized() and not MPI.Is_finalized() else 1


def _safe_rank() -> int:
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else 0
    except Exception:  # noqa: BLE001 - best effort while already failing
        return 0
