"""AB-training: factorised layers, groups, schedule, sync modes, optimiser state, reporting."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from conftest import RANK, SIZE, needs_ranks
from hvd_lowcomm import config
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.factorized import FactorizedLayer, factorize_model, rank_for
from hvd_lowcomm.methods.ab import ABTraining, Schedule, _resize
from hvd_lowcomm.train import main


def test_svd_split_reproduces_w_at_full_rank():
    torch.manual_seed(0)
    for layer in (nn.Linear(7, 5), nn.Linear(5, 7), nn.Conv2d(3, 8, 3)):
        original = layer.weight.detach().clone()
        wrapped = FactorizedLayer(layer)
        assert wrapped.factorize(tau=0.1, truncate=False) == min(wrapped.tall_shape)
        assert wrapped.A.shape[0] >= wrapped.B.shape[1]  # the tall orientation is factorised
        torch.testing.assert_close(wrapped.weight(), original, rtol=1e-5, atol=1e-5)


def test_tau_keeps_the_singular_values_above_tau_sigma1():
    torch.manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(12, 5))
    v, _ = torch.linalg.qr(torch.randn(6, 5))
    spectrum = torch.tensor([10.0, 5.0, 2.0, 0.9, 0.5])
    layer = nn.Linear(6, 12, bias=False)
    layer.weight.data = u @ torch.diag(spectrum) @ v.T
    assert rank_for(spectrum, 0.1) == 3  # 10, 5, 2 > 1.0
    wrapped = FactorizedLayer(layer)
    assert wrapped.factorize(tau=0.1, truncate=True) == 3
    assert wrapped.factorize(tau=0.04, truncate=True) == 5
    assert wrapped.A.shape == (12, 5) and wrapped.B.shape == (5, 6)


def test_conv_reshape_round_trips():
    conv = nn.Conv2d(3, 8, 3)
    wrapped = FactorizedLayer(conv)
    assert wrapped.transposed and wrapped.tall_shape == (27, 8)  # 8 x 27 is wide: factorise its transpose
    torch.testing.assert_close(wrapped.weight_from_tall(wrapped.tall_matrix()), conv.weight)


def test_first_and_last_layers_stay_full_rank_by_default():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    assert list(factorize_model(model, ["first", "last"])) == ["2"]
    with pytest.raises(ConfigError, match="names layer 'fc9'"):
        factorize_model(nn.Sequential(nn.Linear(4, 3)), ["fc9"])


def test_optimizer_moments_are_sliced_or_padded():
    moment = torch.arange(12.0).reshape(3, 4)
    assert _resize(moment, torch.Size([3, 2])).tolist() == [[0, 1], [4, 5], [8, 9]]
    padded = _resize(moment, torch.Size([4, 5]))
    assert padded[:3, :4].equal(moment) and padded[3].abs().sum() == 0 and padded[:, 4].abs().sum() == 0


def test_schedule_phases_and_transitions():
    s = Schedule(config.load(["--ab.warmup", "3", "--ab.sync_every", "2", "--ab.full_rank_steps", "1"]).method_options["ab"])
    assert [s.phase(t) for t in range(10)] == ["warmup"] * 3 + ["group", "group", "full"] * 2 + ["group"]
    assert [s.transitions(t) for t in (3, 5, 6, 8)] == [["factorize-first"], ["sync"], ["refactorize"], ["sync"]]
    s = Schedule(config.load(["--ab.warmup", "0", "--ab.sync_every", "2", "--ab.full_rank_steps", "0"]).method_options["ab"])
    assert [s.transitions(t) for t in range(5)] == [["factorize-first"], [], ["sync", "refactorize"], [], ["sync", "refactorize"]]


@pytest.mark.parametrize("argv, message", [
    (["--ab.tau", "1.5"], r"ab.tau must be in \(0, 1\), got 1.5"),
    (["--ab.tau", "0"], r"ab.tau must be in \(0, 1\), got 0.0"),
    (["--ab.sync_every", "0"], "ab.sync_every must be >= 1, got 0"),
])
def test_invalid_settings_are_rejected(argv, message):
    with pytest.raises(ConfigError, match=message):
        config.load(["--method", "ab", *argv])


def test_groups_that_do_not_divide_the_world_are_rejected(world):
    method = ABTraining(config.load(["--method", "ab", "--ab.groups", str(SIZE + 1)]))
    with pytest.raises(ConfigError, match=f"cannot split {SIZE} ranks into {SIZE + 1} equal groups"):
        method.check_world(SIZE)
    with pytest.raises(ConfigError, match="needs at least 2 groups"):
        ABTraining(config.load(["--method", "ab", "--ab.groups", "1"])).check_world(SIZE)


def ab_method(*argv: str) -> ABTraining:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3))
    method = ABTraining(config.load(["--method", "ab", "--ab.groups", "2", "--train.lr", "0.01", *argv]))
    method.check_world(SIZE)
    method.setup(model)
    return method


def batch(step: int):
    generator = torch.Generator().manual_seed(100 * step + RANK)
    return torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)


@needs_ranks(2)
def test_group_phase_sends_nothing_across_groups_and_a_sync_leaves_every_rank_with_the_same_w(world, fresh_meter):
    method = ab_method("--ab.warmup", "2", "--ab.sync_every", "3", "--ab.full_rank_steps", "1")
    training_labels: dict[str, set[str]] = {}
    for step in range(6):
        method.train_step(*batch(step))
        records = fresh_meter.step_records
        training_labels.setdefault(method.phase, set()).update(r.group for r in records if r.name.startswith("ab.grad."))
        if method.phase == "group":  # the only world collective: agreeing on ranks when the phase starts
            assert {r.name for r in records if r.group == "world"} == ({"ab.ranks"} if step == 2 else set())
        fresh_meter.next_step()
        if step == 4:  # last group step: the groups' models differ
            assert method.phase == "group" and method.layers["2"].factorized
    assert training_labels["group"] == {method.group.label}  # gradients averaged in this rank's group only
    assert training_labels["warmup"] == training_labels["full"] == {"world"}
    # step 5 began with a sync; afterwards every rank holds the same W
    weights = world.comm.allgather(method.layers["2"].layer.weight.detach().numpy())
    for w in weights[1:]:
        assert (w == weights[0]).all()


@needs_ranks(2)
@pytest.mark.parametrize("mode", ["with-stale", "only-learned"])
def test_sync_modes_combine_the_factors_as_specified(world, mode):
    method = ab_method("--ab.warmup", "0", "--ab.sync_mode", mode)
    method.train_step(*batch(0))  # factorises at step 0
    layer = method.layers["2"]
    generator = torch.Generator().manual_seed(9)  # the same on every rank
    a0, b0 = torch.randn(*layer.A.shape, generator=generator), torch.randn(*layer.B.shape, generator=generator)
    delta_a, delta_b = torch.randn(*a0.shape, generator=generator), torch.randn(*b0.shape, generator=generator)
    layer.A.data = a0 + delta_a if method.role == "A" else a0.clone()
    layer.B.data = b0 + delta_b if method.role == "B" else b0.clone()
    method._sync()
    expected = (a0 + delta_a / 2) @ (b0 + delta_b / 2) if mode == "with-stale" else (a0 + delta_a) @ (b0 + delta_b)
    torch.testing.assert_close(layer.tall_matrix(), expected, rtol=1e-5, atol=1e-5)
    assert not layer.factorized


@needs_ranks(2)
def test_lr_rebounds_after_a_switch_and_moments_follow_rank_changes(world):
    method = ab_method("--ab.warmup", "2", "--ab.sync_every", "3", "--ab.full_rank_steps", "2", "--ab.rebound_steps", "4",
                       "--ab.rebound_lr", "1e-5", "--ab.tau", "0.3", "--train.lr_schedule", "constant")
    lrs = []
    for step in range(10):
        method.set_lr(0.01)
        method.train_step(*batch(step))
        lrs.append(method.optimizer.param_groups[0]["lr"])
    assert lrs[:2] == [0.01, 0.01]                            # warm-up: no switch yet
    assert lrs[2] == pytest.approx(1e-5)                      # step 2: switch to the group phase
    assert lrs[3] == pytest.approx(1e-5 + (0.01 - 1e-5) / 4)  # ramps back linearly
    assert lrs[5] == pytest.approx(1e-5)                      # step 5: switch to the full phase
    layer = method.layers["2"]
    assert method.phase == "group" and layer.rank < 12        # step 7 re-factorised with truncation
    factor = getattr(layer, method.role)
    for value in method.optimizer.state[factor].values():
        if torch.is_tensor(value) and value.dim() == 2:
            assert value.shape == factor.shape


@needs_ranks(2)
def test_a_run_goes_through_every_phase_and_its_loss_decreases(shared_tmp):
    argv = ["--method", "ab", "--ab.groups", "2", "--ab.warmup", "15", "--ab.sync_every", "10", "--ab.full_rank_steps", "4",
            "--train.epochs", "6", "--data.path", str(shared_tmp / "digits.h5"), "--run.dir", str(shared_tmp / "runs"),
            # lr 1e-2: in 6 epochs at the default 1e-3 no singular value falls below tau * sigma_1 yet
            "--train.lr", "0.01", "--run.name", "ab", "--run.progress", "false"]
    assert main(argv) == 0
    if RANK == 0:
        rows = [json.loads(line) for line in (shared_tmp / "runs" / "ab" / "metrics.jsonl").read_text().splitlines()]
        epochs = [r for r in rows if r["type"] == "epoch"]
        assert {"warmup", "group", "full"} >= {e["phase"] for e in epochs} and len({e["phase"] for e in epochs}) >= 2
        assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
        assert epochs[-1]["test_acc"] > 0.8
        assert epochs[-1]["rank/3"] < 128  # re-factorised with truncation at least once
        assert epochs[-1]["inter_group_wire_bytes"] > 0 and epochs[-1]["intra_group_wire_bytes"] >= 0
        assert epochs[-1]["compression_ratio"] > 1.0
        assert (shared_tmp / "runs" / "ab" / "rank.png").exists()
