"""Run directory, metrics files, progress display and the final summary (rank 0 only).

runs/<name>/config.yaml     the full resolved configuration
runs/<name>/metrics.jsonl   one JSON object per line: {"type": "step"|"epoch"|"summary", ...}
runs/<name>/epochs.csv      one row per epoch (rewritten each epoch: columns may grow)
runs/<name>/summary.json    the final summary
runs/<name>/model.pt        the trained model, one ordinary state dict (torch.load)
runs/<name>/tensorboard/    with --run.loggers tensorboard (and wandb/ with wandb: hvd_lowcomm.trackers)
runs/<name>/<group>.png     epoch columns named "<group>/<series>" plotted together
                            (e.g. effective_rank/<layer>, one line per layer)
"""

from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, TypeVar

import yaml
from tqdm import tqdm

from hvd_lowcomm.trackers import Tracker, open_trackers

T = TypeVar("T")


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000.0
    raise AssertionError("unreachable")


def quality_text(record: dict[str, Any]) -> str:
    """How good the model is now, as its task measures it (a language model: by its loss)."""
    if "perplexity" in record:
        return (
            f"val loss {record['test_loss']:.4f} (ppl {record['perplexity']:.2f}, "
            f"{record['bits_per_byte']:.3f} bits/byte)"
        )
    return f"test acc {100 * record['test_acc']:6.2f}%"


def show_value(key: str, value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and "bytes" in key:
        return human_bytes(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def summary_rows(s: dict[str, Any], extra: dict[str, Any]) -> list[tuple[str, str]]:
    """The table printed at the end of a run, from its summary record `s` (hvd_lowcomm.loop);
    `extra`: the method's own figures and notes, shown under its name."""
    if "final_perplexity" in s:
        last = {"test_loss": s["final_test_loss"], "perplexity": s["final_perplexity"]}
        last["bits_per_byte"] = s["final_bits_per_byte"]
        quality = (
            "validation",
            f"{quality_text(last)}, next-token accuracy {100 * s['final_test_acc']:.2f}%; "
            f"{s['tokens_per_step_per_rank']:,} tokens per step per rank",
        )
    else:
        quality = ("test accuracy", f"{100 * s['final_test_acc']:.2f}% (best {100 * s['best_test_acc']:.2f}%)")
    rows = [
        ("method", f"{s['method']} on {s['world_size']} rank(s), engine {s['engine_name']}"),
        quality,
        ("steps", f"{s['steps']} in {s['seconds']:.1f} s ({1000 * s['step_seconds_mean']:.1f} ms/step)"),
        (
            "step time (rank 0)",
            ", ".join(f"{name} {s[f'step_ms_{name}']:.1f} ms" for name in ("forward", "backward", "exchange", "other")),
        ),
        ("lr schedule", f"{s['lr_schedule']}, peak {s['peak_lr']:g}"),
        ("waiting for data (rank 0)", f"{100 * s['data_wait_fraction']:.1f}% of step time"),
        ("sent for training (rank 0)", f"{human_bytes(s['train_wire_bytes'])} on the wire"),
        ("sent per step", human_bytes(s["train_wire_bytes_per_step"])),
    ]
    if s["nodes"] > 1:
        rows.append(
            (
                "between nodes (all ranks)",
                f"{human_bytes(s['train_between_nodes_bytes_all_ranks'])} ({s['nodes']} nodes)",
            )
        )
    rows += [
        ("sent for evaluation", human_bytes(s["eval_wire_bytes"])),
        ("sent at setup (broadcasts, checks)", human_bytes(s["setup_wire_bytes"])),
        ("peak memory (max over ranks)", human_bytes(s["peak_rss_bytes_max_rank"])),
    ]
    rows += [(f"  {kind}", human_bytes(wire)) for kind, wire in s["train_wire_bytes_by_kind"].items()]
    rows += [
        (f"{s['method']}: {key} (rank 0)", show_value(key, value))
        for key, value in extra.items()
        if not isinstance(value, (list, dict))
    ]  # structured figures: summary.json only
    return rows


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Rows as a CSV file with a header: every key any row has, in order of first appearance."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def unique_run_dir(parent: str, name: str) -> Path:
    """`parent/name`, with -2, -3, ... appended if it exists, so no run overwrites another."""
    base = Path(parent) / name
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


class RunLogger:
    """Writes metrics and shows progress on rank 0; on other ranks every call does nothing."""

    def __init__(self, run_dir: Path | None, progress: bool = True, continuing: bool = False) -> None:
        self.run_dir = run_dir
        # A bar redraws its line: in a log file that is fragments, so only where stderr is a
        # terminal (mpirun pipes it: a job's log gets the per-epoch lines alone).
        self.show_progress = progress and run_dir is not None and sys.stderr.isatty()
        self.epoch_rows: list[dict[str, Any]] = []
        self.trackers: list[Tracker] = []
        self._jsonl = None
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=continuing)
            self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)

    def continue_from(self, step: int) -> None:
        """A resumed run: keep the epoch records written up to `step` (for epochs.csv and the
        plots) and mark the resume point in metrics.jsonl."""
        if self.run_dir is None:
            return
        for line in (self.run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line cut off by the interruption
                continue
            if record.get("type") == "epoch" and record["step"] <= step:
                self.epoch_rows.append({k: v for k, v in record.items() if k not in ("type", "time")})
        self.log("resume", {"step": step})

    @property
    def active(self) -> bool:
        return self.run_dir is not None

    def write_config(self, config: dict[str, Any], loggers: list[str] = ()) -> None:
        """The resolved configuration into the run dir, and the trackers `loggers` names opened."""
        if self.run_dir is not None:
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            self.trackers = open_trackers(list(loggers), self.run_dir, config)

    def print(self, text: str) -> None:
        if self.active:  # flushed: a batch system's log (and a harness reading it) sees it at once
            tqdm.write(text)
            sys.stdout.flush()

    def log(self, kind: str, record: dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"type": kind, "time": round(time.time(), 3), **record}) + "\n")
        if kind in ("step", "epoch", "summary"):
            for tracker in self.trackers:
                tracker.log(kind, record, int(record.get("step", record.get("steps", 0))))

    def epoch(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        self.log("epoch", record)
        self.epoch_rows.append(record)
        write_csv(self.run_dir / "epochs.csv", self.epoch_rows)

    def evaluation(self, record: dict[str, Any]) -> None:
        """An evaluation within an epoch: its record, and a line."""
        self.epoch(record)
        self.print(f"step {record['step']:>6} | loss {record['train_loss']:.4f} | {quality_text(record)}")

    def end_of_epoch(self, record: dict[str, Any], epochs: int, steps: int) -> None:
        """The epoch's record, and its line: loss, quality, bytes sent (in all and per step)."""
        self.epoch(record)
        sent = record["train_wire_bytes"]
        self.print(
            f"epoch {record['epoch']:>3}/{epochs} | loss {record['train_loss']:.4f} | {quality_text(record)} | "
            f"sent {human_bytes(sent)} ({human_bytes(sent / max(steps, 1))}/step)"
        )

    def progress(self, items: Iterable[T], total: int, desc: str) -> Iterator[T] | tqdm:
        if not self.show_progress:
            return iter(items)
        # redrawn at most twice a second: a fast step would spend its time drawing
        return tqdm(items, total=total, desc=desc, leave=False, dynamic_ncols=True, unit="step", mininterval=0.5)

    def summary(self, record: dict[str, Any], extra: dict[str, Any]) -> None:
        """The run's summary record to summary.json (and the trackers), and its table."""
        if not self.active:
            return
        rows = summary_rows(record, extra)
        self.log("summary", record)
        (self.run_dir / "summary.json").write_text(json.dumps(record, indent=2) + "\n")
        plotted = plot_series_groups(self.epoch_rows, self.run_dir)
        if not plotted and any("/" in key for row in self.epoch_rows for key in row):
            self.print("plots: none (pip install 'hvd_lowcomm[plots]' for the per-layer series' PNGs)")
        width = max(len(label) for label, _ in rows)
        lines = ["", "=" * (width + 40), "summary", "-" * (width + 40)]
        lines += [f"{label:<{width}}  {value}" for label, value in rows]
        lines += [
            "=" * (width + 40),
            f"metrics: {self.run_dir}/metrics.jsonl, epochs.csv, summary.json"
            + "".join(f", {p.name}" for p in plotted),
        ]
        self.print("\n".join(lines))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def plot_series_groups(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """One PNG per group of numeric columns named "<group>/<series>", against the epoch."""
    groups: dict[str, list[str]] = {}
    for row in rows:
        for key, value in row.items():
            if "/" in key and isinstance(value, (int, float)) and key not in groups.get(key.split("/")[0], []):
                groups.setdefault(key.split("/", 1)[0], []).append(key)
    if not groups:
        return []
    try:
        import matplotlib
    except ImportError:  # an extra: the numbers are in epochs.csv either way
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for group, keys in groups.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for key in keys:
            points = [(row["epoch"], row[key]) for row in rows if key in row]
            ax.plot(*zip(*points), marker="o", label=key.split("/", 1)[1])
        ax.set(xlabel="epoch", ylabel=group.replace("_", " "), title=group.replace("_", " "))
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{group}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
