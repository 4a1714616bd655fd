"""The built-in training loop over the Method interface (hvd_lowcomm.methods.base).

The loop knows no method by name: the method does one step on the local batch and sends
whatever it sends through the traffic meter; the loop shards the data, schedules the learning
rate, evaluates, checkpoints (hvd_lowcomm.checkpoint) and writes metrics.
"""

from __future__ import annotations

import copy
import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from hvd_lowcomm import checkpoint, data, optimizers, task
from hvd_lowcomm.budget import RunLength
from hvd_lowcomm.checkpoint import Checkpointer, PreemptionSignal, TrainState
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.mesh import local_part
from hvd_lowcomm.comm.traffic import meter
from hvd_lowcomm.elastic.protocol import Launch
from hvd_lowcomm.config import Config
from hvd_lowcomm.methods.base import Method
from hvd_lowcomm.metrics import RunLogger, human_bytes, unique_run_dir
from hvd_lowcomm.schedule import scheduled_lr


@dataclass
class EpochResult:
    """One pass over this rank's shard (or the part of it run before a stop)."""

    mean_loss: float  # mean local training loss over the steps taken
    step_seconds: float  # time inside method.train_step
    wait_seconds: float  # time waiting for batches
    steps: int
    next_batch: int  # index of the next batch to run in this epoch


def train(
    cfg: Config,
    method: Method,
    info: data.DatasetInfo,
    model: torch.nn.Module,
    resume_dir: Path | None = None,
    resume_from: Path | None = None,
    preemption: PreemptionSignal | None = None,
    notes: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Train (from `resume_from` when given) and write the run's files; returns rank 0's
    summary, or None when a preemption signal stopped the run after a checkpoint. `notes`
    join the summary (what --method auto chose and why)."""
    world = runtime.world()
    rank, device = runtime.rank(), runtime.device(cfg.train.device)
    if resume_dir is None:
        name = cfg.run.name or f"{cfg.method}-{time.strftime('%Y%m%d-%H%M%S')}"
        launch = Launch.from_environment()
        if launch is not None:  # elastic groups: one job each, a run directory each
            name = f"{name}-group{launch.slot}-life{launch.life}"
        run_dir = unique_run_dir(cfg.run.dir, name)
        # Only rank 0 writes; it tells the others where (the name has a timestamp).
        with meter.in_phase("control"):
            run_dir = Path(meter.broadcast_object(str(run_dir) if rank == 0 else None, "run.dir"))
    else:
        run_dir = resume_dir
    log = RunLogger(run_dir if rank == 0 else None, cfg.run.progress, continuing=resume_dir is not None)
    log.write_config(cfg.to_dict(), cfg.run.loggers)

    model = model.to(device)
    parameters = _count_parameters(model)  # the whole model; partitioned methods keep a part per rank
    method.setup(model)
    splits = {split: data.open_split(info, split, cfg.data.normalize, cfg.data.driver) for split in data.SPLITS}
    train_batches = method.batches(splits["train"], cfg.data.batch_size, True, device)
    test_batches = method.batches(splits["test"], cfg.data.test_batch_size, False, device)
    epochs = method.epochs()
    shards = f", {len(info.files)} shard files" if len(info.files) > 1 else ""
    log.print(
        f"hvd_lowcomm: method {cfg.method} on {world.size} rank(s) ({device.type}, engine "
        f"{runtime.engine_line()}, "
        f"{torch.get_num_threads()} compute thread(s) each); model "
        f"{cfg.model.name} ({parameters:,} parameters); data {info.path} "
        f"({info.num_train} train / {info.num_test} test {_samples(info)}{shards}); "
        f"{len(train_batches)} steps/epoch; run dir {run_dir}"
    )
    unused = getattr(train_batches, "unused_fraction", lambda: 0.0)()
    if unused > 0.05:
        log.print(
            f"warning: {len(info.files)} shard files split unevenly over {world.size} ranks, so "
            f"{100 * unused:.0f}% of the training samples are skipped each epoch (a different "
            f"random part every epoch); write a shard count that is a multiple or divisor of the rank count"
        )

    state = TrainState()
    keeper = Checkpointer(cfg, method, run_dir, preemption, state, len(train_batches))

    def load_checkpoint() -> None:
        own = checkpoint.load(resume_from, method)
        position = own["position"]
        state.epoch, state.batch = position["epoch"], position["batch"]
        written_with = position.get("batches_per_epoch", len(train_batches))
        if written_with != len(train_batches):  # resharded onto another rank count: the same share of the epoch
            state.batch = round(state.batch * len(train_batches) / written_with)
            log.print(
                f"the checkpoint's epoch had {written_with} steps, this run's {len(train_batches)}: "
                f"continuing at the same share of it, with new random streams"
            )
        state.best_acc, state.skipped = own["extra"]["best_acc"], own["extra"]["skipped"]
        state.train_seconds = own["extra"].get("train_seconds", 0.0)
        log.continue_from(position["step"])
        log.print(f"resumed from {resume_from} at step {position['step']} (epoch {state.epoch}, batch {state.batch})")

    # (an elastic group whose checkpoint is older than the run's heals from a member instead)
    joined = method.join_run(checkpoint.step_of(resume_from) if resume_from else None, load_checkpoint)
    if joined:  # an elastic group that healed from a member mid-run: on at the run's step
        state.epoch, state.batch = joined // len(train_batches) + 1, joined % len(train_batches)
        meter.step = joined
        log.continue_from(joined)
        log.print(f"joined the run at step {joined} (epoch {state.epoch}, batch {state.batch})")
    if rank == 0:
        (run_dir / "PREEMPTED").unlink(missing_ok=True)

    start = time.perf_counter()  # the run's wall clock, which the evaluations below report
    eval_seconds = [0.0]  # evaluation's share of the wall clock, so far
    trained_before = state.train_seconds  # a resumed run's training clock when it stopped

    def train_clock() -> float:
        """Seconds of training so far (a resumed run's before it included): the wall clock
        less evaluation."""
        return trained_before + time.perf_counter() - start - eval_seconds[0]

    keeper.train_clock = train_clock

    def timed_evaluate(mean_loss: float) -> dict[str, Any]:
        """Evaluate, with the wall clock since the start and the part of it spent training (all
        but evaluation: what a method's speed decides) beside the figures."""
        began = time.perf_counter()
        record = evaluate(method, test_batches, mean_loss, info)
        now = time.perf_counter()
        eval_seconds[0] += now - began
        return {**record, "seconds": now - start, "train_seconds": train_clock()}

    def evaluate_within_epoch(epoch: int, batch: int, mean_loss: float) -> None:
        record = {
            "epoch": round(epoch - 1 + batch / len(train_batches), 4),
            "step": meter.step,
            **timed_evaluate(mean_loss),
            "train_wire_bytes_total": meter.total("train"),
            **method.epoch_metrics(),
        }
        log.evaluation(record)

    total_steps = epochs * len(train_batches)
    if cfg.train.max_steps >= 0:
        total_steps = min(total_steps, cfg.train.max_steps)
    t = cfg.train
    length = RunLength(
        total_steps, t.max_time, cfg.run.eval_every_seconds, train_clock, method.lockstep, meter.step, t.warmup_steps
    )
    method.set_total_steps(total_steps)
    evaluates_within = (cfg.run.eval_every or cfg.run.eval_every_seconds) and method.lockstep
    for epoch in range(state.epoch, epochs + 1):
        first_batch = state.batch if epoch == state.epoch else 0
        if first_batch == 0:  # a resumed epoch's start-of-epoch state is in the checkpoint
            method.start_epoch(epoch)
        wire_at_start = meter.total("train")
        result = train_epoch(
            cfg,
            method,
            train_batches,
            epoch,
            first_batch,
            length,
            log,
            keeper,
            evaluate_within_epoch if evaluates_within else None,
        )
        state.step_seconds += result.step_seconds
        state.wait_seconds += result.wait_seconds
        if keeper.stopping:
            keeper.stop(epoch, result.next_batch, log)
            return None
        record = {
            "epoch": epoch,
            "step": meter.step,
            **timed_evaluate(result.mean_loss),
            "train_wire_bytes": meter.total("train") - wire_at_start,
            "train_wire_bytes_total": meter.total("train"),
            "data_wait_seconds": result.wait_seconds,
            "skipped_steps": state.skipped,
            **method.epoch_metrics(),
        }
        state.record = record
        state.best_acc = max(state.best_acc, record["test_acc"])
        log.end_of_epoch(record, epochs, result.steps)
        done = result.next_batch >= len(train_batches)
        state.epoch, state.batch = (epoch + 1, 0) if done else (epoch, result.next_batch)
        if not method.lockstep:  # the epoch's end is where all ranks meet
            keeper.at_epoch_end(state.epoch, state.batch, log)
            if keeper.stopping:
                return None
            if length.at_epoch_end(meter.step) and len(length.plans) == 1:
                method.set_total_steps(length.total)
        if meter.step >= length.total:
            break
        state.epoch, state.batch = epoch + 1, 0
    trained = train_clock()  # the final checkpoint below is not training
    if "epoch" not in state.record:  # resumed a run that had nothing left to do: report where it stands
        state.record = evaluate(method, test_batches, 0.0, info)
    keeper.save(state.epoch, state.batch)

    summary, extra = summarize(cfg, method, state, time.perf_counter() - start, parameters, notes or {}, info)
    summary.update({"train_seconds": trained, **length.summary()})
    if isinstance(getattr(method, "optimizer", None), torch.optim.Optimizer):
        summary["optimizer"] = optimizers.describe(method.optimizer)
    final = method.final_state_dict()
    if final is not None:
        torch.save(final, run_dir / "model.pt")
    log.summary(summary, extra)
    log.close()
    return summary


def train_epoch(
    cfg: Config,
    method: Method,
    batches: Any,
    epoch: int,
    first_batch: int,
    length: RunLength,
    log: RunLogger,
    keeper: Checkpointer,
    evaluate_within: Callable[[int, int, float], None] | None = None,
) -> EpochResult:
    """One pass over this rank's shard from batch `first_batch`, ending early at the run's
    length (`length.total`, revised by a time budget) or on a preemption signal;
    `evaluate_within(epoch, batch, mean loss)` every run.eval_every steps and every
    run.eval_every_seconds of training clock, except at the epoch's end (evaluated anyway)."""
    batches.set_epoch(epoch, first_batch)
    loss_sum, seconds, waited, steps, batch = 0.0, 0.0, 0.0, 0, first_batch
    bar = log.progress(batches, len(batches) - first_batch, f"epoch {epoch}")
    ready = time.perf_counter()
    for x, y in bar:
        waited += time.perf_counter() - ready  # reading and decoding this batch
        if meter.step >= length.total:
            break
        lr = scheduled_lr(cfg, meter.step, length.total, length.progress(meter.step))
        method.set_lr(lr)
        before = copy.deepcopy(method.state_dict()) if cfg.train.skip_nonfinite else None
        t0 = runtime.clock(x.device)
        loss = method.train_step(x, y)
        step_seconds = runtime.clock(x.device) - t0
        seconds += step_seconds
        where = nonfinite(loss, method.model)
        batch += 1
        if keeper.agree(where is not None):
            if before is None:
                raise FloatingPointError(
                    f"non-finite training at step {meter.step} (epoch {epoch}): "
                    f"{where or 'on another rank'}; lower train.lr, check the data, or "
                    f"set --train.skip_nonfinite true to skip such steps"
                )
            method.load_state_dict(before)  # undo the step on every rank
            keeper.state.skipped += 1
            log.log("skipped_step", {"step": meter.step, "epoch": epoch, "reason": where or "another rank"})
            loss = 0.0
        else:
            loss_sum, steps = loss_sum + loss, steps + 1
        step_bytes = meter.step_total()
        if meter.step % cfg.run.log_every == 0:  # on every rank: a sharded gradient's norm is collective
            figures = step_figures(method.model, x, y, lr, step_seconds)
            if log.active:
                log.log("step", {"step": meter.step, "epoch": epoch, "loss": loss, "wire_bytes": step_bytes, **figures})
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{loss:.4f}", sent=human_bytes(step_bytes), refresh=False)
        meter.next_step()
        if length.after_step(meter.step) and len(length.plans) == 1:  # the first plan: the method's too
            method.set_total_steps(length.total)
        if keeper.stopping:
            break
        every = cfg.run.eval_every
        due = bool(every and meter.step % every == 0) | length.evaluation_due(meter.step)  # both on every rank
        if evaluate_within is not None and due and batch < len(batches) and meter.step < length.total:
            evaluate_within(epoch, batch, loss_sum / max(steps, 1))
        keeper.periodic(epoch, batch)
        ready = time.perf_counter()
    return EpochResult(loss_sum / max(steps, 1), seconds, waited, steps, batch)


def step_figures(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float, step_seconds: float
) -> dict[str, float]:
    """What a step record says beside the loss, as rank 0 sees it: the learning rate, the norm
    of the gradient the optimiser stepped with (pooled over the ranks that share it), the
    step's time, throughput over all ranks (tokens for a language model's windows, else
    samples; every rank takes a batch of the same size), and peak memory (CUDA memory on a GPU,
    the process's resident memory on the CPU). Collective where the model is sharded (FSDP's
    DTensor gradients: the norm sums over their shards): call it on every rank."""
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    if any(isinstance(g, DTensor) for g in grads):
        norm = torch.nn.utils.get_total_norm(grads)
        grads = [(norm.full_tensor() if isinstance(norm, DTensor) else norm).float().pow(2)]
    else:
        grads = [g.float().pow(2).sum() for g in grads]
    positions = "tokens" if y.dim() > 1 else "samples"
    peak = (
        torch.cuda.max_memory_allocated(x.device)
        if x.device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "lr": lr,
        "grad_norm": float(torch.stack(grads).sum().sqrt()) if grads else 0.0,
        "step_seconds": step_seconds,
        f"{positions}_per_second": y.numel() * runtime.size() / max(step_seconds, 1e-9),
        "peak_memory_bytes": peak,
    }


def nonfinite(loss: float, model: torch.nn.Module) -> str | None:
    """What went non-finite in the step just taken (loss, or the first layer whose gradient
    or value is NaN/inf), or None."""
    # Screen first with one sum per tensor and a single check of all the sums (one pass over
    # each tensor and one host sync, where isfinite().all() per tensor makes a mask the size of
    # the tensor and syncs once per tensor): NaN and inf always propagate through a sum, so a
    # finite total clears the tensor; a sum that overflowed is cleared by the exact check.
    # A sharded model's parameters are DTensors: each rank checks its own shards.
    sums = [local_part(t).sum() for p in model.parameters() for t in (p, p.grad) if t is not None]
    if math.isfinite(loss) and (not sums or bool(torch.stack([s.to(sums[0].device) for s in sums]).isfinite().all())):
        return None
    for name, p in model.named_parameters():
        if p.grad is not None and not torch.isfinite(local_part(p.grad)).all():
            return f"loss {loss}, gradient of layer {name!r} is not finite"
        if not torch.isfinite(local_part(p)).all():
            return f"loss {loss}, parameters of layer {name!r} are not finite"
    return None if math.isfinite(loss) else f"loss is {loss}"


def evaluate(method: Method, test_batches: Any, local_train_loss: float, info: data.DatasetInfo) -> dict[str, float]:
    """Test accuracy and loss over the whole test set (per labelled position: sample, or token
    of a language model, with its perplexity and bits per byte), and the mean training loss
    over ranks."""
    with meter.in_phase("eval"):
        correct, count, test_loss = method.evaluate(test_batches)
        correct, count, test_loss, train_loss = meter.allreduce_object_sum(
            [correct, count, test_loss, local_train_loss], "eval.totals"
        )
    record = {"train_loss": train_loss / runtime.size(), "test_loss": test_loss / count, "test_acc": correct / count}
    if info.task == task.LANGUAGE_MODEL:
        record.update(task.language_model_figures(record["test_loss"], info.bytes_per_token))
    return record


def _samples(info: data.DatasetInfo) -> str:
    if info.task == task.LANGUAGE_MODEL:
        return f"windows of {info.input_shape[0]} tokens, vocabulary {info.num_classes}"
    return f"samples, {info.num_classes} classes"


def summarize(
    cfg: Config,
    method: Method,
    state: TrainState,
    elapsed: float,
    parameters: int,
    notes: dict[str, Any],
    info: data.DatasetInfo,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run's summary record (the method's own figures and `notes` included), and those
    figures on their own (the summary table shows them under the method's name)."""
    last, step_seconds, wait_seconds = state.record, state.step_seconds, state.wait_seconds
    best_acc, skipped = state.best_acc, state.skipped
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports kB
    own = {
        "peak_rss": peak_rss,
        "train": meter.total("train"),
        "train_between_nodes": meter.total("train", field="between_nodes_bytes"),
        "between_nodes": meter.total(None, field="between_nodes_bytes"),
        "after_setup": meter.total(None) - meter.total("setup"),
        "between_nodes_after_setup": meter.total(None, field="between_nodes_bytes")
        - meter.total("setup", field="between_nodes_bytes"),
    }
    with meter.in_phase("control"):
        gathered = meter.allgather(torch.tensor([list(own.values())], dtype=torch.float64), "summary.per_rank")
    per_rank = {name: gathered[:, column] for column, name in enumerate(own)}  # one column per figure
    peak_rss_max = int(per_rank["peak_rss"].max().item())
    steps = max(meter.step, 1)
    summary = {
        "method": cfg.method,
        "world_size": runtime.size(),
        "epochs": method.epochs(),
        "steps": meter.step,
        "final_test_acc": last["test_acc"],
        "best_test_acc": best_acc,
        "final_test_loss": last["test_loss"],
        "seconds": elapsed,
        "step_seconds_mean": step_seconds / steps,
        "parameters": parameters,
        "data_wait_fraction": wait_seconds / max(wait_seconds + step_seconds, 1e-12),
        "skipped_nonfinite_steps": skipped,
        "train_wire_bytes_per_step": meter.total("train") / steps,
        "train_wire_bytes_all_ranks": per_rank["train"].sum().item(),
        # What the job's network carried: the bytes every rank sent to another node.
        "nodes": runtime.node_count(),
        "train_between_nodes_bytes_all_ranks": per_rank["train_between_nodes"].sum().item(),
        # every phase: what a link counter sees
        "between_nodes_bytes_all_ranks": per_rank["between_nodes"].sum().item(),
        # what links carry once training starts (setup's broadcasts are done): training, evaluation, control
        "wire_bytes_all_ranks_after_setup": per_rank["after_setup"].sum().item(),
        "between_nodes_bytes_all_ranks_after_setup": per_rank["between_nodes_after_setup"].sum().item(),
        "engine": runtime.engine_line(),
        "engine_name": runtime.engine().name,
        "lr_schedule": cfg.train.lr_schedule,
        "peak_lr": cfg.train.lr,
        "train_wire_bytes_by_kind": {
            f"{op} in {group}": t.wire_bytes
            for (phase, op, group), t in sorted(meter.by_kind.items())
            if phase == "train"
        },
        "process_sets": [list(ranks) for ranks in runtime.process_sets()],
        "peak_rss_bytes_max_rank": peak_rss_max,
        "peak_rss_bytes_per_rank": [int(v) for v in per_rank["peak_rss"].tolist()],
        **meter.summary(),
        # Where a step's time goes on this rank (rank 0): forward and backward passes (methods
        # that use Method.forward_backward), blocked in communication (the meter's timers), and
        # the rest (the method's own computation: power iteration, SVD, optimiser step...).
        **step_split(method, step_seconds, steps),
    }
    if info.task == task.LANGUAGE_MODEL:
        summary.update(
            {
                "final_perplexity": last["perplexity"],
                "final_bits_per_byte": last["bits_per_byte"],
                "tokens_per_step_per_rank": cfg.data.batch_size * info.input_shape[0],
            }
        )
    extra = {**method.summary_metrics(), **notes}
    summary.update(extra)
    return summary, extra


def step_split(method: Method, step_seconds: float, steps: int) -> dict[str, float]:
    ms = {
        "forward": method.pass_seconds["forward"],
        "backward": method.pass_seconds["backward"],
        "exchange": meter.seconds["train"],
    }
    ms["other"] = max(0.0, step_seconds - sum(ms.values()))
    return {f"step_ms_{name}": 1000 * seconds / steps for name, seconds in ms.items()}


def _count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
