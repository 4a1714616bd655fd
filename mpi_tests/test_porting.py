"""Three real programs ported as their users port them (examples/porting/, the code the porting
pages show): torchft's DiLoCo loop, Horovod's synthetic benchmark, PyTorch's DDP tutorial with
its snapshot and resume, plain and with FSDP2. Each is checked against its unported original
where that runs here, bit for bit where the method is exact; and what a user naturally does
instead either trains right or stops at the first step with the fix."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

import hvd_lowcomm as hl
from conftest import RANK, SIZE, clean_env, mpirun
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.config import ConfigError

PORTING = Path(__file__).resolve().parents[1] / "examples" / "porting"
sys.path.insert(0, str(PORTING))
import ddp_tutorial  # noqa: E402
import horovod_synthetic  # noqa: E402
import torchft_diloco  # noqa: E402

pytestmark = pytest.mark.skipif(SIZE != 2, reason="the ported programs run at np 2")


def on_torch_engine() -> bool:
    return runtime.engine().name == "torch"


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_on_every_rank(state: dict[str, torch.Tensor]) -> None:
    for key, value in state.items():
        gathered = runtime.world().comm.allgather(value)
        assert all(torch.equal(g, gathered[0]) for g in gathered), key


# -- torchft's DiLoCo loop -------------------------------------------------------------------


def test_torchfts_loop_with_the_optimisers_own_step_is_the_same_run_as_diloco_step(fresh_meter):
    model, diloco = torchft_diloco.train(steps=40, sync_every=10, own_step=True)
    sent = fresh_meter.total("train")
    final = state_of(diloco.full_model())
    fresh_meter.reset()
    reference, reference_diloco = torchft_diloco.train(steps=40, sync_every=10, own_step=False)
    assert sent > 0 and sent == fresh_meter.total("train")  # the groups synchronised, the same bytes
    assert diloco.current_step() == reference_diloco.current_step() == 4
    assert diloco.members() == [(0,), (1,)]
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name  # bit for bit: one inner step per batch, whichever door
    assert_same_on_every_rank(final)
    steps = diloco.inner_steps
    model(torch.randn(2, 16)).sum().backward()
    diloco.optimizer.step()  # after the `with` block DiLoCo's hooks are off
    assert diloco.inner_steps == steps


def test_calling_both_diloco_step_and_the_optimisers_step_refuses_at_the_first_batch():
    model = torchft_diloco.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = hl.DiLoCo(model, opt, sync_every=4)
    (x, y), *_ = torchft_diloco.batches(1, seed=RANK)
    F.cross_entropy(model(x), y).backward()
    diloco.step()
    with pytest.raises(ConfigError, match=r"optimizer.step\(\) was called, but this run steps through diloco.step"):
        opt.step()
    diloco.close()


def test_full_model_refuses_a_model_changed_outside_dilocos_inner_optimiser():
    model = torchft_diloco.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=0.1)  # an optimiser DiLoCo was not given
    diloco = hl.DiLoCo(model, opt, sync_every=1)
    (x, y), *_ = torchft_diloco.batches(1, seed=RANK)
    F.cross_entropy(model(x), y).backward()
    opt.step()  # synced: nothing pending
    other.step()  # each rank's own gradient, unseen by DiLoCo
    with pytest.raises(RuntimeError, match="the model differs between ranks"):
        diloco.full_model()
    diloco.close()


def test_a_checkpoint_making_the_optimisers_state_is_not_an_inner_step():
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torchft_diloco.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco = hl.DiLoCo(model, opt, sync_every=4)
    get_state_dict(model, opt)  # DCP makes AdamW's state with a step at learning rate 0
    assert diloco.inner_steps == 0 and opt.state
    (x, y), *_ = torchft_diloco.batches(1, seed=RANK)
    F.cross_entropy(model(x), y).backward()
    diloco.step()  # the door is still the loop's to choose
    assert diloco.inner_steps == 1
    diloco.close()


def test_diloco_given_a_gradscaler_refuses_the_optimisers_own_step_naming_diloco_step():
    model = torchft_diloco.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = hl.DiLoCo(model, opt, sync_every=4, scaler=torch.amp.GradScaler("cpu"))
    (x, y), *_ = torchft_diloco.batches(1, seed=RANK)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(ConfigError, match=r"call diloco.step\(\) in place of scaler.step\(opt\)"):
        opt.step()
    diloco.close()


def deep_mlp() -> torch.nn.Sequential:
    """16 -> 4 through four weight layers: deep enough for AB's cuts and SIL's two partitions."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32), torch.nn.ReLU()]
    for _ in range(2):
        layers += [torch.nn.Linear(32, 32), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(32, 4))


def test_ab_training_refuses_a_step_of_the_loops_own_and_horovods_synchronize_is_harmless():
    model = deep_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ab = hl.ABTraining(model, opt, total_steps=10)
    (x, y), *_ = torchft_diloco.batches(1, seed=RANK)
    opt.synchronize()  # Horovod's call: nothing to do here, said once
    with pytest.raises(ConfigError, match=r"remove optimizer.step\(\) from the loop"):
        with ab.step(x, y):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()


def test_sil_refuses_a_step_of_the_loops_own_after_its_own():
    model = deep_mlp()
    sil = hl.SIL(model, input_shape=(16,), num_classes=4, partitions=2)
    opt = torch.optim.Adam(sil.module.parameters(), lr=1e-3)
    (x, y), *_ = torchft_diloco.batches(1, seed=0)
    sil.step(opt, x, y)
    with pytest.raises(ConfigError, match=r"SIL steps this optimiser itself"):
        opt.step()


# -- Horovod's synthetic benchmark -----------------------------------------------------------


def test_horovods_synthetic_benchmark_ported_by_its_import_trains_as_horovod_on_either_engine():
    """Every rank trains on the same synthetic batch (as the benchmark does once seeded), so the
    pooled gradient is each rank's own and Horovod's run equals one process's, bit for bit."""
    args = horovod_synthetic.arguments([])
    assert (hl.local_rank(), hl.local_size(), hl.cross_size()) == (RANK, SIZE, 1)
    torch.manual_seed(0)
    model = horovod_synthetic.conv_net(8)
    reference = copy.deepcopy(model)
    data, target = torch.randn(8, 3, 16, 16), torch.arange(8) % 10
    optimizer = horovod_synthetic.make_optimizer(model, args)
    local = torch.optim.SGD(reference.parameters(), lr=0.01 * SIZE)
    for _ in range(4):
        horovod_synthetic.benchmark_step(model, optimizer, data, target)
        horovod_synthetic.benchmark_step(reference, local, data, target)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(ConfigError, match="not hvd.Adasum"):
        horovod_synthetic.make_optimizer(model, horovod_synthetic.arguments(["--use-adasum"]))


# -- PyTorch's DDP tutorial ------------------------------------------------------------------


def ddp_original(epochs: int, resume_at: int) -> dict[str, torch.Tensor]:
    """The tutorial's own Trainer loop with DDP (on the default group hvd_lowcomm.init started),
    stopped after `resume_at` epochs and resumed from its snapshot, as the port is below. The
    tutorial's snapshot records the epoch it was saved after, and its resume runs that epoch again."""
    dataset, _, _ = ddp_tutorial.load_train_objs()
    data = ddp_tutorial.prepare_dataloader(dataset, 16)
    state = None
    for start, stop in ((0, resume_at), (resume_at - 1, epochs)):
        _, model, make_optimizer = ddp_tutorial.load_train_objs()
        if state is not None:
            model.load_state_dict(state)
        model = DistributedDataParallel(model)
        optimizer = make_optimizer(model.parameters())
        for epoch in range(start, stop):
            data.sampler.set_epoch(epoch)
            for source, targets in data:
                optimizer.zero_grad()
                F.cross_entropy(model(source), targets).backward()
                optimizer.step()
        state = state_of(model.module)
    return state


def ported(epochs: int, resume_at: int, path: Path, sharded: bool) -> torch.nn.Module:
    """The port: trained `resume_at` epochs, snapshot at the last, then a new Trainer resumes."""
    dataset, _, _ = ddp_tutorial.load_train_objs()
    data = ddp_tutorial.prepare_dataloader(dataset, 16)
    for stop in (resume_at, epochs):
        _, model, make_optimizer = ddp_tutorial.load_train_objs()
        mesh = hl.device_mesh() if sharded else None
        trainer = ddp_tutorial.Trainer(model, data, make_optimizer, save_every=1, snapshot_path=str(path), mesh=mesh)
        trainer.train(stop)
        dist.barrier()  # rank 0's snapshot is written before any rank reads it (a new job, in the tutorial)
    return model


def test_the_ddp_tutorials_default_group_calls_work_on_either_engine():
    assert dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) == (RANK, SIZE)
    dataset = torch.utils.data.TensorDataset(torch.arange(10.0))
    assert list(DistributedSampler(dataset, shuffle=False)) == list(range(RANK, 10, SIZE))
    dist.barrier()


def test_the_ddp_tutorial_ported_equals_ddp_bit_for_bit_resumed_run_included(shared_tmp):
    expected = ddp_original(3, 2)
    model = ported(3, 2, shared_tmp / "port.pt", sharded=False)
    for name, value in state_of(model).items():
        assert torch.equal(value, expected[name]), name


def test_the_ddp_tutorial_with_fsdp2_matches_ddp_and_its_snapshots_load_with_torchs_defaults(shared_tmp):
    if not on_torch_engine():
        pytest.skip("FSDP2 runs on the torch engine (make test-2-torch runs it)")
    expected = ddp_original(3, 2)
    model = ported(3, 2, shared_tmp / "port.pt", sharded=True)
    full = torch.load(shared_tmp / "port.pt")["MODEL_STATE"]  # the snapshot: an ordinary state dict
    for name, value in expected.items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6)
    # the tutorial's own torch.save of the sharded model's state_dict pickles torch's objects alone
    torch.save(model.state_dict(), shared_tmp / f"shards-{RANK}.pt")
    shards = torch.load(shared_tmp / f"shards-{RANK}.pt")
    assert set(shards) == set(expected)


def test_an_optimiser_built_before_sharding_is_refused_at_its_first_step():
    if not on_torch_engine():
        pytest.skip("FSDP2 runs on the torch engine (make test-2-torch runs it)")
    _, model, make_optimizer = ddp_tutorial.load_train_objs()
    optimizer = make_optimizer(model.parameters())  # the tutorial's order: optimiser, then DDP(model)
    hl.shard_model(model, hl.device_mesh())
    F.cross_entropy(model(torch.randn(4, 20)), torch.arange(4)).backward()
    with pytest.raises(ConfigError, match="Shard first, then build the optimiser"):
        optimizer.step()
    make_optimizer(model.parameters()).step()  # built after sharding: steps


def test_the_ddp_tutorial_runs_as_a_program_and_resumes_from_its_snapshot(shared_tmp):
    if RANK != 0:
        return
    snapshot = shared_tmp / "program.pt"
    command = mpirun(2, sys.executable, str(PORTING / "ddp_tutorial.py"), "--snapshot", str(snapshot))
    for epochs, said in (
        ("1", "Epoch 0 | Training snapshot saved"),
        ("2", "Resuming training from snapshot at Epoch 0"),
    ):
        done = subprocess.run(
            [*command, "--epochs", epochs, "--save-every", "1"], env=clean_env(), capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert said in done.stdout, done.stdout
