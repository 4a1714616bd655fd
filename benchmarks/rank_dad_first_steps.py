"""What one truncated gradient does to Adam's step, at the first step and after an exact start
(#81: why rank-dAD's result scatters and why `rank-dad.start_iter` removes it):

    python -m benchmarks.rank_dad_first_steps                   # changelogs, seeds 42 and 43
    python -m benchmarks.rank_dad_first_steps --data data/heldout/man-pages.h5 --seeds 42

Three short runs per seed (the zoo's `gpt` 4 × 128, np 2, a checkpoint at every step): ddp,
rank-dAD at its defaults, and rank-dAD with `start_iter` exact steps. The first two start from
the same weights, so at step 1 they differ only in the gradient; the warm-up run equals ddp up
to step `start_iter`, so at the step after it they again differ in one gradient only. For each
weight the factors changed, the gradient Adam received (from its first moment) and the step Adam
took (from both moments) are compared with ddp's at that step: cosine and the share of
coordinates of the same sign. Writes --csv, one row per run, step and weight, and prints the
mean over weights, weighted by size.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.netns import MPIRUN

COLUMNS = ("seed", "run", "step", "weight", "numel", "gradient_cosine", "adam_step_cosine", "sign_agreement")
# A weight whose gradient matches ddp's this closely was not factored (exact, or rank enough).
EXACT_COSINE = 0.99999


def train(method: list[str], name: str, seed: int, steps: int, args: argparse.Namespace) -> Path:
    run = Path(args.out) / f"s{seed}" / name
    if not (run / "checkpoints" / f"step-{steps:08d}").is_dir():
        command = [*MPIRUN, "-np", "2", sys.executable, "-m", "hvd_lowcomm.train", "--method", *method]
        command += ["--data.path", args.data, "--model.name", "gpt", "--model.hidden", ""]
        command += ["--train.epochs", "10", "--train.seed", str(seed), "--train.max_steps", str(steps)]
        command += ["--run.checkpoint_every", "1", "--run.keep_checkpoints", str(steps + 1)]
        command += ["--run.dir", str(run.parent), "--run.name", name, "--run.progress", "false"]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return run


def adam_view(run: Path, step: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per weight: the gradient Adam received at `step` and the (unscaled) step it took."""

    def state(t: int) -> dict:
        return torch.load(run / "checkpoints" / f"step-{t:08d}" / "rank-00000.pt", weights_only=False)["state"]

    now = state(step)
    before = state(step - 1)["optimizer"]["state"] if step > 1 else None
    beta1, beta2 = now["optimizer"]["param_groups"][0]["betas"]
    eps = now["optimizer"]["param_groups"][0]["eps"]
    names = list(now["model"])
    view = {}
    for index, moments in now["optimizer"]["state"].items():
        m, v = moments["exp_avg"], moments["exp_avg_sq"]
        m_before = before[index]["exp_avg"] if before else torch.zeros_like(m)
        gradient = (m - beta1 * m_before) / (1 - beta1)
        adam_step = (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt() + eps)
        view[names[index]] = gradient, adam_step
    return view


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-30))


def rows_at(seed: int, name: str, run: Path, ddp: Path, step: int) -> list[dict]:
    exact, other = adam_view(ddp, step), adam_view(run, step)
    rows = []
    for weight, (gradient, adam_step) in exact.items():
        g, s = other[weight]
        if gradient.dim() == 2 and cosine(gradient, g) < EXACT_COSINE:
            rows.append(
                {"seed": seed, "run": name, "step": step, "weight": weight, "numel": gradient.numel()}
                | {"gradient_cosine": cosine(gradient, g), "adam_step_cosine": cosine(adam_step, s)}
                | {"sign_agreement": float((gradient.sign() == g.sign()).float().mean())}
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.rank_dad_first_steps",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--data", default="data/heldout/debian-changelogs.h5", help="a text set (HDF5)")
    parser.add_argument("--seeds", default="42,43", help="comma-separated seeds")
    parser.add_argument("--start-iter", type=int, default=10, help="the warm-up run's exact steps (default: 10)")
    parser.add_argument("--out", default="runs/rank-dad-first-steps", help="the runs (git-ignored)")
    parser.add_argument("--csv", default="runs/rank-dad-first-steps/results.csv", help="the table")
    args = parser.parse_args(argv)
    if not Path(args.data).is_file():
        parser.error(f"{args.data} does not exist: prepare it with benchmarks.heldout.prepare")
    steps, rows = args.start_iter + 1, []
    warmup = f"start_iter={args.start_iter}"
    for seed in (int(s) for s in args.seeds.split(",")):
        ddp = train(["ddp"], "ddp", seed, steps, args)
        default = train(["rank-dad"], "rank-dad", seed, steps, args)
        warm = train(["rank-dad", "--rank-dad.start_iter", str(args.start_iter)], warmup, seed, steps, args)
        rows += rows_at(seed, "rank-dad", default, ddp, 1) + rows_at(seed, warmup, warm, ddp, steps)
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print("| seed | run | step | weights | gradient cosine | Adam step cosine | same sign |")
    print("|---|---|---|---|---|---|---|")
    for key in dict.fromkeys((r["seed"], r["run"], r["step"]) for r in rows):
        group = [r for r in rows if (r["seed"], r["run"], r["step"]) == key]
        size = sum(r["numel"] for r in group)
        mean = {c: sum(r[c] * r["numel"] for r in group) / size for c in COLUMNS[5:]}
        low = min(r["adam_step_cosine"] for r in group)
        print(
            f"| {key[0]} | {key[1]} | {key[2]} | {len(group)} | {mean['gradient_cosine']:.4f} | "
            f"{mean['adam_step_cosine']:.5f} (lowest {low:.5f}) | {mean['sign_agreement']:.3f} |"
        )
    print(f"wrote {args.csv} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
