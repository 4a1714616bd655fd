"""The package root: Horovod-style names a user's own training loop needs."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hvd_lowcomm
from conftest import RANK, SIZE


def test_every_exported_name_resolves_to_the_implementation():
    from hvd_lowcomm import runtime, traffic
    from hvd_lowcomm.methods import dad, ddp, powersgd

    assert hvd_lowcomm.init is runtime.init and hvd_lowcomm.meter is traffic.meter
    assert hvd_lowcomm.DistributedOptimizer is ddp.DistributedOptimizer
    assert hvd_lowcomm.PowerSGDOptimizer is powersgd.PowerSGDOptimizer
    assert hvd_lowcomm.DadOptimizer is dad.DadOptimizer
    with pytest.raises(AttributeError, match="no attribute 'ABTrainer'"):
        hvd_lowcomm.ABTrainer  # noqa: B018


@pytest.mark.parametrize("wrapper", ["DistributedOptimizer", "PowerSGDOptimizer", "DadOptimizer"])
def test_a_users_own_loop_switches_method_by_the_optimizer_line(world, fresh_meter, wrapper):
    """The README's example: the same loop, one line changed; ranks end with the same model
    and the bytes are metered."""
    hvd_lowcomm.init()
    torch.manual_seed(0)  # the same initial model everywhere
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    make = getattr(hvd_lowcomm, wrapper)
    opt = make(base, model) if wrapper == "DadOptimizer" else make(base, model.named_parameters())
    generator = torch.Generator().manual_seed(RANK)  # each rank its own data
    for _ in range(3):
        x, y = torch.randn(16, 8, generator=generator), torch.randint(0, 3, (16,), generator=generator)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if SIZE > 1:
        assert hvd_lowcomm.meter.total("train") > 0
    copies = world.comm.allgather([p.detach().numpy() for p in model.parameters()])
    for copy in copies[1:]:
        assert all(abs(a - b).max() < 1e-5 for a, b in zip(copy, copies[0]))
