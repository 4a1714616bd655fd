"""How many steps each method needs to reach ddp's quality, measured at equal time on emulated
clusters (benchmarks/time_to_quality.py), as data.

A method's *steps multiple* is the most steps it needed, on any judged set and link, to reach
ddp's final validation loss within the suite's margin (its LOSS_MARGIN), as a multiple of ddp's
steps (1: as many as ddp; an exact method needs no measurement). `--method auto` ranks its
candidates by predicted step time × this multiple, the predicted time to ddp's quality, and
considers a method that changes how the model trains (DiLoCo) only where it reached the target
on every judged set. The figures come from TABLE, which the benchmark writes (`python -m
benchmarks.time_to_quality --package`); nothing here is typed by hand.
"""

from __future__ import annotations

import csv
import functools
import math
from dataclasses import dataclass
from pathlib import Path

TABLE = Path(__file__).with_name("time_to_quality.csv")
# A link where the network takes at least a third of ddp's time: its training takes this
# multiple of the no-communication limit or more (the suite's equal-time verdicts are made there).
NETWORK_BOUND = 1.5
FIELDS = ("method", "sets", "steps_vs_ddp", "time_vs_limit", "loss_at_ddp_time_pct")


@dataclass(frozen=True)
class AtEqualTime:
    """One method's defaults on the judged sets, given ddp's training time: the most steps it
    needed for ddp's quality (× ddp's steps; inf: not reached on some set), and on the links
    where ddp's step waits on the network, its worst time to that quality as a multiple of the
    no-communication limit (ddp's steps at a step without communication; inf: not reached) and
    its worst loss when ddp's time had passed (% against ddp's final loss)."""

    method: str
    sets: int
    steps_vs_ddp: float
    time_vs_limit: float
    loss_at_ddp_time_pct: float


def _number(text: str, missing: float) -> float:
    return float(text) if text not in ("", None) else missing


@functools.cache
def measured() -> dict[str, AtEqualTime]:
    """Per measured method, what the suite found (empty without a table)."""
    if not TABLE.exists():
        return {}
    with open(TABLE) as f:
        return {
            r["method"]: AtEqualTime(
                r["method"],
                int(r["sets"]),
                _number(r["steps_vs_ddp"], math.inf),
                _number(r.get("time_vs_limit", ""), math.inf),
                _number(r.get("loss_at_ddp_time_pct", ""), math.nan),
            )
            for r in csv.DictReader(f)
        }


def steps_multiples() -> dict[str, float]:
    """Per measured method, its steps multiple (inf: it missed the target on some judged set)."""
    return {name: m.steps_vs_ddp for name, m in measured().items()}


def write_rows(rows: list[dict[str, object]], path: Path = TABLE) -> None:
    """The benchmark's summary, one row per method (an empty figure: the target not reached)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(FIELDS))
        writer.writeheader()
        writer.writerows(rows)
    measured.cache_clear()
