"""DiLoCo's exchange codecs: sparse positions, quantisation, low-rank budgets, their bytes."""

from __future__ import annotations

import math

import pytest
import torch

from hvd_lowcomm.methods.diloco import DiLoCoOptions, LowRankOptions
from hvd_lowcomm.comm.wire_codecs import (
    BLOCK,
    BLOCK4,
    INT4,
    elias_fano_decode,
    elias_fano_encode,
    int2_bytes,
    int2_decode,
    int2_encode,
    positions_bytes,
    sparse_bytes,
    sparse_decode,
    sparse_encode,
    sparse_layout,
)
from hvd_lowcomm.methods.diloco.exchange import make_exchange, slice_pieces


def test_quantised_bytes_per_rank_stay_flat_in_the_number_of_groups():
    """Reduce-scatter + allgather: 2 (G-1)/G of the quantised slice, below twice it for any G;
    the allgather of every group's slice it replaced sent (G-1) times it."""
    numbers = 1 << 20
    for kind, per_number in (("int8", 1 + 4 / BLOCK), ("fp16", 2), ("int2", 0.25 + 4 / BLOCK4)):
        options = DiLoCoOptions(compression=kind)
        for groups in (2, 4, 8, 16):
            sent = sum(
                t.sent_bytes(groups) for t in make_exchange(None, options, members=groups).transfers(numbers, [], 0)
            )
            assert sent == pytest.approx(2 * (groups - 1) / groups * numbers * per_number, rel=1e-3)
            assert sent < 2 * numbers * per_number


def test_sparse_sends_the_top_of_each_chunk_at_two_bits():
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    payload, sent = sparse_encode(values, 0.02)
    assert len(payload) == sparse_bytes(10_000, 0.02) and torch.equal(sparse_decode(payload, 10_000, 0.02), sent)
    kept = sent != 0
    assert sparse_layout(10_000, 0.02) == (3, 3334, 67)  # three equal chunks of at most 4096, 2 numbers padding
    assert int(kept.sum()) == 3 * 67
    assert bool((torch.sign(sent[kept]) == torch.sign(values[kept])).all())
    for chunk, chunk_sent in zip(values.split(3334), sent.split(3334)):  # each chunk keeps its own largest
        threshold = chunk.abs().topk(67).values[-1]
        assert bool((chunk_sent.ne(0) == chunk.abs().ge(threshold)).all())
    # two magnitudes per chunk, each the mean of the half it stands for
    magnitudes = sent[:3334][kept[:3334]].abs().unique()
    assert len(magnitudes) == 2
    top = values[:3334].abs().topk(67).values
    # the median of 67 is the middle one: the larger half holds 34
    assert magnitudes.max() == pytest.approx(float(top[:34].mean()), rel=1e-5)
    assert magnitudes.min() == pytest.approx(float(top[34:].mean()), rel=1e-5)


@pytest.mark.parametrize("numbers", [1, 100, 1000, 4096])
def test_int2_rounds_every_number_to_the_nearest_of_four_even_levels_of_its_block(numbers):
    values = torch.randn(numbers, generator=torch.Generator().manual_seed(numbers)) * 1e-3
    values[-1] = 0  # a zero in a block of others, and a block of zeros (which stays zero)
    values = torch.cat([values, torch.zeros(BLOCK4)])
    payload = int2_encode(values)
    sent = int2_decode(payload, len(values))
    assert len(payload) == int2_bytes(len(values)) == -(-len(values) // 4) + 4 * math.ceil(len(values) / BLOCK4)
    assert int2_bytes(1 << 20) * 10 <= 4 * (1 << 20)  # a tenth of fp32's bytes, scales included
    for block, block_sent in zip(values.split(BLOCK4), sent.split(BLOCK4)):
        top = float(block.abs().max())
        levels = torch.tensor([-top, -top / 3, top / 3, top])
        assert bool(torch.isclose(block_sent[:, None], levels, rtol=1e-5, atol=1e-12).any(1).all())  # a level
        nearest = (block[:, None] - levels).abs().amin(1)  # (a number midway between two may take either)
        torch.testing.assert_close((block - block_sent).abs(), nearest, rtol=1e-4, atol=1e-9)
        assert float((block - block_sent).abs().max()) <= top / 3 * (1 + 1e-5)  # never more than a third of the block


@pytest.mark.parametrize("chunk, k", [(4096, 328), (4096, 1), (4096, 4096), (4096, 2048), (1000, 80), (7, 3)])
def test_sparse_positions_travel_by_elias_fano_in_a_fixed_size(chunk, k):
    """Any k distinct ascending offsets below `chunk` come back as they were, in exactly
    positions_bytes(chunk, k) bytes: at most k (2 + log2(chunk / k)) bits and whole bytes."""
    generator = torch.Generator().manual_seed(k)
    rows = [torch.randperm(chunk, generator=generator)[:k].sort().values for _ in range(5)]
    rows += [torch.arange(k), torch.arange(chunk - k, chunk)]  # both ends of the range
    offsets = torch.stack(rows)
    packed = elias_fano_encode(offsets, chunk)
    assert packed.shape == (len(rows), positions_bytes(chunk, k))
    assert torch.equal(elias_fano_decode(packed, chunk, k), offsets)
    assert positions_bytes(chunk, k) <= (k * (2 + math.log2(chunk / k))) / 8 + 2


def test_a_kept_value_costs_under_a_byte_at_eight_percent():
    """328 kept of a chunk of 4096: 3 low bits each (123 bytes) and a 328 + 512 bit vector of high
    parts (105 bytes), 2-bit codes (82 bytes), two fp32 magnitudes: 0.97 bytes a kept value,
    where 12-bit offsets cost 1.75."""
    assert positions_bytes(4096, 328) == 123 + 105
    assert sparse_bytes(4096, 0.08) == 123 + 105 + 82 + 8
    assert sparse_bytes(3 * 4096, 0.02) == 3 * (positions_bytes(4096, 82) + 21 + 8)


def test_sparse_bytes_per_rank_stay_flat_in_the_number_of_groups():
    """Allgathered at 2 groups (one slice's sparse bytes, what a reduce-scatter would send);
    reduced by owner beyond: (G-1)/G of them at density plus (G-1)/G of them at the owner's
    density (3 x density by default) at any G, where an allgather of every group's
    contribution sends (G-1) times them."""
    numbers, options = 1 << 22, DiLoCoOptions(compression="sparse")
    one, owners = sparse_bytes(numbers, options.sparse.density), sparse_bytes(numbers, 3 * options.sparse.density)
    for groups in (2, 3, 4, 8, 16):
        transfers = make_exchange(None, options, members=groups).transfers(numbers, [], 0)
        assert [t.op for t in transfers] == (["allgather"] if groups == 2 else ["alltoall", "allgather"])
        sent = sum(t.sent_bytes(groups) for t in transfers)
        expected = one if groups == 2 else (groups - 1) / groups * (one + owners)
        assert sent == pytest.approx(expected, rel=1e-2)
        assert sent < one + owners


def test_a_slice_cuts_matrices_into_whole_row_blocks():
    pieces = slice_pieces([(64, 32), (64,), (10, 32)], 50, 2000, 4, 0.05)
    assert pieces.matrices == ((14, 62, 32, 4),)  # rows 2..63 of the first matrix
    assert pieces.dense == ((0, 14), (1998, 2))  # the cut row's tail, the start of the bias
    assert slice_pieces([(8, 8)], 0, 64, 4, 0.05).dense == ((0, 64),)  # rank 4 does not pay on 8 × 8


@pytest.mark.parametrize("share", [0.05, 0.02])
def test_lowrank_ranks_from_the_byte_budget_spend_it_evenly(share):
    # rank 0: each matrix's rank is what its share of the budget buys, so a GPT's 128-wide
    # matrices and an MLP's 1024-wide ones are compressed alike, within the budget, dense numbers
    # and int8 scales included
    for shapes in (
        [(65, 128), (384, 128), (384,), (128, 128), (512, 128), (128, 512), (128,)],
        [(1024, 784), (1024,), (1024, 1024), (10, 1024), (10,)],
        [(256, 784), (256,), (256, 256), (256,), (10, 256), (10,)],
    ):
        numbers = sum(math.prod(s) for s in shapes)
        # whole, and each slice of groups of 2 and 4 ranks (short slices round up the most)
        for members, ranks_per_group in ((2, 1), (4, 1), (8, 1), (4, 2), (2, 4)):
            size = -(-numbers // ranks_per_group)
            for start in range(0, numbers, size):
                sent, fp32 = (
                    sum(
                        t.sent_bytes(members)
                        for t in make_exchange(None, options, members=members).transfers(size, shapes, start)
                    )
                    for options in (
                        DiLoCoOptions(compression="lowrank", lowrank=LowRankOptions(factor_share=share)),
                        DiLoCoOptions(compression="none"),
                    )
                )
                assert 0.8 * share <= sent / fp32 <= share
        pieces = slice_pieces(shapes, 0, numbers, 0, share)
        assert len(pieces.matrices) == sum(len(s) == 2 for s in shapes)
        # every matrix at the same compression (4-bit factors, scales included, at `share` of
        # fp32's 4 bytes a number, less the dense numbers' part), up to the rounding down of its
        # rank; at least rank 1 (a 10-row head at 2 %)
        for _, rows, cols, r in pieces.matrices:
            factor_bytes = [(rows + cols) * rank * INT4.per_number / (4 * rows * cols) for rank in (r, r + 1)]
            assert r == 1 or factor_bytes[0] <= share
            assert share < factor_bytes[1] / 0.9
    # a generous share stops where factors stop paying (PowerSGD's rule), and a slice of a few
    # rows of a matrix is still compressed as a block of its own
    generous = slice_pieces([(64, 64)], 0, 4096, 0, 1.0).matrices
    assert generous and all((rows + cols) * r * 2 < rows * cols for _, rows, cols, r in generous)
    assert slice_pieces([(64, 64)], 1000, 2000, 0, 0.05).matrices[0][1:3] == (30, 64)  # rows 16..45
