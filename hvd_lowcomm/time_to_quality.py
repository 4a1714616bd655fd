"""How many steps each method needs to reach ddp's quality, measured at equal time on emulated
clusters (benchmarks/time_to_quality.py), as data.

A method's *steps multiple* is the most steps it needed, on any judged set and link, to reach
ddp's final validation loss within the suite's margin (its LOSS_MARGIN), as a multiple of ddp's steps (1: as many as ddp; an exact
method needs no measurement). `--method auto` ranks its candidates by predicted step time ×
this multiple, the predicted time to ddp's quality, and considers a method that changes how the
model trains (DiLoCo) only where it reached the target on every judged set. The figures come
from TABLE, which the benchmark writes (`python -m benchmarks.time_to_quality --package`);
nothing here is typed by hand.
"""

from __future__ import annotations

import csv
import functools
import math
from pathlib import Path

TABLE = Path(__file__).with_name("time_to_quality.csv")
FIELDS = ("method", "sets", "steps_vs_ddp")


@functools.cache
def steps_multiples() -> dict[str, float]:
    """Per measured method, its steps multiple (inf: it missed the target on some judged set)."""
    if not TABLE.exists():
        return {}
    with open(TABLE) as f:
        return {r["method"]: float(r["steps_vs_ddp"]) if r["steps_vs_ddp"] else math.inf for r in csv.DictReader(f)}


def write_rows(rows: list[dict[str, object]], path: Path = TABLE) -> None:
    """The benchmark's summary, one row per method (an empty steps_vs_ddp: not reached)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(FIELDS))
        writer.writeheader()
        writer.writerows(rows)
    steps_multiples.cache_clear()
