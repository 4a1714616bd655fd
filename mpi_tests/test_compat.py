"""The compatibility matrix (docs/library.rst, "What works with what"): each supported cell is checked here against a
single-process reference on the pooled batch; unsupported ones are refused before training."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_lowcomm
from conftest import RANK, SIZE
from hvd_lowcomm import config
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.registry import spec
from hvd_lowcomm.models import mlp

LOCAL = 8


def pooled_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of the mean loss over the whole pooled batch, flattened (one process)."""
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    return torch.cat([p.grad.flatten() for p in reference.parameters()])


def pooled_problem():
    torch.manual_seed(1234)  # the same on every rank
    model = mlp((6,), 3, [16, 8])
    x, y = torch.randn(SIZE * LOCAL, 6), torch.randint(0, 3, (SIZE * LOCAL,))
    return model, x, y, slice(RANK * LOCAL, (RANK + 1) * LOCAL)


@pytest.mark.parametrize("name", ["ddp", "powersgd", "dad", "ab"])
def test_clip_grad_norm_clips_the_pooled_gradient(world, name):
    """SGD at lr 1 with a tiny clip: the step is -clip x the pooled gradient's direction (a clip
    of each rank's own gradient would give each rank a different step)."""
    model, x, y, local = pooled_problem()
    pooled = pooled_gradient(model, x, y)
    clip = 0.01
    assert pooled.norm() > 10 * clip
    step = one_sgd_step(name, model, x[local], y[local], "--train.clip_grad_norm", str(clip))
    torch.testing.assert_close(step, -clip * pooled / pooled.norm(), rtol=1e-4, atol=1e-7)


def one_sgd_step(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *argv: str) -> torch.Tensor:
    """The step (new - old parameters, flattened) one training step of method `name` takes
    with plain SGD at lr 1 on this rank's batch."""
    if name == "ab" and SIZE % 2:  # an odd rank count has one group, which only-b allows
        argv = (*argv, "--ab.groups", "1", "--ab.sync_mode", "only-b")
    if name == "powersgd":  # its first steps are plain means; float32 so they are exact
        argv = (*argv, "--powersgd.factor_dtype", "float32")
    method = spec(name).method(
        config.load(
            [
                "--method",
                name,
                "--train.optimizer",
                "sgd",
                "--train.momentum",
                "0",
                "--train.weight_decay",
                "0",
                "--train.lr",
                "1",
                *argv,
            ]
        )
    )
    method.setup(model)
    method.set_total_steps(100)
    dense = [p for n, p in model.named_parameters() if not n.endswith((".A", ".B"))]  # ab: W, not its factors
    before = [p.detach().clone() for p in dense]
    method.train_step(x, y)
    return torch.cat([(p.detach() - b).flatten() for p, b in zip(dense, before)])


@pytest.mark.parametrize("name", ["ddp", "powersgd", "dad", "ab"])
def test_accumulated_micro_batches_give_the_pooled_batch_gradient(world, name):
    model, x, y, local = pooled_problem()
    pooled = pooled_gradient(model, x, y)
    plan = ["--dad.plan", "all"] if name == "dad" else []  # rows shared for every layer (auto may allreduce all)
    step = one_sgd_step(name, model, x[local], y[local], "--train.accumulate", "3", *plan)
    torch.testing.assert_close(step, -pooled, rtol=1e-4, atol=1e-6)


def test_rank_dad_takes_the_same_step_with_accumulated_micro_batches(world):
    """rank-dAD is approximate; its factors come from the rows of all micro-batches together,
    so accumulating changes nothing."""
    model, x, y, local = pooled_problem()
    argv = ["--rank-dad.rank", "2", "--rank-dad.plan", "all", "--rank-dad.start_iter", "0"]
    whole = one_sgd_step("rank-dad", copy.deepcopy(model), x[local], y[local], *argv)
    accumulated = one_sgd_step("rank-dad", model, x[local], y[local], "--train.accumulate", "3", *argv)
    torch.testing.assert_close(accumulated, whole, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["ddp", "dad", "ab"])
def test_bf16_autocast_runs_the_forward_in_bf16_and_keeps_fp32_parameters(world, name):
    model, x, y, local = pooled_problem()
    pooled = pooled_gradient(model, x, y)
    seen = []
    model[1].register_forward_hook(lambda module, inputs, out: seen.append(out.dtype))
    plan = ["--dad.plan", "all"] if name == "dad" else []  # the rows path: bf16 activations sent as fp32
    step = one_sgd_step(name, model, x[local], y[local], "--train.amp", "bf16", *plan)
    assert seen == [torch.bfloat16]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # bf16 keeps 8 bits of mantissa: the step is the pooled gradient's to a few % (4.6 % measured at
    # np 4, where averaging makes the pooled gradient small); a wrong scale or a lost term is >= 50 %
    assert (step + pooled).norm() < 0.1 * pooled.norm()


REFUSALS = [
    (name, argv, what)
    for name in ("sil", "mp")
    for argv, what in (
        (["--train.clip_grad_norm", "1"], "train.clip_grad_norm"),
        (["--train.accumulate", "2"], "train.accumulate or train.amp"),
        (["--train.amp", "bf16"], "train.accumulate or train.amp"),
    )
]
REFUSALS += [
    ("edad", argv, "train.accumulate or train.amp") for argv in (["--train.accumulate", "2"], ["--train.amp", "bf16"])
]


@pytest.mark.parametrize("name, argv, what", REFUSALS)
def test_methods_refuse_what_they_cannot_honour(name, argv, what):
    method = spec(name).method(config.load(["--method", name, *argv]))
    with pytest.raises(ConfigError, match=f"{name} does not support {what}"):
        method.check_world(method.cfg, SIZE)


def wrap(kind: str, model: nn.Module, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    if kind == "ddp":
        return hvd_lowcomm.DistributedOptimizer(opt, model.named_parameters())
    if kind == "powersgd":  # its first steps are plain means; float32 so they are exact
        state = hvd_lowcomm.PowerSGDState(factor_dtype="float32")
        return hvd_lowcomm.PowerSGDOptimizer(opt, model.named_parameters(), state=state)
    return hvd_lowcomm.DadOptimizer(opt, model, plan="all")  # rows shared for every layer (the dAD path)


@pytest.mark.parametrize("kind", ["ddp", "powersgd", "dad"])
def test_frozen_layers_stay_as_they_are_and_the_rest_gets_the_pooled_gradient(world, kind):
    model, x, y, local = pooled_problem()
    model[1].requires_grad_(False)  # the first Linear: a frozen feature extractor
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    opt = wrap(kind, model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5))
    F.cross_entropy(model(x[local]), y[local]).backward()
    opt.step()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        expected = r.detach() if not r.requires_grad else r.detach() - 0.5 * r.grad
        torch.testing.assert_close(p.detach(), expected, rtol=1e-4, atol=1e-6, msg=name)


class SharedLayer(nn.Module):
    """The same Linear applied twice in one forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.shared, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        h = torch.relu(self.shared(h))
        return self.head(torch.relu(self.shared(h)))


def shared_layer_problem():
    torch.manual_seed(3)  # the same on every rank
    x, y = torch.randn(SIZE * LOCAL, 6), torch.randint(0, 3, (SIZE * LOCAL,))
    return SharedLayer(), x, y, slice(RANK * LOCAL, (RANK + 1) * LOCAL)


@pytest.mark.parametrize("kind", ["ddp", "powersgd", "dad"])
def test_a_layer_used_twice_in_one_step_gets_the_sum_of_both_uses(world, kind):
    model, x, y, local = shared_layer_problem()
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    opt = wrap(kind, model, torch.optim.SGD(model.parameters(), lr=0.5))
    F.cross_entropy(model(x[local]), y[local]).backward()
    opt.step()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), r.detach() - 0.5 * r.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_ab_sums_both_uses_of_a_factorised_layer_used_twice(world):
    model, x, y, local = shared_layer_problem()
    pooled = pooled_gradient(model, x, y)
    step = one_sgd_step("ab", model, x[local], y[local])  # warm-up: the dense W of the factorised layer
    torch.testing.assert_close(step, -pooled, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(SIZE % 2, reason="two AB groups need an even rank count")
def test_ab_keeps_frozen_layers_dense_and_untouched(world):
    model, x, y, local = pooled_problem()
    model[3].requires_grad_(False)  # the middle Linear (16 -> 8)
    frozen = model[3].weight.detach().clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    ab = hvd_lowcomm.ABTraining(
        model, opt, groups=2, warmup=1, sync_every=2, full_rank_steps=1, first_cut=0, full_rank=["first"]
    )
    assert "3" not in ab.layers and "5" in ab.layers
    for step in range(5):
        with ab.step(x[local], y[local]):
            opt.zero_grad()
            F.cross_entropy(model(x[local]), y[local]).backward()
    assert torch.equal(model[3].weight.detach(), frozen)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_asking_for_a_gpu_without_one_is_refused_before_training(shared_tmp, capsys):
    from hvd_lowcomm.train import main

    argv = ["--train.device", "cuda", "--data.path", str(shared_tmp / "digits.h5"), "--run.dir", str(shared_tmp / "r")]
    assert main(argv) == 2
    if RANK == 0:
        assert "train.device cuda, but this rank sees no CUDA GPU" in capsys.readouterr().err
