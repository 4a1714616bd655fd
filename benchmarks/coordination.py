"""Horovod's coordination traffic, which hvd_lowcomm's meter never sees, measured from outside.

Horovod's background thread runs a cycle every HOROVOD_CYCLE_TIME (1 ms), whether or not any
tensor is waiting: in each, every process set's members agree on what is ready by a small
allreduce. On a real network those bytes are negligible; on emulated nodes that share a 2-core
machine they are not, and their rate depends on how idle the cores are. Measured with this
probe (every rank asleep, the world's process set only): 0.87 MB/s between the nodes for 4 ranks
on 2 nodes, 7.3 MB/s for 16 on 4, 9.8 MB/s for 64 on 8, where about 100 cycles a second is what
the cores allow (a 10 ms cycle time hardly lowered it). With the main threads computing instead
of sleeping, 16 ranks on 4 nodes sent 30x less. A compressed method's ranks spend most of a step
waiting, so on 64 ranks that background reaches a sixth of PowerSGD's own traffic (10 of 59 MB
per 1.06 s step), and a launch's start-up varies by tens of MB between launches for the same
reason (PowerSGD: 63 MB in one launch, 103 MB in the next), which is why compare counts from
the trainer's first line instead of subtracting a zero-step run.

So `benchmarks.compare` measures the background's ceiling for each run's layout and lets the
counters differ from the meter by that rate over the time a run's rank 0 did not compute
(blocked in communication, or evaluating). It measures it inside the run's own launch: the
trainer runs, then every rank sleeps with the run's process sets still registered, and the
counters are read when the sleep starts (IDLE) and ends (DONE):

    mpirun ... python -m benchmarks.coordination --after-training -- --method ab --train.epochs 2 ...

Every rank of an emulated launch runs this program, so it is also where MPI's start-up and
shutdown are made to wait cheaply on ranks that share a few cores (benchmarks/timer_slack.py).
A launch of its own would cost as much again as the run's start-up, which on 64 ranks sharing
2 cores is minutes (`make test-cluster` saves one per process-set layout). For a finished run
with no such reading (`compare --reuse`), the probe runs alone with the layout's sets:

    mpirun ... python -m benchmarks.coordination --sets '[[0, 1], [2, 3]]' --seconds 10
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from benchmarks.netns import run_reading_counters
from benchmarks.timer_slack import start_mpi_waiting_cheaply, stop_mpi_waiting_cheaply

IDLE, DONE = "IDLE", "DONE"
IDLE_MARKS = {mark: (lambda line, m=mark: line.strip() == m) for mark in (IDLE, DONE)}
PROBE_SECONDS = 5.0


def idle_bytes_per_second(net: Any, np_: int, process_sets: list[list[int]], seconds: float = PROBE_SECONDS) -> float:
    """Bytes per second that Horovod's coordination sends over `net`'s counted links (all
    together) while np_ ranks with `process_sets` sit idle: the probe below in a launch of its
    own, on a network made like the runs' (benchmarks.netns)."""
    command = [
        *net.mpirun(np_),
        sys.executable,
        "-m",
        "benchmarks.coordination",
        "--sets",
        json.dumps(process_sets),
        "--seconds",
        str(seconds),
    ]
    code, lines, readings = run_reading_counters(command, net, IDLE_MARKS)
    if code != 0 or len(readings) != 2:
        tail = "".join(lines[-15:])
        raise RuntimeError(f"coordination probe failed (exit {code}): {' '.join(command)}\n{tail}")
    return idle_rate_between(readings)


def idle_rate_between(readings: dict[str, tuple[float, list[int]]]) -> float:
    """Bytes per second over the counted links between the IDLE and DONE readings."""
    (began, before), (ended, after) = readings[IDLE], readings[DONE]
    return (sum(after) - sum(before)) / max(ended - began, 1e-9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Horovod's ranks idle with the given process sets, or after a "
        "training run with its own (run under mpirun)."
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--sets", help="JSON list of rank lists (the world's may be among them)")
    what.add_argument(
        "--after-training", action="store_true", help="run hvd_lowcomm.train with the arguments after '--', then idle"
    )
    parser.add_argument("--seconds", type=float, default=PROBE_SECONDS, help="how long every rank sleeps")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- and the trainer's arguments")
    args = parser.parse_args(argv)
    start_mpi_waiting_cheaply()  # the ranks of an emulated launch share a few cores
    try:
        if args.after_training:
            from hvd_lowcomm import train

            code = train.main(args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args)
            if code != 0:
                return code
        else:
            _register(json.loads(args.sets))
        _sleep_on_every_rank(args.seconds)
        return 0
    finally:
        stop_mpi_waiting_cheaply()


def _register(process_sets: list[list[int]]) -> None:
    import horovod.torch as hvd
    from mpi4py import MPI

    hvd.init(comm=MPI.COMM_WORLD, process_sets="dynamic")
    world = list(range(hvd.size()))
    for ranks in process_sets:
        if sorted(ranks) != world:
            hvd.add_process_set(sorted(ranks))


def _sleep_on_every_rank(seconds: float) -> None:
    """IDLE once every rank is up (and every set registered), sleep, DONE when rank 0 wakes
    (MPI's barriers, on either engine: the torch engine has no coordination of its own to count)."""
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(IDLE, flush=True)
    time.sleep(seconds)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(DONE, flush=True)
    MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    sys.exit(main())
