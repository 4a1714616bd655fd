"""benchmarks.pseudo_gradient_energy: the shares of a matrix's energy it reports, and a run's files."""

from __future__ import annotations

import csv

import pytest
import torch

from benchmarks.pseudo_gradient_energy import kept_energy, main
from conftest import RANK, random_images


def test_kept_energy_matches_matrices_whose_shares_are_known():
    torch.manual_seed(RANK)
    low = torch.randn(64, 3) @ torch.randn(3, 40)  # rank 3
    shares = kept_energy(low, [1, 3], 0.12)
    assert shares["rank 3"] == pytest.approx(1.0, abs=1e-5) and shares["rank 1"] < 0.99
    sparse = torch.zeros(100, 50)
    sparse.view(-1)[torch.randperm(5000)[:600]] = torch.randn(600)  # exactly 12 % of the entries
    assert kept_energy(sparse, [1], 0.12)["top 12%"] == pytest.approx(1.0, abs=1e-6)
    noise = torch.randn(200, 200)  # no low-rank or sparse structure
    assert kept_energy(noise, [1], 0.12)["top 12%"] == pytest.approx(
        0.49, abs=0.02
    )  # 2(tφ(t) + 1 - Φ(t)) at P(|z| > t) = 0.12
    assert kept_energy(noise, [1], 0.12)["stable rank"] > 20  # flat spectrum


def test_a_run_writes_a_row_per_weight_matrix(tmp_path):
    main(
        [
            "--data",
            str(random_images(tmp_path / "digits.h5", RANK)),
            "--model",
            "mlp",
            "--hidden",
            "32",
            "--warmup",
            "3",
            "--sync-every",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    rows = list(csv.DictReader(open(tmp_path / "energy.csv")))
    assert [r["shape"] for r in rows] == ["32×784", "10×32"]
    assert all(0 < float(r["rank 4"]) <= float(r["rank 16"]) <= 1 + 1e-6 for r in rows)
    assert (tmp_path / "energy.md").read_text().count("\n| ") == 3  # header and two rows
