"""How low-rank, and how sparse, is a DiLoCo pseudo-gradient? One process, no communication.

    python -m benchmarks.pseudo_gradient_energy --data data/shakespeare.h5 --model gpt \\
        --batch-size 8 --out benchmarks/results/pseudo-gradient-energy-gpt

Trains the model with Adam for --warmup steps, then takes Δ = θ before − θ after --sync-every
more steps (what one group sends at a DiLoCo sync) and, for every weight matrix (conv kernels as
C_out × the rest), the share of Δ's energy (squared Frobenius norm) that the best rank-r
approximation keeps (the bound on DiLoCo's low-rank form, which reaches it only with exact
power iterations) and that the largest --density share of its entries keeps (the sparse form's
selection before its values are quantised). Writes energy.md and energy.csv.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.single_process import add_model_arguments, trainee, write_table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_model_arguments(p)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--warmup", type=int, default=200, help="steps before the pseudo-gradient is taken")
    p.add_argument("--sync-every", type=int, default=10, help="H: the steps the pseudo-gradient spans")
    p.add_argument("--ranks", default="4,8,16", help="ranks whose kept energy to report")
    p.add_argument("--density", type=float, default=0.12, help="the share of entries the sparse form keeps")
    p.add_argument("--out", required=True, help="directory for energy.md and energy.csv")
    return p.parse_args(argv)


def kept_energy(delta: torch.Tensor, ranks: list[int], density: float) -> dict[str, float]:
    """Shares of ‖Δ‖² kept by the best rank-r approximations and by the top `density` entries."""
    matrix = delta.reshape(delta.shape[0], -1)
    energy = matrix.pow(2).sum()
    spectrum = torch.linalg.svdvals(matrix).pow(2)
    top = matrix.flatten().abs().topk(max(1, round(density * matrix.numel()))).values.pow(2).sum()
    return {
        **{f"rank {r}": float(spectrum[:r].sum() / energy) for r in ranks},
        f"top {density:.0%}": float(top / energy),
        "stable rank": float(energy / spectrum[0]),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    trained = trainee(args)
    model = trained.model

    def train(steps: int) -> None:
        for _ in range(steps):
            trained.step(args.batch_size)

    train(args.warmup)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    train(args.sync_every)
    ranks = [int(r) for r in args.ranks.split(",")]
    rows = [
        {
            "parameter": name,
            "shape": "×".join(map(str, p.shape)),
            **kept_energy(before[name] - p.detach(), ranks, args.density),
        }
        for name, p in model.named_parameters()
        if p.dim() > 1
    ]
    write_table(
        args.out,
        "energy",
        [
            f"# Energy of a pseudo-gradient kept by rank and by top-k: {args.model} on {Path(args.data).name}",
            "",
            f"Δ over {args.sync_every} Adam steps (lr {args.lr}, batch {args.batch_size}) after "
            f"{args.warmup}; shares of each weight matrix's ‖Δ‖² (`python -m benchmarks.pseudo_gradient_energy`).",
        ],
        rows,
        lambda v: f"{v:.2f}" if isinstance(v, float) else str(v),
    )


if __name__ == "__main__":
    main()
