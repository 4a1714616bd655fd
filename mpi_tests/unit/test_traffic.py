"""The traffic meter's ring formulas and summaries."""

from __future__ import annotations

import pytest

from hvd_lowcomm.comm.traffic import wire_bytes


def test_ring_formulas():
    assert wire_bytes("allreduce", 1000, 4) == pytest.approx(1500.0)  # 2 (p-1)/p M
    assert wire_bytes("allgather", 4000, 4) == pytest.approx(3000.0)  # (p-1)/p T
    assert wire_bytes("reduce_scatter", 4000, 4) == pytest.approx(3000.0)  # (p-1)/p M
    assert wire_bytes("broadcast", 1000, 8) == 1000.0
    assert wire_bytes("send", 123, 2) == 123.0 and wire_bytes("recv", 123, 2) == 0.0
    assert all(wire_bytes(op, 1000, 1) == 0.0 for op in ("allreduce", "allgather", "reduce_scatter", "broadcast"))


def test_total_on_sums_the_wire_bytes_of_process_sets_by_label_prefix_and_phase(fresh_meter):
    from types import SimpleNamespace

    group = lambda label, size: SimpleNamespace(label=label, size=size, peers=None)  # noqa: E731
    fresh_meter.record("allreduce", "a", 100, group("group0", 2))  # wire 100
    fresh_meter.record("allreduce", "b", 100, group("group1", 2))  # wire 100
    fresh_meter.record("allreduce", "c", 300, group("column0", 4))  # wire 450
    with fresh_meter.in_phase("control"):
        fresh_meter.record("allreduce", "d", 40, group("column0", 4))  # wire 60
    assert fresh_meter.total_on(("group",)) == 200
    assert fresh_meter.total_on(("column", "world")) == 450
    assert fresh_meter.total_on(("column",), ("train", "control")) == 510
    assert fresh_meter.total_on(("partition",)) == 0
