"""SIL and model parallelism without ranks: cuts, codes, partition checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hvd_lowcomm import config
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.methods.partition import can_learn, cut_points, partition_table
from hvd_lowcomm.models import cnn, mlp, sil6

from test_partition import six_layer_mlp


def test_partitions_cover_every_layer_exactly_once():
    model = six_layer_mlp()
    for k in (2, 3, 6):
        bounds = cut_points(model, k, [])
        pieces = [list(model)[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        assert [id(m) for piece in pieces for m in piece] == [id(m) for m in model]
        assert all(any(p.numel() for m in piece for p in m.parameters()) for piece in pieces)


@pytest.mark.parametrize(
    "k, cuts, message",
    [
        (7, [], "7 partitions but the model has only 6 layers with weights"),
        (2, [0], r"cuts \[0\] must be 1 increasing module indices"),
        (3, [5, 3], r"cuts \[5, 3\] must be 2 increasing"),
    ],
)
def test_bad_partitionings_are_rejected(k, cuts, message):
    with pytest.raises(ConfigError, match=message):
        cut_points(six_layer_mlp(), k, cuts)


def conv_net_with_dense_head(input_shape=(1, 28, 28)) -> nn.Sequential:
    """Two conv blocks, then three fully connected layers: SIL can cut among those."""
    trunk = list(cnn(input_shape, 10, [8, 16]))[:-1]  # ... AdaptiveAvgPool2d, Flatten
    return nn.Sequential(
        *trunk, nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    )


DEEP_ENOUGH = [  # (model, input shape, partitions): every one has a cut that gives each partition depth
    *[(sil6(shape, 10, [256] * 5), shape, 2) for shape in ((64,), (784,), (3, 32, 32), (40,))],
    (mlp((784,), 10, [512, 256, 128, 64, 32]), (784,), 2),
    (mlp((784,), 10, [2048] * 4), (1, 28, 28), 2),
    (mlp((784,), 10, [256] * 7), (784,), 3),
    (mlp((784,), 10, [256] * 7), (784,), 4),
    (mlp((20,), 5, [64] * 9), (20,), 3),
    (mlp((784,), 10, [256, 256, 256], dropout=0.2), (784,), 2),
    (conv_net_with_dense_head(), (1, 28, 28), 2),
]


@pytest.mark.parametrize("model, input_shape, k", DEEP_ENOUGH)
def test_the_default_sil_cut_never_leaves_a_partition_affine(model, input_shape, k):
    bounds = cut_points(model, k, [], True, input_shape)
    modules = list(model)
    assert len(bounds) == k + 1 and bounds[0] == 0 and bounds[-1] == len(modules)
    for a, b in zip(bounds[:-1], bounds[1:]):
        kinds = [type(m).__name__ for m in modules[a:b]]
        weights = [i for i, m in enumerate(modules[a:b]) if isinstance(m, (nn.Linear, nn.Conv2d))]
        assert len(weights) >= 2, kinds
        assert any(isinstance(m, nn.ReLU) for m in modules[a:b][weights[0] : weights[-1]]), kinds
    # ... and among the block cuts (before a weight layer) that keep that depth, its largest
    # partition is the smallest possible.
    import itertools

    table_max = max(p["parameter_share"] for p in partition_table(model, bounds))
    block_starts = [i for i, m in enumerate(modules) if i and isinstance(m, (nn.Linear, nn.Conv2d))]
    for combo in itertools.combinations(block_starts, k - 1):
        candidate = [0, *combo, len(modules)]
        flat = all(not isinstance(m, nn.Conv2d) for m in modules[combo[0] :])  # cuts stay out of the convolutions
        if flat and all(can_learn(modules[a:b]) for a, b in zip(candidate[:-1], candidate[1:])):
            assert table_max <= max(p["parameter_share"] for p in partition_table(model, candidate)) + 1e-12


def test_sil6_on_mnist_keeps_every_partition_under_65_percent_of_the_parameters():
    shares = [
        p["parameter_share"]
        for p in partition_table(sil6((784,), 10, [256] * 5), cut_points(sil6((784,), 10, [256] * 5), 2, [], True))
    ]
    assert max(shares) < 0.65 and sum(shares) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "model, k, needed, hidden",
    [
        (mlp((40,), 10, [256, 256]), 2, "at least 4 weight layers; this model has 3", "--model.hidden 256,256,256"),
        (
            sil6((784,), 10, [64] * 5),
            4,
            "at least 8 weight layers; this model has 6",
            "--model.hidden 256,256,256,256,256,256,256) or at most 3 partitions",
        ),
        (mlp((40,), 10, [8]), 2, "this model has 2", "--model.name sil6"),
    ],
)
def test_a_model_too_shallow_for_sil_is_refused_with_what_would_do(model, k, needed, hidden):
    with pytest.raises(ConfigError) as caught:
        cut_points(model, k, [], need_depth=True)
    assert needed in str(caught.value) and hidden in str(caught.value)
    assert cut_points(model, k, [], need_depth=False)  # model parallelism can still cut it


@pytest.mark.parametrize(
    "model, k", [(cnn((1, 28, 28), 10, [16, 32, 32, 64]), 2), (cnn((3, 32, 32), 10, [8, 8, 16, 16, 32, 32]), 3)]
)
def test_sil_refuses_to_cut_inside_the_convolutions_by_default(model, k):
    with pytest.raises(ConfigError) as caught:
        cut_points(model, k, [], True, (model[0].in_channels, 28, 28))
    assert "no cut into" in str(caught.value) and "outside this model's convolutional part" in str(caught.value)
    assert 'docs: methods/sil, "Where it cuts"' in str(caught.value)  # where the measured reason is
    assert "--sil.cuts" in str(caught.value) and "Use mp" in str(caught.value)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    training = [m.training for m in model.modules()]
    assert cut_points(model, k, [], False, (model[0].in_channels, 28, 28))  # model parallelism can still cut it
    # the dry run that found the activation shapes left the model as it was
    assert all(torch.equal(value, model.state_dict()[key]) for key, value in state.items())
    assert [m.training for m in model.modules()] == training


def test_sil_and_mp_train_the_six_layer_network_unless_told_otherwise():
    for method in ("sil", "mp"):
        cfg = config.load(["--method", method])
        assert cfg.model.name == "sil6"
    assert config.load([]).model.name == "mlp"
    assert config.load(["--method", "sil", "--model.name", "cnn"]).model.name == "cnn"
    with pytest.raises(ConfigError, match="sil6 has six fully connected layers, so --model.hidden takes five widths"):
        sil6((64,), 10, [32, 32])


def test_a_non_sequential_model_is_rejected():
    class Branchy(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(ConfigError, match="needs an nn.Sequential model"):
        cut_points(Branchy(), 2, [])


def test_bad_sil_options_are_rejected():
    with pytest.raises(ConfigError, match="sil.kappa must be > 0, got 0.0"):
        config.load(["--method", "sil", "--sil.kappa", "0"])
    with pytest.raises(ConfigError, match=r"sil.epochs needs one positive value per partition \(2\)"):
        config.load(["--method", "sil", "--sil.epochs", "3"])
    with pytest.raises(ConfigError, match=r"sil.recovery_lr must be > 0 \(a fraction of train.lr\), got 0.0"):
        config.load(["--method", "sil", "--sil.recovery_lr", "0"])
