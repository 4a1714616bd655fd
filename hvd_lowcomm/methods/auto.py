"""`auto`: the cost model (hvd_lowcomm.costmodel) picks the method for this model, batch, rank
count and network, and the run trains with it.

Candidates are the drop-in methods (ddp, ddp fp16, powersgd, dad, rank-dad: the same model and
training, only the gradient exchange differs); SIL and AB change how the model trains, so they
are a user's decision. Rank 0 times the model's forward, backward and optimiser step on its
batch and, unless `auto.link` describes the network, every rank takes part in a short probe of
the job's own network: allreduces of a few bytes (latency) and of `auto.probe_mb` (bandwidth).
The choice, the predicted step of every candidate and why are printed before training; every
rank trains with the method rank 0 chose.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from hvd_lowcomm.config import ConfigError, option
from hvd_lowcomm.methods import get_method, register
from hvd_lowcomm.methods.base import Method


@dataclass
class AutoOptions:
    """auto: the cost model chooses the method from the measured compute and network."""

    link: str = option("", "the network between nodes, a rate such as 25gbit (empty: measure this job's own "
                           "with a short allreduce probe)")
    latency_us: float = option(2.0, "message latency with auto.link, in microseconds")
    ranks_per_node: int = option(1, "ranks sharing a node, with auto.link")
    probe_mb: float = option(8.0, "size of the bandwidth probe's allreduce, in MB")

    def validate(self) -> None:
        if self.link:
            from hvd_lowcomm.costmodel import rate_bits

            rate_bits(self.link)
        if self.latency_us < 0 or self.ranks_per_node < 1 or self.probe_mb <= 0:
            raise ConfigError("auto.latency_us must be >= 0, auto.ranks_per_node >= 1 and auto.probe_mb > 0")


@register("auto")
class Auto(Method):
    """Stands in for the method the cost model will choose (see `choose`)."""

    options = AutoOptions
    # Nothing to check before the choice: every candidate trains any model on any rank count.

    def choose(self, model: torch.nn.Module, world_size: int) -> Method:
        """Collective: the chosen method, built from this run's config (cfg.method is set to it)."""
        from hvd_lowcomm import costmodel, runtime
        from hvd_lowcomm.traffic import meter

        o, cfg = self.cfg.options, self.cfg
        link = probe_link(o.probe_mb) if not o.link else \
            costmodel.Link.parse(o.link, o.latency_us, ranks_per_node=o.ranks_per_node)
        decision = None
        if runtime.rank() == 0:
            settings = costmodel.MethodSettings.from_config(cfg)
            profile = costmodel.profile_model(model, self.data.input_shape, cfg.data.batch_size, settings=settings)
            if world_size == 1:
                decision = ("ddp", "one rank: nothing to exchange", "")
            else:
                name, predictions, why = costmodel.choose(profile, world_size, link, settings)
                decision = (name, why, costmodel.format_predictions(predictions))
        with meter.in_phase("setup"):
            name, why, table = meter.broadcast_object(decision, "auto.decision")
        if runtime.rank() == 0:
            from tqdm import tqdm

            tqdm.write(f"auto: chose {why}" + (f"\npredicted per step:\n{table}" if table else ""))
        cfg.method = "ddp" if name == "ddp-fp16" else name
        if name == "ddp-fp16":
            cfg.comm.compression = "fp16"
        chosen = get_method(cfg.method)(cfg)
        chosen.data = self.data
        chosen.check_world(world_size)
        chosen.check_model(model)
        chosen.auto_choice = {"auto_choice": name, "auto_reason": why}  # in the summary's table and summary.json
        return chosen


def probe_link(probe_mb: float) -> Any:
    """This job's network as the cost model sees it, from timed allreduces over every rank: of
    8 bytes (latency: 2⌈log2 p⌉ messages) and of probe_mb MB (bandwidth: 2(p-1)/p of it per
    rank). The fastest of a few tries counts (the others met noise)."""
    from hvd_lowcomm import costmodel, runtime
    from hvd_lowcomm.traffic import meter

    p = runtime.size()
    if p == 1:
        return costmodel.Link(bandwidth=float("inf"), latency=0.0)

    def fastest(tensor: torch.Tensor, name: str) -> float:
        times = []
        for _ in range(5):
            meter.barrier(f"{name}.barrier")
            start = time.perf_counter()
            meter.allreduce(tensor, name)
            times.append(time.perf_counter() - start)
        return min(times[1:])

    with meter.in_phase("setup"):
        small = fastest(torch.zeros(2), "auto.probe_latency")
        large = fastest(torch.zeros(int(probe_mb * 1e6 / 4)), "auto.probe_bandwidth")
        # Every rank uses rank 0's figures, so the choice is the same everywhere.
        small, large = meter.broadcast_object((small, large), "auto.probe")
    latency = small / (2 * math.ceil(math.log2(p)))
    bandwidth = 2 * (p - 1) / p * probe_mb * 1e6 / max(large - small, 1e-9)
    return costmodel.Link(bandwidth=bandwidth, latency=latency)
