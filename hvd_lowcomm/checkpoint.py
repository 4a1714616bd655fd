"""Checkpoints: what a run needs to continue exactly where it stopped.

    <run dir>/checkpoints/step-00001200/
        rank-00000.pt ... rank-0000N.pt   one per rank
        sharded/                          a sharded method's DTensors, by torch.distributed.checkpoint
        manifest.json                     written last: files, sizes, sha256, step, ranks, method

Every rank writes a small file with what is its own: RNG states, data position, traffic
totals and the method's per-rank extras (`Method.local_state_dict`). The method's real state
(model, optimiser, schedule, its own state) is written only by the ranks that own it
(`Method.state_owner()`: rank 0 when all ranks hold the same state; one rank per group or
partition where groups differ; every rank where each holds its own, like PowerSGD's error
feedback); every rank restores from its owner's file. A sharded model's and optimiser's state
(`Method.sharded_state_dict`: FSDP2's DTensors) is saved with PyTorch Distributed Checkpoint
(DCP) into `sharded/`: each rank writes its shards, one copy of what groups hold alike, and DCP
loads it onto whatever layout the resumed run has. A method whose whole layout-dependent state
is there (`Method.reshards`: fsdp) resumes on another rank count or group size; the others on
the layout they were written with.

A checkpoint is written into `.step-N.tmp/` (each file: temporary name, fsync, rename), then
rank 0 writes the manifest and renames the directory: a checkpoint directory without the
`.tmp` exists only complete. The newest `keep` are kept. On resume, rank 0 checks the newest
checkpoint against its manifest (sizes and sha256) and falls back to the previous one, saying
why, when it is corrupt or partial.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.traffic import meter
from hvd_lowcomm.config import Config, ConfigError
from hvd_lowcomm.elastic.protocol import Launch
from hvd_lowcomm.methods.base import Method
from hvd_lowcomm.metrics import RunLogger
from hvd_lowcomm.registry import spec

FORMAT = "hvd_lowcomm-ckpt/1"
_STEP_DIR = re.compile(r"step-(\d{8})")
SHARDED = "sharded"  # the DCP checkpoint's folder inside a step directory


class CheckpointError(ConfigError):
    """No usable checkpoint where the user pointed, or one that does not fit this run."""


def rng_state() -> dict[str, Any]:
    """Every random generator a run draws from, this rank's GPU's included."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def onto(device: torch.device) -> Any:
    """torch.load's map_location for a rank computing on `device`: what was saved on a GPU comes
    back on this rank's GPU (or the CPU, where it has none); what was saved on the CPU (random
    states, host-side buffers) stays there. Another accelerator's tensors load where they were
    saved (None: torch's default)."""
    if device.type not in ("cpu", "cuda"):
        return None

    def place(storage: Any, location: str) -> Any:
        if not location.startswith("cuda"):
            return storage
        return storage.cuda(device.index) if device.type == "cuda" else storage

    return place


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes | Any) -> None:
    """`data` (bytes, or an object torch.save writes straight to the file: no copy of a large
    model's state in memory) into `path` through a temporary name, fsynced."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        if isinstance(data, bytes):
            fh.write(data)
        else:
            torch.save(data, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _size_and_sha256(path: Path) -> tuple[int, str]:
    """A file's size and sha256, read in chunks (a rank's state can be gigabytes)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def save(run_dir: Path, method: Method, position: dict[str, Any], extra: dict[str, Any], keep: int) -> Path:
    """Write a checkpoint of this rank's part; collective over all ranks. Returns its directory."""
    from mpi4py import MPI

    comm, rank = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank()
    root = run_dir / "checkpoints"
    # Named by rank 0's step: ranks of SIL's partitions may have taken different step counts.
    with meter.in_phase("control"):
        step = meter.broadcast_object(position["step"], "checkpoint.step")
    final, tmp = root / f"step-{step:08d}", root / f".step-{step:08d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted earlier attempt
        tmp.mkdir(parents=True)
    with meter.in_phase("control"):
        meter.barrier("checkpoint.directory")
    owner = method.state_owner()
    payload = {
        "format": FORMAT,
        "rank": rank,
        "world_size": comm.Get_size(),
        "method": method.cfg.method,
        "position": position,
        "rng": rng_state(),
        "traffic": meter.state_dict(),
        "local": method.local_state_dict(),
        "owner": owner,
        "extra": extra,
        "state": method.state_dict() if owner == rank else None,
    }
    name = f"rank-{rank:05d}.pt"
    _write_atomic(tmp / name, payload)
    written = [name]
    sharded = method.sharded_state_dict()
    if sharded is not None:
        dcp.save(sharded, checkpoint_id=tmp / SHARDED)  # collective; rank 0 writes its metadata last
        written += [f"{SHARDED}/{f.name}" for f in sorted((tmp / SHARDED).glob(f"__{rank}_*"))]
        written += [f"{SHARDED}/.metadata"] if rank == 0 else []
    with meter.in_phase("control"):
        files = meter.gather_object([(n, *_size_and_sha256(tmp / n)) for n in written], "checkpoint.files")
    if rank == 0:
        manifest = {
            "format": FORMAT,
            "step": step,
            "world_size": comm.Get_size(),
            "method": method.cfg.method,
            "position": position,
            "time": time.time(),
            "files": {n: {"bytes": b, "sha256": h} for rank_files in files for n, b, h in rank_files},
        }
        _write_atomic(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        if final.exists():  # the same step saved twice (e.g. a periodic save, then the last one)
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(root)
        for old in sorted(checkpoints(root))[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    with meter.in_phase("control"):
        meter.barrier("checkpoint.written")
    return final


def checkpoints(root: Path) -> list[Path]:
    """Complete-looking checkpoint directories under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name))


def problem(path: Path) -> str | None:
    """Why checkpoint directory `path` cannot be used, or None when its files match its manifest."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as err:
        return f"no readable manifest.json ({err.__class__.__name__}): it was not finished"
    if manifest.get("format") != FORMAT:
        return f"format {manifest.get('format')!r}, expected {FORMAT!r}"
    for name, meta in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if _size_and_sha256(file) != (meta["bytes"], meta["sha256"]):
            return f"{name} does not match its checksum (truncated or overwritten)"
    if sum(name.startswith("rank-") for name in manifest.get("files", {})) != manifest.get("world_size"):
        return "the manifest lists fewer files than ranks"
    return None


def newest_usable(root: Path, say: Any = print) -> Path | None:
    """The newest checkpoint under `root` that passes `problem`, reporting each one skipped."""
    for path in reversed(checkpoints(root)):
        why = problem(path)
        if why is None:
            return path
        say(f"checkpoint {path} is unusable ({why}); trying the previous one")
    return None


def resolve(cfg: Config, world_size: int, say: Any = print) -> tuple[Path | None, Path | None]:
    """(run directory to continue in or None for a fresh one, checkpoint to load or None) for
    `run.resume`: "" (fresh run), "auto" (the run `run.dir/run.name`, from its newest usable
    checkpoint if it has one), or a run / checkpoints / checkpoint directory. Rank 0 only."""
    resume = cfg.run.resume
    if not resume:
        return None, None
    launch = Launch.from_environment()
    if resume == "auto":
        if not cfg.run.name:
            raise CheckpointError(
                "--resume auto needs --run.name, so it knows which run to continue (job scripts set it to the job name)"
            )
        run_dir = Path(cfg.run.dir) / cfg.run.name
        if launch is not None:  # an elastic group: the newest of its slot's run directories (one per launch)
            run_dir, found = _newest_of_slot(Path(cfg.run.dir), cfg.run.name, launch.slot, say)
        else:
            found = newest_usable(run_dir / "checkpoints", say)
        if found is None:
            say(f"no checkpoint in {run_dir or cfg.run.name}: starting from scratch")
    elif launch is not None:
        raise CheckpointError(
            f"--resume {resume} under the elastic launcher: give --resume auto, so that each group "
            f"finds its own newest checkpoint (the groups' states differ between rounds)"
        )
    else:
        path = Path(resume)
        if (path / "manifest.json").exists() or _STEP_DIR.fullmatch(path.name):
            why = problem(path)
            if why is not None:
                raise CheckpointError(
                    f"checkpoint {path} is unusable: {why}; give its run directory to take the newest usable one"
                )
            found, run_dir = path, path.parent.parent
        else:
            root = path if path.name == "checkpoints" else path / "checkpoints"
            found, run_dir = newest_usable(root, say), root.parent
            if found is None:
                raise CheckpointError(
                    f"no usable checkpoint in {root}; check --resume (a run directory, its "
                    f"checkpoints/ or one step-N directory)"
                )
    if found is not None:
        manifest = json.loads((found / "manifest.json").read_text())
        if manifest["method"] != cfg.method:
            raise CheckpointError(
                f"checkpoint {found} was written by {manifest['method']}; resume it with --method {manifest['method']}"
            )
        if manifest["world_size"] != world_size and not spec(cfg.method).method.reshards(cfg):
            raise CheckpointError(
                f"checkpoint {found} was written by {manifest['world_size']} ranks; resume it "
                f"with mpirun -np {manifest['world_size']} ({cfg.method}'s state depends on "
                f"the rank count; fsdp's checkpoints resume on any)"
            )
    return run_dir, found


def _newest_of_slot(parent: Path, name: str, slot: int, say: Any) -> tuple[Path | None, Path | None]:
    """An elastic group's (run directory, checkpoint) to resume: the highest step among its
    slot's run directories (NAME-groupS-lifeL, one per launch), or (None, None)."""
    found = [newest_usable(d / "checkpoints", say) for d in sorted(parent.glob(f"{name}-group{slot}-life*"))]
    usable = [path for path in found if path is not None]
    if not usable:
        return None, None
    newest = max(usable, key=step_of)
    return newest.parent.parent, newest


def step_of(path: Path) -> int:
    """The training step checkpoint `path` was written at."""
    return json.loads((path / "manifest.json").read_text())["step"]


def load(path: Path, method: Method) -> dict[str, Any]:
    """Restore this rank's state from checkpoint `path` (after `method.setup`); returns this
    rank's payload (position, extra...). Written by another rank count (a method that
    reshards): the sharded state is DCP's, the rest rank 0's, and the random streams start
    afresh."""
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    resharded = json.loads((path / "manifest.json").read_text())["world_size"] != MPI.COMM_WORLD.Get_size()
    device = runtime.device_of(method.model.parameters() if method.model is not None else ())
    sharded = method.sharded_state_dict()
    if sharded is not None:
        try:
            dcp.load(sharded, checkpoint_id=path / SHARDED)  # in place, onto this run's layout
        except Exception as err:  # a DCP error names a missing key or a shape: say what to do
            raise CheckpointError(
                f"checkpoint {path}'s sharded state does not fit this run ({err}); resume "
                f"with the groups and sharding options it was written with"
            ) from err
        method.load_sharded_state_dict(sharded)
    own = torch.load(path / f"rank-{0 if resharded else rank:05d}.pt", weights_only=False, map_location=onto(device))
    owner = own["owner"]
    state = (
        own["state"]
        if owner == own["rank"]
        else torch.load(path / f"rank-{owner:05d}.pt", weights_only=False, map_location=onto(device))["state"]
    )
    method.load_state_dict(state)
    meter.load_state_dict(own["traffic"])
    if not resharded:
        method.load_local_state_dict(own["local"])
        set_rng_state(own["rng"])
    return own


class PreemptionSignal:
    """SIGTERM / SIGUSR1 (what Slurm and PBS send before they kill a job) set a flag instead of
    killing the process; the training loop checks it every step, agreed over all ranks."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


@dataclass
class TrainState:
    """Where a run stands: the next (epoch, batch) to run, the best test accuracy so far, the
    skipped non-finite steps, the training clock when the run last stopped (these five are
    checkpointed), the step timers and the latest epoch record."""

    epoch: int = 1
    batch: int = 0
    best_acc: float = 0.0
    skipped: int = 0
    train_seconds: float = 0.0
    step_seconds: float = 0.0
    wait_seconds: float = 0.0
    record: dict[str, Any] = field(default_factory=lambda: {"test_acc": 0.0})


class Checkpointer:
    """Periodic checkpoints, the last one, and the stop on a preemption signal."""

    def __init__(
        self,
        cfg: Config,
        method: Method,
        run_dir: Path,
        preemption: PreemptionSignal | None,
        state: TrainState | None = None,
        batches_per_epoch: int = 0,
    ) -> None:
        self.cfg, self.method, self.run_dir, self.preemption = cfg, method, run_dir, preemption
        self.batches_per_epoch = batches_per_epoch
        self.state = state or TrainState()
        self.stopping, self.checkpoint_due = False, False
        self.train_clock: Callable[[], float] = lambda: self.state.train_seconds  # the loop's, once it runs

    def save(self, epoch: int, batch: int) -> Path:
        position = {"epoch": epoch, "batch": batch, "step": meter.step, "batches_per_epoch": self.batches_per_epoch}
        extra = {
            "best_acc": self.state.best_acc,
            "skipped": self.state.skipped,
            "train_seconds": self.train_clock(),  # a time budget counts the time before a resume
            "config": self.cfg.to_dict(),
        }
        return save(self.run_dir, self.method, position, extra, self.cfg.run.keep_checkpoints)

    def received(self) -> bool:
        """Whether this process got a preemption signal."""
        return self.preemption is not None and self.preemption.received is not None

    def signalled(self) -> bool:
        """Whether to stop here: this process's signal, unless the method stops with others at
        a point they agree on (elastic DiLoCo's groups, after one round), or the method's own stop."""
        own = self.received() and not self.method.request_stop()
        return own or self.method.stop_requested()

    def agree(self, locally_bad: bool) -> bool:
        """After every step of a lockstep method: agree on non-finite values, and on
        preemption, over the ranks the method says meet after this step (all of them, or a
        group running free: then preemption waits for the next step where all ranks meet);
        returns whether the step went bad anywhere there."""
        if not self.method.lockstep:
            return locally_bad
        group = self.method.agreement_group()
        with meter.in_phase("control"):
            if group is not None:
                bad, received = meter.any_flags([locally_bad, self.received()], "step.flags", group)
                if received:  # elastic DiLoCo asks for a stop of every group now, not at this group's next round
                    self.method.request_stop()
                return bad
            self.stopping, bad = meter.any_flags([self.signalled(), locally_bad], "step.flags")
        return bad

    def periodic(self, epoch: int, next_batch: int) -> None:
        """After a lockstep method's step is closed: a checkpoint every run.checkpoint_every steps
        (at the first step after that where all ranks meet)."""
        every = self.cfg.run.checkpoint_every
        self.checkpoint_due |= bool(self.method.lockstep and every and meter.step % every == 0)
        if self.checkpoint_due and not self.stopping and self.method.agreement_group() is None:
            self.save(epoch, next_batch)
            self.checkpoint_due = False

    def at_epoch_end(self, epoch: int, batch: int, log: RunLogger) -> None:
        """Methods whose ranks step independently checkpoint and answer signals here."""
        with meter.in_phase("control"):
            (self.stopping,) = meter.any_flags([self.signalled()], "epoch.flags")
        if self.stopping:
            self.stop(epoch, batch, log)
        elif self.cfg.run.checkpoint_every:
            self.save(epoch, batch)

    def stop(self, epoch: int, batch: int, log: RunLogger) -> None:
        path = self.save(epoch, batch)
        if runtime.rank() == 0:
            (self.run_dir / "PREEMPTED").write_text(f"{path}\n")
        if self.method.stop_requested():
            base = self.run_dir.name.rsplit("-group", 1)[0]  # the run's name (NAME-groupS-lifeL)
            name, how = "a preemption of the elastic run", f"--resume auto --run.name {base}"
        else:
            name = signal.Signals(self.preemption.received).name if self.received() else "a signal on another rank"
            how = f"--resume auto (--run.name {self.run_dir.name}) or --resume {self.run_dir}"
        log.print(f"stopped by {name}: checkpoint {path} written; continue with {how}")
        log.close()
