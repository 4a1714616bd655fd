"""PowerSGD without ranks: start rank and subspace, the rank floor, options."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.methods.adaptive_rank import PROBES, next_rank, probe_residual, probes, smallest_rank_within
from hvd_lowcomm.methods.powersgd import PowerSGDState, compresses, highest_rank


def test_the_min_compression_rate_rule_decides_which_layers_are_compressed():
    options = PowerSGDState(rank=2, min_compression_rate=2.0).options
    assert compresses(100, 100, options) == (True, 2)  # (100+100)*2*2 = 800 < 10000
    assert compresses(10, 12, options) == (True, 2)  # (10+12)*2*2 = 88 < 120
    assert compresses(6, 8, options) == (False, 2)  # (6+8)*2*2 = 56 >= 48
    assert compresses(1, 50, options) == (False, 1)  # rank capped at min(n, m) = 1: 102 >= 50


@pytest.mark.parametrize(
    "options, message",
    [
        ({"rank": -1}, "powersgd.rank must be >= 0"),
        ({"error_target": 0.0}, "error_target must be between 0 and 1"),
        ({"min_rank": 4, "max_rank": 2}, "min_rank <= max_rank"),
        ({"adapt_every": 0}, "adapt_every must be >= 1"),
    ],
)
def test_bad_options_are_rejected(options, message):
    with pytest.raises(ConfigError, match=message):
        PowerSGDState(**options)


def test_the_adaptive_rank_is_bounded_where_compression_stops_paying():
    options = PowerSGDState(min_compression_rate=2.0, max_rank=64, min_rank=1).options
    assert options.adaptive and compresses(100, 100, options) == (True, 1)  # starts at min_rank
    # the default floor: a matrix is compressed only where rank 16 pays
    assert compresses(100, 100, PowerSGDState().options) == (True, 16)
    assert compresses(60, 60, PowerSGDState().options) == (False, 16)
    assert highest_rank(100, 100, options) == 24  # (100+100)*24*2 = 9600 < 10000 <= 200*25*2
    assert highest_rank(1000, 1000, options) == 64  # max_rank
    assert highest_rank(100, 100, PowerSGDState(rank=3).options) == 3  # a fixed rank stays put


def test_probes_estimate_the_energy_a_basis_misses():
    generator = torch.Generator().manual_seed(3)
    m = torch.randn(60, 8, generator=generator) @ torch.randn(8, 50, generator=generator)
    basis = torch.linalg.svd(m, full_matrices=False).U[:, :3]
    truth = float((m - basis @ (basis.T @ m)).pow(2).sum())
    estimates = [probe_residual(basis, m @ probes(50, generator, m)) for _ in range(400)]
    assert abs(np.mean(estimates) / truth - 1) < 0.05  # unbiased: the mean of 400 within 5 %
    assert np.std(estimates) / truth < 2 / PROBES**0.5  # and one estimate is not wild


def test_next_rank_doubles_on_a_miss_shrinks_with_a_margin_and_keeps_within_its_bounds():
    energies = torch.tensor([50.0, 30.0, 10.0, 5.0])  # 95 kept at rank 4, 5 missed: 100 in all
    # a shrink keeps within half the allowance: 25 (two leave out 20), 15 (three leave out 10)
    assert next_rank(4, energies, missed=5.0, allowed=50.0, lowest=1, highest=32) == 2
    assert next_rank(4, energies, missed=5.0, allowed=30.0, lowest=1, highest=32) == 3
    assert next_rank(4, energies, missed=5.0, allowed=50.0, lowest=3, highest=32) == 3
    assert next_rank(4, energies, missed=5.0, allowed=4.0, lowest=1, highest=32) == 8  # 5 missed > 4 allowed
    assert next_rank(4, energies, missed=5.0, allowed=4.0, lowest=1, highest=6) == 6
    assert next_rank(4, energies, missed=5.0, allowed=8.0, lowest=1, highest=32) == 4  # within, no room to shrink
    assert smallest_rank_within(energies, 100.0, 0.5) == 1 and smallest_rank_within(energies, 200.0, 0.5) == 4
