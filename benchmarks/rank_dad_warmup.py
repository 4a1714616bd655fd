"""rank-dAD with exact warm-up steps (`rank-dad.start_iter`) against ddp, on both halves of the
held-out suite and on a corpus in none of its sets:

    python -m benchmarks.rank_dad_warmup                       # every run below, finished ones reused
    python -m benchmarks.rank_dad_warmup --start-iter 30 --out runs/rank-dad-warmup30

Corpora (benchmarks.heldout.prepare): Debian's changelogs (the chosen text set), the machine's man
pages (in no set) and the Python standard library (a judged set), the zoo's `gpt` 4 × 128, np 2,
10 epochs, with ddp, rank-dAD with factors from the first step (`start_iter=0`, the default
until 2026-12-03) and the warm-up beside it; then the judged sets of benchmarks.heldout named
by --sets, at each of their seeds, with ddp and the warm-up (the figures of factors from the
first step on them are the held-out suite's table before the warm-up became the default).
Writes --csv: one row per set, seed and method, its quality against ddp at the same seed and its
bytes as a multiple of ddp's.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from benchmarks import compare, heldout as suite

CORPORA = (("debian-changelogs", 42), ("debian-changelogs", 43), ("man-pages", 42), ("man-pages", 43))
JUDGED_CORPORA = (("python-stdlib", 42),)
COLUMNS = ("set", "seed", "method", "final_test_loss", "loss_diff_to_ddp_pct", "final_test_acc")
COLUMNS += ("acc_diff_to_ddp_points", "bytes_ratio_to_ddp")


def corpus_rows(corpus: str, seed: int, methods: str, args: argparse.Namespace) -> list[dict[str, str]]:
    out = Path(args.out) / f"{corpus}-s{seed}"
    data = suite.prepare(corpus, Path(args.data_dir))
    argv = ["--methods", methods, "--np", "2", "--data", str(data), "--model", "gpt", "--hidden", ""]
    argv += ["--epochs", "10", "--seed", str(seed), "--out", str(out), "--reuse"]
    if compare.main(argv):
        raise SystemExit(f"rank_dad_warmup: a run on {corpus} at seed {seed} failed (see {out}/runs/*.log)")
    return read(out / "results.csv", corpus, seed)


def read(path: Path, name: str, seed: int) -> list[dict[str, str]]:
    """A comparison's rows; a language model's judged by its loss alone (as the suite judges it)."""
    with open(path) as f:
        rows = [{"set": name, "seed": str(seed), **{c: r.get(c, "") for c in COLUMNS[2:]}} for r in csv.DictReader(f)]
    for row in rows:
        if row["final_test_loss"] not in ("", "nan"):
            row["final_test_acc"] = row["acc_diff_to_ddp_points"] = ""
        else:
            row["final_test_loss"] = row["loss_diff_to_ddp_pct"] = ""
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.rank_dad_warmup", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--start-iter", type=int, default=10, help="exact steps before the factors (default: 10)")
    judged_sets = ",".join(name for name, s in suite.SETS.items() if s.split == "judged")
    parser.add_argument("--sets", default=judged_sets, help="judged held-out sets (default: all of them)")
    parser.add_argument("--data-dir", default="data/heldout", help="where the corpora are prepared")
    parser.add_argument("--out", default="runs/rank-dad-warmup", help="the runs (git-ignored)")
    parser.add_argument("--csv", default="benchmarks/results/rank-dad-warmup/results.csv", help="the table")
    args = parser.parse_args(argv)
    warmup = f"rank-dad:start_iter={args.start_iter}"
    rows = [
        r
        for corpus, seed in CORPORA + JUDGED_CORPORA
        for r in corpus_rows(corpus, seed, f"ddp,rank-dad:start_iter=0,{warmup}", args)
    ]
    judged = Path(args.out) / "heldout"
    suite.main(
        ["--split", "judged", "--sets", args.sets, "--seeds", "all", "--methods", f"ddp,{warmup}"]
        + ["--data-dir", args.data_dir, "--out", str(judged)]
    )
    for name in args.sets.split(","):
        s = suite.SETS[name]
        rows += [
            r
            for seed in s.seeds
            if (s.results(judged, seed) / "results.csv").exists()
            for r in read(s.results(judged, seed) / "results.csv", name, seed)
        ]
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.csv} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
