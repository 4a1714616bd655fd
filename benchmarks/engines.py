"""Step time of the wrappers on each engine against PyTorch's own DDP (Gloo), side by side.

One user's loop (the zoo's GPT, AdamW, random tokens), one changed line per variant: PyTorch's
DistributedDataParallel over Gloo (the reference), then hvd_lowcomm's ddp, powersgd and dad
wrappers and DiLoCo, each on the Horovod and on the torch engine. Every variant is its own
mpirun job (an engine is chosen once per job), run one after another on the same machine; the
table gives each variant's median step against PyTorch DDP's in the same run.

    python -m benchmarks.engines --np 2,4 --steps 60 --out runs/engines

Variants after '@' change one Horovod setting: its background thread's cycle time
(HOROVOD_CYCLE_TIME) or mpirun's core binding (--bind-to none).

Writes results.csv and results.md in --out; --report also writes the committed report
(benchmarks/reports/engines.md).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = [
    "torch-ddp",
    "ddp/horovod",
    "ddp/torch",
    "powersgd/horovod",
    "powersgd/torch",
    "dad/horovod",
    "dad/torch",
    "diloco/horovod",
    "diloco/torch",
    # Horovod's own settings: its background thread's cycle (HOROVOD_CYCLE_TIME, ms; default
    # 1) and mpirun's binding of each rank to a core, which its thread shares (--bind-to none)
    "ddp/horovod@cycle5",
    "diloco/horovod@cycle20",
    "ddp/horovod@unbound",
    "diloco/horovod@unbound",
]
WARMUP = 10  # steps left out of the median: allocation, the plans, PowerSGD's start


def worker(variant: str, steps: int, layers: int, width: int, batch: int, context: int) -> None:
    import torch
    import torch.nn.functional as F

    method, _, engine = variant.partition("@")[0].partition("/")
    vocab = 256
    if method == "torch-ddp":
        import torch.distributed as dist
        from mpi4py import MPI

        from hvd_lowcomm.comm.engines import TorchEngine

        TorchEngine(MPI.COMM_WORLD)  # the same rendezvous from MPI; DDP then runs on it alone
        rank, size = dist.get_rank(), dist.get_world_size()
    else:
        import hvd_lowcomm as hl

        hl.init(engine=engine)
        rank, size = hl.rank(), hl.size()
    from hvd_lowcomm.models.transformer import gpt

    torch.manual_seed(0)
    model = gpt(vocab, context, layers=layers, width=width, tie_weights=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    forward, owner = model, None
    if method == "torch-ddp":
        forward = torch.nn.parallel.DistributedDataParallel(model)
    elif method == "ddp":
        opt = hl.DistributedOptimizer(opt, model.named_parameters())
    elif method == "powersgd":
        opt = hl.PowerSGDOptimizer(opt, model.named_parameters())
    elif method == "dad":
        opt = hl.DadOptimizer(opt, model)
    elif method == "diloco":
        owner = hl.DiLoCo(model, opt, total_steps=steps, groups=size)
    g = torch.Generator().manual_seed(1 + rank)
    seconds, loss = [], 0.0
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, context + 1), generator=g)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = forward(tokens[:, :-1])
        loss_tensor = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss_tensor.backward()
        (opt if owner is None else owner).step()  # DiLoCo steps the optimiser itself
        seconds.append(time.perf_counter() - start)
        loss = float(loss_tensor)
    if rank == 0:
        print(
            "RESULT "
            + json.dumps(
                {"variant": variant, "step_ms": 1000 * statistics.median(seconds[WARMUP:]), "final_loss": loss}
            ),
            flush=True,
        )


def launch_settings(variant: str) -> tuple[list[str], dict[str, str]]:
    """mpirun options and environment of a variant's Horovod setting (after '@')."""
    setting = variant.partition("@")[2]
    if setting.startswith("cycle"):
        return [], {"HOROVOD_CYCLE_TIME": setting[len("cycle") :]}
    return (["--bind-to", "none"], {}) if setting == "unbound" else ([], {})


def run(args: argparse.Namespace, ranks: int) -> list[dict]:
    rows = []
    for variant in args.variants:
        options, env = launch_settings(variant)
        command = [
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
            *options,
            "-np",
            str(ranks),
            sys.executable,
            "-m",
            "benchmarks.engines",
            "--worker",
            variant,
            "--steps",
            str(args.steps),
            "--layers",
            str(args.layers),
            "--width",
            str(args.width),
            "--batch",
            str(args.batch),
            "--context",
            str(args.context),
        ]
        print(f"[engines] np {ranks} {variant} ...", flush=True)
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env={**os.environ, **env})
        line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
        if done.returncode != 0 or line is None:
            sys.exit(f"[engines] {variant} failed:\n{done.stdout}\n{done.stderr}")
        rows.append({"np": ranks, **json.loads(line[len("RESULT ") :])})
        print(f"[engines] {variant}: {rows[-1]['step_ms']:.1f} ms/step", flush=True)
    reference = rows[0]["step_ms"]
    for row in rows:
        row["ratio_to_torch_ddp"] = row["step_ms"] / reference
    return rows


def write(rows: list[dict], args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["np", "variant", "step_ms", "ratio_to_torch_ddp", "final_loss"])
        writer.writeheader()
        writer.writerows({k: row[k] for k in writer.fieldnames} for row in rows)
    table = ["| np | variant | step (ms, median) | × PyTorch DDP | final loss |", "|---|---|---|---|---|"]
    table += [
        f"| {r['np']} | {r['variant']} | {r['step_ms']:.1f} | {r['ratio_to_torch_ddp']:.2f} | {r['final_loss']:.4f} |"
        for r in rows
    ]
    shape = (
        f"np {args.np}, gpt {args.layers} x {args.width} (tied head), batch {args.batch} x {args.context} tokens, "
        f"AdamW, {args.steps} steps (median after {WARMUP})"
    )
    (out / "results.md").write_text(f"{shape}\n\n" + "\n".join(table) + "\n")
    if args.report:
        report = Path(__file__).parent / "reports" / "engines.md"
        report.parent.mkdir(exist_ok=True)
        report.write_text(
            f"# Engines: step time against PyTorch DDP\n\nWhat ran: {shape}, one mpirun job per "
            f"variant on one machine, one after another.\n\nCommand: `python -m benchmarks.engines "
            f"--np {args.np} --steps {args.steps} --report`\n\n" + "\n".join(table) + "\n"
        )
    print((out / "results.md").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", default="2,4", help="ranks per job, comma-separated (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=60, help="training steps per variant")
    parser.add_argument("--layers", type=int, default=4, help="GPT blocks")
    parser.add_argument("--width", type=int, default=128, help="GPT width")
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    parser.add_argument("--context", type=int, default=64, help="tokens per sequence")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=VARIANTS,
        choices=VARIANTS,
        help="what to run; the first is the reference of the ratio column",
    )
    parser.add_argument("--out", default="runs/engines", help="where results.csv and results.md go")
    parser.add_argument("--report", action="store_true", help="also write benchmarks/reports/engines.md")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.layers, args.width, args.batch, args.context)
        return
    write([row for ranks in map(int, args.np.split(",")) for row in run(args, ranks)], args)


if __name__ == "__main__":
    main()
