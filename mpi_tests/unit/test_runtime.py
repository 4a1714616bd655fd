"""Runtime without MPI: group layouts, launcher checks, thread counts."""

from __future__ import annotations

import pytest
import torch

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.runtime import GroupLayoutError, group_layout

from test_runtime import TORCHRUN


def test_layout_is_contiguous_equal_groups():
    assert group_layout(4, num_groups=2) == [(0, 1), (2, 3)]
    assert group_layout(6, group_size=3) == [(0, 1, 2), (3, 4, 5)]
    assert group_layout(3, num_groups=3) == [(0,), (1,), (2,)]


def test_a_group_count_that_does_not_divide_the_world_is_a_clear_error():
    with pytest.raises(
        GroupLayoutError,
        match=r"cannot split 6 ranks into 4 equal groups: use a group count "
        r"that divides 6 \(1, 2, 3, 6\) or launch a multiple of 4 ranks",
    ):
        group_layout(6, num_groups=4)
    with pytest.raises(GroupLayoutError, match="cannot split 4 ranks into groups of 3"):
        group_layout(4, group_size=3)


def test_one_group_per_node_when_the_job_spans_nodes():
    assert runtime.groups_for(0, 64, 8) == 8  # 8 nodes of 8
    assert runtime.groups_for(0, 8, 8) == 2  # one node: two groups all the same
    assert runtime.groups_for(4, 64, 8) == 4  # asked for
    assert runtime.groups_for(0, 6, 1) == 6  # one rank per node
    assert runtime.groups_for(0, 3, 3) == 3  # one node, an odd rank count: its smallest divisor
    assert runtime.groups_for(0, 9, 9) == 3
    assert runtime.groups_for(0, 6, 6) == 2


def test_torchrun_s_variables_without_an_mpi_launcher_are_a_launcher_problem():
    assert "mpirun -np 2" in runtime.launcher_problem(TORCHRUN)
    assert runtime.launcher_problem({**TORCHRUN, "OMPI_COMM_WORLD_SIZE": "2"}) is None  # mpirun started it
    assert runtime.launcher_problem({**TORCHRUN, "SLURM_PROCID": "0"}) is None  # srun started it
    assert runtime.launcher_problem({**TORCHRUN, "WORLD_SIZE": "1"}) is None  # one process is one rank anyway
    assert runtime.launcher_problem({}) is None


def test_a_rank_computes_on_its_share_of_the_node_s_cores():
    assert runtime.compute_threads(local_ranks=4, cores_allowed=2, cores_on_node=2) == 1  # unbound, oversubscribed
    assert runtime.compute_threads(local_ranks=2, cores_allowed=8, cores_on_node=8) == 4  # unbound: a half each
    assert runtime.compute_threads(local_ranks=16, cores_allowed=4, cores_on_node=64) == 4  # bound to its 4 cores
    assert runtime.compute_threads(local_ranks=1, cores_allowed=2, cores_on_node=8) == 2  # the cores it may use
    assert runtime.compute_threads(local_ranks=1, cores_allowed=8, cores_on_node=8) == 8


@pytest.mark.parametrize(
    "local_rank, local_size, visible, expected",
    [
        (3, 4, 1, 0),  # one GPU per task (Slurm --gpus-per-task=1): the one it sees
        (3, 4, 4, 3),  # the node's GPUs all visible: its local rank's
        (1, 2, 4, 1),  # fewer ranks than GPUs
    ],
)
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
