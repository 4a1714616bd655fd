"""A GPT whose replicas do not fit this machine trains when each group shards it (FSDP2).

    python -m benchmarks.sharding [--np 4] [--layers 32] [--width 1024] [--steps 4] [--out runs/sharding]

At np 4 as 2 groups x 2 shards, the zoo's GPT (by default 32 layers x 1024, about 400 M
parameters, AdamW) is trained for a few steps twice, one mpirun job each: as HSDP (`--method fsdp
--fsdp.group_size 2`) and as DiLoCo across the sharded groups (`--method diloco --diloco.shard
true`). Each run's peak resident memory per rank and its first steps' losses are written beside
the planner's memory per rank (python -m hvd_lowcomm.plan's table) for every form, ddp and
diloco included: those two are not run, since four replicas of the weights, gradients and AdamW
state would not fit this machine's memory. Writes results.csv and results.md under --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import subprocess
import sys
from pathlib import Path

import torch

from data_prep.__main__ import main as data_prep_main
from hvd_lowcomm import config, costmodel, data, models
from hvd_lowcomm.metrics import write_csv
from hvd_lowcomm.plan import memory_per_rank

WORDS = "the cat sat on a mat while dogs ran past two red birds and one old fox".split()
RUNS = (
    ("fsdp in each group, all-reduced across (HSDP)", ["--method", "fsdp", "--fsdp.group_size", "2"]),
    (
        "diloco + shard (FSDP in each group)",
        ["--method", "diloco", "--diloco.groups", "2", "--diloco.shard", "true", "--diloco.sync_every", "2"],
    ),
)


def corpus(out: Path, lines: int = 600) -> Path:
    """A small text dataset of `lines` lines of random words (600: a few windows to evaluate,
    where the model is what is large)."""
    path = out / "text.h5"
    if not path.exists():
        rng = random.Random(0)
        (out / "text").mkdir(parents=True, exist_ok=True)
        (out / "text" / "a.txt").write_text(
            "\n".join(" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(lines))
        )
        if data_prep_main(["text", str(out / "text"), "--out", str(path)]) != 0:
            raise SystemExit("sharding: data_prep could not write the text dataset")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.sharding", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--np", type=int, default=4, help="ranks, as 2 groups (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=32, help="GPT layers (default: %(default)s)")
    parser.add_argument("--width", type=int, default=1024, help="GPT width (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per run (default: %(default)s)")
    parser.add_argument("--out", default="runs/sharding", help="output directory (default: %(default)s)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = corpus(out)
    model = [
        "--model.name",
        "gpt",
        "--model.layers",
        str(args.layers),
        "--model.width",
        str(args.width),
        "--model.heads",
        str(args.width // 64),
        "--data.seq_len",
        "64",
        "--data.batch_size",
        "2",
        "--data.path",
        str(path),
        "--train.optimizer",
        "adamw",
        "--train.max_steps",
        str(args.steps),
        "--train.epochs",
        "1",
    ]
    rows = []
    planned = planned_memory(model, args.np)
    for name, options in RUNS:
        print(f"sharding: {name} at np {args.np} ...", flush=True)
        done = subprocess.run(
            [
                "mpirun",
                "--allow-run-as-root",
                "--oversubscribe",
                "-np",
                str(args.np),
                sys.executable,
                "-m",
                "hvd_lowcomm.train",
                *model,
                *options,
                "--run.dir",
                str(out / "runs"),
                "--run.name",
                options[1],
                "--run.progress",
                "false",
                "--run.log_every",
                "1",
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"sharding: {name} failed (exit {done.returncode})")
        run = out / "runs" / options[1]
        summary = json.loads((run / "summary.json").read_text())
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in records if r["type"] == "step"]
        rows.append(
            {
                "form": name,
                "ran": "yes",
                "planned_gib": planned[name],
                "peak_rss_gib_max_rank": summary["peak_rss_bytes_max_rank"] / 2**30,
                "first_losses": " ".join(f"{v:.3f}" for v in losses[: args.steps]),
                "final_test_loss": summary["final_test_loss"],
            }
        )
    for name in ("ddp", "diloco"):
        rows.append(
            {
                "form": name,
                "ran": "no: replicas do not fit",
                "planned_gib": planned[name],
                "peak_rss_gib_max_rank": "",
                "first_losses": "",
                "final_test_loss": "",
            }
        )
    write_csv(out / "results.csv", rows)
    table = ["| form | ran | planned GiB per rank | peak RSS GiB (max rank) | first losses |", "|---|---|---|---|---|"]
    table += [
        f"| {r['form']} | {r['ran']} | {r['planned_gib']:.2f} | "
        f"{r['peak_rss_gib_max_rank'] and format(r['peak_rss_gib_max_rank'], '.2f')} | {r['first_losses']} |"
        for r in rows
    ]
    (out / "results.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


def planned_memory(train_argv: list[str], ranks: int) -> dict[str, float]:
    """The planner's memory per rank (GiB) of each form, groups of ranks/2 as the planner's nodes."""
    cfg = config.load(train_argv)
    info = data.inspect(cfg.data.path, cfg.data.seq_len)
    with torch.device("meta"):
        model = models.build_model(cfg.model, info.input_shape, info.num_classes, info.task)
    profile = costmodel.profile_model(
        model,
        info.input_shape,
        cfg.data.batch_size,
        cfg=cfg,
        methods=("fsdp",),
        vocabulary=info.vocabulary,
        device=costmodel.compute_device("h100"),
    )
    group = ranks // 2
    forms = {
        "ddp": ("ddp", {}),
        "diloco": ("diloco", {"groups": 2}),
        RUNS[0][0]: ("fsdp", {"group_size": group}),
        RUNS[1][0]: ("diloco", {"groups": 2, "shard": True}),
    }
    planned = {}
    for name, (method, options) in forms.items():
        form = copy.deepcopy(cfg)
        section = form.method_options.get(method)
        for key, value in options.items():
            setattr(section, key, value)
        planned[name] = memory_per_rank(profile, method, section, ranks, group, form) / 2**30
    return planned


if __name__ == "__main__":
    sys.exit(main())
