"""Runtime: rank groups and their collectives, and ending the job when a rank fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import RANK, SIZE, clean_env, mpirun, needs_ranks
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.runtime import group_layout


@needs_ranks(2)
def test_groups_communicate_only_inside_themselves(world, fresh_meter):
    rank = world.comm.Get_rank()
    mine, groups = runtime.split_world(num_groups=2)
    assert [g.ranks for g in groups] == group_layout(world.size, num_groups=2)
    assert rank in mine and mine.comm.Get_size() == mine.size

    total = fresh_meter.allreduce(torch.tensor([float(rank)]), "probe.sum", group=mine, average=False)
    assert total.item() == sum(mine.ranks)
    gathered = fresh_meter.allgather(torch.tensor([rank]), "probe.gather", group=mine)
    assert gathered.tolist() == list(mine.ranks)
    assert mine.comm.allreduce(rank) == sum(mine.ranks)  # the mpi4py side agrees

    value = torch.tensor([float(rank)])
    fresh_meter.broadcast_tensors({"value": value}, root_rank=mine.ranks[-1], group=mine)
    assert value.item() == mine.ranks[-1]  # each group got its own root's value, not rank 0's

    assert {(r.group, r.group_size) for r in fresh_meter.step_records} == {(mine.label, mine.size)}


@needs_ranks(2)
def test_splitting_twice_reuses_the_process_sets(world):
    first, _ = runtime.split_world(num_groups=2)
    second, _ = runtime.split_world(num_groups=2, label="again")
    assert first.process_set is second.process_set
    assert second.label.startswith("again")


@needs_ranks(4)
def test_the_meter_counts_apart_what_leaves_a_node_and_the_cost_model_agrees(world, fresh_meter, monkeypatch):
    """Ranks as nodes of 2 (the meter's node map set by hand; the real traffic is the same): a
    rank's bytes leave its node when its ring successor lives on another node."""
    from hvd_lowcomm.costmodel import Link

    monkeypatch.setattr(runtime, "_node_of", tuple(r // 2 for r in range(SIZE)))
    assert runtime.node_count() == SIZE // 2
    group, _ = runtime.split_world(group_size=2)  # a node
    column, _ = runtime.split_by_position(SIZE // 2)  # one rank per node
    for name, g in (("world", None), ("node", group), ("column", column)):
        fresh_meter.allreduce(torch.ones(1000), f"probe.{name}", group=g)
    wire = {name: fresh_meter.by_name[f"probe.{name}"].wire_bytes for name in ("world", "node", "column")}
    crossed = {name: fresh_meter.by_name[f"probe.{name}"].between_nodes_bytes for name in wire}
    # world ring 0→1→2→...: ranks 1, 3, ... send to the next node; a node's ring stays inside;
    # every rank of a column sends to another node
    assert crossed == {"world": wire["world"] if RANK % 2 else 0.0, "node": 0.0, "column": wire["column"]}
    # what node 0 sent in all, against the cost model's shares of one rank's bytes
    sent_by_node0 = sum(world.comm.allgather(sum(crossed.values()))[:2])
    link = Link(1e9, ranks_per_node=2)
    assert sent_by_node0 == pytest.approx(
        wire["world"] * link.node_share(SIZE)
        + wire["node"] * link.node_share(2)
        + wire["column"] * link.node_share(SIZE // 2, spans_nodes=True)
    )


def run_on_two_ranks(tmp_path, failure: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run a 2-rank job where rank 1 executes `failure` while rank 0 waits in an allreduce that
    rank 1 never joins; return the finished process and how long it took."""
    script = tmp_path / "job.py"
    script.write_text(
        "import os, signal, torch\n"
        "from hvd_lowcomm.comm import runtime\n"
        "from hvd_lowcomm.comm.traffic import meter\n"
        "runtime.init(0)\n"
        "with runtime.abort_on_error():\n"
        "    if runtime.rank() == 1:\n"
        f"        {failure}\n"
        "    meter.allreduce(torch.ones(1), 'waits-for-rank-1')  # would hang without the abort\n"
    )
    start = time.monotonic()
    proc = subprocess.run(
        mpirun(2, sys.executable, str(script)), capture_output=True, text=True, env=clean_env(), timeout=120
    )
    return proc, time.monotonic() - start


only_from_the_1_rank_suite = pytest.mark.skipif(
    SIZE != 1 or RANK != 0, reason="launches its own mpirun; run from the 1-rank suite"
)


@only_from_the_1_rank_suite
def test_an_exception_on_one_rank_ends_the_whole_job_nonzero(tmp_path):
    proc, seconds = run_on_two_ranks(tmp_path, "raise RuntimeError('boom on rank 1')")
    assert proc.returncode != 0
    assert "[rank 1] RuntimeError: boom on rank 1" in proc.stderr
    assert seconds < 60


@only_from_the_1_rank_suite
def test_a_killed_rank_ends_the_whole_job_nonzero(tmp_path):
    # No exception, no cleanup: the process just vanishes.
    proc, seconds = run_on_two_ranks(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)")
    assert proc.returncode != 0
    assert seconds < 60


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "job", "MASTER_ADDR": "127.0.0.1"}


@only_from_the_1_rank_suite
def test_the_cli_started_by_torchrun_stops_before_training_with_the_mpirun_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "hvd_lowcomm.train", "--run.dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**clean_env(), **TORCHRUN},
        timeout=120,
    )
    assert proc.returncode == 2
    assert "started by torchrun (RANK=0, WORLD_SIZE=2)" in proc.stderr and "mpirun -np 2 python" in proc.stderr
    assert not list(tmp_path.iterdir())  # no run directory: nothing trained


# Each rank writes its own file: printed lines of several ranks can interleave in mpirun's output.
THREADS = (
    "import os, json, torch; from hvd_lowcomm.comm import runtime; runtime.init(0); import horovod.torch as hvd; "
    "open(os.path.join(os.environ['THREADS_DIR'], str(hvd.rank())), 'w').write("
    "json.dumps([torch.get_num_threads(), hvd.local_size(), len(os.sched_getaffinity(0))]))"
)


def compute_threads_of(ranks: int, **env: str) -> list[list[int]]:
    """[threads, local ranks, cores allowed] of every rank of a job of `ranks` on this machine,
    unbound (as mpirun leaves ranks that outnumber cores), without OMP_NUM_THREADS unless given."""
    with tempfile.TemporaryDirectory() as out:
        environ = {**{k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"}, "THREADS_DIR": out, **env}
        proc = subprocess.run(
            mpirun(ranks, "--bind-to", "none", "-x", "THREADS_DIR", sys.executable, "-c", THREADS),
            capture_output=True,
            text=True,
            env=environ,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        reports = [json.loads(f.read_text()) for f in sorted(Path(out).iterdir())]
    assert len(reports) == ranks, proc.stdout
    return reports


@only_from_the_1_rank_suite
def test_the_ranks_of_a_node_do_not_start_more_compute_threads_than_it_has_cores():
    # torch's default is a thread per core in every process: 4 ranks on 2 cores ran 8 threads,
    # and a step without communication took 2.2x as long.
    cores = os.cpu_count() or 1
    for threads, local_size, _ in compute_threads_of(4):
        assert local_size == 4 and 1 <= threads
        assert threads * local_size <= max(cores, local_size), (threads, local_size, cores)
    [(threads, _, allowed)] = compute_threads_of(1)
    assert threads == allowed  # alone on the machine, a rank uses every core it may run on


@only_from_the_1_rank_suite
def test_omp_num_threads_set_by_the_user_or_job_script_stands():
    assert compute_threads_of(1, OMP_NUM_THREADS="1")[0][0] == 1
