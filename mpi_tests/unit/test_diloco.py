"""DiLoCo's options, schedule and CLI checks that need no ranks."""

from __future__ import annotations

import pytest
import torch

from hvd_lowcomm import config
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.methods.diloco import fragment_bounds, sync_due
from hvd_lowcomm.comm.wire_codecs import BLOCK, dequantise, quantise


def test_int8_quantisation_errs_by_at_most_half_a_step_per_block():
    values = torch.randn(3 * BLOCK + 17) * torch.linspace(0.01, 10, 3 * BLOCK + 17)
    q, scales = quantise(values)
    assert q.dtype == torch.int8 and len(scales) == 4
    error = (dequantise(q, scales, len(values)) - values).abs()
    steps = scales.repeat_interleave(BLOCK)[: len(values)]
    assert bool((error <= steps / 2 + 1e-7).all())


def test_fragments_hold_about_equal_numbers_and_sync_at_staggered_steps():
    assert fragment_bounds([10, 10, 10, 10], 2) == [0, 2, 4]
    assert fragment_bounds([100, 1, 1, 100], 2) == [0, 2, 4]
    assert fragment_bounds([5, 5, 5], 3) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="only 2 trainable tensors"):
        fragment_bounds([5, 5], 3)
    assert [s for s in range(1, 25) if sync_due(s, 0, 8, 2)] == [8, 16, 24]
    assert [s for s in range(1, 25) if sync_due(s, 1, 8, 2)] == [4, 12, 20]
    assert [s for s in range(1, 13) if sync_due(s, 0, 4, 1)] == [4, 8, 12]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--diloco.sync_every", "1.5"], "diloco.sync_every must be a whole number of steps or a fraction"),
        (["--diloco.outer_momentum", "1"], r"diloco.outer_momentum must be in \[0, 1\)"),
        (["--diloco.fragments", "0"], "diloco.fragments must be >= 1"),
        (
            ["--diloco.sparse.owner_density", "1.5"],
            r"diloco.sparse.owner_density must be in \[0, 1\] \(0: three times density\)",
        ),
        (["--diloco.sparse.unsent_share", "-0.5"], r"diloco.sparse.unsent_share must be in \[0, 1\] \(0: 1/groups\)"),
        (["--diloco.compression", "int4"], "diloco.compression must be one of none, fp16, int8, int2, sparse, lowrank"),
        (
            ["--diloco.compression", "sparse", "--diloco.sparse.error_decay", "0.9"],
            "with diloco.sparse.keep_unsent .* each group's model holds what is unsent: "
            "set --diloco.sparse.keep_unsent false",
        ),
    ],
)
def test_bad_options_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        config.load(["--method", "diloco", *argv])
