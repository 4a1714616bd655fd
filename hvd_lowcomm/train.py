"""`python -m hvd_lowcomm.train`: parse the config, build everything, train, report.

    mpirun -np 4 python -m hvd_lowcomm.train --config run.yaml --train.epochs 5

With no arguments: an MLP trained data-parallel on scikit-learn's handwritten digits
(prepared into data/digits.h5 on first use). `--help` lists every option.

This module parses and checks (before the first training collective: a bad input ends every
rank with one clear message) and resolves --method auto; the loop itself is hvd_lowcomm.loop.
Nothing here starts MPI before the config is read: mpi4py initialises MPI when its MPI module
is first imported, which the comm layer does only inside its functions.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data_prep import prepare_if_bundled
from hvd_lowcomm import auto, checkpoint, config, data, models, trackers
from hvd_lowcomm.checkpoint import PreemptionSignal
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.traffic import meter
from hvd_lowcomm.config import AUTO, Config, ConfigError
from hvd_lowcomm.elastic.protocol import Launch
from hvd_lowcomm.loop import train
from hvd_lowcomm.registry import spec
from hvd_lowcomm.methods.base import Method


def main(argv: list[str] | None = None) -> int:
    problem = runtime.launcher_problem()
    if problem:  # before anything starts: torchrun's processes are not one MPI job
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        cfg = config.load(argv)
    except ConfigError as err:
        # MPI is not started yet: every rank sees the same error; let one of them say it.
        if _launcher_rank() == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2

    needed = spec(cfg.method).method.engine_needed(cfg) if cfg.method != AUTO else None
    if needed and cfg.comm.engine == "auto":  # sharding runs on torch.distributed only
        cfg.comm.engine = needed
    try:
        world = runtime.init(cfg.train.seed, cfg.comm.engine, cfg.comm.reduce_dtype)
    except ConfigError as err:  # an engine this job cannot start, or not the one it already runs on
        if _launcher_rank() == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2
    meter.reset()  # one run's traffic, from start-up checks to the summary
    preemption = PreemptionSignal()  # from here on SIGTERM/SIGUSR1 mean "checkpoint and stop"
    try:
        with runtime.abort_on_error():  # also a user's model factory or data source that raises
            prepared = preflight(cfg, world)
            if prepared is None:
                return 2
            train(
                cfg,
                prepared.method,
                prepared.info,
                prepared.model,
                prepared.resume_dir,
                prepared.resume_from,
                preemption,
                prepared.notes,
            )
            with meter.in_phase("control"):  # no rank exits (and shuts Horovod down) while another still sends
                meter.barrier("run.end")
    finally:
        preemption.restore()
    return 0


def check_elastic_run(cfg: Config) -> None:
    """Refuse under the elastic launcher what would train wrong there: each group is its own
    job, and only DiLoCo's groups meet (at outer steps, through the coordinator)."""
    if cfg.method != "diloco":
        raise ConfigError(
            f"--method {cfg.method} under python -m hvd_lowcomm.elastic: only diloco trains there. Every other "
            f"method (ddp, PowerSGD, dAD, AB-training's full-rank phases) synchronises all ranks every step, so "
            f"the job stays one failure domain: launch it with mpirun or srun"
        )
    if cfg.train.max_time:
        raise ConfigError(
            "--train.max_time under the elastic launcher: each group would plan its own length; give "
            "--train.max_steps or --train.epochs"
        )


@dataclass
class Prepared:
    """What preflight checked and built, for the loop."""

    method: Method
    info: data.DatasetInfo
    model: torch.nn.Module
    resume_dir: Path | None
    resume_from: Path | None
    notes: dict[str, Any]  # for the summary: what --method auto chose and why


def preflight(cfg: Config, world: runtime.Group) -> Prepared | None:
    """Everything that can fail because of the user's input, checked on every rank before the
    first training collective. All ranks agree on the outcome (one allgather), so a bad input
    ends every rank with the same clear message instead of a hang. `--method auto` is resolved
    here, so the loop gets a concrete method."""
    rank = world.comm.Get_rank()
    error = None
    info = model = resume = method = None
    try:
        if cfg.method != AUTO:  # auto's candidates fit any rank count
            spec(cfg.method).method.check_world(cfg, world.size)
        if Launch.from_environment() is not None:
            check_elastic_run(cfg)
        runtime.device(cfg.train.device)  # a GPU asked for and not there
        trackers.check_installed(cfg.run.loggers)
        if rank == 0 and not cfg.data.source:
            prepare_if_bundled(cfg.data.path)
        if rank == 0:
            resume = tuple(str(p) if p else None for p in checkpoint.resolve(cfg, world.size))
    except (ConfigError, OSError, ValueError) as err:
        error = str(err)
    with meter.in_phase("control"):
        meter.barrier("preflight.dataset")  # the bundled dataset, if rank 0 made it, is now in place
    if error is None:
        try:
            info = (
                data.from_source(cfg.data.source) if cfg.data.source else data.inspect(cfg.data.path, cfg.data.seq_len)
            )
            if info.num_train < world.size:
                raise data.DataError(
                    f"{cfg.data.path} has {info.num_train} training samples, fewer than the {world.size} ranks"
                )
            if cfg.data.verify:  # each file checked once, by one rank
                data.verify(info.files[rank :: world.size])
            model = models.build_model(cfg.model, info.input_shape, info.num_classes, info.task)
            if cfg.method != AUTO:
                method = spec(cfg.method).method(cfg, info)
                method.check_model(model)
        except ConfigError as err:
            error = str(err)
    with meter.in_phase("control"):
        errors = meter.allgather_object(error, "preflight.errors")
    if any(errors):
        if rank == 0:
            for message in dict.fromkeys(e for e in errors if e):
                failing = [r for r, e in enumerate(errors) if e == message]
                where = "all ranks" if len(failing) == world.size else f"rank(s) {_rank_list(failing)}"
                print(f"error ({where}): {message}", file=sys.stderr, flush=True)
        return None
    notes: dict[str, Any] = {}
    if cfg.method == AUTO:  # every rank got here: the probe's collectives cannot hang
        choice = auto.choose(cfg, model, info, world.size)
        notes = choice.summary()
        cfg.method = choice.method
        config.apply_presets(cfg, spec(choice.method).presets)  # ddp-fp16: its compression
        method = spec(cfg.method).method(cfg, info)
        try:
            method.check_model(model)
        except ConfigError as err:  # the same model and choice everywhere: every rank stops alike
            if rank == 0:
                print(f"error: {err}", file=sys.stderr, flush=True)
            return None
    with meter.in_phase("control"):
        run_dir, found = meter.broadcast_object(resume, "preflight.resume")
    return Prepared(method, info, model, Path(run_dir) if run_dir else None, Path(found) if found else None, notes)


def _launcher_rank() -> int:
    """This process's rank as the launcher announces it, readable before MPI starts."""
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def _rank_list(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks[:8]) + (",..." if len(ranks) > 8 else "")


if __name__ == "__main__":
    runtime.exit_process(main())
