"""The traffic meter records what each collective carries, by the ring formulas."""

from __future__ import annotations

import pytest
import torch

from conftest import needs_ranks


def test_collectives_are_recorded_with_payload_and_wire_bytes(world, fresh_meter):
    p, rank = world.size, world.comm.Get_rank()
    out = fresh_meter.allreduce(torch.full((10, 10), float(rank)), "grad.w")
    assert torch.allclose(out, torch.full((10, 10), (p - 1) / 2))  # mean of 0..p-1
    # Unequal first dims: rank r contributes r+1 rows of 3 float32.
    gathered = fresh_meter.allgather(torch.ones(rank + 1, 3), "acts")
    assert gathered.shape == (p * (p + 1) // 2, 3)
    fresh_meter.broadcast_(torch.zeros(7, dtype=torch.float64), 0, "b")
    reduce, gather, bcast = fresh_meter.step_records
    assert (reduce.op, reduce.name, reduce.payload_bytes) == ("allreduce", "grad.w", 400)
    assert reduce.wire_bytes == pytest.approx(2 * (p - 1) / p * 400)
    # payload: this rank's own rows; wire: (p-1)/p of everything gathered
    assert (gather.payload_bytes, gather.wire_bytes) == (
        12 * (rank + 1),
        pytest.approx((p - 1) / p * 12 * p * (p + 1) // 2),
    )
    assert (bcast.payload_bytes, bcast.wire_bytes) == (56, 56.0 if p > 1 else 0.0)
    assert fresh_meter.total(op="allreduce") == pytest.approx(reduce.wire_bytes)
    fresh_meter.next_step()
    assert fresh_meter.step == 1 and list(fresh_meter.step_records) == []
    assert fresh_meter.by_name["grad.w"].calls == 1  # totals survive the step


def test_batched_collectives_give_the_same_results_and_records(world, fresh_meter):
    p, rank = world.size, world.comm.Get_rank()
    a, b = fresh_meter.allgather_many([("a", torch.full((2, 3), float(rank))), ("b", torch.ones(rank + 1))])
    assert a.shape == (2 * p, 3) and a[::2, 0].tolist() == [float(r) for r in range(p)]
    assert b.shape == (p * (p + 1) // 2,)
    total, biggest = (
        fresh_meter.allreduce_many([("s", torch.tensor([1.0 + rank])), ("m", torch.tensor([rank]))], op="sum")[0],
        fresh_meter.allreduce_many([("m", torch.tensor([rank]))], op="max")[0],
    )
    assert total.item() == p * (p + 1) / 2 and biggest.item() == p - 1
    assert [(r.op, r.name, r.payload_bytes) for r in fresh_meter.step_records] == [
        ("allgather", "a", 24),
        ("allgather", "b", 4 * (rank + 1)),
        ("allreduce", "s", 4),
        ("allreduce", "m", 8),
        ("allreduce", "m", 8),
    ]


def test_phases_are_counted_apart(world, fresh_meter):
    fresh_meter.allreduce(torch.ones(4), "t")
    with fresh_meter.in_phase("eval"):
        fresh_meter.allreduce(torch.ones(8), "e")
    assert fresh_meter.total("train", field="payload_bytes") == 16
    assert fresh_meter.total("eval", field="payload_bytes") == 32
    assert fresh_meter.phase == "train"


@needs_ranks(2)
def test_point_to_point_messages_are_recorded_on_both_sides(world, fresh_meter):
    rank = world.comm.Get_rank()
    if rank == 0:
        fresh_meter.send(torch.arange(6, dtype=torch.float32), dest=1, name="acts.fwd")
        (rec,) = fresh_meter.step_records
        assert (rec.op, rec.payload_bytes, rec.wire_bytes) == ("send", 24, 24.0)
    elif rank == 1:
        out = fresh_meter.recv(torch.empty(6), source=0, name="acts.fwd")
        assert out.tolist() == [0, 1, 2, 3, 4, 5]
        (rec,) = fresh_meter.step_records
        assert (rec.op, rec.payload_bytes, rec.wire_bytes) == ("recv", 24, 0.0)
    world.comm.Barrier()
