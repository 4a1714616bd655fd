"""`--method auto`: the cost model (hvd_lowcomm.costmodel) picks the method for this model, batch,
rank count and network, before training starts; the run then trains with it.

Candidates are the methods registered as drop-in (ddp, ddp-fp16, powersgd, dad, rank-dad: the
same model and training, only the gradient exchange differs) that keep quality: exact ones
(ddp, dad), and fp16's rounding and compressions to an error target (powersgd, rank-dad) whose
defaults held on every judged set of the held-out suite (within hvd_lowcomm.heldout's bound on
ddp's validation loss or accuracy). A fixed `rank`, error feedback off, or any option changed
from what was measured takes a compression out; the printed choice says what quality risk
remains and which methods were left out, and why. SIL, AB and DiLoCo change how the model
trains, so they are a user's decision, except where the time-to-quality suite measured one at
its defaults reaching ddp's quality on every judged set (hvd_lowcomm.time_to_quality).
Candidates are ranked by predicted time to ddp's quality: the predicted step × the steps the
method needs for it, as a multiple of ddp's (1 for an exact exchange; measured for the others).
Rank 0 profiles the model on its batch: on a CPU it times the forward, backward and optimiser
step (a model too large to time quickly: its FLOPs at this CPU's measured rates); on a GPU it
counts the model's FLOPs and the methods' kernels at that GPU's measured rates
(costmodel.measured_device). Unless `auto.link` describes the network, every rank takes part in
a short probe of the job's own network: allreduces of a few bytes (latency) and of
`auto.probe_mb` (bandwidth). The choice, the predicted step of every candidate and why are
printed before training; every rank trains with the method rank 0 chose.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch

from hvd_lowcomm import costmodel
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.traffic import meter
from hvd_lowcomm.config import Config, ConfigError
from hvd_lowcomm.data import DatasetInfo
from hvd_lowcomm.metrics import human_bytes


@dataclass(frozen=True)
class Choice:
    """What --method auto chose, and why (in the run's summary)."""

    method: str
    reason: str

    def summary(self) -> dict[str, str]:
        return {"auto_choice": self.method, "auto_reason": self.reason}


def choose(cfg: Config, model: torch.nn.Module, data: DatasetInfo, world_size: int) -> Choice:
    """Collective: the method the cost model predicts steps fastest here (the same on every rank)."""
    o = cfg.auto
    link = (
        probe_link(o.probe_mb)
        if not o.link
        else costmodel.Link.parse(
            o.link,
            None if o.latency_us == -1 else o.latency_us,
            ranks_per_node=o.ranks_per_node or _job_ranks_per_node(),
        )
    )
    decision = None
    if runtime.rank() == 0:
        profile = costmodel.profile_model(
            model,
            data.input_shape,
            cfg.data.batch_size,
            cfg=cfg,
            methods=(*costmodel.auto_candidates(cfg), *OTHERS_SHOWN),
            vocabulary=data.vocabulary,
            device=_run_device(cfg),
        )
        if world_size == 1:
            decision = ("ddp", "one rank: nothing to exchange", "")
        else:
            name, predictions, why = costmodel.choose(profile, world_size, link, cfg)
            decision = (
                name,
                why,
                costmodel.format_predictions(predictions, cfg) + _others(profile, world_size, link, cfg),
            )
    with meter.in_phase("setup"):
        name, why, table = meter.broadcast_object(decision, "auto.decision")
    runtime.announce(f"auto: chose {why}" + (f"\npredicted per step:\n{table}" if table else ""))
    return Choice(name, why)


def _run_device(cfg: Config) -> costmodel.Device | None:
    """The device the run computes on, for the profile: a CUDA GPU by its measured rates; None
    (timed on this CPU) otherwise."""
    where = runtime.device(cfg.train.device)
    return costmodel.measured_device(str(where), cfg.train.amp) if where.type == "cuda" else None


# Shown beside the choice, and chosen only where the time-to-quality suite found them reaching
# ddp's quality on every judged set: they change how the model trains (what it converges to),
# which only the user can otherwise weigh against the time they save.
OTHERS_SHOWN = ("diloco", "ab")


def _others(profile: costmodel.Profile, ranks: int, link: costmodel.Link, cfg: Config) -> str:
    why_not = {m: costmodel.left_out(m, cfg) for m in costmodel.drop_in_methods()}
    left_out = "".join(f"\nleft out: {m}: {why}" for m, why in why_not.items() if why)
    lines = []
    for name in (m for m in OTHERS_SHOWN if m not in costmodel.time_held_methods(cfg)):
        try:
            q = costmodel.predict(profile, name, ranks, link, cfg)
        except ConfigError:  # this model or rank count does not suit it
            continue
        lines.append(
            f"{name:<10} {q.step * 1e3:>9.1f} ms per step, {human_bytes(q.bytes_per_rank)} sent per rank "
            "per step on average"
        )
    return left_out + (
        ("\nnot chosen automatically (they change how the model trains; choose them yourself):\n" + "\n".join(lines))
        if lines
        else ""
    )


def _job_ranks_per_node() -> int:
    """The job's ranks per node when it spans nodes; on one node, 1: a link given for a job that
    fits in one node is the network its ranks are to be judged on (else nothing would cross it)."""
    return runtime.ranks_per_node() if runtime.node_count() > 1 else 1


def probe_link(probe_mb: float) -> costmodel.Link:
    """This job's network as the cost model sees it, from timed allreduces over every rank: of
    8 bytes (latency: 2⌈log2 p⌉ messages) and of probe_mb MB (bandwidth: 2(p-1)/p of it per
    rank); on several nodes also over each node's ranks (the node's own bandwidth), with the
    job's ranks per node. The fastest of a few tries counts (the others met noise)."""
    p = runtime.size()
    if p == 1:
        return costmodel.Link(bandwidth=float("inf"), latency=0.0)

    def fastest(tensor: torch.Tensor, name: str, group: runtime.Group | None = None) -> float:
        times = []
        for _ in range(5):
            meter.barrier(f"{name}.barrier", group)
            start = time.perf_counter()
            meter.allreduce(tensor, name, group)
            times.append(time.perf_counter() - start)
        return min(times[1:])

    def bandwidth(group_size: int, small: float, large: float) -> float:
        return 2 * (group_size - 1) / group_size * probe_mb * 1e6 / max(large - small, 1e-9)

    per_node = runtime.ranks_per_node()
    several = 1 < per_node < p
    with meter.in_phase("setup"):
        probe = torch.zeros(int(probe_mb * 1e6 / 4))
        small, large = fastest(torch.zeros(2), "auto.probe_latency"), fastest(probe, "auto.probe_bandwidth")
        node, _ = runtime.split(runtime.node_layout(), "node") if several else (None, None)
        inside = (
            (
                fastest(torch.zeros(2), "auto.probe_node_latency", node),
                fastest(probe, "auto.probe_node_bandwidth", node),
            )
            if several
            else (0.0, 0.0)
        )
        # Every rank uses rank 0's figures, so the choice is the same everywhere.
        small, large, inside = meter.broadcast_object((small, large, inside), "auto.probe")
    link = costmodel.Link(
        bandwidth=bandwidth(p, small, large), latency=small / (2 * math.ceil(math.log2(p))), ranks_per_node=per_node
    )
    return replace(link, intra_bandwidth=bandwidth(per_node, *inside)) if several else link
