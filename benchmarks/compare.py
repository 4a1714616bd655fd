"""Side-by-side comparison of training methods: same data, model, seed and epochs.

    python -m benchmarks.compare --methods ddp,ddp-fp16,dad,rank-dad:rank=4 --np 2,4 \\
        --data data/mnist5k.h5 --hidden 1024,1024 --epochs 5 --out benchmarks/results/dad

Each method runs as its own `mpirun -np N python -m hvd_lowcomm.train` job. A method entry
is a registered method name, optionally with options, `name:key=value,key=value` (keys
without a dot belong to the method's own section: `rank-dad:rank=4` is
`--rank-dad.rank 4`; `ddp:comm.compression=fp16` sets another section); registered variants
such as `ddp-fp16` are method names like any other. Anything after `--` is passed to every run.

With --link RATE each run happens on an emulated network (benchmarks/netns.py) whose bytes are
counted from outside the processes and printed beside the meter's: without --nodes, one
rate-limited loopback that every rank's traffic crosses; with --nodes N, a cluster of N nodes
(np/N ranks each, shared memory inside a node) joined by links of RATE, where only traffic
between nodes crosses the links and hvd_lowcomm sees N nodes (one AB/DiLoCo group per node).

Besides equal-step results, every run is judged by time to quality, as a slow-link user asks:
the training time (wall clock less evaluation) until it first reaches ddp's final quality within
--loss-margin / --acc-margin, and its quality when the quickest run had finished (equal time),
with quality against training time plotted.

With --budget K, judged at equal time instead of equal steps: ddp runs first as above, and
every other method (`local` and `auto` included) trains for K x ddp's training time
(--train.max_time, its schedule planned to end there, evaluated every twentieth of ddp's time).
The tables then add each method's time to ddp's final quality, its quality when ddp's
training time had passed and at the end of its budget, and the no-communication limit: ddp's
steps at `local`'s step time, what ddp would take on a free network, with each method's time
to quality as a multiple of it; loss_vs_time.png draws the limit.

The entry `horovod` runs benchmarks/bare_horovod.py instead: ddp's training as a plain Horovod
script (MLP models, unshaped link), to show what hvd_lowcomm's loop and meter add.

`--methods all` runs every method and `local`, the no-communication floor (each rank steps
alone): each row then shows where its step goes (forward, backward, blocked in communication,
the rest) and its distance to the floor, max(local's step time, bytes per step / link rate).

Writes to --out: results.csv and results.md (accuracy, bytes per step from the traffic meter,
step time and its phases, floor, peak memory, ratios to ddp fp32 at the same rank count; for a
language model (a text dataset) validation loss, its difference to ddp's, perplexity, bits per
byte and the time to come within --loss-margin of ddp's final loss instead of accuracy),
accuracy_vs_epoch.png, accuracy_vs_bytes.png, accuracy_vs_time.png (loss_vs_* for a language
model), step_time.png,
step_phases.png (stacked),
effective_rank.png when a method logs one,
accuracy_vs_inter_group_bytes.png when a method trains in groups and compression.png when one
factorises its model; the runs themselves under
runs/ (--reuse remakes tables and plots from them). Ratios, not absolute seconds, are what compare across machines;
on a shared machine, --repeat N runs every method N times in rounds and reports each one's median run
(step ms shows the range of the N).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.coordination import DONE, IDLE, IDLE_MARKS, idle_bytes_per_second, idle_rate_between
from benchmarks.netns import (
    MPIRUN,
    EmulatedCluster,
    LinkUnavailable,
    ShapedLink,
    check_available,
    rate_bits,
    run_reading_counters,
)
from data_prep import BUNDLED
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.config import default_config
from hvd_lowcomm.registry import specs
from hvd_lowcomm.metrics import human_bytes, write_csv

SECTIONS = set(default_config().sections())  # a method entry's dotted key starting with one names it

# Measured and metered bytes should agree within this fraction: on one shaped loopback, and
# between emulated nodes (where the meter's count is exact: large messages, jumbo frames).
AGREEMENT = 0.10
NODE_AGREEMENT = 0.05
# Horovod's coordination (a small allreduce on every process set, every 1 ms cycle) is never
# metered. The counters may exceed the meter by this much per step and link (negotiating new
# tensors: a run that sends almost nothing), plus the coordination's rate with every rank idle,
# measured for the run's process sets on the same network (benchmarks/coordination.py), over the
# time the run's rank 0 was not computing (blocked in communication, evaluating): at 64 ranks on
# 8 emulated nodes that rate is 8-10 MB/s, a sixth of PowerSGD's traffic per step there.
BACKGROUND_BYTES_PER_STEP = 64e3
# The trainer's first line (printed after setup's broadcasts) and an epoch's line (after its
# evaluation): the link's counters are read at both, so the count covers training alone.
TRAINING_STARTS = "hvd_lowcomm: method "
EPOCH_ENDS = re.compile(r"epoch\s+\d+/\d+ \|")
STEP_PHASES = ("forward", "backward", "exchange", "other")  # as the trainer's summary splits a step
# "Reached ddp's quality": a validation loss at most this fraction above ddp's final one (language
# models), or an accuracy at most this many points below ddp's final one (--loss-margin, --acc-margin).
LOSS_MARGIN = 0.02
ACC_MARGIN_POINTS = 1.0
# With --budget: epochs enough that the time budget, not the epoch count, ends a run; and
# evaluations per ddp training time, for a loss-against-time curve.
BUDGET_EPOCHS = 1000
EVALUATIONS_PER_DDP_TIME = 20
# benchmarks/bare_horovod.py as a method name: ddp's training without hvd_lowcomm's machinery.
BARE_HOROVOD = "horovod"
# Every registered method, the no-communication floor and ddp first (--methods all).
ALL_METHODS = ",".join(["local", "ddp", *sorted(name for name in specs() if name not in ("local", "ddp"))])


@dataclass(frozen=True)
class Variant:
    label: str  # as given on the command line
    method: str
    overrides: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> "Variant":
        method, _, options = text.partition(":")
        section = specs()[method].section if method in specs() else method  # a variant's options are its base's
        overrides: list[str] = []
        for item in filter(None, options.split(",")):
            key, sep, value = item.partition("=")
            if not sep:
                raise SystemExit(f"compare: method option {item!r} in {text!r} needs key=value")
            # 'train.lr' names its section; 'sparse.density' is the method's own (diloco.sparse.density)
            overrides += [f"--{key if key.split('.')[0] in SECTIONS else f'{section}.{key}'}", value]
        return cls(text, method, tuple(overrides))


def run_name(np_: int, label: str) -> str:
    """The directory name of the run of method entry `label` on np_ ranks."""
    return f"np{np_}-{label.replace(':', '-').replace(',', '-').replace('=', '')}"


def budget_arguments(ddp_seconds: float, factor: float) -> list[str]:
    """What a method's run gets under --budget: factor x ddp's training time, a schedule planned
    to end there, and evaluations every twentieth of ddp's time."""
    return [
        "--train.epochs",
        str(BUDGET_EPOCHS),
        "--train.max_steps",
        "-1",
        "--train.max_time",
        f"{factor * ddp_seconds:.3f}",
        "--run.eval_every_seconds",
        f"{ddp_seconds / EVALUATIONS_PER_DDP_TIME:.3f}",
    ]


def run_one(
    variant: Variant,
    np_: int,
    args: argparse.Namespace,
    runs_dir: Path,
    extra: list[str],
    repeat: int = 0,
    budget: list[str] = (),
) -> dict[str, Any]:
    name = run_name(np_, variant.label) + (f"-r{repeat + 1}" if repeat else "")
    model = [
        *(["--model.name", args.model] if args.model else []),
        *(["--model.hidden", args.hidden] if args.hidden else []),
    ]
    train_args = [
        "--method",
        variant.method,
        *variant.overrides,
        "--data.path",
        args.data,
        *model,
        "--train.epochs",
        str(args.epochs),
        "--data.batch_size",
        str(args.batch_size),
        "--train.seed",
        str(args.seed),
        "--run.dir",
        str(runs_dir),
        "--run.progress",
        "false",
        *extra,
        *budget,  # after the options for every run: a budget run's length is the budget's
    ]
    started = time.monotonic()
    measured_file = runs_dir / f"{name}.link.json"
    if variant.method == BARE_HOROVOD:  # the same training as ddp, as a plain Horovod script
        if args.link is not None:
            raise RunFailed("compare: horovod (the bare script) runs on an unshaped link only")
        if not (args.reuse and (runs_dir / name / "summary.json").exists()):
            launch(
                np_,
                [
                    "--data",
                    args.data,
                    "--hidden",
                    args.hidden,
                    "--epochs",
                    str(args.epochs),
                    "--batch-size",
                    str(args.batch_size),
                    "--seed",
                    str(args.seed),
                    "--run-dir",
                    str(runs_dir / name),
                ],
                runs_dir / f"{name}.log",
                module="benchmarks.bare_horovod",
            )
        measured = None
    elif args.reuse and (runs_dir / name / "summary.json").exists():
        # A finished run: only its tables and plots are made again.
        measured = json.loads(measured_file.read_text()) if measured_file.exists() else None
    elif args.link is None:
        shutil.rmtree(runs_dir / name, ignore_errors=True)  # an interrupted earlier run (the trainer never overwrites)
        launch(np_, [*train_args, "--run.name", name], runs_dir / f"{name}.log")
        measured = None
    else:
        shutil.rmtree(runs_dir / name, ignore_errors=True)
        with network(args) as net:
            sent, idle = launch(np_, [*train_args, "--run.name", name], runs_dir / f"{name}.log", net)
            measured = {
                "link": args.link,
                "link_bits_per_s": net.rate_bits,
                "nodes": args.nodes,
                "measured_train_bytes": sum(sent),
                "measured_bytes_per_node": sent,
                "idle_bytes_per_second": idle,
            }
        measured_file.write_text(json.dumps(measured))
    summary = json.loads((runs_dir / name / "summary.json").read_text())
    if (
        measured is not None
        and "idle_bytes_per_second" not in measured
        and args.link is not None
        and "process_sets" in summary
    ):  # a run kept from before runs measured it themselves (--reuse)
        measured["idle_bytes_per_second"] = idle_rate(args, np_, summary["process_sets"])
        measured_file.write_text(json.dumps(measured))
    with open(runs_dir / name / "epochs.csv") as fh:
        epochs = list(csv.DictReader(fh))
    return {
        "variant": variant.label,
        "np": np_,
        "summary": summary,
        "epochs": epochs,
        "measured": measured,
        "wall_seconds": time.monotonic() - started,
        "step_ms_runs": [1000 * summary["step_seconds_mean"]],
    }


def counters_agree(measured: float, metered: float, unmetered_allowance: float, nodes: bool) -> bool:
    """Whether the bytes counted on the links agree with the meter's: within NODE_AGREEMENT
    (emulated nodes) or AGREEMENT (one shaped loopback), or by less than the allowance for
    Horovod's unmetered coordination (`unmetered_allowance`)."""
    if metered and abs(measured / metered - 1) <= (NODE_AGREEMENT if nodes else AGREEMENT):
        return True
    return abs(measured - metered) < unmetered_allowance


def unmetered_allowance(summary: dict[str, Any], measured: dict[str, Any]) -> float:
    """Bytes of Horovod coordination a run may have sent beyond the meter: BACKGROUND_BYTES_PER_STEP
    per step and link, and the idle rate over the seconds rank 0 spent not computing."""
    links = max(len(measured.get("measured_bytes_per_node", [])), 1)
    computing = (
        summary["steps"]
        * sum(summary.get(f"step_ms_{phase}", 0.0) for phase in STEP_PHASES if phase != "exchange")
        / 1000
    )
    waiting = max(summary["seconds"] - computing, 0.0)
    return links * BACKGROUND_BYTES_PER_STEP * summary["steps"] + measured.get("idle_bytes_per_second", 0.0) * waiting


_idle_rates: dict[tuple[int, str], float] = {}


def idle_rate_text(rate: float) -> str:
    return "–" if math.isnan(rate) else f"{human_bytes(rate)}/s"


def idle_rate(args: argparse.Namespace, np_: int, process_sets: list[list[int]]) -> float:
    """Horovod's coordination rate with every rank idle, for this layout on a network like the
    runs' (measured once per layout and comparison)."""
    key = (np_, json.dumps(process_sets))
    if key not in _idle_rates:
        with network(args) as net:
            _idle_rates[key] = idle_bytes_per_second(net, np_, process_sets)
    return _idle_rates[key]


def median_runs(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One result per (method, rank count): with --repeat, the run whose mean step time is the
    median of its repeats (every column from that one run, so they stay consistent; runs are
    deterministic for a seed, so only times differ), with every repeat's step time beside it."""
    merged: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in results:
        merged.setdefault((r["variant"], r["np"]), []).append(r)
    out = []
    for runs in merged.values():
        ordered = sorted(runs, key=lambda r: r["summary"]["step_seconds_mean"])
        out.append({**ordered[(len(ordered) - 1) // 2], "step_ms_runs": [r["step_ms_runs"][0] for r in runs]})
    return out


def network(args: argparse.Namespace) -> ShapedLink | EmulatedCluster:
    """The emulated network of --link (and --nodes): made afresh for every run, so each
    run has counters of its own."""
    rate, _, latency = args.link.partition(",")
    return EmulatedCluster(args.nodes, rate, latency or None) if args.nodes else ShapedLink(rate)


def launch(
    np_: int,
    train_args: list[str],
    log: Path,
    net: ShapedLink | EmulatedCluster | None = None,
    module: str = "hvd_lowcomm.train",
) -> tuple[list[int], float] | None:
    """Run one job, its output into `log` as it comes. On an emulated network, returns the bytes each node
    (or the loopback) sent while the job trained: from the trainer's first line (printed once
    setup's broadcasts are done) to its last epoch line (after the last evaluation), so launch
    and start-up traffic, which varies between launches, stays out of the count; and the rate of
    Horovod's coordination with every rank idle after training, the run's process sets still
    registered (benchmarks.coordination), which bounds what the counters may see beyond the meter."""
    # On a shaped link the trainer runs inside the idle probe (run_one refuses bare Horovod there).
    program = [module] if net is None else ["benchmarks.coordination", "--after-training", "--"]
    command = [*(net.mpirun(np_) if net else [*MPIRUN, "-np", str(np_)]), sys.executable, "-m", *program, *train_args]
    # Every rank runs on this one machine, emulated nodes too (where each rank would otherwise take
    # a share of its emulated node's cores, as on a real one): its cores shared among all np ranks.
    cores = os.cpu_count() or 1
    env = {"OMP_NUM_THREADS": str(runtime.compute_threads(np_, cores, cores)), **os.environ}
    with log.open("w") as out:  # written as the job prints: `tail -f` follows a long launch
        code, lines, readings = run_reading_counters(
            command,
            net,
            {
                "began": lambda line: line.startswith(TRAINING_STARTS),
                "ended": lambda line: bool(EPOCH_ENDS.match(line)),
                **IDLE_MARKS,
            },
            env,
            log=out,
        )
    if code != 0:
        tail = "".join(lines[-15:]).strip()
        raise RunFailed(f"compare: run failed (exit {code}): {' '.join(command)}\n{tail}\nfull log: {log}")
    if net is None:
        return None
    if "began" not in readings or readings.get("ended", (0.0,))[0] < readings["began"][0]:
        raise RunFailed(
            f"compare: {log} has no {TRAINING_STARTS.strip()!r} line followed by an epoch line to "
            "count the link's bytes between"
        )
    if not {IDLE, DONE} <= readings.keys():
        raise RunFailed(f"compare: {log} has no {IDLE} and {DONE} lines around the idle probe after training")
    (_, began), (_, ended) = readings["began"], readings["ended"]
    return [after - before for before, after in zip(began, ended)], idle_rate_between(readings)


class RunFailed(Exception):
    """One method's run exited non-zero; the others still make the table."""


def tabulate(
    results: list[dict[str, Any]],
    wire_rate: float | None,
    margins: tuple[float, float] = (LOSS_MARGIN, ACC_MARGIN_POINTS),
    budget: float = 0.0,
) -> list[dict[str, Any]]:
    """One row per run; `wire_rate` (bits/s) converts bytes per step into wire time (None: an
    unshaped link, whose floor is the computation alone); `margins` (loss fraction, accuracy
    points) say how close to ddp's final quality counts as reaching it; `budget`: the runs
    were given that multiple of ddp's training time (equal-time columns)."""
    rows = []
    for r in results:
        s = r["summary"]
        ddp = next((b for b in results if b["np"] == r["np"] and b["variant"] == "ddp"), None)
        base = ddp["summary"] if ddp is not None else None
        row = {
            "np": r["np"],
            "method": r["variant"],
            "final_test_acc": s["final_test_acc"],
            "best_test_acc": s["best_test_acc"],
            "bytes_per_step": s["train_wire_bytes_per_step"],
            "step_ms": 1000 * s["step_seconds_mean"],
            "step_ms_runs": r.get("step_ms_runs", []),
            "peak_rss_mb": s["peak_rss_bytes_max_rank"] / 1e6,
            "peak_rss_per_rank": s.get("peak_rss_bytes_per_rank", [s["peak_rss_bytes_max_rank"]]),
            # Traffic on the world process set: with groups of one node, what crosses the network.
            "world_bytes_per_step": world_bytes(s) / max(s["steps"], 1),
            "train_bytes_total": s["train_wire_bytes"],
            "world_bytes_total": world_bytes(s),
            "auto_choice": s.get("auto_choice", ""),  # what --method auto chose
        }
        for phase in STEP_PHASES:
            row[f"step_ms_{phase}"] = s.get(f"step_ms_{phase}", float("nan"))
        floor = next((b["summary"] for b in results if b["np"] == r["np"] and b["variant"] == "local"), None)
        # The floor a step cannot beat: the compute of the same step without any exchange
        # (the local run), or the time its bytes need on the link, whichever is longer.
        # On emulated nodes a link carries what one node sends to the others; else what a rank sends.
        nodes = (r["measured"] or {}).get("nodes") or 0
        wire = (
            s["train_between_nodes_bytes_all_ranks"] / nodes / max(s["steps"], 1)
            if nodes
            else s["train_wire_bytes_per_step"]
        )
        row["wire_ms"] = 1000 * wire * 8 / wire_rate if wire_rate else float("nan")
        if floor is not None:
            row["floor_ms"] = max(1000 * floor["step_seconds_mean"], 0.0 if wire_rate is None else row["wire_ms"])
            row["step_time_ratio_to_floor"] = row["step_ms"] / row["floor_ms"]
        # Methods that train in groups say what crossed between them, also with one-rank groups
        # (np 2), where the world set carries all their traffic.
        row["in_groups"] = "inter_group_wire_bytes" in s
        kept = sorted(v for k, v in s.items() if k.startswith("rank/"))  # AB: each factorised layer's rank
        if kept:
            row["ranks_kept"] = f"{kept[0]:g}–{kept[-1]:g} (median {statistics.median(kept):g})"
        last_epoch = r["epochs"][-1]
        for key in (
            "compression_ratio",
            "compression_bound",
            "low_rank_parameters",
            "parameter_fraction",
            "parameter_bytes",
            "between_partitions_bytes",
        ):
            if last_epoch.get(key) not in (None, ""):
                row[key] = float(last_epoch[key])
        if r["measured"] is not None:
            m = r["measured"]
            # On emulated nodes only traffic between nodes crosses the links; on one shaped
            # loopback all of it does.
            if "metered_startup_bytes" in m:  # sets made when a zero-step run's start-up was subtracted
                metered = (
                    s["between_nodes_bytes_all_ranks"] - m["metered_startup_bytes"]
                    if m.get("nodes")
                    else s["train_wire_bytes_all_ranks"]
                )
            else:  # the counters' window: everything after setup's broadcasts
                metered = (
                    s["between_nodes_bytes_all_ranks_after_setup"]
                    if m.get("nodes")
                    else s["wire_bytes_all_ranks_after_setup"]
                )
            row.update(
                {
                    "link": m["link"],
                    "nodes": m.get("nodes") or 0,
                    "measured_bytes_per_step": m["measured_train_bytes"] / max(s["steps"], 1),
                    "metered_bytes_per_step_all_ranks": metered / max(s["steps"], 1),
                    "measured_vs_meter": m["measured_train_bytes"] / metered - 1 if metered else float("nan"),
                    # The busiest link's share of its capacity over the counters' window, which
                    # holds evaluation's traffic and time too (mp's evaluation crosses nodes).
                    "link_utilisation": max(m.get("measured_bytes_per_node") or [m["measured_train_bytes"]])
                    * 8
                    / (s["seconds"] * m["link_bits_per_s"]),
                    "idle_coordination_bytes_per_s": m.get("idle_bytes_per_second", float("nan")),
                }
            )
            row["agreement"] = (
                "ok"
                if counters_agree(m["measured_train_bytes"], metered, unmetered_allowance(s, m), bool(nodes))
                else "DISAGREE"
            )
        if base is not None and "final_perplexity" in s:
            row.update(
                {
                    "final_test_loss": s["final_test_loss"],
                    "perplexity": s["final_perplexity"],
                    "bits_per_byte": s["final_bits_per_byte"],
                    "loss_diff_to_ddp_pct": 100 * (s["final_test_loss"] / base["final_test_loss"] - 1),
                }
            )
        if ddp is not None:
            row.update(
                time_to_quality(r, ddp, [b for b in results if b["np"] == r["np"] and b["variant"] != "local"], margins)
            )
            row["bytes_ratio_to_ddp"] = (
                s["train_wire_bytes_per_step"] / base["train_wire_bytes_per_step"]
                if base["train_wire_bytes_per_step"]
                else float("nan")
            )
            row["step_time_ratio_to_ddp"] = s["step_seconds_mean"] / base["step_seconds_mean"]
            row["acc_diff_to_ddp_points"] = 100 * (s["final_test_acc"] - base["final_test_acc"])
            row["world_bytes_ratio_to_ddp"] = world_bytes(s) / world_bytes(base) if world_bytes(base) else float("nan")
            if budget:
                row.update(equal_time(r, ddp, floor, budget, row["seconds_to_target"]))
        rows.append(row)
    return rows


def training_clock(r: dict[str, Any]) -> list[float]:
    """Seconds of training (wall clock less evaluation) at each evaluation of a run; runs made
    before the trainer recorded it fall back to the wall clock."""
    return [float(e.get("train_seconds") or e["seconds"]) for e in r["epochs"]]


def quality_series(r: dict[str, Any]) -> list[float]:
    """A run's quality at each evaluation, higher is better: minus the validation loss for a
    language model, else the test accuracy in points."""
    if "final_perplexity" in r["summary"]:
        return [-float(e["test_loss"]) for e in r["epochs"]]
    return [100 * float(e["test_acc"]) for e in r["epochs"]]


def quality_at(r: dict[str, Any], seconds: float) -> float:
    """The run's quality after `seconds` of training, interpolated between its evaluations (NaN
    before the first one; its last one after it finished)."""
    import numpy as np

    clock, quality = training_clock(r), quality_series(r)
    return float(np.interp(seconds, clock, quality, left=float("nan")))


def time_to_quality(
    r: dict[str, Any], ddp: dict[str, Any], peers: list[dict[str, Any]], margins: tuple[float, float]
) -> dict[str, Any]:
    """What a user on a slow network asks of a method: how long (training wall clock) until it
    reaches ddp's final quality within the margin, and what quality it has when the fastest of
    the runs at its rank count finished (equal time). Also the SIL paper's headline, the time
    until 90 % of ddp's final accuracy."""
    loss_margin, acc_points = margins
    language_model = "final_perplexity" in r["summary"]
    ddp_final = quality_series(ddp)[-1]
    # Higher is better in quality_series: a loss within the margin is -loss >= -(1 + m) ddp_loss.
    target = (1 + loss_margin) * ddp_final if language_model else ddp_final - acc_points
    reached = [t for t, q in zip(training_clock(r), quality_series(r)) if q >= target]
    reached_ddp = [t for t, q in zip(training_clock(ddp), quality_series(ddp)) if q >= target]
    equal_time = min(training_clock(p)[-1] for p in peers)
    sign = -1 if language_model else 1
    out = {
        "target": sign * target,
        "seconds_to_target": reached[0] if reached else float("nan"),
        "time_to_target_ratio_to_ddp": reached[0] / reached_ddp[0] if reached and reached_ddp else float("nan"),
        "equal_time_seconds": equal_time,
        "quality_at_equal_time": sign * quality_at(r, equal_time),
        "ddp_quality_at_equal_time": sign * quality_at(ddp, equal_time),
        "train_seconds": training_clock(r)[-1],
    }
    if not language_model:  # wall clock (training and evaluation), as the SIL paper measures it
        ninety = [
            float(e["seconds"]) for e in r["epochs"] if float(e["test_acc"]) >= 0.9 * ddp["summary"]["final_test_acc"]
        ]
        out["seconds_to_90pct_of_ddp"] = ninety[0] if ninety else float("nan")
    return out


def equal_time(
    r: dict[str, Any], ddp: dict[str, Any], local: dict[str, Any] | None, budget: float, reached: float
) -> dict[str, Any]:
    """A run given `budget` x ddp's training time, judged against ddp's time and against the
    no-communication limit: ddp's steps at the step time of `local` (its summary; NaN without
    a local run). `reached`: the run's time to the target."""
    language_model = "final_perplexity" in r["summary"]
    sign = -1 if language_model else 1
    ddp_seconds = training_clock(ddp)[-1]
    limit = ddp["summary"]["steps"] * local["step_seconds_mean"] if local is not None else float("nan")
    return {
        "budget": budget,
        "steps": r["summary"]["steps"],
        "ddp_seconds": ddp_seconds,
        "quality_at_ddp_time": sign * quality_at(r, ddp_seconds),
        "limit_seconds": limit,
        "time_to_target_vs_limit": reached / limit,
        "ddp_time_vs_limit": ddp_seconds / limit,
    }


def _step_ms(row: dict[str, Any]) -> str:
    """The step time, and with repeats the range of all of them."""
    runs = row.get("step_ms_runs") or []
    return f"{row['step_ms']:.1f}" + (f" ({min(runs):.1f}–{max(runs):.1f})" if len(runs) > 1 else "")


def world_bytes(summary: dict[str, Any]) -> float:
    """Bytes on the world process set: a group method's own count (every world collective,
    its per-step checks included), else the training collectives on the world set."""
    if "inter_group_wire_bytes" in summary:
        return summary["inter_group_wire_bytes"]
    return sum(v for k, v in summary.items() if k.startswith("train_") and k.endswith("_world_wire_bytes"))


def write_tables(
    rows: list[dict[str, Any]],
    out: Path,
    title: str,
    failed: list[str] = (),
    wire_label: str | None = None,
    margins: tuple[float, float] = (LOSS_MARGIN, ACC_MARGIN_POINTS),
) -> str:
    write_csv(out / "results.csv", rows)
    language_model = any("perplexity" in row for row in rows)
    quality = ["val loss", "Δ loss vs ddp", "ppl", "bits/byte"] if language_model else ["test acc", "Δ acc vs ddp"]
    header = [
        "np",
        "method",
        *quality,
        "bytes/step",
        "× ddp bytes",
        "step ms",
        "× ddp time",
        f"time to ddp's loss +{margins[0]:.0%}" if language_model else "time to 90 % of ddp",
        "peak RSS",
    ]
    lines = [f"# {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if language_model:
            figures = [
                f"{row['final_test_loss']:.4f}",
                f"{row.get('loss_diff_to_ddp_pct', float('nan')):+.2f} %",
                f"{row['perplexity']:.2f}",
                f"{row['bits_per_byte']:.3f}",
            ]
            reached = row.get("seconds_to_target", float("nan"))
        else:
            figures = [
                f"{100 * row['final_test_acc']:.2f} %",
                f"{row.get('acc_diff_to_ddp_points', float('nan')):+.2f}",
            ]
            reached = row.get("seconds_to_90pct_of_ddp", float("nan"))
        lines.append(
            "| "
            + " | ".join(
                _cell(cell)
                for cell in [
                    str(row["np"]),
                    row["method"],
                    *figures,
                    human_bytes(row["bytes_per_step"]),
                    f"{row.get('bytes_ratio_to_ddp', float('nan')):.4f}",
                    _step_ms(row),
                    f"{row.get('step_time_ratio_to_ddp', float('nan')):.2f}",
                    f"{reached:.1f} s",
                    f"{row['peak_rss_mb']:.0f} MB",
                ]
            )
            + " |"
        )
    lines += _table(
        "Where a step goes (rank 0, ms): forward and backward passes, blocked in communication, and the rest (the "
        "method's own computation and the optimiser step). Floor = "
        + (
            f"the longer of the no-communication step (method local) and the wire time of the step's bytes at "
            f"{wire_label} (on emulated nodes: the bytes one node sends to the others)"
            if wire_label
            else "the no-communication step (method local; unshaped link, so no wire floor: pass --link or --wire-rate)"
        )
        + "; × floor = step time over it.",
        ["np", "method", "forward", "backward", "exchange", "other", "step", "wire", "floor", "× floor"],
        [
            [
                row["np"],
                row["method"],
                *(_ms(row[f"step_ms_{phase}"]) for phase in STEP_PHASES),
                f"{row['step_ms']:.1f}",
                _ms(row["wire_ms"]),
                _ms(row.get("floor_ms")),
                "–" if "step_time_ratio_to_floor" not in row else f"{row['step_time_ratio_to_floor']:.2f}",
            ]
            for row in rows
        ],
    )
    grouped = [row for row in rows if row.get("in_groups") or row["world_bytes_total"] < row["train_bytes_total"]]
    lines += _table(
        "Methods that train in groups: traffic on the world process set (inter-group, the network traffic when a "
        "group is a node) against all training traffic, per rank over the run.",
        [
            "np",
            "method",
            "all traffic",
            "inter-group",
            "inter-group × ddp",
            "compression (A+B)",
            "bound",
            "parameters at the end",
            "ranks kept",
        ],
        [
            [
                row["np"],
                row["method"],
                human_bytes(row["train_bytes_total"]),
                human_bytes(row["world_bytes_total"]),
                f"{row.get('world_bytes_ratio_to_ddp', float('nan')):.4f}",
                _times(row.get("compression_ratio")),
                _times(row.get("compression_bound")),
                f"{row['low_rank_parameters']:,.0f}" if "low_rank_parameters" in row else "–",
                row.get("ranks_kept", "–"),
            ]
            for row in grouped
        ],
    )
    lines += _table(
        "Partitioned methods (figures of rank 0, which holds the first partition): bytes sent between partition "
        "groups over the whole run, parameters held against the whole model, and each rank's peak memory.",
        ["np", "method", "between partitions", "parameter bytes", "share of the model", "peak RSS per rank"],
        [
            [
                row["np"],
                row["method"],
                human_bytes(row["between_partitions_bytes"]),
                human_bytes(row["parameter_bytes"]),
                f"{row['parameter_fraction']:.1%}",
                " / ".join(f"{v / 1e6:.0f}" for v in row["peak_rss_per_rank"]) + " MB",
            ]
            for row in rows
            if "parameter_fraction" in row
        ],
    )
    timed = [row for row in rows if "seconds_to_target" in row and row["method"] != "local"]
    if timed:
        unit = (lambda v: f"{v:.4f}") if language_model else (lambda v: f"{v:.2f} %")  # noqa: E731
        lines += _table(
            "Time to quality, on the training clock (wall clock less evaluation): the time until a method first "
            "reached ddp's final "
            + (f"validation loss +{margins[0]:.0%}" if language_model else f"accuracy −{margins[1]:g} point")
            + " (target), at the evaluations the run made; its quality when the quickest run of its rank count had "
            "finished (equal time, interpolated between evaluations), beside ddp's then; and its quality at the end "
            "(–: the target was not reached, or no evaluation had been made by then).",
            [
                "np",
                "method",
                "target",
                "time to target",
                "× ddp's time",
                "equal time",
                "quality then",
                "ddp then",
                "at the end",
                "training time",
            ],
            [
                [
                    row["np"],
                    row["method"],
                    unit(row["target"]),
                    f"{row['seconds_to_target']:.1f} s",
                    f"{row['time_to_target_ratio_to_ddp']:.2f}",
                    f"{row['equal_time_seconds']:.1f} s",
                    unit(row["quality_at_equal_time"]),
                    unit(row["ddp_quality_at_equal_time"]),
                    unit(row["final_test_loss"] if language_model else 100 * row["final_test_acc"]),
                    f"{row['train_seconds']:.1f} s",
                ]
                for row in timed
            ],
        )
    budgeted = [row for row in rows if "limit_seconds" in row and row["method"] != "ddp"]
    ddp_final = {row["np"]: final_quality(row, language_model) for row in rows if row["method"] == "ddp"}
    if budgeted:
        unit = (lambda v: f"{v:.4f}") if language_model else (lambda v: f"{v:.2f} %")  # noqa: E731
        lines += _table(
            f"Equal time: every method but ddp trained for {budgeted[0]['budget']:g} × ddp's training time. "
            "Limit = ddp's steps at local's step time (ddp on a free network); × limit = the time to the target "
            "above as a multiple of it (≤ 1: sooner than ddp could on any network); quality when ddp's training "
            "time had passed and at the end of the budget (–: no local run, or the target not reached).",
            ["np", "method", "steps", "time to target", "× limit", "at ddp's time", "ddp's", "at the end", "limit"],
            [
                [
                    row["np"],
                    row["method"],
                    row["steps"],
                    f"{row['seconds_to_target']:.1f} s",
                    f"{row['time_to_target_vs_limit']:.2f}",
                    unit(row["quality_at_ddp_time"]),
                    unit(ddp_final[row["np"]]),
                    unit(final_quality(row, language_model)),
                    f"{row['limit_seconds']:.1f} s (ddp {row['ddp_seconds']:.1f} s: {row['ddp_time_vs_limit']:.2f}×)",
                ]
                for row in budgeted
            ],
        )
    measured = [row for row in rows if "link" in row]
    nodes = measured[0]["nodes"] if measured else 0
    lines += _table(
        (
            f"Traffic between the {nodes} emulated nodes (links of {measured[0]['link']}), all nodes together, per "
            "training step (evaluation's traffic included: the counters cannot tell it apart): measured = the nodes' "
            "interface counters; metered = what hvd_lowcomm's meter counts as sent to another node"
            if nodes
            else f"Traffic on the emulated {measured[0]['link'] if measured else ''} "
            f"link, all ranks together, per training "
            "step: measured = the namespace's loopback counters; metered = hvd_lowcomm's meter"
        )
        + " (both from the trainer's first line, once setup's broadcasts are done, to its last epoch line; "
        f"evaluation included); agreement within {NODE_AGREEMENT if nodes else AGREEMENT:.0%} "
        f"is ok, or a difference under Horovod's unmetered coordination: {human_bytes(BACKGROUND_BYTES_PER_STEP)} "
        "per step and link, plus its rate with every rank idle (idle coordination: a probe with the run's process "
        "sets on the same network) over the seconds rank 0 did not compute; utilisation: "
        "the busiest link's bytes against its capacity over the run's time (evaluation included, as in the counters).",
        [
            "np",
            "method",
            "measured/step",
            "metered/step",
            "measured vs meter",
            "idle coordination",
            "link utilisation",
            "agreement",
        ],
        [
            [
                row["np"],
                row["method"],
                human_bytes(row["measured_bytes_per_step"]),
                human_bytes(row["metered_bytes_per_step_all_ranks"]),
                f"{row['measured_vs_meter']:+.1%}",
                idle_rate_text(row["idle_coordination_bytes_per_s"]),
                f"{row['link_utilisation']:.1%}",
                row["agreement"],
            ]
            for row in measured
        ],
    )
    if failed:
        lines += ["", f"Failed runs (exit non-zero, logs under runs/): {', '.join(failed)}"]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    return text


def final_quality(row: dict[str, Any], language_model: bool) -> float:
    """A row's final quality as the tables show it: its loss, or its accuracy in %."""
    return row["final_test_loss"] if language_model else 100 * row["final_test_acc"]


def _ms(value: float | None) -> str:
    return "–" if value is None or value != value else f"{value:.1f}"  # value != value: NaN


def _times(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


# A formatted NaN ("nan %", "+nan", "nan s"): a figure that does not exist (a target never reached,
# no ddp run to compare with, no evaluation yet at that time), shown as a dash.
_MISSING = re.compile(r"[+-]?nan\b.*")


def _cell(value: Any) -> str:
    text = str(value)
    return "–" if _MISSING.fullmatch(text) else text


def _table(caption: str, header: list[str], rows: list[list[Any]]) -> list[str]:
    """A captioned markdown table (figures that do not exist as "–"), or nothing when there are
    no rows."""
    if not rows:
        return []
    return [
        "",
        caption,
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(map(_cell, row)) + " |" for row in rows),
    ]


def _finish(fig: Any, ax: Any, path: Path, legend: str = "small") -> None:
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot(results: list[dict[str, Any]], out: Path, rows: list[dict[str, Any]] = ()) -> None:
    """The runs' plots; `rows` (tabulate's) give the no-communication limit a --budget run
    draws on the quality-against-time plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(r: dict[str, Any], key: str) -> list[float]:
        return [float(e[key]) if e.get(key) not in (None, "") else float("nan") for e in r["epochs"]]  # NaN: a gap

    label = lambda r: f"{r['variant']} (np {r['np']})"  # noqa: E731
    # What the plots show of a run's quality: validation loss for a language model, else accuracy.
    # Over time: a language model's run is often a fraction of an epoch (--train.max_steps), so
    # its evaluations are placed by training step.
    if any("final_perplexity" in r["summary"] for r in results):
        quality, quality_label, quality_name = (
            (lambda r: series(r, "test_loss")),
            "validation loss (nats/token)",
            "loss",
        )
        over_time = ("loss_vs_step", "step", "training step")
    else:
        quality, quality_label, quality_name = (
            (lambda r: [100 * a for a in series(r, "test_acc")]),
            "test accuracy (%)",
            "accuracy",
        )
        over_time = ("accuracy_vs_epoch", "epoch", "epoch")
    for name, xkey, xlabel in (
        over_time,
        (f"{quality_name}_vs_bytes", "train_wire_bytes_total", "cumulative bytes sent per rank"),
        (f"{quality_name}_vs_time", None, "training time (s, wall clock less evaluation)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in results:
            ax.plot(training_clock(r) if xkey is None else series(r, xkey), quality(r), marker="o", label=label(r))
        ax.set(xlabel=xlabel, ylabel=quality_label, xscale="log" if "bytes" in name else "linear")
        limits = {row["np"]: row["limit_seconds"] for row in rows if math.isfinite(row.get("limit_seconds", math.nan))}
        if xkey is None:
            for np_, limit in limits.items():  # ddp's steps at the no-communication step time
                ax.axvline(limit, linestyle="--", color="grey", label=f"no-communication limit (np {np_})")
        _finish(fig, ax, out / f"{name}.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.barh([label(r) for r in results], [1000 * r["summary"]["step_seconds_mean"] for r in results])
    ax.set(xlabel="mean step time (ms)")
    fig.tight_layout()
    fig.savefig(out / "step_time.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    left = [0.0] * len(results)
    for phase in STEP_PHASES:
        widths = [r["summary"].get(f"step_ms_{phase}", 0.0) for r in results]
        ax.barh([label(r) for r in results], widths, left=left, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    ax.set(xlabel="ms per step on rank 0 (forward, backward, blocked in communication, the rest)")
    _finish(fig, ax, out / "step_phases.png")

    if any("inter_group_wire_bytes" in r["epochs"][0] for r in results):
        # Group methods: only inter-group traffic crosses nodes; for the others all of it does.
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in results:
            key = "inter_group_wire_bytes" if "inter_group_wire_bytes" in r["epochs"][0] else "train_wire_bytes_total"
            ax.plot(series(r, key), quality(r), marker="o", label=label(r))
        ax.set(
            xlabel="cumulative inter-group bytes per rank (all bytes for methods without groups)",
            ylabel=quality_label,
            xscale="log",
        )
        _finish(fig, ax, out / f"{quality_name}_vs_inter_group_bytes.png")

    compressed = [r for r in results if r["epochs"][0].get("compression_ratio") not in (None, "")]
    if compressed:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in compressed:
            ax.plot(series(r, "epoch"), series(r, "compression_ratio"), marker="o", label=label(r))
            if r["epochs"][0].get("compression_bound") not in (None, ""):
                ax.axhline(
                    float(r["epochs"][-1]["compression_bound"]),
                    linestyle="--",
                    alpha=0.5,
                    label=f"{label(r)}: bound set by the dense layers",
                )
        ax.set(xlabel="epoch", ylabel="compression (full-rank parameters / low-rank model's)", yscale="log")
        _finish(fig, ax, out / "compression.png")

    ranked = [(r, k) for r in results for k in r["epochs"][0] if k.startswith("effective_rank/")]
    if ranked:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r, key in ranked:
            ax.plot(series(r, "epoch"), series(r, key), marker="o", label=f"{label(r)} layer {key.split('/', 1)[1]}")
        ax.set(xlabel="epoch", ylabel="effective rank (components kept, mean over steps)")
        _finish(fig, ax, out / "effective_rank.png", legend="x-small")


def _exit_on_sigterm(*_: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(128 + signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--methods",
        default="ddp,ddp-fp16",
        help="comma-separated method entries, or 'all' "
        f"({ALL_METHODS}; local is the no-communication floor) (default: %(default)s)",
    )
    parser.add_argument(
        "--wire-rate",
        default=None,
        metavar="RATE",
        help="link rate for the wire-time floor column (default: --link's; none on an unshaped link)",
    )
    parser.add_argument("--np", default="2", help="comma-separated rank counts (default: %(default)s)")
    parser.add_argument("--data", default="data/mnist5k.h5", help="HDF5 dataset (default: %(default)s)")
    parser.add_argument(
        "--model", default="mlp", help="model name; empty: each method's default (default: %(default)s)"
    )
    parser.add_argument(
        "--hidden", default="1024,1024", help="hidden widths; empty: the model's default (default: %(default)s)"
    )
    parser.add_argument("--epochs", type=int, default=5, help="epochs per run (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=42, help="seed shared by every run (default: %(default)s)")
    parser.add_argument("--out", default="benchmarks/results/compare", help="output directory (default: %(default)s)")
    parser.add_argument("--title", default=None, help="heading of results.md")
    parser.add_argument(
        "--reuse", action="store_true", help="reuse finished runs found under --out/runs (remake tables and plots only)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every method this many times, in rounds (all methods, then all again: "
        "a slow spell of a shared machine hits every method alike) and report the "
        "run with the median step time, the range beside it (default: %(default)s)",
    )
    parser.add_argument(
        "--link",
        default=None,
        metavar="RATE[,LATENCY]",
        help="emulate a network of RATE (tc units: 1gbit, 100mbit) and measure the bytes that cross "
        "it (needs root): without --nodes every rank's traffic crosses one shaped loopback; with "
        "--nodes, the links between nodes, with LATENCY added one way (tc units: 100us, 1ms; "
        "needs the kernel's netem)",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=0,
        help="with --link: run on this many emulated nodes, np/nodes ranks each, sharing memory "
        "inside a node and joined by links of RATE; hvd_lowcomm sees the nodes as under Slurm "
        "(default: 0, one shaped loopback)",
    )
    parser.add_argument(
        "--loss-margin",
        type=float,
        default=LOSS_MARGIN,
        help="a language model reached ddp's quality when its validation loss is at most this "
        "fraction above ddp's final one (default: %(default)s)",
    )
    parser.add_argument(
        "--acc-margin",
        type=float,
        default=ACC_MARGIN_POINTS,
        help="a classifier reached ddp's quality when its accuracy is at most this many points "
        "below ddp's final one (default: %(default)s)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=0.0,
        metavar="K",
        help="judge at equal time: every method but ddp trains for K x ddp's training time "
        "(ddp runs first, for --epochs, or --train.max_steps after --, which the others do not "
        "get; needs ddp among --methods) (default: 0, equal epochs)",
    )
    args = parser.parse_args(argv)
    # A job killed by its scheduler (SIGTERM) still removes the namespaces it made: the
    # signal becomes an exit, which unwinds the `with` that owns them; a second SIGTERM is
    # ignored so that it cannot cut that clean-up short.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)

    # Entries split on commas, but "rank-dad:rank=4,iterations=5" keeps its options together.
    entries: list[str] = []
    for piece in (ALL_METHODS if args.methods == "all" else args.methods).split(","):
        if entries and "=" in piece and ":" not in piece:
            entries[-1] += "," + piece
        else:
            entries.append(piece)
    variants = [Variant.parse(e) for e in entries]
    if args.budget < 0:
        raise SystemExit(f"compare: --budget must be > 0 (a multiple of ddp's training time), got {args.budget}")
    if args.budget:
        if not any(v.label == "ddp" for v in variants):
            raise SystemExit("compare: --budget needs ddp among --methods: its training time is the budget's unit")
        variants.sort(key=lambda v: v.label != "ddp")  # ddp first: the others' budget is its time
    counts = [int(n) for n in args.np.split(",")]
    out = Path(args.out)
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    if not Path(args.data).exists() and Path(args.data).stem not in BUNDLED:
        raise SystemExit(f"compare: {args.data} does not exist; make it with python -m data_prep")
    if args.nodes:
        if args.link is None:
            raise SystemExit("compare: --nodes needs --link RATE (the rate of the links between the nodes)")
        uneven = [n for n in counts if n % args.nodes]
        if args.nodes < 1 or uneven:
            raise SystemExit(
                f"compare: --np {','.join(map(str, uneven))} cannot be spread evenly over {args.nodes} "
                f"nodes: give rank counts that are multiples of --nodes"
            )
    if args.link is not None:
        try:
            check_available()
            rate_bits(args.link.partition(",")[0])
        except (LinkUnavailable, ValueError) as err:
            if args.nodes:
                raise SystemExit(f"compare: {err}")
            print(f"compare: {err}; running without an emulated link", file=sys.stderr)
            args.link = None

    results, failed = [], []
    if args.repeat < 1:
        raise SystemExit(f"compare: --repeat must be >= 1, got {args.repeat}")
    jobs = [(v, n, r) for r in range(args.repeat) for n in counts for v in variants]
    with tqdm(jobs, desc="runs", unit="run", file=sys.stdout) as bar:
        for variant, np_, repeat in bar:
            bar.set_postfix_str(
                f"{variant.label} on {np_} ranks" + (f", round {repeat + 1}" if args.repeat > 1 else "")
            )
            budget: list[str] = []
            if args.budget and variant.label != "ddp":
                ddp = next((r for r in results if r["np"] == np_ and r["variant"] == "ddp"), None)
                if ddp is None:
                    failed.append(f"{variant.label} on {np_} ranks (no ddp run to time it by)")
                    continue
                budget = budget_arguments(training_clock(ddp)[-1], args.budget)
            try:
                result = run_one(variant, np_, args, runs_dir, extra, repeat, budget)
            except RunFailed as err:
                print(err, file=sys.stderr, flush=True)
                failed.append(f"{variant.label} on {np_} ranks" + (f" (round {repeat + 1})" if repeat else ""))
                continue
            results.append(result)
            s = result["summary"]
            quality = (
                f"val loss {s['final_test_loss']:.4f}"
                if "final_perplexity" in s
                else f"acc {100 * s['final_test_acc']:.2f} %"
            )
            bar.write(
                f"{variant.label:>24} np {np_}: {quality}, "
                f"{human_bytes(s['train_wire_bytes_per_step'])}/step, {1000 * s['step_seconds_mean']:.1f} ms/step"
            )
    if not results:
        raise SystemExit("compare: every run failed; see the logs above")
    wire_label = args.wire_rate or (args.link.partition(",")[0] if args.link else None)
    results = median_runs(results)
    margins = (args.loss_margin, args.acc_margin)
    rows = tabulate(results, rate_bits(wire_label) if wire_label else None, margins, args.budget)
    title = args.title or (
        f"{', '.join(v.label for v in variants)}: {args.model} {args.hidden} on {args.data}, "
        f"{args.epochs} epochs, batch {args.batch_size}/rank, seed {args.seed}"
    )
    if args.budget:
        title += f"; every method but ddp trained for {args.budget:g} x ddp's training time"
    print("\n" + write_tables(rows, out, title, failed, wire_label, margins))
    plot(results, out, rows)
    print(f"tables and plots in {out}/ (results.md, results.csv, *.png); runs in {runs_dir}/")
    if failed:
        print(
            f"compare: {len(failed)} run(s) failed and are missing from the table: {', '.join(failed)}", file=sys.stderr
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
