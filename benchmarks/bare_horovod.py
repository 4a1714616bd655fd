"""The same data-parallel training as `--method ddp`, written as a bare Horovod script: no
hvd_lowcomm loop, meter, checkpoints or logging, only Horovod's DistributedOptimizer around
the same model, optimiser, batches and epochs. benchmarks.compare runs it as the method
`horovod`, so the table shows what hvd_lowcomm's own machinery costs on top of Horovod.

    mpirun -np 2 python -m benchmarks.bare_horovod --data data/mnist5k.h5 --hidden 1024,1024 \\
        --epochs 2 --run-dir runs/bare

Writes summary.json and epochs.csv in --run-dir with the fields compare reads (bytes per step
are the analytic ring-allreduce bytes of the gradients: nothing meters them here).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from hvd_lowcomm.data import H5Split, ShardedBatches, inspect
from hvd_lowcomm.metrics import write_csv
from hvd_lowcomm.models import mlp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="HDF5 dataset from data_prep")
    parser.add_argument("--hidden", default="1024,1024", help="MLP hidden widths")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--run-dir", required=True, help="where summary.json and epochs.csv go")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(args.seed)
    info = inspect(args.data)
    model = mlp(info.input_shape, info.num_classes, [int(h) for h in args.hidden.split(",")])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    train = ShardedBatches(H5Split(info, "train"), args.batch_size, hvd.rank(), hvd.size(), seed=args.seed)
    test = ShardedBatches(H5Split(info, "test"), 512, hvd.rank(), hvd.size(), shuffle=False)

    start, step_seconds, steps, rows = time.perf_counter(), 0.0, 0, []
    for epoch in range(1, args.epochs + 1):
        train.set_epoch(epoch)
        for x, y in train:
            t0 = time.perf_counter()
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            step_seconds += time.perf_counter() - t0
            steps += 1
        correct = count = 0
        with torch.no_grad():
            for x, y in test:
                correct += (model(x).argmax(1) == y).sum().item()
                count += len(y)
        correct, count = (int(v) for v in hvd.allreduce(torch.tensor([correct, count]), op=hvd.Sum))
        rows.append({"epoch": epoch, "test_acc": correct / count, "seconds": time.perf_counter() - start})

    p = hvd.size()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports kB
    peak_rss = int(hvd.allreduce(torch.tensor([peak_rss], dtype=torch.float64), op=hvd.Max).item())
    gradient_bytes = 4 * sum(t.numel() for t in model.parameters())
    wire = 2 * (p - 1) / p * gradient_bytes if p > 1 else 0.0
    if hvd.rank() == 0:
        run_dir = Path(args.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        for row in rows:
            row["train_wire_bytes_total"] = wire * steps * row["epoch"] / args.epochs
        write_csv(run_dir / "epochs.csv", rows)
        summary = {
            "method": "horovod",
            "world_size": p,
            "steps": steps,
            "final_test_acc": rows[-1]["test_acc"],
            "best_test_acc": max(r["test_acc"] for r in rows),
            "step_seconds_mean": step_seconds / steps,
            "train_wire_bytes_per_step": wire,
            "train_wire_bytes": wire * steps,
            "train_wire_bytes_all_ranks": wire * steps * p,
            "train_allreduce_world_wire_bytes": wire * steps,
            "peak_rss_bytes_max_rank": peak_rss,
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(
            f"horovod: {steps} steps, {1000 * step_seconds / steps:.1f} ms/step, "
            f"test acc {100 * rows[-1]['test_acc']:.2f} %"
        )


if __name__ == "__main__":
    main()
