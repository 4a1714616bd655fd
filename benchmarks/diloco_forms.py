"""DiLoCo's exchange forms and outer optimisers side by side, at several group counts.

    python -m benchmarks.diloco_forms --data data/mnist5k.h5 --model mlp --hidden 256,256 \\
        --np 8 --groups 2,4,8 --sync-every 10 --epochs 16 --batch-size 16 \\
        --out benchmarks/results/diloco-forms-mnist5k

One benchmarks.compare set (ddp, then for every group count DiLoCo at H = --sync-every with each
--forms entry: diloco.compression's values (`none`, `int8`, `int2`, `sparse`, `lowrank`...) are
compressions, `nesterov` the paper's outer step (lr 0.7, momentum 0.9); entries join with `+`,
e.g. `sparse+nesterov`; `key=value` sets any other diloco option), then forms.md / forms.csv:
per group count, each form's quality and its Δ against fp32 DiLoCo with the same outer step and
group count (what the done criteria of the exchange forms compare against), its inter-group bytes
per rank × that run's and × ddp's bytes, its outer steps, and the time its steps waited for the
exchange.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks import compare
from hvd_lowcomm.methods.diloco.exchange import COMPRESSIONS
from hvd_lowcomm.metrics import human_bytes, write_csv

NESTEROV = "outer_lr=0.7,outer_momentum=0.9"


def entry(form: str, groups: int, sync_every: int) -> str:
    """The compare entry of one form: diloco:groups=G,sync_every=H,compression=C,... (a form
    naming no compression is fp32, `none`, whatever DiLoCo's default)."""
    parts = form.split("+")
    compression = next((part for part in parts if part in COMPRESSIONS), "none")
    options = [f"groups={groups}", f"sync_every={sync_every}", f"compression={compression}"]
    for part in parts:
        if part == "nesterov":
            options.append(NESTEROV)
        elif "=" in part:
            options.append(part)
        elif part not in COMPRESSIONS:
            raise SystemExit(f"diloco_forms: unknown form part {part!r} (a compression, nesterov, or key=value)")
    return "diloco:" + ",".join(options)


def baseline_of(form: str) -> str:
    """The fp32 DiLoCo a form is judged against: the same outer step, no compression."""
    return "nesterov" if "nesterov" in form.split("+") else "none"


def rows(
    out: Path, np_: int, groups: list[int], forms: list[str], sync_every: int
) -> tuple[list[dict[str, Any]], bool]:
    """The table's rows, and whether quality is a language model's validation loss."""

    def summary(method: str) -> dict[str, Any]:
        return json.loads((out / "runs" / compare.run_name(np_, method) / "summary.json").read_text())

    ddp = summary("ddp")
    language = "final_perplexity" in ddp  # as compare tells a language model
    quality = "final_test_loss" if language else "final_test_acc"
    table = []
    for g in groups:
        runs = {form: summary(entry(form, g, sync_every)) for form in forms}
        for form, s in runs.items():
            base = runs.get(baseline_of(form))
            ddp_bytes = ddp["train_wire_bytes"]
            row = {
                "groups": g,
                "form": form,
                "quality": s[quality],
                "ddp_quality": ddp[quality],
                "inter_group_bytes": s["inter_group_wire_bytes"],
                "outer_steps": s["outer_steps"],
                "exchange_wait_seconds": s.get("exchange_wait_seconds"),
                "inter_bytes_x_ddp": s["inter_group_wire_bytes"] / ddp_bytes,
            }
            if base is not None:
                row["inter_bytes_x_fp32_diloco"] = s["inter_group_wire_bytes"] / base["inter_group_wire_bytes"]
                row["quality_vs_fp32_diloco"] = (
                    (s[quality] / base[quality] - 1) * 100 if language else (s[quality] - base[quality]) * 100
                )
            table.append(row)
    return table, language


def markdown(table: list[dict[str, Any]], title: str, language: bool) -> str:
    unit = "Δ loss vs {} (%)" if language else "Δ acc vs {} (points)"
    lines = [
        f"# {title}",
        "",
        "Each form against fp32 DiLoCo with the same outer step and group count; bytes are what one "
        "rank sent between groups over the run.",
        "",
        f"| groups | form | {'val loss' if language else 'test acc'} | {unit.format('ddp')} | "
        f"{unit.format('fp32 DiLoCo')} | inter-group bytes/rank | × fp32 DiLoCo | × ddp's bytes | outer steps | "
        "waited for the exchange |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        q = f"{r['quality']:.4f}" if language else f"{100 * r['quality']:.2f} %"
        d = f"{r['quality_vs_fp32_diloco']:+.2f}" if "quality_vs_fp32_diloco" in r else "–"
        vs_ddp = (r["quality"] / r["ddp_quality"] - 1) * 100 if language else (r["quality"] - r["ddp_quality"]) * 100
        x = f"1/{1 / r['inter_bytes_x_fp32_diloco']:.1f}" if r.get("inter_bytes_x_fp32_diloco") else "–"
        wait = f"{r['exchange_wait_seconds']:.2f} s" if r["exchange_wait_seconds"] is not None else "–"
        lines.append(
            f"| {r['groups']} | {r['form']} | {q} | {vs_ddp:+.2f} | {d} | "
            f"{human_bytes(r['inter_group_bytes'])} | {x} | "
            f"{r['inter_bytes_x_ddp']:.4f} | {r['outer_steps']} | {wait} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.diloco_forms",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--hidden", default="256,256")
    parser.add_argument("--np", type=int, default=8, help="ranks (default: %(default)s)")
    parser.add_argument("--groups", default="2,4,8", help="group counts, each dividing --np (default: %(default)s)")
    parser.add_argument(
        "--forms", default="none,int8,sparse,lowrank,nesterov", help="forms to run (default: %(default)s)"
    )
    parser.add_argument("--sync-every", type=int, default=10, help="H, inner steps per outer step (default: 10)")
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default="")
    parser.add_argument("--reuse", action="store_true", help="reuse finished runs under --out/runs")
    args, rest = parser.parse_known_args(argv)
    groups = [int(g) for g in args.groups.split(",")]
    forms = args.forms.split(",")
    if any(args.np % g for g in groups):
        parser.error(f"every group count must divide --np {args.np}: {groups}")
    methods = ["ddp"] + [entry(f, g, args.sync_every) for g in groups for f in forms]
    title = args.title or (
        f"DiLoCo's exchange forms: {args.model} on {Path(args.data).stem}, np {args.np} as "
        f"{'/'.join(map(str, groups))} groups, H = {args.sync_every}"
    )
    out = Path(args.out)
    compare.main(
        [
            "--methods",
            ",".join(methods),
            "--np",
            str(args.np),
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
            "--out",
            str(out),
            "--title",
            title,
            *(["--reuse"] if args.reuse else []),
            *rest,
        ]
    )
    table, language = rows(out, args.np, groups, forms, args.sync_every)
    (out / "forms.md").write_text(markdown(table, title, language))
    write_csv(out / "forms.csv", table)
    print((out / "forms.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
