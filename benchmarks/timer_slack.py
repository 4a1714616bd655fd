"""Cheap waits for Open MPI's start-up and shutdown on ranks that share a few cores.

MPI_Init and MPI_Finalize wait for every other rank in a loop that sleeps 100 µs at a time
(Open MPI 4's OMPI_LAZY_WAIT_FOR_COMPLETION). On a real cluster each rank has a core and the
loop costs nothing; on emulated nodes that share a 2-core machine the waiting ranks wake
10,000 times a second each, and the context switches (200,000-600,000 a second at 64 ranks)
starve the ranks still importing torch and the daemons that run the fence. Measured on this
project's 2-core machine, 64 ranks on 8 emulated nodes importing torch and Horovod, then
MPI_Init and one barrier: 550-720 s from launch to exit, 111-337 s of it in MPI_Init; with
2 ms of timer slack while MPI starts and stops, 188 s, 3.6 s in MPI_Init.

Linux's timer slack (prctl PR_SET_TIMERSLACK) lets each of those sleeps run up to that long;
`benchmarks.coordination`, the program every rank of an emulated launch runs, sets it around
MPI_Init and MPI_Finalize only, so the training itself (and Horovod's background thread, which
starts later and inherits the slack of its creator) sleeps as it would on a cluster. The helper
threads Open MPI starts inside MPI_Init (its PMIx and event-loop threads) keep the coarse slack;
they wait on sockets for launcher events, and the TCP transport is progressed by the calling
thread (btl_tcp_progress_thread is off), so the training's messages do not pass through them.
"""

from __future__ import annotations

import ctypes
import importlib
import os

PR_SET_TIMERSLACK = 29  # <linux/prctl.h>
# Long enough to cut the wake-ups fifty-fold, short against MPI_Init's seconds.
MPI_WAIT_SLACK_NS = 2_000_000


def set_timer_slack(nanoseconds: int) -> None:
    """Set the calling thread's timer slack; 0 restores the default it started with."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(nanoseconds), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_TIMERSLACK, {nanoseconds}): {os.strerror(errno)}")


def start_mpi_waiting_cheaply() -> None:
    """MPI_Init (mpi4py's import) with coarse sleeps while the ranks wait for each other, then
    the default slack again."""
    set_timer_slack(MPI_WAIT_SLACK_NS)
    importlib.import_module("mpi4py.MPI")  # importing it initialises MPI

    set_timer_slack(0)


def stop_mpi_waiting_cheaply() -> None:
    """Call once the program's work is done: the MPI_Finalize that mpi4py runs at exit waits
    with coarse sleeps."""
    set_timer_slack(MPI_WAIT_SLACK_NS)
