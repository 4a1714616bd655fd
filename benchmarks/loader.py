"""Loader throughput: samples per second that 1, 2 and 4 ranks read from one HDF5 file, from
shard files, from a gzip-compressed file, and from the same arrays held in memory (the upper
bound: same sharding, same batches, same uint8 -> normalised float32 conversion, no file).
The files were just written, so they are in the page cache: this measures the loader, not the
disk or the parallel file system. Then the share of step time
the trainer spends waiting for data in the demo and in a CNN on CIFAR-sized images.

    python -m benchmarks.loader --out benchmarks/results/loader

Writes results.md, results.csv and throughput.png to --out; the datasets and runs go under
--out/work (git-ignored). Each measurement is its own `mpirun -np N` job; ratios to the
in-memory read are what compare across machines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from hvd_lowcomm.metrics import write_csv

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]
LAYOUTS = ("memory", "file", "shards", "file-gzip")


def make_datasets(work: Path, samples: int, shape: tuple[int, ...], shards: int) -> dict[str, Path]:
    from data_prep import write_dataset

    paths = {"file": work / "images.h5", "shards": work / "images-shards", "file-gzip": work / "images-gzip.h5"}
    if all(p.exists() for p in paths.values()):
        return paths
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(samples, *shape), dtype=np.uint8)
    y = rng.integers(0, 10, size=samples)
    test = (x[: samples // 10], y[: samples // 10])
    write_dataset(paths["file"], (x, y), test, 10, "loader benchmark")
    write_dataset(paths["shards"], (x, y), test, 10, "loader benchmark", shards=shards)
    write_dataset(paths["file-gzip"], (x, y), test, 10, "loader benchmark", compression="gzip")
    return paths


def worker(path: str, layout: str, batch_size: int, epochs: int) -> None:
    """Run under mpirun: read `epochs` epochs of this rank's batches; rank 0 prints the result."""
    import h5py
    from mpi4py import MPI

    from hvd_lowcomm import data

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    split = data.H5Split(path, "train")
    if layout == "memory":  # the same reader over arrays already in memory
        for shard, file in enumerate(split.info.files):
            with h5py.File(file) as f:
                split._files[shard] = (f["train/x"][:], f["train/y"][:])
    batches = data.ShardedBatches(split, batch_size, rank, size, seed=1)
    samples = 0
    comm.Barrier()
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        batches.set_epoch(epoch)
        for x, _ in batches:
            samples += len(x)
    seconds = time.perf_counter() - start
    totals = comm.gather((samples, seconds), root=0)
    if rank == 0:
        print("RESULT " + json.dumps({"samples": sum(s for s, _ in totals), "seconds": max(t for _, t in totals)}))


def measure(path: Path, layout: str, np_: int, batch_size: int, epochs: int) -> float:
    cmd = [
        *MPIRUN,
        "-np",
        str(np_),
        sys.executable,
        "-m",
        "benchmarks.loader",
        "--worker",
        layout,
        "--path",
        str(path),
        "--batch",
        str(batch_size),
        "--epochs",
        str(epochs),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    return result["samples"] / result["seconds"]


def data_wait(work: Path, label: str, np_: int, args: list[str]) -> dict:
    run_dir = work / "runs"
    cmd = [
        *MPIRUN,
        "-np",
        str(np_),
        sys.executable,
        "-m",
        "hvd_lowcomm.train",
        "--run.dir",
        str(run_dir),
        "--run.name",
        label,
        "--run.progress",
        "false",
        *args,
    ]
    subprocess.run(cmd, capture_output=True, text=True, check=True)
    summary = json.loads((run_dir / label / "summary.json").read_text())
    return {
        "run": label,
        "np": np_,
        "data_wait_fraction": summary["data_wait_fraction"],
        "step_ms": 1000 * summary["step_seconds_mean"],
        "test_acc": summary["final_test_acc"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.loader", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="benchmarks/results/loader", help="where tables and plots go")
    parser.add_argument("--samples", type=int, default=20000, help="training images in the benchmark dataset")
    parser.add_argument("--shape", default="3,32,32", help="image shape (CIFAR-sized by default)")
    parser.add_argument("--shards", type=int, default=4, help="shard files of the sharded copy")
    parser.add_argument("--np", default="1,2,4", help="rank counts")
    parser.add_argument("--batch", type=int, default=128, help="batch size per rank")
    parser.add_argument("--epochs", type=int, default=2, help="epochs read per measurement")
    parser.add_argument("--worker", choices=LAYOUTS, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.path, args.worker, args.batch, args.epochs)
        return 0

    out = Path(args.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    shape = tuple(int(v) for v in args.shape.split(","))
    paths = make_datasets(work, args.samples, shape, args.shards)
    paths["memory"] = paths["file"]
    rows = []
    for np_ in (int(v) for v in args.np.split(",")):
        rates = {layout: measure(paths[layout], layout, np_, args.batch, args.epochs) for layout in LAYOUTS}
        for layout in LAYOUTS:
            rows.append(
                {
                    "np": np_,
                    "source": layout,
                    "samples_per_s": round(rates[layout]),
                    "per_rank": round(rates[layout] / np_),
                    "x_memory": round(rates[layout] / rates["memory"], 3),
                }
            )
            print(
                f"np {np_} {layout:>7}: {rates[layout]:10.0f} samples/s "
                f"({rates[layout] / rates['memory']:.2f} x memory)",
                flush=True,
            )
    waits = [
        data_wait(work, "demo", 2, []),
        data_wait(
            work,
            "cnn-images",
            2,
            [
                "--data.path",
                str(paths["shards"]),
                "--model.name",
                "cnn",
                "--model.hidden",
                "16,32",
                "--train.max_steps",
                "40",
                "--data.batch_size",
                "64",
            ],
        ),
    ]
    for w in waits:
        print(
            f"{w['run']}: waiting for data {100 * w['data_wait_fraction']:.1f}% of step time "
            f"({w['step_ms']:.2f} ms/step)",
            flush=True,
        )
    write_results(out, rows, waits, args)
    return 0


def write_results(out: Path, rows: list[dict], waits: list[dict], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    write_csv(out / "results.csv", rows)
    lines = [
        f"# Loader throughput ({args.samples} uint8 images of {args.shape}, batch {args.batch}/rank, "
        f"{args.epochs} epochs, {args.shards} shards)",
        "",
        "| ranks | source | samples/s (all ranks) | per rank | x in-memory |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['np']} | {r['source']} | {r['samples_per_s']:,} | {r['per_rank']:,} | {r['x_memory']:.2f} |"
        for r in rows
    ]
    lines += [
        "",
        "## Waiting for data during training (2 ranks)",
        "",
        "demo: the default run (MLP on digits). cnn-images: a CNN on the sharded benchmark images "
        "(random pixels and labels, so its accuracy is chance by construction).",
        "",
        "| run | waiting / step time | ms per step | test acc |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {w['run']} | {100 * w['data_wait_fraction']:.1f} % | {w['step_ms']:.2f} | {100 * w['test_acc']:.2f} % |"
        for w in waits
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(6, 4))
    for layout in LAYOUTS:
        mine = [r for r in rows if r["source"] == layout]
        ax.plot([r["np"] for r in mine], [r["samples_per_s"] for r in mine], marker="o", label=layout)
    ax.set(xlabel="ranks", ylabel="samples/s (all ranks)", title="HDF5 loader throughput")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)
    print(f"wrote {out / 'results.md'}, results.csv, throughput.png")


if __name__ == "__main__":
    sys.exit(main())
