"""dAD, rank-dAD, edAD: pooled-batch gradients from shared activations and deltas."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import RANK, SIZE
from hvd_lowcomm.methods.dad.lowrank import WAYS, exact_factors, gradient_power_iteration, structured_power_iteration
from hvd_lowcomm.methods.dad import DadOptimizer
from hvd_lowcomm.methods.dad.factor_rows import FALLBACK_STEPS
from hvd_lowcomm.train import main


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def unequal_batches(p: int, rank: int, input_shape, classes: int, seed: int = 5, base: int = 3):
    """Pooled batch with base + r samples on rank r (identical on every rank), and this rank's slice."""
    sizes = [base + r for r in range(p)]
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), *input_shape, generator=generator)
    y = torch.randint(0, classes, (sum(sizes),), generator=generator)
    start = sum(sizes[:rank])
    return x, y, slice(start, start + sizes[rank]), sizes[rank]


def mlp() -> nn.Sequential:
    torch.manual_seed(11)
    return nn.Sequential(nn.Flatten(), nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))


def cnn() -> nn.Sequential:
    torch.manual_seed(12)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 5, 3, padding=2, dilation=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(5 * 5 * 5, 3),
    )


def pooled_and_distributed_grads(world, model, x, y, local, **dad_options):
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    opt = DadOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, **dad_options)
    F.cross_entropy(model(x[local]), y[local]).backward()
    opt.synchronize()
    return opt, [(n, p.grad, r.grad) for (n, p), r in zip(model.named_parameters(), reference.parameters())]


@pytest.mark.parametrize("build, input_shape", [(mlp, (6,)), (cnn, (2, 9, 9))], ids=["mlp", "cnn"])
def test_dad_gradient_equals_autograd_on_the_pooled_batch_with_unequal_batches(world, build, input_shape):
    x, y, local, _ = unequal_batches(world.size, world.comm.Get_rank(), input_shape, 3)
    _, grads = pooled_and_distributed_grads(world, build(), x, y, local, plan="all")
    for name, got, want in grads:
        assert relative_error(got, want) <= 1e-5, name


@pytest.mark.parametrize("mode", ["exact", "rank", "edad"])
def test_after_the_first_step_autograd_skips_the_weight_gradients_rows_replace_and_later_steps_stay_exact(world, mode):
    x, y, local, _ = unequal_batches(world.size, world.comm.Get_rank(), (6,), 3)
    model = mlp()
    model[1].bias = None  # a first layer without bias: its output's gradient needs its weight's
    reference = copy.deepcopy(model)
    # (rank-dAD without error feedback: with it, the factors come from the local gradient; float32
    # rows: the exactness of the algorithm, float16's rounding is tested on its own)
    options = (
        {"rank": 8, "start_iter": 0, "iterations": 300, "tol": 1e-9, "error_feedback": False}
        | {"factor_dtype": "float32"}
        if mode == "rank"
        else {}
    )
    opt = DadOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, mode=mode, plan="all", **options)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        F.cross_entropy(model(x[local]), y[local]).backward()
        F.cross_entropy(reference(x), y).backward()
        if step:  # only the first layer (no bias, input without gradient) still forms its local gradient
            assert [model[i].weight.requires_grad for i in (1, 3, 5)] == [True, False, False]
        opt.step()
        ref_opt.step()
        for (name, got), want in zip(model.named_parameters(), reference.parameters()):
            assert relative_error(got.grad, want.grad) <= 1e-4, (step, name)
            assert relative_error(got.detach(), want.detach()) <= 1e-5, (step, name)


@pytest.mark.parametrize("mode", ["exact", "edad"])
def test_a_layer_the_user_froze_keeps_its_weight(world, mode):
    x, y, local, _ = unequal_batches(world.size, world.comm.Get_rank(), (6,), 3)
    model = mlp()
    model[3].weight.requires_grad_(False)
    frozen = model[3].weight.detach().clone()
    opt = DadOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, mode=mode, plan="all")
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x[local]), y[local]).backward()
        opt.step()
    assert model[3].weight.grad is None and torch.equal(model[3].weight, frozen)
    assert not torch.equal(model[5].weight, mlp()[5].weight)  # the others trained


def test_bytes_per_layer_are_rows_times_fan_in_plus_fan_out(world, fresh_meter):
    rank = world.comm.Get_rank()
    x, y, local, n = unequal_batches(world.size, rank, (2, 9, 9), 3)
    pooled_and_distributed_grads(world, cnn(), x, y, local, plan="all")
    payload = {r.name: r.payload_bytes for r in fresh_meter.step_records if r.op == "allgather"}
    # conv 0: 5x5 output positions, 2*3*3 inputs, 4 outputs; conv 2: 5x5 positions, 4*3*3 in, 5 out
    assert payload["dad.0"] == n * 25 * (2 * 9 + 4) * 4
    assert payload["dad.2"] == n * 25 * (4 * 9 + 5) * 4
    assert payload["dad.5"] == n * (125 + 3) * 4  # Linear: N (d_in + d_out) float32


def test_the_plan_falls_back_to_allreduce_where_sharing_costs_more(world, fresh_meter):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    x, y, local, _ = unequal_batches(world.size, world.comm.Get_rank(), (64,), 2, base=8)
    opt, grads = pooled_and_distributed_grads(world, model, x, y, local, plan="auto")
    rows = sum(8 + r for r in range(world.size))  # 8..38 for 1..4 ranks
    # layer 0: rows*(64+64) shared < 2*(64*64+64) allreduced; layer 2: rows*(64+2) > 2*(64*2+2)
    assert rows * 128 < 2 * 4160 and rows * 66 > 2 * 130
    assert (opt.plan["0"].choice, opt.plan["2"].choice) == ("dad", "allreduce")
    names = {(r.op, r.name) for r in fresh_meter.step_records}
    assert ("allreduce", "allreduce.2.weight") in names and ("allreduce", "allreduce.2.bias") in names
    assert ("allgather", "dad.0") in names
    for name, got, want in grads:
        assert relative_error(got, want) <= 1e-5, name


def test_rank_dad_at_or_above_the_true_rank_reproduces_the_exact_gradient(world):
    x, y, local, n = unequal_batches(world.size, world.comm.Get_rank(), (6,), 3)
    # n <= 3 + (p-1) rows per rank: each local gradient has rank <= n < 8
    opt, grads = pooled_and_distributed_grads(
        world,
        mlp(),
        x,
        y,
        local,
        rank=8,
        start_iter=0,
        iterations=300,
        tol=1e-9,
        plan="all",
        error_feedback=False,
        factor_dtype="float32",
    )
    for name, got, want in grads:
        assert relative_error(got, want) <= 1e-4, name
    assert all(max(ks) <= n for ks in opt.effective_ranks.values())
    assert not any(opt.sharing.from_gradient(opt, name) for name in ("1", "3", "5"))  # few rows: exact from them


def test_rank_dad_takes_a_conv_layer_s_factors_from_its_gradient_and_stays_exact_at_its_rank(world):
    x, y, local, _ = unequal_batches(world.size, world.comm.Get_rank(), (2, 9, 9), 3)
    model = cnn()
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    opt = DadOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        rank=5,
        start_iter=0,
        iterations=10,
        tol=1e-9,
        plan="all",
        factor_dtype="float32",
    )  # its block is as wide as the gradient's rank: exact
    F.cross_entropy(model(x[local]), y[local]).backward()
    # 3..6 samples x 25 positions = 75..150 rows against 18 x 4 and 36 x 5 gradients
    assert opt.sharing.from_gradient(opt, "0") and opt.sharing.from_gradient(opt, "2")
    opt.synchronize()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert relative_error(got.grad, want.grad) <= 1e-4, name  # rank 5 >= both conv gradients' rank
    assert opt.effective_ranks["0"] == [4] and opt.effective_ranks["2"] == [5]


def test_adaptive_rank_dad_is_exact_at_a_tight_target_and_keeps_the_fewest_components_at_a_loose_one(world):
    x, y, local, n = unequal_batches(world.size, world.comm.Get_rank(), (6,), 3)
    opt, grads = pooled_and_distributed_grads(
        world,
        mlp(),
        x,
        y,
        local,
        mode="rank",
        start_iter=0,
        error_target=1e-9,
        iterations=300,
        tol=1e-9,
        plan="all",
        factor_dtype="float32",
    )
    for name, got, want in grads:
        assert relative_error(got, want) <= 1e-4, name
    model = mlp()
    local_grads = copy.deepcopy(model)
    F.cross_entropy(local_grads(x[local]), y[local]).backward()
    opt, _ = pooled_and_distributed_grads(
        world, model, x, y, local, mode="rank", start_iter=0, error_target=0.5, plan="all", min_rank=1
    )
    for name in ("1", "3", "5"):
        energies = torch.linalg.svdvals(local_grads.get_submodule(name).weight.grad).pow(2)
        missed = 1 - energies.cumsum(0) / energies.sum()
        k = opt.effective_ranks[name][-1]
        assert missed[k - 1] <= 0.5 + 1e-6 and (k == 1 or missed[k - 2] > 0.5), (name, k, missed)
        # the epoch record's missed_energy: the share of the gradient's energy the sent factors left out
        assert abs(opt.sharing.missed_shares[name][-1] - float(missed[k - 1])) <= 2e-3, (name, k, missed)
    assert not opt.sharing.feedback_norms  # a first step has no error to feed back
    # the floor: at least min_rank components where the layer has them, whatever the target
    opt, _ = pooled_and_distributed_grads(
        world, mlp(), x, y, local, mode="rank", start_iter=0, error_target=0.5, plan="all", min_rank=3
    )
    assert opt.effective_ranks["1"] == opt.effective_ranks["3"] == [3], opt.effective_ranks


@pytest.mark.parametrize("factor_dtype", ["float32", "float16"])
def test_rank_dad_error_feedback_carries_what_the_factors_dropped(world, factor_dtype):
    """Σ_t applied_t + Σ_s (N_s/N) e_s = Σ_t pooled_t: nothing is lost, only delayed (float16's
    rounding of the rows included)."""
    x, y, local, n = unequal_batches(world.size, world.comm.Get_rank(), (6,), 3)
    model = mlp()
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    opt = DadOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model,
        rank=1,
        start_iter=0,
        error_feedback=True,
        plan="all",
        factor_dtype=factor_dtype,
    )
    applied = {name: torch.zeros_like(model.get_submodule(name).weight) for name in ("1", "3", "5")}
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x[local]), y[local]).backward()
        opt.step()
        for name in applied:
            applied[name] += model.get_submodule(name).weight.grad
    total = float(world.comm.allreduce(n))
    for name, summed in applied.items():
        assert opt.sharing.from_gradient(opt, name)  # error feedback needs the local gradient itself
        mean_error = torch.from_numpy(world.comm.allreduce((n / total * opt.sharing.errors[name]).T.numpy()))
        want = 3 * reference.get_submodule(name).weight.grad
        assert relative_error(summed + mean_error, want) <= 1e-4, name
        assert relative_error(summed, want) > 1e-3, name  # rank 1 alone did drop something


def test_a_layer_whose_factors_keep_missing_the_target_falls_back_to_its_exact_gradient_and_loses_nothing(world):
    """One component cannot hold 1 % of these gradients' energy: after FALLBACK_STEPS steps over
    the target every layer allreduces its exact gradient, the first time with what its factors
    still owed, so that the steps' gradients add up to the pooled ones."""
    x, y, local, n = unequal_batches(world.size, world.comm.Get_rank(), (6,), 3)
    model = mlp()
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    opt = DadOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model,
        mode="rank",
        start_iter=0,
        min_rank=1,
        max_rank=1,
        error_target=0.01,
        plan="all",
        exact_fallback=True,
    )
    layers = ("1", "3", "5")
    applied = {name: torch.zeros_like(model.get_submodule(name).weight) for name in layers}
    steps = FALLBACK_STEPS + 2
    for step in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x[local]), y[local]).backward()
        opt.step()
        for name in layers:
            applied[name] += model.get_submodule(name).weight.grad
        assert opt.sharing.exact == ([] if step < FALLBACK_STEPS - 1 else list(layers)), step
    for name in layers:
        want = reference.get_submodule(name).weight.grad
        assert relative_error(model.get_submodule(name).weight.grad, want) <= 1e-5, name  # the last step: exact
        assert relative_error(applied[name], steps * want) <= 1e-4, name
    assert not opt.sharing.errors and opt.effective_ranks["1"] == [1] * FALLBACK_STEPS


def test_rank_dad_s_first_start_iter_steps_allreduce_exact_gradients_then_factors_start(world, fresh_meter):
    """start_iter 2 at rank 1: steps 1 and 2 give the pooled gradient exactly through one
    allreduce, with no factor rows sent; step 3 sends rows and its gradient is rank 1's."""
    x, y, local, _ = unequal_batches(world.size, world.comm.Get_rank(), (6,), 3)
    model = mlp()
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    opt = DadOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, rank=1, start_iter=2, plan="all")
    for step in range(3):
        opt.zero_grad()
        fresh_meter.reset()
        F.cross_entropy(model(x[local]), y[local]).backward()
        opt.step()
        names = [r.name for r in fresh_meter.step_records]
        sent_rows = [n for n in names if n.startswith("rank-dad.") and not n.startswith("rank-dad.warmup.")]
        assert any(n.startswith("rank-dad.warmup.") for n in names) == (step < 2), (step, names)
        for name in ("1", "3", "5"):
            error = relative_error(model.get_submodule(name).weight.grad, reference.get_submodule(name).weight.grad)
            assert (error <= 1e-5) == (step < 2), (step, name, error)
        assert bool(sent_rows) == (step == 2), (step, sent_rows)
    assert opt.effective_ranks["1"] == [1] and not opt.sharing.fallen_back()


@pytest.mark.parametrize("magnitude", [1e-9, 1.0, 1e6])
def test_rank_dad_float16_rows_halve_the_bytes_and_keep_the_gradient_at_any_magnitude(world, fresh_meter, magnitude):
    """At full rank the float16 rows (each scaled by its own power of two) give the pooled
    gradient within float16's rounding, for losses so small or large that a plain cast would
    flush or overflow; each row is 2 bytes a number (and 8 for the scales of its two parts)."""
    x, y, local, _ = unequal_batches(world.size, world.comm.Get_rank(), (6,), 3)
    model = mlp()
    reference = copy.deepcopy(model)
    (magnitude * F.cross_entropy(reference(x), y)).backward()
    opt = DadOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        rank=8,
        start_iter=0,
        iterations=300,
        tol=1e-9,
        plan="all",
        error_feedback=False,
    )
    (magnitude * F.cross_entropy(model(x[local]), y[local])).backward()
    opt.synchronize()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert relative_error(got.grad, want.grad) <= (1e-3 if world.size > 1 else 1e-4), name
    for record in fresh_meter.step_records:
        if record.name.startswith("rank-dad.") and not record.name.endswith(".scales") and world.size > 1:
            layer = model.get_submodule(record.name.split(".", 1)[1])
            rows = opt.effective_ranks[record.name.split(".", 1)[1]][-1]
            assert record.payload_bytes == rows * (layer.in_features + layer.out_features) * 2, record


@pytest.mark.parametrize("way", WAYS)
def test_every_way_to_rank_dad_s_factors_is_within_5_percent_of_the_truncated_svd(way):
    generator = torch.Generator().manual_seed(RANK)
    acts = torch.randn(128, 40, generator=generator)
    low_rank = torch.randn(40, 4, generator=generator) @ torch.randn(4, 30, generator=generator)
    deltas = acts @ low_rank + 0.3 * torch.randn(128, 30, generator=generator)
    gradient = acts.T @ deltas
    u, s, vh = torch.linalg.svd(gradient)
    for r in (2, 4):
        b_rows, c_rows = {
            "exact": lambda: exact_factors(acts, deltas, r, tol=1e-3),
            "gradient": lambda: gradient_power_iteration(gradient, r, 10, 1e-3, generator),
            "structured": lambda: structured_power_iteration(acts, deltas, r, 10, 1e-3, generator),
        }[way]()
        svd_error = relative_error(u[:, :r] @ torch.diag(s[:r]) @ vh[:r], gradient)
        assert b_rows.shape == (r, 40) and c_rows.shape == (r, 30)
        assert relative_error(b_rows.T @ c_rows, gradient) <= (1 + 1e-4 if way == "exact" else 1.05) * svd_error, r


def test_edad_equals_dad(world):
    x, y, local, _ = unequal_batches(world.size, world.comm.Get_rank(), (6,), 3)
    _, dad = pooled_and_distributed_grads(world, mlp(), x, y, local, plan="all")
    _, edad = pooled_and_distributed_grads(world, mlp(), x, y, local, mode="edad")
    for (name, got, _), (_, want, _) in zip(edad, dad):
        assert relative_error(got, want) <= 1e-5, name


@pytest.mark.parametrize("method", ["dad", "rank-dad", "edad"])
def test_training_with_dad_methods_reports_plan_and_layer_bytes(shared_tmp, method):
    # lr 1e-2: at np 4 two epochs are 24 steps, too few at the default 1e-3 for the accuracy check
    argv = [
        "--method",
        method,
        "--train.epochs",
        "2",
        "--train.lr",
        "0.01",
        "--data.path",
        str(shared_tmp / "digits.h5"),
        "--run.dir",
        str(shared_tmp / "runs"),
        "--run.name",
        method,
        "--run.progress",
        "false",
    ]
    assert main(argv) == 0
    if RANK == 0:
        epochs = [
            json.loads(line)
            for line in (shared_tmp / "runs" / method / "metrics.jsonl").read_text().splitlines()
            if '"epoch"' in line and '"type": "epoch"' in line
        ]
        assert len(epochs) == 2 and epochs[-1]["test_acc"] > 0.8
        assert {k for k in epochs[-1] if k.startswith("plan/")} == {"plan/1", "plan/3", "plan/5"}
        if SIZE > 1:
            assert any(k.startswith("layer_payload_bytes/") for k in epochs[-1])
        if method == "rank-dad":
            assert (
                1 <= epochs[-1]["effective_rank/1"] <= 32
            )  # at most max_rank; below min_rank where the gradient has fewer
            assert 0 <= epochs[-1]["missed_energy/1"] <= 1 and epochs[-1]["feedback_norm/1"] >= 0


def test_edad_on_a_cnn_is_rejected_before_training(shared_tmp, capsys):
    argv = [
        "--method",
        "edad",
        "--model.name",
        "cnn",
        "--model.hidden",
        "4",
        "--data.path",
        str(shared_tmp / "digits.h5"),
        "--run.dir",
        str(shared_tmp / "runs"),
    ]
    assert main(argv) == 2
    if RANK == 0:
        assert "error (all ranks): edAD is exact only for Linear layers" in capsys.readouterr().err
    assert not (shared_tmp / "runs").exists()
