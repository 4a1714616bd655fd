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
from hvd_lowcomm.comm.runtime import GroupLayoutError, group_layout


def test_layout_is_contiguous_equal_groups():
    assert group_layout(4, num_groups=2) == [(0, 1), (2, 3)]
    assert group_layout(6, group_size=3) == [(0, 1, 2), (3, 4, 5)]
    assert group_layout(3, num_groups=3) == [(0,), (1,), (2,)]


def test_a_group_count_that_does_not_divide_the_world_is_a_clear_error():
    with pytest.raises(GroupLayoutError, match=r"cannot split 6 ranks into 4 equal groups: use a group count "
                                               r"that divides 6 \(1, 2, 3, 6\) or launch a multiple of 4 ranks"):
        group_layout(6, num_groups=4)
    with pytest.raises(GroupLayoutError, match="cannot split 4 ranks into groups of 3"):
        group_layout(4, group_size=3)


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


def test_one_group_per_node_when_the_job_spans_nodes():
    assert runtime.groups_for(0, 64, 8) == 8   # 8 nodes of 8
    assert runtime.groups_for(0, 8, 8) == 2    # one node: two groups all the same
    assert runtime.groups_for(4, 64, 8) == 4   # asked for
    assert runtime.groups_for(0, 6, 1) == 6    # one rank per node


@needs_ranks(4)
def test_the_meter_counts_apart_what_leaves_a_node_and_the_cost_model_agrees(world, fresh_meter, monkeypatch):
    """Ranks as nodes of 2 (the meter's node map set by hand; the real traffic is the same): a
    rank's bytes leave its node when its ring successor lives on another node."""
    from hvd_lowcomm.costmodel import Link

    monkeypatch.setattr(runtime, "_node_of", tuple(r // 2 for r in range(SIZE)))
    assert runtime.node_count() == SIZE // 2
    group, _ = runtime.split_world(group_size=2)            # a node
    column, _ = runtime.split_by_position(SIZE // 2)         # one rank per node
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
    assert sent_by_node0 == pytest.approx(wire["world"] * link.node_share(SIZE) + wire["node"] * link.node_share(2)
                                          + wire["column"] * link.node_share(SIZE // 2, spans_nodes=True))


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
        "    meter.allreduce(torch.ones(1), 'waits-for-rank-1')  # would hang without the abort\n")
    start = time.monotonic()
    proc = subprocess.run(mpirun(2, sys.executable, str(script)), capture_output=True, text=True,
                          env=clean_env(), timeout=120)
    return proc, time.monotonic() - start


only_from_the_1_rank_suite = pytest.mark.skipif(SIZE != 1 or RANK != 0,
                                                reason="launches its own mpirun; run from the 1-rank suite")


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


def test_torchrun_s_variables_without_an_mpi_launcher_are_a_launcher_problem():
    assert "mpirun -np 2" in runtime.launcher_problem(TORCHRUN)
    assert runtime.launcher_problem({**TORCHRUN, "OMPI_COMM_WORLD_SIZE": "2"}) is None  # mpirun started it
    assert runtime.launcher_problem({**TORCHRUN, "SLURM_PROCID": "0"}) is None  # srun started it
    assert runtime.launcher_problem({**TORCHRUN, "WORLD_SIZE": "1"}) is None  # one process is one rank anyway
    assert runtime.launcher_problem({}) is None


@only_from_the_1_rank_suite
def test_the_cli_started_by_torchrun_stops_before_training_with_the_mpirun_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hvd_lowcomm.train", "--run.dir", str(tmp_path)],
                          capture_output=True, text=True, env={**clean_env(), **TORCHRUN}, timeout=120)
    assert proc.returncode == 2
    assert "started by torchrun (RANK=0, WORLD_SIZE=2)" in proc.stderr and "mpirun -np 2 python" in proc.stderr
    assert not list(tmp_path.iterdir())  # no run directory: nothing trained


def test_a_rank_computes_on_its_share_of_the_node_s_cores():
    assert runtime.compute_threads(local_ranks=4, cores_allowed=2, cores_on_node=2) == 1  # unbound, oversubscribed
    assert runtime.compute_threads(local_ranks=2, cores_allowed=8, cores_on_node=8) == 4  # unbound: a half each
    assert runtime.compute_threads(local_ranks=16, cores_allowed=4, cores_on_node=64) == 4  # bound to its 4 cores
    assert runtime.compute_threads(local_ranks=1, cores_allowed=2, cores_on_node=8) == 2  # the cores it may use
    assert runtime.compute_threads(local_ranks=1, cores_allowed=8, cores_on_node=8) == 8


# Each rank writes its own file: printed lines of several ranks can interleave in mpirun's output.
THREADS = ("import os, json, torch; from hvd_lowcomm.comm import runtime; runtime.init(0); import horovod.torch as hvd; "
           "open(os.path.join(os.environ['THREADS_DIR'], str(hvd.rank())), 'w').write("
           "json.dumps([torch.get_num_threads(), hvd.local_size(), len(os.sched_getaffinity(0))]))")


def compute_threads_of(ranks: int, **env: str) -> list[list[int]]:
    """[threads, local ranks, cores allowed] of every rank of a job of `ranks` on this machine,
    unbound (as mpirun leaves ranks that outnumber cores), without OMP_NUM_THREADS unless given."""
    with tempfile.TemporaryDirectory() as out:
        environ = {**{k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"}, "THREADS_DIR": out, **env}
        proc = subprocess.run(mpirun(ranks, "--bind-to", "none", "-x", "THREADS_DIR", sys.executable, "-c", THREADS),
                              capture_output=True, text=True, env=environ, timeout=120)
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


@pytest.mark.parametrize("local_rank, local_size, visible, expected", [
    (3, 4, 1, 0),   # one GPU per task (Slurm --gpus-per-task=1): the one it sees
    (3, 4, 4, 3),   # the node's GPUs all visible: its local rank's
    (1, 2, 4, 1),   # fewer ranks than GPUs
])
def test_a_rank_uses_the_gpu_it_is_given(local_rank, local_size, visible, expected):
    assert runtime.gpu_for_rank(local_rank, local_size, visible) == expected


def test_more_ranks_than_gpus_on_a_node_is_refused_with_the_line_that_fixes_it():
    with pytest.raises(runtime.ConfigError, match=r"8 ranks on this node but 4 GPUs.*--ntasks-per-node=4"):
        runtime.gpu_for_rank(5, 8, 4)
    assert runtime.gpu_for_rank(5, 8, 4, share=True) == 1  # (HVD_LOWCOMM_SHARE_GPUS=1, for tests)


def test_a_device_pytorch_does_not_know_is_refused_with_the_choices():
    with pytest.raises(runtime.ConfigError, match="not a device PyTorch knows"):
        runtime.device("warp-drive")


def test_a_checkpoint_saved_on_the_cpu_loads_on_the_cpu(tmp_path):
    from hvd_lowcomm.checkpoint import onto

    torch.save({"w": torch.ones(3)}, tmp_path / "c.pt")
    loaded = torch.load(tmp_path / "c.pt", map_location=onto(torch.device("cpu")))
    assert loaded["w"].device.type == "cpu" and torch.equal(loaded["w"], torch.ones(3))
