"""An elastic run's restart: where each group finds its checkpoint, and the coordinator's
decisions at a restart, at a preemption and after the last round, on a real TCPStore (the
groups' side is what rank 0 of each group writes: hvd_lowcomm.elastic.protocol)."""

from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path

import pytest
import torch.distributed as dist

from hvd_lowcomm import checkpoint, config
from hvd_lowcomm.elastic import protocol
from hvd_lowcomm.elastic.coordinator import Coordinator


@pytest.fixture
def coordinator():
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10)
    )
    c = Coordinator(store, groups=3, timeout=60.0)
    for slot in range(3):
        c.launched(slot, 0)
        store.add(f"beat/{slot}/0", 1)
    return c


def join(c: Coordinator, slot: int, step: int | None) -> None:
    protocol.put(c.store, f"resume/{slot}/0", step)
    protocol.put(c.store, f"join/{slot}", 0)


def test_groups_at_the_newest_checkpoint_resume_and_the_others_heal_from_them(coordinator):
    join(coordinator, 0, 30)
    join(coordinator, 1, 20)  # it missed the last checkpoint
    coordinator.poll()
    assert protocol.read(coordinator.store, "commit/0") is None, "started before every group joined"
    join(coordinator, 2, 30)
    coordinator.poll()
    commit = protocol.read(coordinator.store, "commit/0")
    assert commit["members"] == [0, 2] and commit["joiners"] == [1] and not commit["stop"]
    assert all(protocol.read(coordinator.store, f"admit/{s}/0") == 0 for s in range(3))
    resume = next(e for e in coordinator.events if e["event"] == "resume")
    assert resume["step"] == 30 and resume["members"] == [0, 2] and resume["joiners"] == [1]


def test_a_fresh_run_starts_from_the_lowest_slot(coordinator):
    for slot in (2, 0, 1):
        join(coordinator, slot, None)
    coordinator.poll()
    commit = protocol.read(coordinator.store, "commit/0")
    assert commit["members"] == [0] and commit["joiners"] == [1, 2]
    assert not any(e["event"] == "resume" for e in coordinator.events)


def test_a_preempted_run_stops_every_group_after_the_same_round_and_admits_no_one(coordinator):
    for slot in range(3):
        join(coordinator, slot, None)
    coordinator.poll()
    coordinator.preempt()
    for slot in range(3):
        protocol.put(coordinator.store, f"arrive/1/{slot}", 0)
    coordinator.poll()
    assert protocol.read(coordinator.store, "attempt/1/0") == {"members": [0, 1, 2]}
    coordinator.exited(1, 0, 137)  # killed in the round; its relaunch asks to join
    coordinator.launched(1, 1)
    coordinator.store.add("beat/1/1", 1)
    protocol.put(coordinator.store, "join/1", 1)
    for slot in (0, 2):
        protocol.put(coordinator.store, f"done/1/0/{slot}", "failed")
    coordinator.poll()
    assert protocol.read(coordinator.store, "attempt/1/1") == {"members": [0, 2]}
    for slot in (0, 2):
        protocol.put(coordinator.store, f"done/1/1/{slot}", "ok")
    coordinator.poll()
    commit = protocol.read(coordinator.store, "commit/1")
    assert commit == {"attempt": 1, "members": [0, 2], "joiners": [], "stop": True}
    assert protocol.read(coordinator.store, "admit/1/1") is None
    assert protocol.read(coordinator.store, "stop").startswith("preempted")


@pytest.mark.parametrize("code, finished", [(0, True), (137, False)])
def test_a_group_relaunched_after_the_last_round_is_told_whether_the_run_finished(coordinator, code, finished):
    for slot in range(3):
        join(coordinator, slot, None)
    coordinator.poll()  # the start: round 1 expects every group
    coordinator.exited(1, 0, 137)
    coordinator.launched(1, 1)  # relaunched; it asks to join while the others end
    coordinator.store.add("beat/1/1", 1)
    protocol.put(coordinator.store, "join/1", 1)
    coordinator.lifeline_closed(0, 0)
    coordinator.exited(2, 0, code)
    coordinator.poll()
    assert protocol.read(coordinator.store, "stop") is None, "decided before group 0's exit code came"
    coordinator.exited(0, 0, code)
    coordinator.poll()
    stop = protocol.read(coordinator.store, "stop")
    assert stop.startswith(protocol.FINISHED) == finished, stop


def fake_checkpoint(run: Path, step: int) -> None:
    """A finished checkpoint directory of one rank (its files match its manifest)."""
    where = run / "checkpoints" / f"step-{step:08d}"
    where.mkdir(parents=True)
    payload = b"state"
    (where / "rank-00000.pt").write_bytes(payload)
    files = {"rank-00000.pt": {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}}
    manifest = {"format": checkpoint.FORMAT, "step": step, "world_size": 1, "method": "diloco", "files": files}
    (where / "manifest.json").write_text(json.dumps(manifest))


def test_each_group_resumes_from_the_newest_checkpoint_of_its_own_slot(tmp_path, monkeypatch):
    fake_checkpoint(tmp_path / "el-group1-life0", 30)
    fake_checkpoint(tmp_path / "el-group1-life1", 50)  # its relaunch, healed, checkpointed later
    fake_checkpoint(tmp_path / "el-group1-life1", 40)
    fake_checkpoint(tmp_path / "el-group11-life0", 90)  # another slot's
    launch = protocol.Launch("127.0.0.1", 1, slot=1, life=0, groups=12, timeout=5.0)
    for name, value in launch.environment().items():
        monkeypatch.setenv(name, value)
    cfg = config.load(["--method", "diloco", "--run.dir", str(tmp_path), "--run.name", "el", "--resume", "auto"])
    run_dir, found = checkpoint.resolve(cfg, 1, say=lambda _: None)
    assert (run_dir, found) == (tmp_path / "el-group1-life1", tmp_path / "el-group1-life1/checkpoints/step-00000050")
    cfg.run.resume = str(tmp_path / "el-group1-life1")
    with pytest.raises(checkpoint.CheckpointError, match="give --resume auto"):
        checkpoint.resolve(cfg, 1)
    monkeypatch.setenv(protocol.SLOT_VARIABLE, "2")
    cfg.run.resume = "auto"
    assert checkpoint.resolve(cfg, 1, say=lambda _: None) == (None, None)  # a fresh directory of its own


def test_a_group_that_got_the_schedulers_signal_stops_every_group(coordinator):
    """A group's own SIGTERM/USR1 (Slurm signals every task at the time limit) is a preemption of
    the run: the coordinator stops every group after the same round, not that group alone."""
    for slot in range(3):
        join(coordinator, slot, None)
    coordinator.poll()
    assert not coordinator.preempting
    protocol.put(coordinator.store, "preempt/2", 0)
    coordinator.poll()
    assert coordinator.preempting
