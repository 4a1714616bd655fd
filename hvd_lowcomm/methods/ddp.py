"""`ddp`: plain data parallelism, Horovod's DistributedOptimizer with every gradient allreduced.

The baseline every other method is judged against. `ddp-fp16` (the same as `--method ddp
--comm.compression fp16`) halves the bytes on the wire: gradients are cast to fp16 for the
allreduce and back afterwards. `local` trains without any exchange: the compute floor.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from hvd_lowcomm.comm.runtime import Group
from hvd_lowcomm.comm.traffic import FLOAT_BYTES, meter
from hvd_lowcomm.config import Config
from hvd_lowcomm.costmodel import Link, MethodCost, Prediction, Profile, RunAssumptions, wire
from hvd_lowcomm.registry import register, register_variant
from hvd_lowcomm.methods.base import (GradientExchange, Method, broadcast_model_and_optimizer, make_optimizer,
                                     wrap_optimizer)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                         compression: str = "none", group: Group | None = None,
                         backward_passes_per_step: int = 1) -> torch.optim.Optimizer:
    """`hvd.DistributedOptimizer` whose every allreduce is recorded by the traffic meter.

    Use it in your own loop exactly as Horovod's: `loss.backward(); opt.step()`. Gradients are
    averaged over `group` (default: all ranks) while backward runs.
    """
    import horovod.torch as hvd

    compressor = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[compression]
    dist = hvd.DistributedOptimizer(
        optimizer, named_parameters=list(named_parameters), compression=compressor,
        backward_passes_per_step=backward_passes_per_step,
        process_set=hvd.global_process_set if group is None else group.process_set)
    allreduce_grad_async = dist._allreduce_grad_async

    def metered_allreduce_grad_async(p: torch.nn.Parameter) -> Any:
        handle, ctx = allreduce_grad_async(p)
        # Compress an empty tensor to learn the wire dtype without repeating the real work.
        wire_itemsize = compressor.compress(p.grad.new_empty(0))[0].element_size()
        meter.record("allreduce", dist._parameter_names.get(p), p.grad.numel() * wire_itemsize, group)
        return handle, ctx

    # Horovod's gradient hooks look the method up on the instance at call time.
    dist._allreduce_grad_async = metered_allreduce_grad_async
    synchronize = dist.synchronize

    def metered_synchronize() -> None:
        with meter.waiting():  # the allreduces not finished behind the backward pass
            synchronize()

    dist.synchronize = metered_synchronize
    return dist


def predict_ddp(profile: Profile, p: int, link: Link, options: None, cfg: Config,
                assumptions: RunAssumptions) -> Prediction:
    """Every gradient allreduced over all ranks (in fp16 with comm.compression fp16), overlapping
    the backward pass: Horovod starts each allreduce as its gradient appears."""
    fp16 = cfg.comm.compression == "fp16"
    nbytes = profile.params * (2 if fp16 else FLOAT_BYTES)
    comm = link.allreduce(nbytes, p, p)
    sent = wire("allreduce", nbytes, p)
    return Prediction("ddp", p, profile.step_seconds, profile.fp16_seconds if fp16 else 0.0, comm,
                      min(comm, link.overlap * profile.backward_seconds), sent, sent * link.node_share(p))


def predict_local(profile: Profile, p: int, link: Link, options: None, cfg: Config,
                  assumptions: RunAssumptions) -> Prediction:
    """Nothing exchanged: the step is the compute alone."""
    return Prediction("local", p, profile.step_seconds, 0.0, 0.0, 0.0, 0.0)


def ddp_quality(options: None, cfg: Config) -> str:
    """Exact; fp16 on the wire rounds the averaged gradient (which Horovod's users accept)."""
    return "ddp's gradient, rounded to fp16 on the wire" if cfg.comm.compression == "fp16" else ""


@register("ddp", cost=MethodCost(predict_ddp, quality=ddp_quality), drop_in=True)
class DataParallel(Method):
    """Every gradient averaged over all ranks at every step (Horovod allreduce)."""

    honours_compression = True

    def setup(self, model: torch.nn.Module) -> None:
        self.model = model
        optimizer = make_optimizer(self.cfg, model.parameters())
        broadcast_model_and_optimizer(model, optimizer)
        self.optimizer = self.distribute(optimizer, model)

    def distribute(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
        """Wrap the local optimiser so that step() uses the gradient of the pooled batch."""
        return DistributedOptimizer(optimizer, model.named_parameters(), compression=self.cfg.comm.compression,
                                    backward_passes_per_step=self.cfg.train.accumulate)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        assert self.model is not None and self.optimizer is not None
        self.optimizer.zero_grad()
        loss = self.forward_backward(x, y)
        clip = self.cfg.train.clip_grad_norm
        if clip:  # on the pooled gradient: exchange first, then clip, then step without a second exchange
            self.optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            with self.optimizer.skip_synchronize():
                self.optimizer.step()
        else:
            self.optimizer.step()
        return loss


register_variant("ddp-fp16", "ddp", {"comm.compression": "fp16"})


@register("local", cost=MethodCost(predict_local))
class LocalOnly(DataParallel):
    """No communication: every rank trains its own copy on its own shard (the compute floor).

    Not a way to train (the ranks' models drift apart and the reported accuracy pools them):
    benchmarks.compare runs it beside the real methods so that every step time has the floor
    that the same model, batch and optimiser set without any exchange.
    """

    honours_compression = False

    def distribute(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
        return wrap_optimizer(optimizer, _NoExchange)


class _NoExchange(GradientExchange):
    """Keeps every rank's own gradient (method local)."""

    def _exchange(self) -> None:
        pass
