"""benchmarks.gradient_signal: the signal, noise and ranks it reads off independent batches, and a run's files."""

from __future__ import annotations

import csv

import pytest
import torch

from benchmarks.gradient_signal import Pooled, main
from conftest import RANK, random_images


def test_signal_noise_and_ranks_of_gradients_whose_split_is_known():
    torch.manual_seed(RANK)
    signal = torch.randn(24, 3) @ torch.randn(3, 40) / 4  # rank 3, the expected gradient G
    noise_std = 0.6
    pooled = Pooled()
    for _ in range(200):  # measurements of K = 4 batches: G plus independent isotropic noise
        pooled.add([signal + noise_std * torch.randn(24, 40) for _ in range(4)], ranks=2)
    trace_sigma = noise_std**2 * 24 * 40
    assert pooled.signal / 200 == pytest.approx(float(signal.pow(2).sum()), rel=0.05)
    assert pooled.noise / 200 == pytest.approx(trace_sigma, rel=0.02)
    row = pooled.row(ranks=2, batch=16)
    g2 = float(signal.pow(2).sum())
    assert row["signal share of the mean"] == pytest.approx(g2 / (g2 + trace_sigma / 2), abs=0.02)
    assert row["noise scale B (samples)"] == pytest.approx(trace_sigma * 16 / g2, rel=0.06)
    assert row["signal rank"] <= 3  # the noise averages out of the cross terms
    assert row["mean's rank"] >= 10  # the mean of two batches still carries the flat noise


def test_a_run_writes_a_row_per_weight_matrix_and_third(tmp_path):
    main(
        [
            "--data",
            str(random_images(tmp_path / "digits.h5", RANK)),
            "--model",
            "mlp",
            "--hidden",
            "32",
            "--batch-size",
            "8",
            "--steps",
            "9",
            "--every",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    rows = list(csv.DictReader(open(tmp_path / "signal.csv")))
    assert [(r["shape"], r["phase"]) for r in rows] == [
        (shape, phase) for shape in ("32×784", "10×32") for phase in ("early", "middle", "late")
    ]
    assert all(0 <= float(r["signal share of the mean"]) <= 1 for r in rows)
    smaller_side = {"32×784": 32, "10×32": 10}
    assert all(1 <= float(r["mean's rank"]) <= smaller_side[r["shape"]] for r in rows)
    assert (tmp_path / "signal.md").read_text().count("\n| ") == 7  # header and six rows
