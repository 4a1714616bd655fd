"""Goodput under failures: elastic DiLoCo groups against today's whole-job restart.

    python -m benchmarks.elastic_goodput [--groups 4] [--rounds 40] [--sync-every 20] [--heal-link 1gbit] \\
        [--fail-every 10] [--checkpoint-rounds 4] [--data FILE] [--out runs/elastic-goodput]

DiLoCo with --groups one-rank groups trains the zoo's GPT for --rounds outer rounds of
--sync-every steps, five ways, each timed from launch to exit on this machine:

- elastic, no failure (seeds 42 and 43: the seed-to-seed spread of the final loss);
- elastic, a group killed (SIGKILL, at the start of the round's exchange: its inner steps
  of that round are lost) every --fail-every rounds, each time another group, relaunched by
  `python -m hvd_lowcomm.elastic` after a 1 s back-off; it heals from a survivor and rejoins;
- one mpirun job of every group, no failure;
- the same job killed whole at the same steps and resumed from its last checkpoint
  (`--resume auto`, a checkpoint every --checkpoint-rounds rounds), relaunched at once: no
  scheduler queue is waited for, which a real requeue adds.

Goodput is the failure-free run's wall time over the run's with failures (the same work). Where
groups share cores (more ranks than cores), a missing group speeds the others up, which this
hides; "group-rounds kept" does not: the share of the groups' rounds that entered the model
(elastic: the members of each round over every group; whole job: its steps over the steps it
computed, those since a checkpoint twice). Writes results.csv and results.md under --out, with
the heal time (the joiner's) and the bytes a heal sends.

First, with --heal-link, one more elastic run of a larger GPT, its groups meeting over an
emulated link of that rate (needs root: a network namespace with a shaped loopback): the heal's
time against the bytes it sends at the link's rate. Writes heal.csv.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.sharding import corpus
from hvd_lowcomm.metrics import write_csv

MPIRUN = ["mpirun", "--oversubscribe", *(["--allow-run-as-root"] if os.geteuid() == 0 else [])]


def train_command(
    args: argparse.Namespace, data: Path, runs: Path, name: str, seed: int, layers: int = 2, width: int = 128
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hvd_lowcomm.train",
        "--method",
        "diloco",
        "--model.name",
        "gpt",
        "--model.layers",
        str(layers),
        "--model.width",
        str(width),
        "--model.heads",
        "4",
        "--data.path",
        str(data),
        "--data.seq_len",
        "64",
        "--data.batch_size",
        "8",
        "--diloco.sync_every",
        str(args.sync_every),
        "--train.max_steps",
        str(args.rounds * args.sync_every),
        "--train.epochs",
        "1000",
        "--train.seed",
        str(seed),
        "--run.checkpoint_every",
        str(args.checkpoint_rounds * args.sync_every),
        "--run.log_every",
        "1",
        "--run.progress",
        "false",
        "--run.dir",
        str(runs),
        "--run.name",
        name,
    ]


def failure_rounds(args: argparse.Namespace) -> list[int]:
    return list(range(args.fail_every, args.rounds, args.fail_every))


def elastic(args: argparse.Namespace, data: Path, runs: Path, name: str, seed: int, fail: bool) -> dict:
    """One elastic run: its wall time, final loss, and (with failures) the heal's figures."""
    failures = [f"{1 + i % (args.groups - 1)}/0/{r}/before" for i, r in enumerate(failure_rounds(args))]
    env = {**os.environ, "HVD_LOWCOMM_ELASTIC_TEST_FAILURE": ",".join(failures) if fail else ""}
    record = runs / f"{name}.record.json"
    launcher = [sys.executable, "-m", "hvd_lowcomm.elastic", "--groups", str(args.groups), "--backoff", "1"]
    launcher += ["--timeout", "60", "--record", str(record), f"--launcher-args={' '.join(MPIRUN[1:])}", "--"]
    began = time.monotonic()
    done = subprocess.run(
        launcher + train_command(args, data, runs, name, seed), env=env, capture_output=True, text=True
    )
    wall = time.monotonic() - began
    if done.returncode:
        raise SystemExit(f"elastic_goodput: {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    summaries = {p.parent.name: json.loads(p.read_text()) for p in runs.glob(f"{name}-group*-life*/summary.json")}
    healed = [s for run, s in summaries.items() if not run.endswith("life0")]
    events = json.loads(record.read_text())["events"]
    rounds = [e for e in events if e["event"] == "round"]
    return {
        "wall_seconds": wall,
        # what bounds goodput where each group has cores of its own: the groups' rounds in the model
        "group_rounds_in_model": sum(len(e["members"]) for e in rounds) / (args.groups * len(rounds)),
        "final_test_loss": summaries[f"{name}-group0-life0"]["final_test_loss"],
        "failures": sum(e["event"] == "failure" for e in events),
        "heals": len(healed),
        "heal_seconds_max": max((t for s in healed for t in s["elastic_heal_seconds"]), default=0.0),
        "heal_bytes": max((b for s in healed for b in s["elastic_heal_bytes"]), default=0),
    }


def heal_on_link(args: argparse.Namespace, data: Path, runs: Path) -> dict:
    """A heal's time where the groups meet over an emulated link (benchmarks.netns.ShapedLink:
    the launcher, its store and every group in one namespace whose loopback has --heal-link's
    rate): a GPT of --heal-layers x --heal-width, group 1 killed at round 2 and healed."""
    from benchmarks.netns import ShapedLink

    heal = argparse.Namespace(**{**vars(args), "rounds": 4, "sync_every": 5, "checkpoint_rounds": 100})
    name = "heal-on-link"
    record = runs / f"{name}.record.json"
    launcher = [sys.executable, "-m", "hvd_lowcomm.elastic", "--groups", str(args.groups), "--backoff", "0"]
    launcher += ["--timeout", "120", "--record", str(record), f"--launcher-args={' '.join(MPIRUN[1:])}", "--"]
    command = train_command(heal, data, runs, name, 42, args.heal_layers, args.heal_width)
    env = {**os.environ, "HVD_LOWCOMM_ELASTIC_TEST_FAILURE": "1/0/2/before"}
    with ShapedLink(args.heal_link) as link:
        done = subprocess.run([*link.prefix, *launcher, *command], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"elastic_goodput: {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    (joiner,) = [json.loads(p.read_text()) for p in runs.glob(f"{name}-group1-life1/summary.json")]
    model_bytes = 4 * joiner["parameters"]
    return {
        "link": args.heal_link,
        "model": f"gpt {args.heal_layers} x {args.heal_width}",
        "model_bytes": model_bytes,
        "heal_bytes": joiner["elastic_heal_bytes"][0],
        "heal_seconds": joiner["elastic_heal_seconds"][0],
        "bytes_at_link_rate_seconds": joiner["elastic_heal_bytes"][0] * 8 / link.rate_bits,
        "target_seconds": 2 * model_bytes * 8 / link.rate_bits,  # the issue's: 2 x the model's bytes / rate
    }


def whole_job(args: argparse.Namespace, data: Path, runs: Path, name: str, fail: bool) -> dict:
    """One mpirun job of every group; with failures it is killed whole when its step records
    reach each failure round's exchange and resumed from its last checkpoint."""
    command = MPIRUN + ["-np", str(args.groups)] + train_command(args, data, runs, name, 42)
    command += ["--diloco.groups", str(args.groups)]
    metrics = runs / name / "metrics.jsonl"
    pending = failure_rounds(args) if fail else []
    began, restarts, redone = time.monotonic(), 0, 0
    every = args.checkpoint_rounds * args.sync_every
    while True:
        job = subprocess.Popen(
            command + (["--resume", "auto"] if restarts else []),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        killed = False
        while job.poll() is None:
            time.sleep(0.05)
            done = last_step(metrics) + 1
            if pending and done >= pending[0] * args.sync_every:
                os.killpg(job.pid, signal.SIGKILL)  # the node is gone: every rank of the job with it
                job.wait()
                redone += done % every  # the steps since its last checkpoint, taken again
                pending.pop(0)
                killed, restarts = True, restarts + 1
        if not killed:
            break
    wall = time.monotonic() - began
    if job.returncode:
        raise SystemExit(f"elastic_goodput: {name} failed (exit {job.returncode}):\n{job.stderr.read()[-3000:]}")
    summary = json.loads((runs / name / "summary.json").read_text())
    steps = args.rounds * args.sync_every
    return {
        "wall_seconds": wall,
        "group_rounds_in_model": steps / (steps + redone),  # every round's groups, some rounds taken twice
        "final_test_loss": summary["final_test_loss"],
        "failures": restarts,
    }


def last_step(metrics: Path) -> int:
    """The last step record's step (steps taken - 1), or -1 before the first: read from the
    file's tail, which the watch loop polls while the file grows."""
    if not metrics.exists():
        return -1
    with open(metrics, "rb") as fh:
        fh.seek(max(0, fh.seek(0, os.SEEK_END) - 4096))
        lines = fh.read().decode(errors="replace").splitlines()
    steps = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # cut by the tail, or still being written
            continue
        if record.get("type") == "step":
            steps.append(record["step"])
    return max(steps, default=-1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.elastic_goodput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--groups", type=int, default=4, help="DiLoCo groups of one rank (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=40, help="outer rounds of the run (default: %(default)s)")
    parser.add_argument("--sync-every", type=int, default=20, help="inner steps a round, H (default: %(default)s)")
    parser.add_argument("--fail-every", type=int, default=10, help="rounds between failures (default: %(default)s)")
    parser.add_argument(
        "--checkpoint-rounds",
        type=int,
        default=4,
        help="whole-job runs: rounds between checkpoints (default: %(default)s)",
    )
    parser.add_argument(
        "--heal-link", default="1gbit", help="the emulated link of the heal run (tc's units; '' skips it)"
    )
    parser.add_argument("--heal-layers", type=int, default=4, help="the heal run's GPT layers (default: %(default)s)")
    parser.add_argument("--heal-width", type=int, default=512, help="the heal run's GPT width (default: %(default)s)")
    parser.add_argument("--heal-only", action="store_true", help="run the heal on the emulated link alone")
    parser.add_argument("--data", help="an HDF5 text dataset (default: one of random words written under --out)")
    parser.add_argument("--out", default="runs/elastic-goodput", help="output directory (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.groups < 2 or args.fail_every >= args.rounds:
        parser.error("--groups must be >= 2 and --fail-every below --rounds")
    out = Path(args.out)
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else corpus(out, lines=6000)
    healed = heal_on_link(args, data, runs) if args.heal_link else None
    if healed:
        write_csv(out / "heal.csv", [healed])
        print(
            f"elastic_goodput: heal over {healed['link']}: {healed['heal_seconds']:.2f} s for "
            f"{healed['heal_bytes']:,} bytes ({healed['bytes_at_link_rate_seconds']:.2f} s at the link's rate); "
            f"target 2 x model bytes / rate = {healed['target_seconds']:.2f} s"
        )
    if args.heal_only:
        return 0
    plans = [
        ("elastic, no failure", lambda: elastic(args, data, runs, "elastic-free", 42, False)),
        ("elastic, no failure (seed 43)", lambda: elastic(args, data, runs, "elastic-free-43", 43, False)),
        (
            f"elastic, a group killed every {args.fail_every} rounds",
            lambda: elastic(args, data, runs, "elastic-fail", 42, True),
        ),
        ("whole job, no failure", lambda: whole_job(args, data, runs, "job-free", False)),
        (
            f"whole job killed every {args.fail_every} rounds, resumed from a checkpoint",
            lambda: whole_job(args, data, runs, "job-fail", True),
        ),
    ]
    rows = []
    for label, run in plans:
        print(f"elastic_goodput: {label} ...", flush=True)
        rows.append({"run": label, **run()})
        print(f"elastic_goodput: {label}: {rows[-1]['wall_seconds']:.1f} s, loss {rows[-1]['final_test_loss']:.4f}")
    free = {"elastic": rows[0]["wall_seconds"], "whole job": rows[3]["wall_seconds"]}
    spread = abs(rows[0]["final_test_loss"] - rows[1]["final_test_loss"])
    for row in rows:
        row["goodput"] = free["elastic" if row["run"].startswith("elastic") else "whole job"] / row["wall_seconds"]
        row["loss_vs_free"] = row["final_test_loss"] - rows[0]["final_test_loss"]
        row["within_seed_spread"] = abs(row["loss_vs_free"]) <= spread
    write_csv(
        out / "results.csv", [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows]
    )
    table = [
        f"{args.groups} groups of 1 rank, {args.rounds} rounds of H = {args.sync_every}; seed spread of the final loss "
        f"{spread:.4f}.",
        "",
        "| run | wall s | goodput | group-rounds kept | failures | final loss | vs failure-free | heal s (max) | "
        "heal bytes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    table += [
        f"| {r['run']} | {r['wall_seconds']:.1f} | {100 * r['goodput']:.0f} % | "
        f"{100 * r['group_rounds_in_model']:.1f} % | {r['failures']} | "
        f"{r['final_test_loss']:.4f} | {r['loss_vs_free']:+.4f} | {r.get('heal_seconds_max', 0):.2f} | "
        f"{r.get('heal_bytes', 0):,.0f} |"
        for r in rows
    ]
    (out / "results.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
