"""torchft's train_diloco.py loop, ported to hvd_lowcomm.

    mpirun -np 2 python examples/porting/torchft_diloco.py --steps 60 --sync-every 20

torchft's DiLoCo hooks the inner optimiser, so its loop keeps `inner_optimizer.step()`;
hvd_lowcomm's DiLoCo does too (or call `diloco.step()` in its place, not both). What changes:
no Manager or lighthouse (MPI starts the job; the groups are its ranks, one group per node by
default), the outer optimiser is given as options (torchft's SGD lr 0.7, Nesterov momentum 0.9),
and `manager.current_step()` is `diloco.current_step()`.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import hvd_lowcomm


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))


def batches(steps: int, seed: int, batch: int = 16):
    """Each group's own stream of samples (torchft: a DistributedSampler per replica group)."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        inputs = torch.randn(batch, 16, generator=generator)
        yield inputs, (inputs @ teacher).argmax(1)


def train(steps: int, sync_every: int, own_step: bool = True) -> tuple[torch.nn.Module, hvd_lowcomm.DiLoCo]:
    """The loop; `own_step` False calls diloco.step() in the optimiser's place (the same run)."""
    torch.manual_seed(0)
    m = make_model()
    inner_optimizer = torch.optim.AdamW(m.parameters(), lr=4e-3, weight_decay=0.1, betas=(0.9, 0.95))
    # port: torchft's `outer_optimizer = torch.optim.SGD(..., lr=0.7, momentum=0.9, nesterov=True)`
    # and `DiLoCo(manager, [m], inner_optimizer, outer_optimizer, sync_every=...)`
    with hvd_lowcomm.DiLoCo(
        m, inner_optimizer, sync_every=sync_every, outer_lr=0.7, outer_momentum=0.9, compression="none"
    ) as diloco:
        for inputs, labels in batches(steps, seed=hvd_lowcomm.rank()):  # each rank its own samples
            inner_optimizer.zero_grad()
            out = m(inputs)
            loss = F.cross_entropy(out, labels)
            loss.backward()
            if own_step:
                inner_optimizer.step()  # DiLoCo counts the step and syncs every sync_every
            else:
                diloco.step()
            if diloco.current_step() % 2 == 0 and diloco.synced_now and hvd_lowcomm.rank() == 0:
                print(f"[{diloco.current_step()}] loss = {loss.item():.4f}, groups {diloco.members()}", flush=True)
    return m, diloco


def main() -> None:
    parser = argparse.ArgumentParser(description="torchft's DiLoCo loop on hvd_lowcomm")
    parser.add_argument("--steps", type=int, default=60, help="inner steps")
    parser.add_argument("--sync-every", type=int, default=20, help="inner steps between outer steps (H)")
    args = parser.parse_args()
    hvd_lowcomm.init()
    _, diloco = train(args.steps, args.sync_every)
    final = diloco.full_model()  # the same on every rank
    if hvd_lowcomm.rank() == 0:
        sent = hvd_lowcomm.meter.total("train")
        print(f"{diloco.current_step()} outer steps; {sent:,} bytes sent for training; final {type(final).__name__}")


if __name__ == "__main__":
    main()
