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

So `benchmarks.compare` measures the background's ceiling for each run's layout with this probe
(`idle_bytes_per_second`: the run's process sets, every rank asleep, the counters read at the
start and end of the sleep) and lets the counters differ from the meter by that rate over the
time a run's rank 0 did not compute (blocked in communication, or evaluating).

    mpirun ... python -m benchmarks.coordination --sets '[[0, 1], [2, 3]]' --seconds 10

is the probe itself: it prints IDLE when every rank has initialised and starts to sleep, DONE
when rank 0 wakes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from benchmarks.netns import run_reading_counters

IDLE, DONE = "IDLE", "DONE"
PROBE_SECONDS = 5.0


def idle_bytes_per_second(net: Any, np_: int, process_sets: list[list[int]], seconds: float = PROBE_SECONDS) -> float:
    """Bytes per second that Horovod's coordination sends over `net`'s counted links (all
    together) while np_ ranks with `process_sets` sit idle: the probe below, on a network
    made like the runs' (benchmarks.netns)."""
    command = [*net.mpirun(np_), sys.executable, "-m", "benchmarks.coordination",
               "--sets", json.dumps(process_sets), "--seconds", str(seconds)]
    code, lines, readings = run_reading_counters(command, net, {mark: (lambda line, m=mark: line.strip() == m)
                                                                for mark in (IDLE, DONE)})
    if code != 0 or len(readings) != 2:
        tail = "".join(lines[-15:])
        raise RuntimeError(f"coordination probe failed (exit {code}): {' '.join(command)}\n{tail}")
    (began, before), (ended, after) = readings[IDLE], readings[DONE]
    return (sum(after) - sum(before)) / max(ended - began, 1e-9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Horovod with the given process sets, every rank idle (run under mpirun).")
    parser.add_argument("--sets", required=True, help="JSON list of rank lists (the world's may be among them)")
    parser.add_argument("--seconds", type=float, default=PROBE_SECONDS, help="how long every rank sleeps")
    args = parser.parse_args(argv)
    import horovod.torch as hvd
    import torch
    from mpi4py import MPI

    hvd.init(comm=MPI.COMM_WORLD, process_sets="dynamic")
    world = list(range(hvd.size()))
    for ranks in json.loads(args.sets):
        if sorted(ranks) != world:
            hvd.add_process_set(sorted(ranks))
    hvd.allreduce(torch.zeros(1), name="probe.ready")  # every rank is up and every set registered
    if hvd.rank() == 0:
        print(IDLE, flush=True)
    time.sleep(args.seconds)
    if hvd.rank() == 0:
        print(DONE, flush=True)
    hvd.allreduce(torch.zeros(1), name="probe.done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
