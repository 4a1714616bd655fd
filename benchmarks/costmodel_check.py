"""How well the cost model (hvd_lowcomm.costmodel) predicts step times that were measured.

    python -m benchmarks.costmodel_check benchmarks/results/floor-mlp-1gbit ... \\
        --latency-us 600 --out benchmarks/results/costmodel-check

Each directory is a `benchmarks.compare --link RATE` result with its runs/ and a `local` row
(the no-communication floor) at every rank count. For every predicted method the model
predicts the step from the model's layer shapes, the local run's measured forward, backward
and step times (its compute; kernels and passes are profiled with the threads each rank had,
the machine's cores / np, so the ratio to the local run is the sharing of cores alone) and the
link:

* on one shaped medium (compare --link): RATE crossed by every rank's bytes
  (Link(shared=True)) with message latency --latency-us, or `--probe`'s (probe_link on 2 ranks;
  on this machine a Horovod collective's latency is its cycle, not the wire's);
* on emulated nodes (compare --nodes): RATE between nodes and --intra-rate inside one, or with
  `--probe` the link that hvd_lowcomm.auto.probe_link measures on the same nodes, ranks and
  rate (what `--method auto` would see on a cluster: the software path of the emulation does
  not reach the nominal rate); with more ranks than cores (--cores) no communication hides
  behind the backward pass (Link.overlap 0: every core was computing). The bytes one node's
  link carried per step are compared too (predicted, metered, measured by the counters).

Every prediction assumes the run's own length (DiLoCo's H and AB's phases may be fractions of
it) and what only training finds out, from the run: AB's mean step with the ranks its cuts kept
(summary rank/<layer>), PowerSGD's and rank-dAD's adaptive rank as the mean of the
effective_rank/<layer> they logged (rank-dAD's kernels timed at twice it, the width its
adaptive rank iterates). PowerSGD's prediction is the run's mean step, its first
`start_iter` steps being plain allreduces. Methods the model does not cover (local, the floor
itself) are left out. Writes results.md and results.csv: measured against predicted step, the
error, and its mean and largest absolute value.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from dataclasses import replace
from typing import Any

import torch

from benchmarks.compare import run_name
from benchmarks.netns import EmulatedCluster
from hvd_lowcomm import config, costmodel, data, models
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.registry import specs
from hvd_lowcomm.metrics import human_bytes, write_csv


def check(
    directory: Path,
    latency: float,
    profiles: dict[str, costmodel.Profile],
    intra_bandwidth: float = costmodel.Link.intra_bandwidth,
    cores: int = 1 << 30,
    probe_nodes: bool = False,
) -> list[dict[str, Any]]:
    with open(directory / "results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    out = []
    for np_ in sorted({int(r["np"]) for r in rows}):
        mine = [r for r in rows if int(r["np"]) == np_]
        local = next((r for r in mine if r["method"] == "local"), None)
        if local is None or not local.get("link"):
            raise SystemExit(f"{directory}: np {np_} needs a local row and a --link run")
        nodes = int(float(local.get("nodes") or 0))
        rate = config.rate_bits(local["link"].partition(",")[0]) / 8
        # Emulated nodes: the network between them, each node's ranks on its own shared memory;
        # else one shaped medium that every rank's bytes cross.
        # With more ranks than cores no core is free to progress the network during backward.
        overlap = 1.0 if np_ <= cores else 0.0
        link = (
            costmodel.Link(rate, latency, ranks_per_node=np_ // nodes, intra_bandwidth=intra_bandwidth, overlap=overlap)
            if nodes
            else costmodel.Link(rate, latency, shared=True)
        )
        if nodes and probe_nodes:  # the network as `--method auto`'s probe finds it, not as tc was told
            link = replace(probe(np_, EmulatedCluster(nodes, *_rate_and_latency(local["link"]))), overlap=overlap)
            probed = (
                f"{directory.name}, np {np_} on {nodes} nodes: probed {link.describe()}, "
                f"{link.intra_bandwidth / 1e6:.0f} MB/s inside a node"
            )
            print(probed, file=sys.stderr)
            PROBED.append(probed)
        # Kernels and passes timed with the threads each of the run's ranks had (compare gives a
        # rank the machine's cores / np), so their ratio to the local run's is the sharing alone.
        threads = runtime.compute_threads(np_, cores, cores)
        for row in mine:
            method, _, _ = row["method"].partition(":")
            if method not in costmodel.predicted_methods() or method == "local":
                continue
            cfg = _run_config(directory, np_, row["method"])
            run = directory / "runs" / run_name(np_, row["method"])
            summary = json.loads((run / "summary.json").read_text())
            options = cfg.method_options.get(specs()[method].section)
            profiled = cfg
            if method in ADAPTIVE_RANKS and options.rank == 0:
                # An adaptive rank is the training's to find (the model assumes one): as AB's kept
                # ranks below, the check takes the one the run settled at, its mean over layers.
                # rank-dAD's adaptive rank iterates twice the rank it keeps (and the cost model's
                # kernels know it only for an adaptive rank), so its kernels are timed at that.
                options.rank = _mean_rank(run)
                if method == "rank-dad":
                    profiled = copy.deepcopy(cfg)
                    profiled.method_options[specs()[method].section].rank = min(options.max_rank, 2 * options.rank)
            profile = _profile(profiled, profiles, threads)
            # The run's length: schedules given as a fraction of it (DiLoCo's H, AB's phases).
            assumptions = costmodel.RunAssumptions(run_steps=summary["steps"])
            if method == "ab":  # and the ranks its cuts kept
                shares = [
                    summary[f"rank/{layer.name}"] / min(layer.fan_in, layer.fan_out)
                    for layer in profile.layers
                    if f"rank/{layer.name}" in summary
                ]
                assumptions = costmodel.RunAssumptions(run_steps=summary["steps"], rank_share=sum(shares) / len(shares))
            profile = profile.with_compute(
                *(float(local[key]) / 1e3 for key in ("step_ms", "step_ms_forward", "step_ms_backward"))
            )
            predicted = costmodel.predict(profile, method, np_, link, cfg, assumptions)
            if method == "powersgd":  # its first start_iter steps allreduce like ddp: the run's mean step
                steps = summary["steps"]
                plain = min(cfg.method_options["powersgd"].start_iter, steps) / steps
                ddp = costmodel.predict(profile, "ddp", np_, link, cfg)
                predicted = costmodel.Prediction(
                    method,
                    np_,
                    predicted.compute,
                    (1 - plain) * predicted.method_compute,
                    *(
                        (1 - plain) * getattr(predicted, key) + plain * getattr(ddp, key)
                        for key in ("communication", "hidden", "bytes_per_rank", "node_link_bytes")
                    ),
                )
            measured = float(row["step_ms"])
            out.append(
                {
                    "results": directory.name,
                    "link": local["link"],
                    "np": np_,
                    "method": row["method"],
                    "measured_ms": measured,
                    "predicted_ms": predicted.step * 1e3,
                    "compute_ms": predicted.compute * 1e3,
                    "own_work_ms": predicted.method_compute * 1e3,
                    "network_ms": predicted.communication * 1e3,
                    "hidden_ms": predicted.hidden * 1e3,
                    "error": predicted.step * 1e3 / measured - 1,
                }
            )
            if nodes:  # what one node's link carried per step: the meter's and the counters' against the model's
                steps = max(summary["steps"], 1)
                out[-1].update(
                    {
                        "nodes": nodes,
                        "predicted_node_bytes": predicted.node_link_bytes,
                        "metered_node_bytes": summary["train_between_nodes_bytes_all_ranks"] / nodes / steps,
                        "measured_node_bytes": float(row["measured_bytes_per_step"]) / nodes,
                    }
                )
    return out


def _profile(cfg: config.Config, profiles: dict[str, costmodel.Profile], threads: int) -> costmodel.Profile:
    """The run's model profiled once per model, data, method options and thread count (shapes
    and kernels)."""
    key = json.dumps(
        {"threads": threads, **{name: value for name, value in cfg.to_dict().items() if name not in ("method", "run")}},
        sort_keys=True,
        default=str,
    )
    if key not in profiles:
        info = data.inspect(cfg.data.path, cfg.data.seq_len)
        model = models.build_model(cfg.model, info.input_shape, info.num_classes, info.task)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            profiles[key] = costmodel.profile_model(
                model, info.input_shape, cfg.data.batch_size, repeats=1, cfg=cfg, vocabulary=info.vocabulary
            )
        finally:
            torch.set_num_threads(before)
    return profiles[key]


# The links the probe found, for the table's heading.
PROBED: list[str] = []
# Methods whose adaptive rank (options.rank 0) the run logs per layer as effective_rank/<layer>.
ADAPTIVE_RANKS = ("powersgd", "rank-dad")


def _mean_rank(run: Path) -> int:
    """The mean of every effective_rank/<layer> the run logged (metrics.jsonl), over layers and time."""
    ranks = [
        value
        for line in (run / "metrics.jsonl").read_text().splitlines()
        for key, value in json.loads(line).items()
        if key.startswith("effective_rank/")
    ]
    if not ranks:
        raise SystemExit(f"{run}: an adaptive rank, but no effective_rank/<layer> in metrics.jsonl")
    return max(1, round(sum(ranks) / len(ranks)))


def _rate_and_latency(link: str) -> tuple[str, str | None]:
    """compare's --link value, 'RATE[,LATENCY]', as EmulatedCluster's arguments."""
    rate, _, latency = link.partition(",")
    return rate, latency or None


def _bytes_per_second(rate: str) -> float:
    """'20gbyte' -> 2e10; else tc's bit units ('40gbit' -> 5e9)."""
    if rate.lower().endswith("gbyte"):
        return float(rate[:-5]) * 1e9
    return config.rate_bits(rate) / 8


def _run_config(directory: Path, np_: int, label: str) -> config.Config:
    cfg = config.default_config()
    config.apply_mapping(cfg, config.read_yaml(str(directory / "runs" / run_name(np_, label) / "config.yaml")))
    return cfg


PROBE = (
    "import json; from dataclasses import asdict; from hvd_lowcomm.comm import runtime; "
    "from hvd_lowcomm.auto import probe_link; runtime.init(0); link = probe_link({mb}); "
    "runtime.rank() == 0 and print('LINK', json.dumps(asdict(link)), flush=True); "
    "runtime.world().comm.Barrier()"
)  # no rank leaves while another still waits on Horovod


def probe(np_: int = 2, cluster: EmulatedCluster | None = None, probe_mb: float = 8.0) -> costmodel.Link:
    """The link hvd_lowcomm.auto.probe_link measures (Horovod's latency per message, on this
    machine its cycle; the bandwidth an allreduce of probe_mb reaches; on several nodes, the
    bandwidth inside one) on np_ ranks under mpirun: on `cluster`'s emulated nodes, or plainly."""
    command = [sys.executable, "-c", PROBE.format(mb=probe_mb)]
    with cluster or contextlib.nullcontext():
        launch = (
            cluster.mpirun(np_) if cluster else ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np_)]
        )
        result = subprocess.run([*launch, *command], capture_output=True, text=True)
    found = [line for line in result.stdout.splitlines() if line.startswith("LINK ")]
    if result.returncode != 0 or not found:
        raise SystemExit(f"costmodel_check: the link probe failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    return costmodel.Link(**json.loads(found[-1].split(" ", 1)[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.costmodel_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("results", nargs="+", help="benchmarks.compare result directories (with runs/)")
    parser.add_argument("--latency-us", type=float, default=None, help="message latency (default: --probe's)")
    parser.add_argument(
        "--probe",
        action="store_true",
        help="measure the latency with probe_link on 2 ranks (unless --latency-us is given); for "
        "results on emulated nodes, measure their whole link (bandwidth and latency between "
        "nodes, bandwidth inside one) with probe_link on the same nodes, ranks and rate, as "
        "--method auto would on a cluster",
    )
    parser.add_argument(
        "--intra-rate",
        default="20gbyte",
        metavar="RATE",
        help="bandwidth between ranks of one node, for results on emulated nodes (tc units, or "
        "NNgbyte) (default: %(default)s)",
    )
    parser.add_argument(
        "--cores",
        type=int,
        default=os.cpu_count(),
        help="cores of the machine the runs were measured on: for results on emulated nodes with more "
        "ranks than cores, no communication hides behind the backward pass (default: this "
        "machine's, %(default)s)",
    )
    parser.add_argument("--out", default="benchmarks/results/costmodel-check")
    args = parser.parse_args(argv)
    if args.latency_us is None and not args.probe:
        parser.error("give --latency-us or --probe")
    latency = args.latency_us * 1e-6 if args.latency_us is not None else probe().latency
    profiles: dict[str, costmodel.Profile] = {}
    intra = _bytes_per_second(args.intra_rate)
    rows = [
        row
        for directory in args.results
        for row in check(Path(directory), latency, profiles, intra, args.cores, probe_nodes=args.probe)
    ]
    errors = [abs(r["error"]) for r in rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "results.csv", rows)
    shared_medium = any(not r.get("nodes") for r in rows)  # the latency above is theirs; probed sets have their own
    lines = [
        "# Cost model against measured steps (emulated links"
        + (f", latency {latency * 1e6:.0f} µs per message)" if shared_medium else ")"),
        "",
        *(f"* {text}" for text in PROBED),
        *([""] if PROBED else []),
        f"Mean absolute error {100 * sum(errors) / len(errors):.1f} %, largest {100 * max(errors):.1f} %, "
        f"over {len(rows)} runs.",
        "",
        "| results | link | np | method | measured ms | predicted ms | compute | own work | network | hidden | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['results']} | {r['link']} | {r['np']} | {r['method']} | {r['measured_ms']:.1f} | "
        f"{r['predicted_ms']:.1f} | {r['compute_ms']:.1f} | {r['own_work_ms']:.1f} | {r['network_ms']:.1f} | "
        f"{r['hidden_ms']:.1f} | {100 * r['error']:+.1f} % |"
        for r in rows
    ]
    on_nodes = [r for r in rows if r.get("nodes")]
    if on_nodes:
        lines += [
            "",
            "Bytes one node sent to the others per training step (mean over nodes): the cost model's "
            "prediction, hvd_lowcomm's meter (training only) and the nodes' interface counters (evaluation "
            "included).",
            "",
            "| results | nodes | np | method | predicted | metered | measured | predicted vs measured |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['results']} | {r['nodes']} | {r['np']} | {r['method']} | {human_bytes(r['predicted_node_bytes'])} | "
            f"{human_bytes(r['metered_node_bytes'])} | {human_bytes(r['measured_node_bytes'])} | "
            f"{100 * (r['predicted_node_bytes'] / r['measured_node_bytes'] - 1):+.1f} % |"
            for r in on_nodes
        ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
