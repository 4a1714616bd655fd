"""benchmarks.gradient_signal: the signal, noise and ranks it reads off independent batches."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gradient_signal import main, rank_holding


def test_rank_holding_counts_the_directions_of_a_share_of_the_energy():
    gram = torch.diag(torch.tensor([5.0, 3.0, 1.0, 1.0, -0.5]))  # a noisy estimate: the negative one is clipped
    assert rank_holding(gram, 0.5) == 1
    assert rank_holding(gram, 0.8) == 2
    assert rank_holding(gram, 0.85) == 3
    assert rank_holding(torch.zeros(3, 3), 0.85) == 0


@pytest.mark.parametrize("samples, ranks", [(1, 1), (3, 4)])
def test_fewer_batches_than_pairs_or_ranks_are_refused(capsys, samples, ranks):
    with pytest.raises(SystemExit):
        main(["--data", "unused.h5", "--samples", str(samples), "--ranks", str(ranks), "--out", "unused"])
    assert "--samples must be at least 2 and at least --ranks" in capsys.readouterr().err
