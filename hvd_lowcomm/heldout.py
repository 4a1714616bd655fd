"""What each method's defaults measured on the held-out suite (benchmarks/heldout.py), as data.

A method's defaults *held* when, on every judged set, they stayed within LOSS_BOUND_PCT of ddp's
validation loss (language models) or ACC_BOUND_POINTS of its accuracy (classifiers), on average
over the seeds the set was run with (a row's vs_ddp is that mean). `--method auto` only chooses
among methods that held (or are exact), and `plan` prints each method's worst judged result
beside its predicted time. The figures come from SUMMARY, which the
benchmark writes from its results (`python -m benchmarks.heldout --package`); nothing here is
typed by hand.
"""

from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from pathlib import Path

LOSS_BOUND_PCT = 2.0  # a language model's validation loss, % above ddp's
ACC_BOUND_POINTS = 1.0  # a classifier's accuracy, points below ddp's
DILOCO_BYTES = 0.1  # DiLoCo's default exchange, as a share of fp32 DiLoCo's bytes
DILOCO_QUALITY = 1.0  # how much worse than fp32 DiLoCo it may end: % of its loss, points of its accuracy
SUMMARY = Path(__file__).with_name("heldout.csv")


def excess(metric: str, value: float) -> float:
    """How far a result is past its bound, in bounds (<= 0: within it): a loss % above ddp's
    or accuracy points below it."""
    return value / LOSS_BOUND_PCT - 1 if metric == "loss_pct" else -value / ACC_BOUND_POINTS - 1


def compressed_diloco_held(metric: str, against_fp32: float, bytes_ratio: float) -> bool:
    """DiLoCo's compressed default against fp32 DiLoCo: at most DILOCO_BYTES of its bytes,
    at most DILOCO_QUALITY worse (% of its loss, points of its accuracy)."""
    worse = against_fp32 if metric == "loss_pct" else -against_fp32
    return bytes_ratio <= DILOCO_BYTES and worse <= DILOCO_QUALITY


def describe(metric: str, value: float) -> str:
    return f"{value:+.1f} % loss" if metric == "loss_pct" else f"{value:+.1f} points"


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


@dataclass(frozen=True)
class Measured:
    """One method's defaults on the judged sets: whether they held, and the worst result."""

    method: str
    sets: int
    held: bool
    worst_set: str
    worst: str
    bytes_vs_ddp: float  # the median over the judged sets

    def risk(self) -> str:
        if self.held:
            return f"held on all {self.sets} held-out sets (worst: {self.worst} on {self.worst_set})"
        return f"failed the held-out suite ({self.sets} sets; worst: {self.worst} on {self.worst_set}, past its bound)"


def summarize(rows: list[dict[str, str]]) -> list[Measured]:
    """Per method, over the judged rows: held on all, its worst result, its median bytes."""
    judged: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        if row["split"] == "judged" and row["vs_ddp"] not in ("", "nan"):
            judged.setdefault(row["method"], []).append(row)
    out = []
    for method, results in judged.items():
        worst = max(results, key=lambda r: excess(r["metric"], float(r["vs_ddp"])))
        ratios = sorted(float(r["bytes_vs_ddp"]) for r in results)
        out.append(
            Measured(
                method,
                len(results),
                excess(worst["metric"], float(worst["vs_ddp"])) <= 0,
                worst["set"],
                describe(worst["metric"], float(worst["vs_ddp"])),
                ratios[len(ratios) // 2],
            )
        )
    return out


def write_summary(rows: list[dict[str, str]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["method", "sets", "held", "worst_set", "worst", "bytes_vs_ddp"])
        for m in summarize(rows):
            writer.writerow([m.method, m.sets, int(m.held), m.worst_set, m.worst, f"{m.bytes_vs_ddp:.4g}"])


def measured() -> dict[str, Measured]:
    """The committed summary, by method (empty when the package ships none)."""
    return _summary(SUMMARY)


@functools.lru_cache(maxsize=4)
def _summary(path: Path) -> dict[str, Measured]:
    """The summary at `path`, read once (auto and plan ask for it per method and link)."""
    if not path.exists():
        return {}
    return {
        r["method"]: Measured(
            r["method"], int(r["sets"]), r["held"] == "1", r["worst_set"], r["worst"], float(r["bytes_vs_ddp"])
        )
        for r in read_rows(path)
    }


def seeds_of(row: dict[str, str]) -> str:
    """' (mean of n seeds: a, b, c)' where a row averages several seeds' results, else ''."""
    per_seed = row.get("vs_ddp_per_seed", "").split()
    if len(per_seed) < 2:
        return ""
    return f" (mean of {len(per_seed)} seeds: {', '.join(f'{float(v):+.1f}' for v in per_seed)})"


def cells(rows: list[dict[str, str]]) -> dict[tuple[str, str], str]:
    """Each (method, set)'s result as text: quality against ddp (✗ past its bound; a mean over
    seeds with each seed's beside it), bytes as a multiple of ddp's, and for DiLoCo's default
    its quality and bytes against fp32 DiLoCo."""
    out = {}
    for r in rows:
        if r["vs_ddp"] in ("", "nan"):
            continue
        value = float(r["vs_ddp"])
        text = (
            f"{describe(r['metric'], value)}{'' if excess(r['metric'], value) <= 0 else ' ✗'}{seeds_of(r)}, "
            f"{float(r['bytes_vs_ddp']):.3g}× bytes"
        )
        if r["vs_fp32_diloco"] not in ("", "nan"):
            against, ratio = float(r["vs_fp32_diloco"]), float(r["bytes_vs_fp32_diloco"])
            text += f"; vs fp32 DiLoCo {describe(r['metric'], against)}, {ratio:.3g}× bytes" + (
                "" if compressed_diloco_held(r["metric"], against, ratio) else " ✗"
            )
        out[(r["method"], r["set"])] = text
    return out


def markdown(rows: list[dict[str, str]]) -> str:
    """The method × set table (ddp, the reference, left out) in Markdown."""
    sets = list(dict.fromkeys(r["set"] for r in rows))
    split = {r["set"]: r["split"] for r in rows}
    text = cells(rows)
    lines = ["| method | " + " | ".join(f"{n} ({split[n]})" for n in sets) + " |", "|---|" + "---|" * len(sets)]
    lines += [
        f"| {m} | " + " | ".join(text.get((m, n), "–") for n in sets) + " |"
        for m in dict.fromkeys(r["method"] for r in rows)
        if m != "ddp"
    ]
    return "\n".join(lines)
