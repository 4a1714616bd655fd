"""The ddp baseline: Horovod allreduce gives the gradient of the pooled batch, and is metered."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from hvd_lowcomm.methods.ddp import DistributedOptimizer
from hvd_lowcomm.models import mlp

LOCAL_BATCH = 8


def _pooled_problem(p: int):
    torch.manual_seed(1234)  # identical on every rank
    model = mlp((6,), 3, [5, 4])
    x = torch.randn(p * LOCAL_BATCH, 6)
    y = torch.randint(0, 3, (p * LOCAL_BATCH,))
    return model, x, y


@pytest.mark.parametrize("compression, rtol, atol", [("none", 1e-5, 1e-7), ("fp16", 2e-3, 2e-4)])
def test_gradient_equals_single_process_autograd_on_the_pooled_batch(world, fresh_meter, compression, rtol, atol):
    p, rank = world.size, world.comm.Get_rank()
    model, x, y = _pooled_problem(p)
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()

    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(), compression=compression
    )
    local = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    F.cross_entropy(model(x[local]), y[local]).backward()
    opt.synchronize()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=rtol, atol=atol, msg=f"gradient of {name}")
    with opt.skip_synchronize():
        opt.step()
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), ref.detach() - 0.5 * ref.grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("compression, itemsize", [("none", 4), ("fp16", 2)])
def test_meter_counts_the_analytic_payload_of_every_gradient(world, fresh_meter, compression, itemsize):
    p = world.size
    model, x, y = _pooled_problem(p)
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), compression=compression
    )
    F.cross_entropy(model(x[:LOCAL_BATCH]), y[:LOCAL_BATCH]).backward()
    opt.step()
    # mlp 6-5-4-3: weights 30 + 20 + 12, biases 5 + 4 + 3 = 74 numbers
    expected = {name: prm.numel() * itemsize for name, prm in model.named_parameters()}
    assert sum(expected.values()) == 74 * itemsize
    recorded = {r.name: r.payload_bytes for r in fresh_meter.step_records}
    # Horovod skips the allreduce altogether on a single rank: nothing is sent, nothing recorded.
    assert recorded == (expected if p > 1 else {})
    assert all(r.op == "allreduce" and r.group == "world" for r in fresh_meter.step_records)
    assert fresh_meter.step_total() == pytest.approx(2 * (p - 1) / p * 74 * itemsize)


def test_local_trains_each_rank_alone_and_sends_nothing(world, fresh_meter):
    from hvd_lowcomm import config
    from hvd_lowcomm.registry import spec

    p, rank = world.size, world.comm.Get_rank()
    model, x, y = _pooled_problem(p)
    local = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x[local]), y[local]).backward()  # this rank's batch only
    method = spec("local").method(
        config.load(["--method", "local", "--train.optimizer", "sgd", "--train.momentum", "0", "--train.lr", "0.5"])
    )
    method.setup(model)
    fresh_meter.reset()  # the set-up broadcast (all ranks start equal) is not a training step
    method.train_step(x[local], y[local])
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), ref.detach() - 0.5 * ref.grad)
    assert fresh_meter.total(phase=None) == 0 and fresh_meter.seconds["train"] == 0
    assert method.pass_seconds["forward"] > 0 and method.pass_seconds["backward"] > 0


def test_the_meter_times_what_ddp_waits_for_in_synchronize(world, fresh_meter):
    model, x, y = _pooled_problem(world.size)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    F.cross_entropy(model(x[:LOCAL_BATCH]), y[:LOCAL_BATCH]).backward()
    opt.step()
    assert fresh_meter.seconds["train"] > 0  # synchronize() ran inside the meter's timer
