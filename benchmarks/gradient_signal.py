"""How much of a step's mean gradient is signal, and how low-rank is that signal? One process.

    python -m benchmarks.gradient_signal --data data/animals.h5 --model cnn --hidden 32,64,64 \\
        --batch-size 32 --steps 625 --out DIR   # benchmarks/results/gradient-signal/cnn-animals.*

A gradient compressor's error target (PowerSGD's: at most 15 % of the error-fed mean's energy
left out) counts sampling noise as if it were signal. This measures the split. It trains the
model with Adam on batches of --ranks × --batch-size (what ddp steps with on that many ranks) and
every --every steps takes, without stepping, the gradients g_1 … g_K of K = --samples independent
batches of --batch-size (what K ranks compute). Independent batches share only the expected
gradient G, so for each weight matrix (a conv kernel as C_out × the rest):

* signal ‖G‖² is the mean of ⟨g_j, g_k⟩ over pairs j ≠ k, and a batch's noise tr Σ the sample
  variance Σ_j ‖g_j − ḡ‖² / (K − 1);
* the signal share of the mean over p ranks is ‖G‖² / (‖G‖² + tr Σ / p), and the gradient noise
  scale B = tr Σ · batch / ‖G‖² (McCandlish et al. 2018's B_simple, in samples; a sample of a
  text set is a window of tokens);
* the signal's rank is the fewest directions holding 85 % of the energy of the signal's Gram
  matrix, estimated by the symmetrised mean over pairs of g_jᵀ g_k (negative eigenvalues
  clipped), beside the same rank of the p-rank mean's own Gram matrix (what an energy target
  sees). Both Gram matrices are summed over a third of the run, so these ranks are of the
  subspace the gradient used over that third, larger than any one step's.

Ratios are pooled (sums over the measurements of a third, then divided), since one measurement
of a small signal is mostly noise. Writes signal.md and signal.csv; Adam at a constant --lr, not
the trainer's schedule.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.single_process import add_model_arguments, trainee, write_table

PHASES = ("early", "middle", "late")
KEPT = 0.85  # the energy share the ranks are reported at (PowerSGD's default target leaves out 15 %)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_model_arguments(p)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank")
    p.add_argument("--ranks", type=int, default=2, help="ranks the training batch and the mean stand for")
    p.add_argument("--steps", type=int, default=600, help="training steps")
    p.add_argument("--every", type=int, default=25, help="steps between measurements")
    p.add_argument("--samples", type=int, default=4, help="independent batches per measurement (K >= 2 and >= --ranks)")
    p.add_argument("--out", required=True, help="directory for signal.md and signal.csv")
    args = p.parse_args(argv)
    if args.samples < max(2, args.ranks):
        p.error(
            f"--samples must be at least 2 and at least --ranks ({args.ranks}): the signal is read off pairs of "
            f"independent batches, and the mean's rank off --ranks of them"
        )
    return args


def as_matrix(gradient: torch.Tensor) -> torch.Tensor:
    """The gradient as rows × columns with the smaller side first (its Gram matrix is the small one)."""
    matrix = gradient.reshape(gradient.shape[0], -1)
    return matrix if matrix.shape[0] <= matrix.shape[1] else matrix.T


@dataclass
class Pooled:
    """One weight matrix's sums over the measurements of a phase."""

    signal: float = 0.0
    noise: float = 0.0
    measurements: int = 0
    signal_gram: torch.Tensor | None = None
    mean_gram: torch.Tensor | None = None

    def add(self, gradients: list[torch.Tensor], ranks: int) -> None:
        """Adds one measurement: K independent batches' gradients of this matrix."""
        k = len(gradients)
        stacked = torch.stack([as_matrix(g) for g in gradients])  # K × r × c
        total = stacked.sum(0)
        self_terms = sum(g @ g.T for g in stacked)
        cross = (total @ total.T - self_terms) / (k * (k - 1))  # mean over j != k of g_j g_kᵀ (symmetric)
        self.signal += float(cross.trace())
        self.noise += float(stacked.sub(stacked.mean(0)).pow(2).sum()) / (k - 1)
        mean = stacked[:ranks].mean(0)  # what `ranks` ranks would average
        self.signal_gram = cross if self.signal_gram is None else self.signal_gram + cross
        self.mean_gram = mean @ mean.T if self.mean_gram is None else self.mean_gram + mean @ mean.T
        self.measurements += 1

    def row(self, ranks: int, batch: int) -> dict[str, float]:
        signal = max(self.signal, 0.0)
        return {
            "signal share of the mean": signal / (signal + self.noise / ranks) if signal + self.noise else 0.0,
            "noise scale B (samples)": self.noise * batch / signal if signal > 0 else float("inf"),
            "signal rank": float(rank_holding(self.signal_gram, KEPT)),
            "mean's rank": float(rank_holding(self.mean_gram, KEPT)),
        }


def rank_holding(gram: torch.Tensor, share: float) -> int:
    """The fewest eigen-directions of a (symmetric, possibly noisy) Gram matrix that hold `share`
    of the energy of its non-negative eigenvalues."""
    energies = torch.linalg.eigvalsh(gram).clamp(min=0).flip(0)
    total = float(energies.sum())
    if total <= 0:
        return 0
    return int(torch.searchsorted(torch.cumsum(energies, 0) / total, torch.tensor(share)).item()) + 1


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    trained = trainee(args)
    model = trained.model
    matrices = [name for name, p in model.named_parameters() if p.dim() > 1]
    params = dict(model.named_parameters())
    pooled = {(phase, name): Pooled() for phase in PHASES for name in matrices}

    for step in range(args.steps):
        if step % args.every == 0:
            phase = PHASES[min(len(PHASES) - 1, step * len(PHASES) // args.steps)]
            samples = []
            for _ in range(args.samples):
                trained.gradients(args.batch_size)
                samples.append({name: params[name].grad.detach().clone() for name in matrices})
            for name in matrices:
                pooled[(phase, name)].add([s[name] for s in samples], args.ranks)
        trained.step(args.ranks * args.batch_size)
        if (step + 1) % max(1, args.steps // 10) == 0:
            print(f"step {step + 1}/{args.steps}", flush=True)

    rows = [
        {
            "parameter": name,
            "shape": "×".join(map(str, params[name].shape)),
            "phase": phase,
            **pooled[(phase, name)].row(args.ranks, args.batch_size),
        }
        for name in matrices
        for phase in PHASES
        if pooled[(phase, name)].measurements
    ]
    write(rows, args)


def write(rows: list[dict], args: argparse.Namespace) -> None:
    write_table(
        args.out,
        "signal",
        [
            f"# Signal and noise in each weight matrix's gradient: {args.model} on {Path(args.data).name}",
            "",
            f"Adam at lr {args.lr} on batches of {args.ranks} × {args.batch_size} for {args.steps} steps; every "
            f"{args.every} steps {args.samples} independent batches of {args.batch_size} (`python -m "
            f"benchmarks.gradient_signal`). Signal share: of the mean over {args.ranks} ranks' gradients; "
            f"ranks: the directions holding {KEPT:.0%} of the energy over each third of the run.",
        ],
        rows,
        _cell,
    )


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.2f}"
    return str(value)


if __name__ == "__main__":
    main()
