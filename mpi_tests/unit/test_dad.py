"""dAD and rank-dAD without ranks: gradients from activations and deltas, rank rules, options."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.methods.dad import DadOptimizer
from hvd_lowcomm.methods.dad.lowrank import cheapest_way

from test_dad import cnn, mlp


def test_the_cheapest_way_follows_the_shapes():
    assert cheapest_way(rows=32, d_in=1024, d_out=1024, rank=8, iterations=10) == "exact"  # MLP, batch 32
    assert cheapest_way(rows=32 * 28 * 28, d_in=288, d_out=64, rank=8, iterations=10) == "gradient"  # conv
    assert cheapest_way(rows=512, d_in=4096, d_out=4096, rank=8, iterations=10) == "structured"  # wide, large batch


def test_edad_refuses_models_where_it_would_not_be_exact():
    with pytest.raises(ConfigError, match=r"layer 0 \(Conv2d\) breaks that"):
        DadOptimizer(torch.optim.SGD(cnn().parameters(), lr=0.1), cnn(), mode="edad")
    dropout = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Dropout(0.5), nn.Linear(4, 2))
    with pytest.raises(ConfigError, match=r"layer 2 \(Dropout\) breaks that"):
        DadOptimizer(torch.optim.SGD(dropout.parameters(), lr=0.1), dropout, mode="edad")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"rank": -1}, "rank must be >= 0 \\(0: adaptive\\), got -1"),
        ({"rank": 4, "tol": 0.0}, "rank-dad.tol must be > 0, got 0.0"),
        ({"mode": "rank", "min_rank": 40}, "rank-dad needs 1 <= min_rank <= max_rank, got 40 and 32"),
        ({"mode": "rank", "error_target": 1.0}, "error_target must be between 0 and 1"),
        ({"mode": "edad", "rank": 4}, "mode 'edad' is exact and takes no rank options"),
        ({"mode": "fast"}, "mode must be one of exact, rank, edad, got 'fast'"),
    ],
)
def test_bad_rank_dad_options_are_rejected(options, message):
    model = mlp()
    with pytest.raises(ConfigError, match=message):
        DadOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, **options)


def test_a_model_without_supported_layers_is_rejected():
    model = nn.Sequential(nn.BatchNorm1d(4))
    with pytest.raises(ConfigError, match="needs at least one layer it can form from rows"):
        DadOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
