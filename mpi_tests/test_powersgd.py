"""PowerSGD: exact at or above the true rank, error feedback, bytes per compressed layer, and the
adaptive rank (grows to meet its error target, shrinks to what holds the energy, agreed by all)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import RANK
from hvd_lowcomm.methods.adaptive_rank import PROBES
from hvd_lowcomm.methods.powersgd import PowerSGDOptimizer, PowerSGDState
from hvd_lowcomm.train import main

N_OUT, N_IN = 10, 12


def layer_with_grads(world, weight_grad_of_rank, seed=0):
    """A Linear(12 -> 10) whose gradients are set by hand: weight from `weight_grad_of_rank(r)`,
    bias random per rank. Returns the layer and the mean gradients over ranks."""
    layer = torch.nn.Linear(N_IN, N_OUT)
    grads = [weight_grad_of_rank(r) for r in range(world.size)]
    biases = [torch.randn(N_OUT, generator=torch.Generator().manual_seed(seed + 100 + r)) for r in range(world.size)]
    layer.weight.grad = grads[world.comm.Get_rank()].clone()
    layer.bias.grad = biases[world.comm.Get_rank()].clone()
    return layer, torch.stack(grads).mean(0), torch.stack(biases).mean(0)


def rank2_grads(step=0):
    """Rank r's weight gradient A_r Bᵀ shares B, so the mean gradient has rank 2."""
    b = torch.randn(N_IN, 2, generator=torch.Generator().manual_seed(1000 + step))
    return lambda r: torch.randn(N_OUT, 2, generator=torch.Generator().manual_seed(10 * step + r)) @ b.T


def wrap(layer, **state):
    """PowerSGD on `layer`, compressing from the first step, in float32 (the default; float16
    factors on the wire have tests of their own)."""
    return PowerSGDOptimizer(
        torch.optim.SGD(layer.parameters(), lr=0.1),
        layer.named_parameters(),
        state=PowerSGDState(**{"start_iter": 0, "min_compression_rate": 1.0, "factor_dtype": "float32", **state}),
    )


@pytest.mark.parametrize("rank", [2, 4])
def test_at_or_above_the_true_rank_the_update_equals_plain_allreduce(world, rank):
    layer, mean_weight, mean_bias = layer_with_grads(world, rank2_grads())
    wrap(layer, rank=rank).synchronize()
    torch.testing.assert_close(layer.weight.grad, mean_weight, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.bias.grad, mean_bias, rtol=1e-6, atol=1e-7)


def test_below_the_true_rank_the_update_is_an_approximation(world):
    full_rank = lambda r: torch.randn(N_OUT, N_IN, generator=torch.Generator().manual_seed(r))  # noqa: E731
    layer, mean_weight, _ = layer_with_grads(world, full_rank)
    wrap(layer, rank=1).synchronize()
    error = (layer.weight.grad - mean_weight).norm() / mean_weight.norm()
    assert 0.2 < error < 1.0  # a rank-1 approximation of a random 10x12 mean: clearly not exact


@pytest.mark.parametrize("factor_dtype", ["float32", "float16"])
def test_error_feedback_carries_what_compression_dropped(world, factor_dtype):
    """sum_t M̂_t + mean_ranks(e_T) = sum_t mean_ranks(M_t): nothing is lost, only delayed
    (float16's rounding of the factors included)."""
    layer = torch.nn.Linear(N_IN, N_OUT)
    opt = wrap(layer, rank=1, factor_dtype=factor_dtype)
    applied, true_sum = torch.zeros(N_OUT, N_IN), torch.zeros(N_OUT, N_IN)
    for step in range(3):
        grads = [
            torch.randn(N_OUT, N_IN, generator=torch.Generator().manual_seed(50 * step + r)) for r in range(world.size)
        ]
        layer.weight.grad = grads[world.comm.Get_rank()].clone()
        layer.bias.grad = torch.zeros(N_OUT)
        local_input = layer.weight.grad + opt.powersgd.errors.get("weight", torch.zeros(N_OUT, N_IN))
        opt.synchronize()
        torch.testing.assert_close(opt.powersgd.errors["weight"], local_input - layer.weight.grad)
        applied += layer.weight.grad
        true_sum += torch.stack(grads).mean(0)
    mean_error = torch.from_numpy(world.comm.allreduce(opt.powersgd.errors["weight"].numpy()) / world.size)
    torch.testing.assert_close(applied + mean_error, true_sum, rtol=1e-4, atol=1e-5)


def test_bytes_recorded_are_n_plus_m_times_r_per_compressed_layer_and_probes_when_measuring(world, fresh_meter):
    layer, _, _ = layer_with_grads(world, rank2_grads())
    wrap(layer, rank=3).synchronize()
    payload = {r.name: (r.op, r.payload_bytes) for r in fresh_meter.step_records}
    # the first compressed step measures the error too: random probes ride with P
    assert payload == {
        "powersgd.P.weight": ("allreduce", N_OUT * (3 + PROBES) * 4),
        "powersgd.Q.weight": ("allreduce", N_IN * 3 * 4),
        "allreduce.bias": ("allreduce", N_OUT * 4),
    }  # 1-D tensors are never compressed


@pytest.mark.parametrize("compression", [None, "fp16"])
def test_float32_factors_are_the_default_and_horovods_fp16_compression_sends_float16(world, fresh_meter, compression):
    layer, _, _ = layer_with_grads(world, rank2_grads())
    state = PowerSGDState(start_iter=0, min_compression_rate=1.0, rank=3)
    opt = PowerSGDOptimizer(
        torch.optim.SGD(layer.parameters(), lr=0.1), layer.named_parameters(), compression=compression, state=state
    )
    opt.synchronize()
    assert opt.powersgd.options.factor_dtype == ("float16" if compression else "float32")
    # what P weighs on the wire: 2 bytes a number only where float16 was asked for and something is summed
    number = 2 if compression and world.size > 1 else 4
    payload = {r.name: r.payload_bytes for r in fresh_meter.step_records}
    assert payload["powersgd.P.weight"] == N_OUT * (3 + PROBES) * number


def test_float16_factors_halve_the_bytes_and_agree_their_scales_once(world, fresh_meter):
    layer, _, _ = layer_with_grads(world, rank2_grads())
    opt = wrap(layer, rank=3, factor_dtype="float16")
    opt.synchronize()
    payload = {(r.name, r.op, r.payload_bytes) for r in fresh_meter.step_records}
    if world.size == 1:  # nothing is summed, so nothing is rounded either
        assert ("powersgd.P.weight", "allreduce", N_OUT * (3 + PROBES) * 4) in payload
        return
    # the bias rides with P in float16; a number per tensor and round agrees the scales at the
    # first step (P's round: the weight's P and the uncompressed gradients; Q's round: Q)
    assert payload == {
        ("powersgd.P.weight", "allreduce", N_OUT * (3 + PROBES) * 2),
        ("powersgd.Q.weight", "allreduce", N_IN * 3 * 2),
        ("powersgd.uncompressed", "allreduce", N_OUT * 2),
        ("powersgd.scales", "allreduce", 2 * 4),
        ("powersgd.scales", "allreduce", 4),
    }
    fresh_meter.next_step()
    layer.weight.grad, layer.bias.grad = rank2_grads(1)(world.comm.Get_rank()).clone(), torch.zeros(N_OUT)
    opt.synchronize()  # later steps reuse the scales of the previous sums: no agreement
    assert {r.name for r in fresh_meter.step_records} == {
        "powersgd.P.weight",
        "powersgd.Q.weight",
        "powersgd.uncompressed",
    }
    assert set(opt.powersgd.state_dict()["wire"]) == {"powersgd.P.weight", "powersgd.Q.weight", "powersgd.uncompressed"}


@pytest.mark.parametrize("magnitude", [1e-9, 1.0, 1e6])
def test_float16_factors_keep_the_mean_at_any_magnitude(world, magnitude):
    """Where a plain cast to float16 would flush 1e-9 to zero or overflow at 1e6, the scaled
    factors give the mean gradient (rank 2, compressed at rank 3) within float16's rounding."""
    grads = lambda r: magnitude * rank2_grads()(r)  # noqa: E731
    layer, mean_weight, mean_bias = layer_with_grads(world, grads)
    bias = layer.bias.grad.clone() * magnitude  # the uncompressed gradient, on the same scale
    opt = wrap(layer, rank=3, factor_dtype="float16")
    for step in range(3):  # the first step agrees the scales, later ones carry them over
        layer.weight.grad, layer.bias.grad = grads(world.comm.Get_rank()).clone(), bias.clone()
        opt.powersgd.errors.clear()
        opt.synchronize()
        error = float((layer.weight.grad - mean_weight).norm() / mean_weight.norm())
        assert error < 3e-3, (step, error)
        bias_error = float((layer.bias.grad - magnitude * mean_bias).norm() / (magnitude * mean_bias).norm())
        assert bias_error < 3e-3, (step, bias_error)


def test_half_sums_redo_an_overflowing_sum_in_float32(world, fresh_meter):
    from hvd_lowcomm.comm.half_wire import HalfSums

    sums = HalfSums("test")
    ones = torch.ones(6)
    (total,), _ = sums.allreduce([("test.x", ones)], [], None)
    torch.testing.assert_close(total, torch.full((6,), float(world.size)))
    fresh_meter.next_step()
    huge = torch.arange(6.0) * 1e5 * (world.comm.Get_rank() + 1)  # far past the headroom left by the last sum
    (total,), _ = sums.allreduce([("test.x", huge)], [], None)
    torch.testing.assert_close(total, torch.arange(6.0) * 1e5 * world.size * (world.size + 1) / 2)
    attempts = [r.payload_bytes for r in fresh_meter.step_records if r.name == "test.x"]
    assert attempts == [6 * 2, 6 * 4]  # float16, overflowed; float32 again
    assert sums.largest["test.x"] == pytest.approx(5e5 * world.size * (world.size + 1) / 2)


@pytest.mark.parametrize("factor_dtype", ["float32", "float16"])
def test_plain_mean_until_start_iter_then_compression(world, fresh_meter, factor_dtype):
    """The start_iter steps send every gradient whole, as its mean, in factor_dtype: float16
    halves their bytes (a step of plain means is what a run's first steps cost) and keeps each
    tensor's mean within float16's rounding, under its own scale (the weight's gradient is 1e6
    times the bias's)."""
    layer, mean_weight, mean_bias = layer_with_grads(world, lambda r: torch.full((N_OUT, N_IN), r + 1.0))
    layer.bias.grad *= 1e-6
    opt = wrap(layer, rank=1, start_iter=1, adapt_every=3, factor_dtype=factor_dtype)
    opt.synchronize()
    for got, mean in ((layer.weight.grad, mean_weight), (layer.bias.grad, mean_bias * 1e-6)):
        assert float((got - mean).norm() / mean.norm()) < 1e-3  # float16 rounds by 2**-11 at most
    payload = {r.name: r.payload_bytes for r in fresh_meter.step_records}
    number = 2 if factor_dtype == "float16" and world.size > 1 else 4
    assert {k: v for k, v in payload.items() if k != "powersgd.scales"} == {
        "powersgd.warmup.weight": N_OUT * N_IN * number,
        "powersgd.warmup.bias": N_OUT * number,
    }
    assert ("powersgd.scales" in payload) == (number == 2)  # the scales are agreed once, in float16
    fresh_meter.next_step()
    layer.weight.grad, layer.bias.grad = torch.ones(N_OUT, N_IN), torch.ones(N_OUT)
    opt.synchronize()
    plain = "allreduce.bias" if number == 4 else "powersgd.uncompressed"
    assert {r.name for r in fresh_meter.step_records} - {"powersgd.scales"} == {
        "powersgd.P.weight",
        "powersgd.Q.weight",
        plain,
    }
    assert opt.powersgd.iter == 2 and opt.powersgd.qs["weight"].shape == (N_IN, 1)  # kept for warm start


def signal_and_noise(true_rank, step, noise=0.01, n=40, m=48):
    """Rank r's gradient: a shared rank-`true_rank` signal A B (A new each step, B fixed, as a
    layer's gradients keep their directions) plus a little noise of its own."""

    def grad(r):
        b = torch.randn(true_rank, m, generator=torch.Generator().manual_seed(7))
        a = torch.randn(n, true_rank, generator=torch.Generator().manual_seed(1000 + step))
        return a @ b + noise * torch.randn(n, m, generator=torch.Generator().manual_seed(100 * step + r))

    return grad


def adaptive_run(world, fresh_meter, grads_of_step, steps, **state):
    """An adaptive-rank PowerSGD on a Linear(48 -> 40) whose gradients are set by hand."""
    layer = torch.nn.Linear(48, 40)
    opt = PowerSGDOptimizer(
        torch.optim.SGD(layer.parameters(), lr=0.1),
        layer.named_parameters(),
        state=PowerSGDState(**{"start_iter": 0, "adapt_every": 3, "factor_dtype": "float32", "min_rank": 1, **state}),
    )
    history = []
    for step in range(steps):
        layer.weight.grad = grads_of_step(step)(world.comm.Get_rank()).clone()
        layer.bias.grad = torch.zeros(40)
        fresh_meter.next_step()
        opt.synchronize()
        history.append((opt.powersgd.ranks["weight"], {r.name: r.payload_bytes for r in fresh_meter.step_records}))
    return opt, history


@pytest.mark.parametrize("factor_dtype", ["float32", "float16"])
def test_the_adaptive_rank_grows_to_the_gradient_s_rank_and_then_keeps_its_energy(world, fresh_meter, factor_dtype):
    opt, history = adaptive_run(
        world,
        fresh_meter,
        lambda step: signal_and_noise(6, step),
        steps=12,
        error_target=0.05,
        factor_dtype=factor_dtype,
    )
    size = 2 if factor_dtype == "float16" and world.size > 1 else 4  # bytes per number of P
    ranks = [rank for rank, _ in history]
    # doubling, measured again at once after each change: 1 -> 2 -> 4 -> 8, at most 10 (where
    # compression stops paying); then it settles on what holds the rank-6 signal
    assert ranks[:3] == [2, 4, 8] and max(ranks) <= 10 and len(set(ranks[-4:])) == 1 and 5 <= ranks[-1] <= 8, ranks
    assert opt.powersgd.kept_energy["weight"] > 0.95
    assert world.comm.allgather(ranks) == [ranks] * world.size  # every rank agreed at every step
    # the probes ride with P only on measuring steps, with the agreement (one int64): step 2
    # measures (after the change at step 1)
    assert history[2][1]["powersgd.P.weight"] == 40 * (4 + PROBES) * size and history[2][1]["powersgd.ranks"] == 8
    quiet = next(records for _, records in history[3:] if "powersgd.ranks" not in records)
    assert quiet["powersgd.P.weight"] % (40 * size) == 0 and quiet["powersgd.P.weight"] // (40 * size) in ranks


def test_the_adaptive_rank_shrinks_to_what_holds_the_energy(world, fresh_meter):
    opt, history = adaptive_run(
        world, fresh_meter, lambda step: signal_and_noise(1, step), steps=4, min_rank=6, max_rank=16, error_target=0.2
    )
    assert [rank for rank, _ in history] == [6] * 4  # starts at min_rank and stays: shrinking stops there
    opt, history = adaptive_run(world, fresh_meter, lambda step: signal_and_noise(1, step), steps=4, error_target=0.2)
    assert [rank for rank, _ in history] == [1, 1, 1, 1]
    state = opt.powersgd
    state.ranks["weight"], state.next_measurement = 8, state.iter  # as if it had grown to 8
    next(iter(opt.param_groups[0]["params"])).grad = signal_and_noise(1, 9)(world.comm.Get_rank())
    opt.synchronize()
    assert state.ranks["weight"] == 1 and state.kept_energy["weight"] > 0.99


def test_a_fixed_rank_is_measured_but_never_changed(world, fresh_meter):
    opt, history = adaptive_run(world, fresh_meter, lambda step: signal_and_noise(6, step), steps=4, rank=2)
    assert [rank for rank, _ in history] == [2, 2, 2, 2]
    probed = [records["powersgd.P.weight"] == 40 * (2 + PROBES) * 4 for _, records in history]
    assert probed == [True, False, False, True]  # every adapt_every (3) steps, without an agreement
    assert not any("powersgd.ranks" in records for _, records in history)
    assert 0.2 < opt.powersgd.kept_energy["weight"] < 0.9  # rank 2 of a rank-6 mean: clearly not all of it


def test_the_adaptive_rank_survives_a_checkpoint(world, fresh_meter):
    opt, _ = adaptive_run(world, fresh_meter, lambda step: signal_and_noise(6, step), steps=5)
    restored = PowerSGDState()
    restored.load_state_dict(opt.powersgd.state_dict())
    assert restored.ranks == opt.powersgd.ranks and restored.next_measurement == opt.powersgd.next_measurement
    assert restored.kept_energy == opt.powersgd.kept_energy


def test_it_says_once_when_no_gradient_is_worth_compressing(world, capsys):
    layer, _, _ = layer_with_grads(world, rank2_grads())
    opt = wrap(layer, rank=8, min_compression_rate=2.0)  # (10 + 12) * 8 * 2 > 10 * 12: nothing pays
    for _ in range(2):
        opt.step()
        opt.zero_grad()
        layer.weight.grad, layer.bias.grad = torch.ones(N_OUT, N_IN), torch.ones(N_OUT)
    said = capsys.readouterr().out
    assert said.count("no gradient is a matrix large enough") == (1 if RANK == 0 else 0)
    assert opt.powersgd.compression_rate() == 1.0


def test_training_with_powersgd_compresses_and_learns(shared_tmp):
    # lr 1e-2: at np 4 three epochs are 36 steps, too few at the default 1e-3 for the accuracy check
    argv = [
        "--method",
        "powersgd",
        "--train.epochs",
        "3",
        "--train.lr",
        "0.01",
        "--data.path",
        str(shared_tmp / "digits.h5"),
        "--run.dir",
        str(shared_tmp / "runs"),
        "--run.name",
        "psgd",
        "--run.progress",
        "false",
    ]
    assert main(argv) == 0
    if RANK == 0:
        rows = [json.loads(line) for line in (shared_tmp / "runs" / "psgd" / "metrics.jsonl").read_text().splitlines()]
        last = [r for r in rows if r["type"] == "epoch"][-1]
        assert last["test_acc"] > 0.85 and last["powersgd_compression_rate"] > 3
        assert np.isfinite(last["train_loss"])


def test_step_after_synchronize_does_not_exchange_again(world, fresh_meter):
    """Horovod's contract: synchronize() then step() exchanges once, so the error feedback
    is fed once; the result equals a plain step()."""
    results = []
    for explicit in (False, True):
        layer, _, _ = layer_with_grads(world, rank2_grads(step=3))
        torch.nn.init.constant_(layer.weight, 0.5)
        opt = wrap(layer, rank=1)
        fresh_meter.reset()
        if explicit:
            opt.synchronize()
        opt.step()
        results.append((layer.weight.detach().clone(), len(fresh_meter.step_records)))
    (plain, plain_records), (synced, synced_records) = results
    assert synced_records == plain_records > 0
    torch.testing.assert_close(synced, plain, rtol=0, atol=0)


def test_compression_starts_at_the_rank_and_subspace_of_the_last_plain_mean(world, fresh_meter):
    # adaptive, one plain step: the mean has rank 2, so compression starts at rank 2 (not
    # min_rank 1) with Q in the mean's row space, and its first step is already exact
    layer, mean_weight, _ = layer_with_grads(world, rank2_grads())
    opt = wrap(layer, start_iter=1, min_rank=1)
    opt.synchronize()
    assert opt.powersgd.ranks == {"weight": 2}
    opt.step()  # applies the plain mean, so that the next synchronize() is a new step
    layer2, mean_weight2, _ = layer_with_grads(world, rank2_grads())
    layer.weight.grad, layer.bias.grad = layer2.weight.grad, layer2.bias.grad
    opt.synchronize()
    assert opt.powersgd.iter == 2 and opt.powersgd.ranks["weight"] == 2
    torch.testing.assert_close(layer.weight.grad, mean_weight2, rtol=1e-4, atol=1e-5)
