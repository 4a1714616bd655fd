"""AB-training without ranks: SVD factors, rank rules and cuts, schedules, option checks, models it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hvd_lowcomm import config
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.methods.ab import AB, Schedule, _resize
from hvd_lowcomm.methods.ab.factorized import (
    FactorizedLayer,
    choose_rank,
    dropped_fraction,
    factorize_model,
    noise_edge,
)

from test_ab import spectrum_matrix


LAYERS = {
    "linear": lambda: nn.Linear(7, 5),
    "linear-wide": lambda: nn.Linear(5, 7),
    "conv1d": lambda: nn.Conv1d(3, 8, 3),
    "conv2d": lambda: nn.Conv2d(3, 8, 3),
    "conv3d": lambda: nn.Conv3d(2, 4, 2),
    "conv2d-grouped": lambda: nn.Conv2d(4, 8, 3, groups=2),
    "conv2d-circular": lambda: nn.Conv2d(3, 6, 3, padding=1, padding_mode="circular"),
}


INPUTS = {
    "linear": (4, 7),
    "linear-wide": (4, 5),
    "conv1d": (2, 3, 9),
    "conv2d": (2, 3, 6, 6),
    "conv3d": (2, 2, 4, 4, 4),
    "conv2d-grouped": (2, 4, 6, 6),
    "conv2d-circular": (2, 3, 5, 5),
}


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


def test_tau_rule_keeps_the_singular_values_above_tau_sigma1():
    s = torch.tensor([10.0, 5.0, 2.0, 0.9, 0.5])
    no_floor = s.square()  # any floor below 1 is met by keeping everything: use 0.99
    assert choose_rank(s, (12, 5), "tau", 0.1, no_floor, 0.99) == 3  # 10, 5, 2 > 1.0
    assert choose_rank(s, (12, 5), "tau", 0.04, no_floor, 0.99) == 5


def test_noise_rule_cuts_at_the_edge_of_a_random_bulk_and_ignores_an_outlier():
    torch.manual_seed(2)
    n = 256
    bulk = torch.randn(n, n) / n**0.5  # Marchenko-Pastur bulk, edge at 2
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
        assert rank == 12 and rank == choose_rank(
            leading.s, layer.tall_shape, "noise", 0.15, leading_energy, floor, layer.noise_edge, median=median
        )
    x = x.double()  # in float64: a 0.3 % difference of two outputs is measured to 1e-6
    dense = x @ layer.weight().double().T
    for rank in (3, 12, 30):  # the tail, residual included, is exactly what the cut drops
        layer.factorize(rank=rank, svd=leading)
        dropped = (dense - x @ layer.weight().double().T).norm() / dense.norm()
        layer.factorized = False
        assert dropped_fraction(leading_energy, rank) == pytest.approx(dropped.item(), rel=1e-3, abs=1e-6)
        if rank <= leading.trusted:  # as good a cut as the full SVD's (past trusted: the bulk, in any order)
            assert dropped_fraction(leading.weight_energy(), rank) == pytest.approx(
                dropped_fraction(full.weight_energy(), rank), rel=1e-3, abs=1e-6
            )


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
    s = Schedule(
        config.load(["--ab.warmup", "3", "--ab.sync_every", "2", "--ab.full_rank_steps", "1"]).method_options["ab"], 100
    )
    assert [s.phase(t) for t in range(10)] == ["warmup"] * 3 + ["group", "group", "full"] * 2 + ["group"]
    assert [s.transitions(t) for t in (3, 5, 6, 8)] == [["factorize-first"], ["sync"], ["refactorize"], ["sync"]]
    s = Schedule(
        config.load(["--ab.warmup", "0", "--ab.sync_every", "2", "--ab.full_rank_steps", "0"]).method_options["ab"], 100
    )
    assert [s.transitions(t) for t in range(5)] == [
        ["factorize-first"],
        [],
        ["sync", "refactorize"],
        [],
        ["sync", "refactorize"],
    ]


def test_schedule_lengths_below_one_are_fractions_of_the_run():
    options = config.load(["--method", "ab", "--ab.rebound_steps", "0.02"]).method_options["ab"]  # 0.1, 0.05, 0.01, 0.5
    s = Schedule(options, total_steps=800)
    assert (s.warmup, s.sync_every, s.full_rank_steps, s.rebound_steps, s.first_cut) == (80, 40, 8, 16, 400)
    assert not s.cuts(399) and s.cuts(400)
    assert Schedule(options, total_steps=30).sync_every == 2
    with pytest.raises(ConfigError, match="ab.warmup = 0.1 is a fraction of the run"):
        Schedule(options)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ab.cut.tau", "1.5"], r"ab.cut.tau must be in \(0, 1\), got 1.5"),
        (["--ab.cut.tau", "0"], r"ab.cut.tau must be in \(0, 1\), got 0.0"),
        (["--ab.sync_every", "0"], "ab.sync_every must be > 0, got 0"),
        (["--ab.warmup", "2.5"], "ab.warmup must be a whole number of steps or a fraction below 1, got 2.5"),
        (["--ab.cut.max_output_error", "1"], r"ab.cut.max_output_error must be in \[0, 1\)"),
        (["--ab.first_cut", "-1"], "ab.first_cut must be >= 0, got -1"),
        (["--ab.first_cut", "1.5"], "ab.first_cut must be a whole number of steps or a fraction below 1, got 1.5"),
    ],
)
def test_invalid_settings_are_rejected(argv, message):
    with pytest.raises(ConfigError, match=message):
        config.load(["--method", "ab", *argv])


def test_ab_trains_with_adamw_and_weight_decay_unless_told_otherwise(tmp_path):
    assert (config.load(["--method", "ab"]).train.optimizer, config.load(["--method", "ab"]).train.weight_decay) == (
        "adamw",
        0.1,
    )
    assert (config.load(["--method", "ddp"]).train.optimizer, config.load(["--method", "ddp"]).train.weight_decay) == (
        "adam",
        0.0,
    )
    chosen = config.load(["--method", "ab", "--train.optimizer", "sgd", "--train.weight_decay", "0"])
    assert (chosen.train.optimizer, chosen.train.weight_decay) == ("sgd", 0.0)
    (tmp_path / "run.yaml").write_text("method: ab\ntrain:\n  weight_decay: 0.01\n")
    from_file = config.load(["--config", str(tmp_path / "run.yaml")])
    assert (from_file.train.optimizer, from_file.train.weight_decay) == ("adamw", 0.01)


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
        self.embed, self.attention, self.mid, self.head = (
            nn.Linear(6, 8),
            nn.MultiheadAttention(8, 2),
            nn.Linear(8, 8),
            nn.Linear(8, 3),
        )

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
    assert dense == {
        "attention.out_proj": "inside nn.MultiheadAttention, which reads its weight itself",
        "embed": "ab.full_rank",
        "head": "ab.full_rank",
    }


def test_a_model_that_reads_a_factorised_weight_directly_is_refused_before_training():
    model = nn.Sequential(
        nn.Linear(6, 6), nn.ReLU(), ReadsChildWeight(), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3)
    )
    with pytest.raises(ConfigError, match="cannot factorise this model.*2.inner.*--ab.full_rank"):
        checked(model)
    checked(model, "--ab.full_rank", "first,last,2.inner")  # kept dense, it trains
