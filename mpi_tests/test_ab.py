"""AB-training: factorised layers, rank choice, groups, schedule, sync modes, optimiser state,
the final model, reporting."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from conftest import RANK, SIZE, needs_ranks
from hvd_lowcomm import config
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.methods.factorized import FactorizedLayer, choose_rank, dropped_fraction, factorize_model, noise_edge
from hvd_lowcomm.methods.ab import AB, Schedule, _resize
from hvd_lowcomm.checkpoint import Checkpointer
from hvd_lowcomm.train import main

LAYERS = {"linear": lambda: nn.Linear(7, 5), "linear-wide": lambda: nn.Linear(5, 7),
          "conv1d": lambda: nn.Conv1d(3, 8, 3), "conv2d": lambda: nn.Conv2d(3, 8, 3),
          "conv3d": lambda: nn.Conv3d(2, 4, 2), "conv2d-grouped": lambda: nn.Conv2d(4, 8, 3, groups=2),
          "conv2d-circular": lambda: nn.Conv2d(3, 6, 3, padding=1, padding_mode="circular")}
INPUTS = {"linear": (4, 7), "linear-wide": (4, 5), "conv1d": (2, 3, 9), "conv2d": (2, 3, 6, 6), "conv3d": (2, 2, 4, 4, 4),
          "conv2d-grouped": (2, 4, 6, 6), "conv2d-circular": (2, 3, 5, 5)}


@pytest.mark.parametrize("kind", list(LAYERS))
def test_at_full_rank_a_b_reproduce_the_layer(kind):
    torch.manual_seed(0)
    layer = LAYERS[kind]()
    x = torch.randn(*INPUTS[kind])
    expected = layer(x)
    wrapped = FactorizedLayer(layer)
    assert wrapped.factorize(rank=min(wrapped.tall_shape)) == min(wrapped.tall_shape)
    assert wrapped.A.shape[0] >= wrapped.B.shape[1]  # the tall orientation is factorised
    torch.testing.assert_close(wrapped(x), expected, rtol=1e-5, atol=1e-5)
    wrapped.densify()
    torch.testing.assert_close(wrapped(x), expected, rtol=1e-5, atol=1e-5)


def spectrum_matrix(spectrum: list[float], rows: int = 12, cols: int = 6, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, len(spectrum), generator=generator))
    v, _ = torch.linalg.qr(torch.randn(cols, len(spectrum), generator=generator))
    return u @ torch.diag(torch.tensor(spectrum)) @ v.T


def test_tau_rule_keeps_the_singular_values_above_tau_sigma1():
    s = torch.tensor([10.0, 5.0, 2.0, 0.9, 0.5])
    no_floor = s.square()  # any floor below 1 is met by keeping everything: use 0.99
    assert choose_rank(s, (12, 5), "tau", 0.1, no_floor, 0.99) == 3  # 10, 5, 2 > 1.0
    assert choose_rank(s, (12, 5), "tau", 0.04, no_floor, 0.99) == 5


def test_noise_rule_cuts_at_the_edge_of_a_random_bulk_and_ignores_an_outlier():
    torch.manual_seed(2)
    n = 256
    bulk = torch.randn(n, n) / n**0.5                  # Marchenko-Pastur bulk, edge at 2
    signal = spectrum_matrix([60.0, 8.0, 6.0, 5.0], n, n)  # one outlier, three learned directions
    s = torch.linalg.svdvals(bulk + signal)
    energy = s.square()
    assert choose_rank(s, (n, n), "noise", 0.15, energy, 0.99) == 4
    # the reference's rule measures against the outlier and cuts learned directions away
    assert choose_rank(s, (n, n), "tau", 0.15, energy, 0.99) == 1


def test_after_a_cut_the_edge_measured_on_the_bulk_keeps_small_updates_out():
    """After a cut W is low rank plus a few small optimiser updates: more than half of its
    singular values are ~0, so the median says nothing; the edge kept from the first
    factorisation does."""
    torch.manual_seed(3)
    n = 256
    signal = spectrum_matrix([60.0, 8.0, 6.0, 5.0], n, n)
    before = torch.linalg.svdvals(torch.randn(n, n) / n**0.5 + signal)
    edge = noise_edge(before, (n, n))
    updates = 1e-3 * torch.randn(n, 40) @ torch.randn(40, n) / n**0.5  # rank 40, small
    s = torch.linalg.svdvals(signal + updates)
    assert choose_rank(s, (n, n), "noise", 0.15, s.square(), 0.99) > 40  # the median is ~0: nothing is cut
    assert choose_rank(s, (n, n), "noise", 0.15, s.square(), 0.99, kept_edge=edge) == 4


def test_the_floor_raises_the_rank_until_the_dropped_share_is_bounded():
    s = torch.tensor([10.0, 5.0, 2.0, 0.9, 0.5])
    energy = s.square()
    rank = choose_rank(s, (12, 5), "tau", 0.9, energy, 0.1)
    assert rank == 3 and dropped_fraction(energy, rank) <= 0.1 < dropped_fraction(energy, rank - 1)


@pytest.mark.parametrize("kind", ["linear", "conv2d"])
def test_output_error_is_the_share_of_the_layer_output_a_cut_drops(kind):
    torch.manual_seed(4)
    layer = LAYERS[kind]()
    x = torch.randn(*INPUTS[kind]) @ torch.randn(INPUTS[kind][-1], INPUTS[kind][-1])  # correlated inputs
    wrapped = FactorizedLayer(layer)
    wrapped.record_inputs(x)
    svd = wrapped.spectrum()
    energy = wrapped.component_energy(svd)
    dense = wrapped(x) - (layer.bias.view(-1, *[1] * (x.dim() - 2)) if kind == "conv2d" else layer.bias)
    for rank in (1, 2, 3):
        wrapped.factorize(rank=rank, svd=svd)
        dropped = dense - (wrapped(x) - (layer.bias.view(-1, *[1] * (x.dim() - 2)) if kind == "conv2d" else layer.bias))
        expected = (dropped.norm() / dense.norm()).item()
        assert dropped_fraction(energy, rank) == pytest.approx(expected, rel=1e-3)
        wrapped.factorized = False


def low_rank_after_a_cut(rows: int, cols: int, seed: int = 5) -> tuple[FactorizedLayer, torch.Tensor]:
    """A layer as a re-factorisation finds it: a rank-12 product from the last cut (at rank 10)
    plus small full-rank updates, the bulk's edge kept from a random start, and recorded inputs
    that are correlated (so output and weight energies differ)."""
    torch.manual_seed(seed)
    layer = FactorizedLayer(nn.Linear(cols, rows))
    layer.noise_edge = noise_edge(layer.spectrum().s, layer.tall_shape)
    layer.factorize(rank=10)
    m, n = layer.tall_shape
    learned = torch.randn(m, 12) @ torch.diag(torch.linspace(3, 0.5, 12)) @ torch.randn(12, n) / (m * n) ** 0.25
    with torch.no_grad():
        layer.layer.weight.copy_(layer.weight_from_tall(learned + 1e-3 * torch.randn(m, n)))
    layer.factorized = False  # the full-rank phase trains the dense weight
    x = torch.randn(300, cols) @ torch.randn(cols, cols) / cols**0.5
    layer.record_inputs(x)
    return layer, x


@pytest.mark.parametrize("shape", [(512, 512), (256, 512), (512, 160)])  # square, wide (transposed), tall
def test_a_spectrum_of_the_leading_triplets_cuts_as_the_full_svd_and_knows_what_it_drops(shape):
    layer, x = low_rank_after_a_cut(*shape)
    full, leading = layer.spectrum(), layer.spectrum(leading=layer.rank)
    assert full.complete and not leading.complete and len(leading.s) == 2 * 10 + 16
    torch.testing.assert_close(leading.s[:12], full.s[:12], rtol=1e-4, atol=0)
    full_energy, leading_energy = layer.component_energy(full), layer.component_energy(leading)
    median = leading.median_bound(layer.tall_shape)
    assert median >= float(full.s.median())  # an upper bound of the median it did not compute
    for floor in (0.25, 0.01):
        rank = choose_rank(full.s, layer.tall_shape, "noise", 0.15, full_energy, floor, layer.noise_edge)
        assert rank == 12 and rank == choose_rank(leading.s, layer.tall_shape, "noise", 0.15, leading_energy,
                                                  floor, layer.noise_edge, median=median)
    x = x.double()  # in float64: a 0.3 % difference of two outputs is measured to 1e-6
    dense = x @ layer.weight().double().T
    for rank in (3, 12, 30):  # the tail, residual included, is exactly what the cut drops
        layer.factorize(rank=rank, svd=leading)
        dropped = (dense - x @ layer.weight().double().T).norm() / dense.norm()
        layer.factorized = False
        assert dropped_fraction(leading_energy, rank) == pytest.approx(dropped.item(), rel=1e-3, abs=1e-6)
        if rank <= leading.trusted:  # as good a cut as the full SVD's (past trusted: the bulk, in any order)
            assert dropped_fraction(leading.weight_energy(), rank) == pytest.approx(
                dropped_fraction(full.weight_energy(), rank), rel=1e-3, abs=1e-6)


def test_the_full_svd_is_taken_where_the_leading_triplets_would_not_decide_the_cut():
    layer, _ = low_rank_after_a_cut(256, 256)
    assert layer.spectrum(leading=60).complete  # too large a share of the spectrum to be cheaper
    assert not layer.spectrum(leading=10).complete
    with torch.no_grad():  # a new random bulk (a long full-rank phase): its median sets the threshold
        layer.layer.weight.add_(torch.randn(256, 256) / 256**0.5)
    assert layer.spectrum(leading=10).complete


def test_svd_signs_are_canonical():
    layer = FactorizedLayer(nn.Linear(5, 9))
    u, s, vh = layer.svd()
    assert (u.gather(0, u.abs().argmax(0, keepdim=True)) > 0).all()
    torch.testing.assert_close(u @ torch.diag(s) @ vh, layer.tall_matrix(), rtol=1e-5, atol=1e-5)


def test_conv_reshape_round_trips():
    conv = nn.Conv2d(3, 8, 3)
    wrapped = FactorizedLayer(conv)
    assert wrapped.transposed and wrapped.tall_shape == (27, 8)  # 8 x 27 is wide: factorise its transpose
    torch.testing.assert_close(wrapped.weight_from_tall(wrapped.tall_matrix()), conv.weight)


def test_first_and_last_layers_stay_full_rank_by_default():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    assert list(factorize_model(model, ["first", "last"])[0]) == ["2"]
    with pytest.raises(ConfigError, match="names layer 'fc9'"):
        factorize_model(nn.Sequential(nn.Linear(4, 3)), ["fc9"])


def test_optimizer_moments_are_sliced_or_padded():
    moment = torch.arange(12.0).reshape(3, 4)
    assert _resize(moment, torch.Size([3, 2])).tolist() == [[0, 1], [4, 5], [8, 9]]
    padded = _resize(moment, torch.Size([4, 5]))
    assert padded[:3, :4].equal(moment) and padded[3].abs().sum() == 0 and padded[:, 4].abs().sum() == 0


def test_schedule_phases_and_transitions():
    s = Schedule(config.load(["--ab.warmup", "3", "--ab.sync_every", "2", "--ab.full_rank_steps", "1"]).method_options["ab"], 100)
    assert [s.phase(t) for t in range(10)] == ["warmup"] * 3 + ["group", "group", "full"] * 2 + ["group"]
    assert [s.transitions(t) for t in (3, 5, 6, 8)] == [["factorize-first"], ["sync"], ["refactorize"], ["sync"]]
    s = Schedule(config.load(["--ab.warmup", "0", "--ab.sync_every", "2", "--ab.full_rank_steps", "0"]).method_options["ab"], 100)
    assert [s.transitions(t) for t in range(5)] == [["factorize-first"], [], ["sync", "refactorize"], [], ["sync", "refactorize"]]


def test_schedule_lengths_below_one_are_fractions_of_the_run():
    options = config.load(["--method", "ab", "--ab.rebound_steps", "0.02"]).method_options["ab"]  # 0.1, 0.05, 0.01, 0.5
    s = Schedule(options, total_steps=800)
    assert (s.warmup, s.sync_every, s.full_rank_steps, s.rebound_steps, s.first_cut) == (80, 40, 8, 16, 400)
    assert not s.cuts(399) and s.cuts(400)
    assert Schedule(options, total_steps=30).sync_every == 2
    with pytest.raises(ConfigError, match="ab.warmup = 0.1 is a fraction of the run"):
        Schedule(options)


@pytest.mark.parametrize("argv, message", [
    (["--ab.tau", "1.5"], r"ab.tau must be in \(0, 1\), got 1.5"),
    (["--ab.tau", "0"], r"ab.tau must be in \(0, 1\), got 0.0"),
    (["--ab.sync_every", "0"], "ab.sync_every must be > 0, got 0"),
    (["--ab.warmup", "2.5"], "ab.warmup must be a whole number of steps or a fraction below 1, got 2.5"),
    (["--ab.max_output_error", "1"], r"ab.max_output_error must be in \[0, 1\)"),
    (["--ab.first_cut", "-1"], "ab.first_cut must be >= 0, got -1"),
    (["--ab.first_cut", "1.5"], "ab.first_cut must be a whole number of steps or a fraction below 1, got 1.5"),
])
def test_invalid_settings_are_rejected(argv, message):
    with pytest.raises(ConfigError, match=message):
        config.load(["--method", "ab", *argv])


def test_ab_trains_with_adamw_and_weight_decay_unless_told_otherwise(tmp_path):
    assert (config.load(["--method", "ab"]).train.optimizer, config.load(["--method", "ab"]).train.weight_decay) == ("adamw", 0.1)
    assert (config.load(["--method", "ddp"]).train.optimizer, config.load(["--method", "ddp"]).train.weight_decay) == ("adam", 0.0)
    chosen = config.load(["--method", "ab", "--train.optimizer", "sgd", "--train.weight_decay", "0"])
    assert (chosen.train.optimizer, chosen.train.weight_decay) == ("sgd", 0.0)
    (tmp_path / "run.yaml").write_text("method: ab\ntrain:\n  weight_decay: 0.01\n")
    from_file = config.load(["--config", str(tmp_path / "run.yaml")])
    assert (from_file.train.optimizer, from_file.train.weight_decay) == ("adamw", 0.01)


def test_group_count_defaults_to_two_on_one_host_and_is_checked(world):
    method = AB(config.load(["--method", "ab"]))
    assert runtime.default_group_count(method.cfg.options.groups, SIZE) == 2  # the tests run on one host
    if SIZE % 2 == 0:
        method.check_world(method.cfg, SIZE)
    else:
        with pytest.raises(ConfigError, match=f"cannot split {SIZE} ranks into 2 equal groups"):
            method.check_world(method.cfg, SIZE)
    method = AB(config.load(["--method", "ab", "--ab.groups", str(SIZE + 1)]))
    with pytest.raises(ConfigError, match=f"cannot split {SIZE} ranks into {SIZE + 1} equal groups"):
        method.check_world(method.cfg, SIZE)
    with pytest.raises(ConfigError, match="needs at least 2 groups"):
        AB.check_world(config.load(["--method", "ab", "--ab.groups", "1"]), SIZE)
    AB.check_world(config.load(["--method", "ab", "--ab.groups", "1", "--ab.sync_mode", "only-b"]), SIZE)


class ReadsChildWeight(nn.Module):
    """Uses its child's weight without calling the child, as nn.MultiheadAttention does."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6)

    def forward(self, x):
        return nn.functional.linear(x, self.inner.weight)


class WithAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.attention, self.mid, self.head = nn.Linear(6, 8), nn.MultiheadAttention(8, 2), \
            nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.embed(x).unsqueeze(0)
        h, _ = self.attention(h, h, h)
        return self.head(torch.relu(self.mid(h.squeeze(0))))


def checked(model: nn.Module, *argv: str) -> AB:
    from types import SimpleNamespace

    method = AB(config.load(["--method", "ab", *argv]), SimpleNamespace(input_shape=(6,), vocabulary=None))
    method.check_model(model)
    return method


def test_multihead_attention_projections_stay_dense_and_the_model_still_computes_the_same():
    torch.manual_seed(5)
    model = WithAttention()
    checked(model)
    layers, dense = factorize_model(model, ["first", "last"])
    assert list(layers) == ["mid"]
    assert dense == {"attention.out_proj": "inside nn.MultiheadAttention, which reads its weight itself",
                     "embed": "ab.full_rank", "head": "ab.full_rank"}


def test_a_model_that_reads_a_factorised_weight_directly_is_refused_before_training():
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), ReadsChildWeight(), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(),
                          nn.Linear(6, 3))
    with pytest.raises(ConfigError, match="cannot factorise this model.*2.inner.*--ab.full_rank"):
        checked(model)
    checked(model, "--ab.full_rank", "first,last,2.inner")  # kept dense, it trains


def ab_method(*argv: str) -> AB:
    """AB on a tiny MLP; its cuts from the first re-factorisation on and without the rank floor
    unless argv says otherwise (these tests are about the rule, the floor of output error and
    the guards)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3))
    method = AB(config.load(["--method", "ab", "--ab.groups", "2", "--train.lr", "0.01", "--ab.min_rank_share", "0",
                             "--ab.first_cut", "0", *argv]))
    method.check_world(method.cfg, SIZE)
    method.setup(model)
    method.set_total_steps(100)  # resolves the schedule's fractions
    return method


def record_step_lrs(optimizer) -> list[float]:
    """The learning rate each optimizer.step() runs with, appended as it happens."""
    lrs: list[float] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: lrs.append(opt.param_groups[0]["lr"]))
    return lrs


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
        training_labels.setdefault(method.trainer.phase, set()).update(r.group for r in records if r.name.startswith("ab.grad."))
        if method.trainer.phase == "group":  # the first factorisation keeps every rank: nothing to agree on
            assert {r.name for r in records if r.group == "world"} == set()
        fresh_meter.next_step()
        if step == 4:  # last group step: the groups' models differ
            assert method.trainer.phase == "group" and method.trainer.layers["2"].factorized
    assert training_labels["group"] == {method.trainer.group.label}  # gradients averaged in this rank's group only
    assert training_labels["warmup"] == training_labels["full"] == {"world"}
    # step 5 began with a sync; afterwards every rank holds the same W
    weights = world.comm.allgather(method.trainer.layers["2"].layer.weight.detach().numpy())
    for w in weights[1:]:
        assert (w == weights[0]).all()


@needs_ranks(2)
@pytest.mark.parametrize("mode", ["with-stale", "only-learned"])
def test_sync_modes_combine_the_factors_as_specified(world, mode):
    method = ab_method("--ab.warmup", "0", "--ab.sync_mode", mode)
    method.train_step(*batch(0))  # factorises at step 0
    layer = method.trainer.layers["2"]
    generator = torch.Generator().manual_seed(9)  # the same on every rank
    a0, b0 = torch.randn(*layer.A.shape, generator=generator), torch.randn(*layer.B.shape, generator=generator)
    delta_a, delta_b = torch.randn(*a0.shape, generator=generator), torch.randn(*b0.shape, generator=generator)
    layer.A.data = a0 + delta_a if method.trainer.role == "A" else a0.clone()
    layer.B.data = b0 + delta_b if method.trainer.role == "B" else b0.clone()
    method.trainer._sync()
    expected = (a0 + delta_a / 2) @ (b0 + delta_b / 2) if mode == "with-stale" else (a0 + delta_a) @ (b0 + delta_b)
    torch.testing.assert_close(layer.tall_matrix(), expected, rtol=1e-5, atol=1e-5)
    assert not layer.factorized


@needs_ranks(2)
def test_lr_rebounds_after_a_switch_and_moments_follow_rank_changes(world):
    method = ab_method("--ab.warmup", "2", "--ab.sync_every", "3", "--ab.full_rank_steps", "2", "--ab.rebound_steps", "4",
                       "--ab.rebound_lr", "1e-5", "--ab.rank_rule", "tau", "--ab.tau", "0.3", "--ab.max_output_error", "0.9",
                       "--ab.max_accuracy_drop", "1", "--ab.max_loss_rise", "100", "--train.lr_schedule", "constant")
    lrs = record_step_lrs(method.optimizer)
    for step in range(10):
        method.set_lr(0.01)
        method.train_step(*batch(step))
    assert method.optimizer.param_groups[0]["lr"] == 0.01  # the schedule's value is left as it was
    assert lrs[:2] == [0.01, 0.01]                            # warm-up: no switch yet
    assert lrs[2] == pytest.approx(1e-5)                      # step 2: switch to the group phase
    assert lrs[3] == pytest.approx(1e-5 + (0.01 - 1e-5) / 4)  # ramps back linearly
    assert lrs[5] == pytest.approx(1e-5)                      # step 5: switch to the full phase
    layer = method.trainer.layers["2"]
    assert method.trainer.phase == "group" and layer.rank < 12        # step 7 re-factorised with truncation
    factor = getattr(layer, method.trainer.role)
    for value in method.optimizer.state[factor].values():
        if torch.is_tensor(value) and value.dim() == 2:
            assert value.shape == factor.shape


@needs_ranks(2)
def test_a_run_goes_through_every_phase_and_its_loss_decreases(shared_tmp):
    argv = ["--method", "ab", "--train.epochs", "6", "--data.path", str(shared_tmp / "digits.h5"),
            "--run.dir", str(shared_tmp / "runs"), "--run.name", "ab", "--run.progress", "false"]
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
        # model.pt is the synced model as a plain network: it scores what the last epoch reported
        import numpy as np

        from hvd_lowcomm import data, models

        info = data.inspect(shared_tmp / "digits.h5")
        model = models.build_model(config.load(argv).model, info.input_shape, info.num_classes)
        model.load_state_dict(torch.load(shared_tmp / "runs" / "ab" / "model.pt"))
        test = data.H5Split(info, "test")
        x, y = test.read(np.arange(len(test)))
        with torch.no_grad():
            accuracy = (model(x).argmax(1) == y).float().mean().item()
        assert accuracy == pytest.approx(epochs[-1]["test_acc"], abs=1e-6)  # one sample is 3e-3


@needs_ranks(2)
def test_lr_rebounds_at_every_sync_when_there_are_no_full_rank_steps(world):
    method = ab_method("--ab.warmup", "2", "--ab.sync_every", "3", "--ab.full_rank_steps", "0", "--ab.rebound_steps", "2",
                       "--ab.rebound_lr", "1e-5")
    lrs = record_step_lrs(method.optimizer)
    for step in range(9):
        method.set_lr(0.01)
        method.train_step(*batch(step))
    # switches at step 2 (factorise), 5 and 8 (sync + re-factorise), each followed by the ramp
    assert lrs == pytest.approx([0.01, 0.01, 1e-5, 0.005005, 0.01, 1e-5, 0.005005, 0.01, 1e-5])


@needs_ranks(2)
def test_groups_run_free_the_loop_checks_group_steps_inside_the_group(world, fresh_meter):
    """No world collective during a group phase, not even the loop's per-step checks; a
    preemption signal is acted on at the first step where all ranks meet."""
    from types import SimpleNamespace

    method = ab_method("--ab.warmup", "2", "--ab.sync_every", "4", "--ab.full_rank_steps", "1")
    signal = SimpleNamespace(received=None)
    keeper = Checkpointer(method.cfg, method, None, signal)
    world_groups = {}
    for step in range(8):
        method.train_step(*batch(step))
        if step == 3:
            signal.received = 15  # SIGTERM arrives during the group phase
        assert keeper.agree(False) is False
        world_groups[step] = {r.group for r in fresh_meter.step_records if r.group == "world"}
        stopping = keeper.stopping
        fresh_meter.next_step()
        if step in (2, 3, 4):  # group steps whose next step is a group step too
            assert world_groups[step] == set() and not stopping, step
    assert world_groups[5] == {"world"} and keeper.stopping  # step 6 starts with a sync: the world meets


@needs_ranks(2)
def test_inter_group_bytes_count_every_world_collective(world, fresh_meter):
    method = ab_method("--ab.warmup", "1", "--ab.sync_every", "2", "--ab.full_rank_steps", "1")
    keeper = Checkpointer(method.cfg, method, None, None)
    for step in range(5):
        method.train_step(*batch(step))
        keeper.agree(False)
        fresh_meter.next_step()
    world = sum(t.wire_bytes for (phase, _, group), t in fresh_meter.by_kind.items()
                if group == "world" and phase in ("train", "control"))
    assert fresh_meter.total("control", group="world") > 0
    assert method.epoch_metrics()["inter_group_wire_bytes"] == world


@needs_ranks(2)
def test_individual_mode_trains_each_rank_s_own_factor_until_the_sync(world, fresh_meter):
    method = ab_method("--ab.warmup", "1", "--ab.sync_every", "3", "--ab.full_rank_steps", "1", "--ab.comm", "individual")
    for step in range(3):
        method.train_step(*batch(step))
        names = {r.name for r in fresh_meter.step_records}
        fresh_meter.next_step()
    assert not any(n.endswith((".A", ".B")) for n in names if n.startswith("ab.grad."))
    assert any(n.startswith("ab.grad.") for n in names)  # 1-D and dense layers still averaged in the group
    factor = getattr(method.trainer.layers["2"], method.trainer.role).detach()
    copies = world.comm.allgather(factor.numpy())
    group_copies = [copies[r] for r in method.trainer.group.ranks]
    if len(group_copies) > 1:  # each rank trained on its own batches
        assert not (group_copies[0] == group_copies[1]).all()
    for step in range(3, 5):  # step 4 syncs: one W everywhere
        method.train_step(*batch(step))
    weights = world.comm.allgather(method.trainer.layers["2"].layer.weight.detach().numpy())
    assert all((w == weights[0]).all() for w in weights)


@needs_ranks(2)
def test_only_b_trains_b_everywhere_and_may_use_one_group(world):
    method = ab_method("--ab.warmup", "1", "--ab.sync_every", "2", "--ab.full_rank_steps", "1",
                       "--ab.sync_mode", "only-b", "--ab.groups", "1")
    assert method.trainer.role == "B" and len(method.trainer.all_groups) == 1
    method.train_step(*batch(0))
    method.train_step(*batch(1))  # group phase: B trained, A frozen
    layer = method.trainer.layers["2"]
    assert layer.B.requires_grad and not layer.A.requires_grad
    a_before = layer.A.detach().clone()
    method.train_step(*batch(2))
    method.train_step(*batch(3))  # sync: W = A0 B̄
    torch.testing.assert_close(layer.A.detach(), a_before)
    weights = world.comm.allgather(layer.layer.weight.detach().numpy())
    assert all((w == weights[0]).all() for w in weights)


@needs_ranks(2)
def test_ortho_sigma_init_sets_every_singular_value_to_one_on_every_rank(world):
    method = ab_method("--ab.init", "ortho-sigma", "--ab.warmup", "5")
    for name, p in method.model.named_parameters():
        if p.dim() == 2 and not name.endswith((".A", ".B")):
            torch.testing.assert_close(torch.linalg.svdvals(p.detach()), torch.ones(min(p.shape)), rtol=1e-4, atol=1e-4)
            copies = world.comm.allgather(p.detach().numpy())
            assert all((c == copies[0]).all() for c in copies)


def learnable_batch(step: int, n: int = 64):
    """A task the tiny model learns to high accuracy: the class is the argmax of a fixed map."""
    generator = torch.Generator().manual_seed(1000 * step + RANK)
    x = torch.randn(n, 6, generator=generator)
    return x, x[:, :3].argmax(1)


@needs_ranks(2)
@pytest.mark.parametrize("guard", [["--ab.max_accuracy_drop", "0.02", "--ab.max_loss_rise", "100"],
                                   ["--ab.max_accuracy_drop", "1", "--ab.max_loss_rise", "0.01"]],
                         ids=["accuracy", "loss"])
def test_a_cut_that_costs_accuracy_or_loss_is_undone_by_keeping_more_rank(world, guard):
    # A drastic rule (rank 1) with no floor; each guard alone must bring the batch's accuracy back.
    method = ab_method("--ab.warmup", "60", "--ab.sync_every", "2", "--ab.full_rank_steps", "1", "--ab.rank_rule", "tau",
                       "--ab.tau", "0.99", "--ab.max_output_error", "0.99", *guard, "--ab.first_full_rank", "true")
    for step in range(63):
        method.train_step(*learnable_batch(step))
    x, y = learnable_batch(63)
    method.train_step(x, y)  # step 63: re-factorisation
    assert method.trainer.undone_cuts >= 1 and method.trainer.layers["2"].rank > 1
    assert all(0.0 <= c["output_error"] <= 1.0 and 0.0 <= c["weight_error"] <= 1.0 for c in method.trainer.cuts.values())
    with torch.no_grad():
        accuracy = (method.model(x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.8


@needs_ranks(2)
@pytest.mark.parametrize("share, floor", [(0.25, 3), (0.5, 6)])
def test_a_cut_keeps_at_least_its_share_of_the_smaller_side(world, share, floor):
    # the drastic rule (rank 1), no guard: the floor alone decides the 16 x 12 layer's rank
    method = ab_method("--ab.warmup", "2", "--ab.sync_every", "2", "--ab.full_rank_steps", "1", "--ab.rank_rule", "tau",
                       "--ab.tau", "0.99", "--ab.max_output_error", "0.99", "--ab.max_accuracy_drop", "1",
                       "--ab.max_loss_rise", "100", "--ab.min_rank_share", str(share))
    for step in range(6):  # factorised at 2 (full rank), cut at 5
        method.train_step(*batch(step))
    assert method.trainer.cuts["2"]["rank"] == floor == method.trainer.layers["2"].rank


@needs_ranks(2)
def test_re_factorisations_before_the_first_cut_keep_every_singular_value(world):
    # the drastic rule (rank 1), no guard, first_cut at step 9: re-factorised at 5 and 8 with
    # every singular value, cut at 11, the first re-factorisation from step 9 on
    method = ab_method("--ab.warmup", "2", "--ab.sync_every", "2", "--ab.full_rank_steps", "1", "--ab.rank_rule", "tau",
                       "--ab.tau", "0.99", "--ab.max_output_error", "0.99", "--ab.max_accuracy_drop", "1",
                       "--ab.max_loss_rise", "100", "--ab.first_cut", "9")
    layer, ranks, cut = method.trainer.layers["2"], [], []
    for step in range(12):
        method.train_step(*batch(step))
        ranks.append(layer.rank)
        cut.append(bool(method.trainer.cuts))
    assert ranks[2:11] == [12] * 9 and not any(cut[:11])  # factorised at 2, re-factorised at 5 and 8: all kept
    assert ranks[11] == 1 == method.trainer.cuts["2"]["rank"]  # the rule's rank 1 at the first cut


@needs_ranks(2)
def test_the_final_model_is_the_synced_model_the_same_on_every_rank(world):
    method = ab_method("--ab.warmup", "1", "--ab.sync_every", "4", "--ab.full_rank_steps", "1")
    for step in range(3):  # ends inside the group phase: the groups' models differ
        method.train_step(*batch(step))
    final = method.final_state_dict()
    assert (final is not None) == (RANK == 0)
    synced = method.trainer.full_model().state_dict()
    assert set(synced) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}  # a plain model
    copies = world.comm.allgather({k: v.numpy() for k, v in synced.items()})
    for copy_ in copies:
        assert all((copy_[k] == copies[0][k]).all() for k in copy_)
    if RANK == 0:
        assert all(torch.equal(final[k], synced[k]) for k in synced)
    assert method.trainer.phase == "group" and method.trainer.layers["2"].factorized  # the groups' own state is untouched


@needs_ranks(2)
def test_compression_counts_a_and_b_of_every_factorised_layer_and_everything_dense(world):
    method = ab_method("--ab.warmup", "1", "--ab.sync_every", "2", "--ab.full_rank_steps", "1", "--ab.rank_rule", "tau",
                       "--ab.tau", "0.5", "--ab.max_output_error", "0.99", "--ab.max_accuracy_drop", "1", "--ab.max_loss_rise", "100")
    assert method.trainer.compression_ratio() == 1.0  # dense before the first factorisation
    for step in range(5):  # re-factorised at step 4
        method.train_step(*batch(step))
    r = method.trainer.layers["2"].rank
    assert r < 12
    dense = 6 * 16 + 16 + 12 + 12 * 3 + 3  # first and last layer, every bias
    full = dense + 16 * 12
    assert method.trainer.compression_ratio() == pytest.approx(full / (dense + r * (16 + 12)))
    metrics = method.epoch_metrics()
    assert metrics["compression_bound"] == pytest.approx(full / (dense + 16 + 12))
    assert metrics["low_rank_parameters"] == dense + r * (16 + 12)
    assert metrics["compression/2"] == pytest.approx(16 * 12 / (r * 28))


@needs_ranks(2)
@pytest.mark.parametrize("floor", [0.25, 1e-5])
def test_re_factorisations_after_a_cut_compute_only_the_leading_triplets_and_more_when_the_cut_needs_them(world, floor):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 3))
    with torch.no_grad():  # as if trained: a few learned directions over a small random bulk
        model[2].weight.copy_(spectrum_matrix([80.0, 60.0, 50.0, 40.0, 30.0, 20.0], 512, 512)
                              + 0.3 * torch.randn(512, 512) / 512**0.5)
    method = AB(config.load(["--method", "ab", "--ab.groups", "2", "--train.lr", "1e-4", "--ab.warmup", "1",
                             "--ab.min_rank_share", "0", "--ab.first_cut", "0",
                             "--ab.sync_every", "2", "--ab.full_rank_steps", "1",
                             "--ab.max_accuracy_drop", "1", "--ab.max_loss_rise", "100"]))  # an untrained model: its batch accuracy is noise
    method.setup(model)
    method.set_total_steps(100)
    layer = method.trainer.layers["2"]
    computed = []  # (leading asked for, complete) of every spectrum the re-factorisations take
    spectrum = layer.spectrum
    layer.spectrum = lambda leading=None: computed.append((leading, (s := spectrum(leading)).complete)) or s
    for step in range(8):  # factorise at 1 (full rank), cut at 4 (full SVD), cut again at 7
        method.train_step(*learnable_batch(step))
        if step == 4:
            assert computed[-1] == (512, True) and layer.rank == 6  # the learned directions
            method.trainer.options.max_output_error = floor
            computed.clear()
    assert computed[0] == (6, False), computed  # the second cut starts from the last rank's triplets
    assert method.trainer.cuts["2"]["output_error"] <= floor
    ranks = world.comm.allgather(layer.rank)
    assert ranks == [ranks[0]] * SIZE
    if floor < 0.01:  # that floor needs the optimiser's updates too: the leading triplets did not suffice
        assert len(computed) > 1 and layer.rank > 6 + 8
    else:
        assert computed == [(6, False)] and layer.rank == 6


@needs_ranks(2)
def test_an_outer_step_at_the_sync_moves_every_weight_from_where_the_group_phase_began(world):
    """With ab.outer_lr and ab.outer_momentum, a sync is DiLoCo's outer step on W = A B and the
    dense parameters: pseudo-gradient (start - plain synced value), first Nesterov step
    (1 + momentum) times it; lr 1 and momentum 0 leave the plain average."""
    def run(*argv):
        method = ab_method("--ab.warmup", "2", "--ab.sync_every", "3", "--ab.full_rank_steps", "1", *argv)
        for step in range(5):  # warm-up 0-1, factorised at full rank at 2, group steps 2-4
            method.train_step(*learnable_batch(step))
            if step == 1:
                start = dense(method.model)
        with method.trainer.synced() as model:  # the sync the next step would take
            synced = dense(model)
        return start, synced

    def dense(model):  # the weights (W, not its factors) and biases
        return [p.detach().clone() for n, p in model.named_parameters() if not n.endswith((".A", ".B"))]

    start, plain = run()
    lr, momentum = 0.5, 0.9
    same_start, outer = run("--ab.outer_lr", str(lr), "--ab.outer_momentum", str(momentum))
    for s, s2, p, o in zip(start, same_start, plain, outer):
        torch.testing.assert_close(s, s2)
        torch.testing.assert_close(o, s - lr * (1 + momentum) * (s - p), rtol=1e-4, atol=1e-5)
    assert any((o - p).abs().max() > 1e-4 for p, o in zip(plain, outer))  # the outer step did move them
