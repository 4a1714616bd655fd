"""AB-training against DiLoCo at equal inter-group bytes, at several group counts.

    python -m benchmarks.ab_vs_diloco --data data/mnist5k.h5 --model mlp --hidden 512,512,512 \\
        --np 4,8,16 --ranks-per-group 2 --epochs 4 --out benchmarks/results/ab-vs-diloco-mnist5k

For every rank count, in one benchmarks.compare set with one group per `--ranks-per-group`
ranks (2: np 4, 8, 16 give 2, 4 and 8 groups, each group standing for a node): ddp; fp32
diloco (compression none) with plain averaging and with the DiLoCo paper's outer optimiser (lr
0.7, Nesterov momentum 0.9); ab at its defaults and with that outer optimiser at its syncs;
diloco at its defaults and its other exchanges (int8, sparse, low-rank, and fp32 overlapped by
one step); then fp32 diloco with the H at which its inter-group bytes per rank come closest to what
ab's run sent (measured: ab's bytes on the world process set over its steps, against one
sharded outer exchange of the model). Writes each rank count's compare tables under np<N>/,
and at the top results.md / results.csv (accuracy, Δ vs ddp, inter-group bytes × ddp,
compression (AB's parameters: the full model's over the low-rank one's at the end), step time
× ddp, time to 90 % of ddp) and accuracy_vs_inter_group_bytes.png (every method's final
accuracy against its inter-group bytes per rank per step: the Pareto picture).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks import compare
from hvd_lowcomm.comm.traffic import FLOAT_BYTES, wire_bytes
from hvd_lowcomm.methods.diloco import DiLoCoOptions, shard_length
from hvd_lowcomm.metrics import human_bytes, write_csv

# fp32 DiLoCo, named: AB's syncs are fp32, and the equal-bytes H is an fp32 exchange's.
FP32 = "diloco:compression=none"
# The DiLoCo paper's outer optimiser, on DiLoCo and on AB's syncs.
DILOCO_PAPER = f"{FP32},outer_lr=0.7,outer_momentum=0.9"
AB_OUTER = "ab:outer_lr=0.7,outer_momentum=0.9"


def _lowrank_default() -> str:
    """What DiLoCo's low-rank exchange sends at its defaults, for the table's label."""
    o = DiLoCoOptions().lowrank
    budget = f"ranks from 1/{1 / o.factor_share:.0f} of fp32's bytes" if o.rank == 0 else f"rank {o.rank}"
    return f"{budget}, {o.factor_bits} bits"


# DiLoCo's other exchanges: quantised, sparse and low-rank pseudo-gradients (error feedback),
# and the blocking exchange overlapped with the next inner step.
FORMS = {
    "diloco": f"diloco, defaults ({DiLoCoOptions().compression} exchange)",
    "diloco:compression=int8": "diloco, int8 exchange",
    "diloco:compression=sparse": f"diloco, sparse (top {DiLoCoOptions().sparse.density:.0%}, 2 bits)",
    "diloco:compression=lowrank": f"diloco, low-rank ({_lowrank_default()})",
    f"{FP32},sync_delay=1": "diloco, fp32 exchange overlapped (τ = 1)",
}
FIRST = ["ddp", FP32, DILOCO_PAPER, "ab", AB_OUTER, *FORMS]
ROLES = {
    FP32: "diloco, fp32 (plain averaging)",
    DILOCO_PAPER: "diloco, fp32, the paper's outer Nesterov",
    "ab": "ab (defaults: plain averaging)",
    AB_OUTER: "ab + the paper's outer Nesterov",
    **FORMS,
}


def equal_bytes_h(ab_summary: dict[str, Any], ranks: int, groups: int) -> int:
    """The H at which diloco's inter-group bytes per step equal what ab sent per step."""
    per_step = ab_summary["inter_group_wire_bytes"] / max(ab_summary["steps"], 1)
    shard = shard_length(ab_summary["parameters"], ranks // groups)
    per_sync = wire_bytes("allreduce", FLOAT_BYTES * shard, groups)
    return max(1, round(per_sync / per_step))


def run_count(np_: int, args: argparse.Namespace, common: list[str]) -> list[dict[str, Any]]:
    groups = np_ // args.ranks_per_group
    out = Path(args.out) / f"np{np_}"
    extra = ["--", "--ab.groups", str(groups), "--diloco.groups", str(groups)]
    reuse = ["--reuse"] if args.reuse else []
    compare.main([*common, "--np", str(np_), "--methods", ",".join(FIRST), "--out", str(out), *reuse, *extra])
    ab = json.loads((out / "runs" / compare.run_name(np_, "ab") / "summary.json").read_text())
    h = equal_bytes_h(ab, np_, groups)
    equal = f"{FP32},sync_every={h}"
    print(f"ab_vs_diloco: np {np_}: fp32 diloco at ab's inter-group bytes syncs every {h} steps", flush=True)
    compare.main(
        [*common, "--np", str(np_), "--methods", ",".join([*FIRST, equal]), "--out", str(out), "--reuse", *extra]
    )
    with open(out / "results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    for row in rows:
        row["groups"] = groups
        row["role"] = {**ROLES, equal: f"diloco, fp32 at ab's bytes (H={h})"}.get(row["method"], row["method"])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ab_vs_diloco",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--hidden", default="512,512,512")
    parser.add_argument("--np", default="4,8,16", help="rank counts (default: %(default)s)")
    parser.add_argument(
        "--ranks-per-group", type=int, default=2, help="ranks per group, a node's (default: %(default)s)"
    )
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reuse", action="store_true", help="reuse finished runs under --out/np<N>/runs")
    args = parser.parse_args(argv)
    common = [
        "--data",
        args.data,
        "--model",
        args.model,
        "--hidden",
        args.hidden,
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
    ]
    rows = []
    for np_ in (int(n) for n in args.np.split(",")):
        if np_ % args.ranks_per_group or np_ // args.ranks_per_group < 2:
            raise SystemExit(f"ab_vs_diloco: np {np_} does not make 2 or more groups of {args.ranks_per_group}")
        rows += run_count(np_, args, common)
    out = Path(args.out)
    write_csv(out / "results.csv", rows)
    header = [
        "np",
        "groups",
        "method",
        "test acc",
        "Δ acc vs ddp",
        "inter-group bytes/step",
        "inter-group × ddp",
        "compression",
        "step × ddp",
        "time to 90 % of ddp",
    ]
    lines = [
        f"# AB-training vs DiLoCo: {args.model} {args.hidden} on {args.data}, {args.epochs} epochs, batch "
        f"{args.batch_size}/rank, one group per {args.ranks_per_group} ranks",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in rows:
        steps_bytes = float(row["world_bytes_per_step"])
        lines.append(
            "| "
            + " | ".join(
                [
                    row["np"],
                    str(row["groups"]),
                    row["role"],
                    f"{100 * float(row['final_test_acc']):.2f} %",
                    f"{float(row.get('acc_diff_to_ddp_points') or 'nan'):+.2f}",
                    human_bytes(steps_bytes),
                    f"{float(row.get('world_bytes_ratio_to_ddp') or 'nan'):.4f}",
                    f"{float(row['compression_ratio']):.2f}x" if row.get("compression_ratio") else "–",
                    f"{float(row.get('step_time_ratio_to_ddp') or 'nan'):.2f}",
                    f"{float(row.get('seconds_to_90pct_of_ddp') or 'nan'):.1f} s",
                ]
            )
            + " |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plot(rows, out / "accuracy_vs_inter_group_bytes.png")
    print("\n".join(lines))
    return 0


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len({r["np"] for r in rows}), figsize=(5 * len({r["np"] for r in rows}), 4), squeeze=False
    )
    for ax, np_ in zip(axes[0], sorted({r["np"] for r in rows}, key=int)):
        for row in (r for r in rows if r["np"] == np_):
            x = float(row["world_bytes_per_step"])
            ax.scatter(max(x, 1.0), 100 * float(row["final_test_acc"]), label=row["role"])
        ax.set(
            xscale="log",
            xlabel="inter-group bytes per rank per step",
            ylabel="test accuracy (%)",
            title=f"np {np_} ({next(r['groups'] for r in rows if r['np'] == np_)} groups)",
        )
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
