"""The package root: Horovod-style names a user's own training loop needs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hvd_lowcomm
from conftest import RANK, SIZE


@pytest.mark.parametrize("wrapper", ["DistributedOptimizer", "PowerSGDOptimizer", "DadOptimizer"])
def test_a_users_own_loop_switches_method_by_the_optimizer_line(world, fresh_meter, wrapper):
    """The front page's example (README.rst): the same loop, one line changed; ranks end with the same model
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


def learnable(step: int, n: int = 32, rank: int = RANK):
    """A batch of a task small models learn well: the class is the argmax of 3 features."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 6, generator=generator)
    return x, x[:, :3].argmax(1)


@pytest.mark.skipif(SIZE % 2, reason="two AB groups need an even rank count")
def test_ab_training_in_a_users_own_loop(world, fresh_meter):
    """The AB example (docs/library.rst): the user's model and optimiser, one `with ab.step(x, y):` per
    step; the user's LR is left as it was, groups train apart and the synced model is one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    ab = hvd_lowcomm.ABTraining(
        model, opt, total_steps=40, groups=2, warmup=0.25, sync_every=0.25, full_rank_steps=0.05
    )
    assert any(p is ab.layers["2"].A for p in opt.param_groups[0]["params"])  # the factors joined its group
    phases = set()
    for step in range(40):
        x, y = learnable(step)
        with ab.step(x, y):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
        phases.add(ab.phase)
        assert opt.param_groups[0]["lr"] == 0.01
    assert phases == {"warmup", "group", "full"} and ab.layers["2"].rank < 32  # re-factorised with a cut
    final = ab.full_model()
    assert not any(n.endswith((".A", ".B")) for n, _ in final.named_parameters())  # an ordinary network
    copies = world.comm.allgather([p.detach().numpy() for p in final.parameters()])
    assert all((a == b).all() for copy in copies for a, b in zip(copy, copies[0]))
    x, y = learnable(99, 400)
    with torch.no_grad():
        assert (final(x).argmax(1) == y).float().mean() > 0.75  # chance is 1/3
    if SIZE > 1:
        assert hvd_lowcomm.meter.total("train") > 0
    with pytest.raises(ValueError, match="unknown ab option\\(s\\) sync_evry"):
        hvd_lowcomm.ABTraining(
            nn.Sequential(nn.Linear(2, 2)), torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1), sync_evry=3
        )


@pytest.mark.skipif(SIZE % 2, reason="two SIL partitions need an even rank count")
def test_sil_in_a_users_own_loop_sends_nothing_between_partitions(world, fresh_meter):
    torch.manual_seed(0)
    model = nn.Sequential()
    for name, module in [
        ("fc1", nn.Linear(6, 64)),
        ("act1", nn.ReLU()),
        ("fc2", nn.Linear(64, 32)),
        ("act2", nn.ReLU()),
        ("fc3", nn.Linear(32, 32)),
        ("act3", nn.ReLU()),
        ("fc4", nn.Linear(32, 3)),
    ]:
        model.add_module(name, module)
    sil = hvd_lowcomm.SIL(model, input_shape=(6,), num_classes=3, cuts=["fc3"])  # by child name
    assert sil.layout.boundaries == [0, 4, 7] and len(sil.module) == (4 if sil.index == 0 else 3)
    opt = torch.optim.Adam(sil.module.parameters(), lr=0.01)
    for step in range(150):
        x, y = learnable(1000 * sil.data_rank + step)  # partners read the same samples
        sil.step(opt, x, y)
    assert fresh_meter.total("train", op="send") == 0  # parallel SIL: nothing between partitions
    correct, count, _ = sil.evaluate([learnable(5000, 200, rank=sil.data_rank)])
    if sil.layout.last:
        assert count == 200 and correct / count > 0.7, correct / count
    else:
        assert (correct, count) == (0, 0) and sil.diagnostics["code_accuracy"] > 0.7
    with pytest.raises(ValueError, match="SIL cut 'fc9' is not a child of the model"):
        hvd_lowcomm.SIL(model, (6,), 3, cuts=["fc9"])


@pytest.mark.skipif(SIZE < 2, reason="groups of the world")
def test_options_and_a_keyword_both_reach_a_group_trainer():
    from hvd_lowcomm.methods.diloco import DiLoCo, DiLoCoOptions

    model = nn.Linear(4, 2)
    diloco = DiLoCo(
        model, torch.optim.SGD(model.parameters(), lr=0.1), options=DiLoCoOptions(compression="fp16"), sync_every=2
    )
    assert (diloco.options.compression, diloco.options.sync_every) == ("fp16", 2)
