"""How well the cost model (hvd_lowcomm.costmodel) predicts step times that were measured.

    python -m benchmarks.costmodel_check benchmarks/results/floor-mlp-1gbit ... \\
        --latency-us 600 --out benchmarks/results/costmodel-check

Each directory is a `benchmarks.compare --link RATE` result with its runs/ and a `local` row
(the no-communication floor) at every rank count; for a result on emulated nodes (--nodes) the
network is RATE between nodes, --intra-rate inside one, and the bytes one node's link carried
per step are compared too (predicted, metered, measured by the interface counters), and where
the runs had more ranks than the machine has cores (--cores), no communication is assumed to
hide behind the backward pass (Link.overlap 0: every core was computing). For every other method the model predicts
the step from the model's layer shapes, the local run's measured forward, backward and step
times (its compute) and the emulated link: RATE on one medium that every rank's bytes cross
(Link(shared=True)) with message latency --latency-us (on this machine a Horovod collective's
latency is its cycle, not the wire's; measure it with `--probe`, which runs
hvd_lowcomm.auto.probe_link under mpirun on 2 ranks). Methods the model does not
cover (local, the floor itself) are left out; PowerSGD's prediction is the run's mean step, its first
`start_iter` steps being plain allreduces; every prediction assumes the run's own length (DiLoCo's H
and AB's phases may be fractions of it); AB's is the mean over the run's steps with the ranks
its cuts kept (the summary's rank/<layer>) as the assumed rank. Writes results.md and results.csv: measured against predicted
step, the error, and its mean and largest absolute value.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.compare import run_name
from hvd_lowcomm import config, costmodel, data, models
from hvd_lowcomm.metrics import human_bytes, write_csv


def check(directory: Path, latency: float, profiles: dict[str, costmodel.Profile],
          intra_bandwidth: float = costmodel.Link.intra_bandwidth, cores: int = 1 << 30) -> list[dict[str, Any]]:
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
        link = costmodel.Link(rate, latency, ranks_per_node=np_ // nodes, intra_bandwidth=intra_bandwidth,
                              overlap=overlap) if nodes else costmodel.Link(rate, latency, shared=True)
        for row in mine:
            method, _, _ = row["method"].partition(":")
            if method not in costmodel.predicted_methods() or method == "local":
                continue
            cfg = _run_config(directory, np_, row["method"])
            summary = json.loads((directory / "runs" / run_name(np_, row["method"]) / "summary.json").read_text())
            profile = _profile(cfg, profiles)
            # The run's length: schedules given as a fraction of it (DiLoCo's H, AB's phases).
            assumptions = costmodel.RunAssumptions(run_steps=summary["steps"])
            if method == "ab":  # and the ranks its cuts kept
                shares = [summary[f"rank/{layer.name}"] / min(layer.fan_in, layer.fan_out)
                          for layer in profile.layers if f"rank/{layer.name}" in summary]
                assumptions = costmodel.RunAssumptions(run_steps=summary["steps"], rank_share=sum(shares) / len(shares))
            profile = profile.with_compute(*(float(local[key]) / 1e3 for key in
                                             ("step_ms", "step_ms_forward", "step_ms_backward")))
            predicted = costmodel.predict(profile, method, np_, link, cfg, assumptions)
            if method == "powersgd":  # its first start_iter steps allreduce like ddp: the run's mean step
                steps = summary["steps"]
                plain = min(cfg.method_options["powersgd"].start_iter, steps) / steps
                ddp = costmodel.predict(profile, "ddp", np_, link, cfg)
                predicted = costmodel.Prediction(
                    method, np_, predicted.compute, (1 - plain) * predicted.method_compute,
                    *((1 - plain) * getattr(predicted, key) + plain * getattr(ddp, key)
                      for key in ("communication", "hidden", "bytes_per_rank", "node_link_bytes")))
            measured = float(row["step_ms"])
            out.append({"results": directory.name, "link": local["link"], "np": np_, "method": row["method"],
                        "measured_ms": measured, "predicted_ms": predicted.step * 1e3,
                        "compute_ms": predicted.compute * 1e3, "own_work_ms": predicted.method_compute * 1e3,
                        "network_ms": predicted.communication * 1e3, "hidden_ms": predicted.hidden * 1e3,
                        "error": predicted.step * 1e3 / measured - 1})
            if nodes:  # what one node's link carried per step: the meter's and the counters' against the model's
                steps = max(summary["steps"], 1)
                out[-1].update({"nodes": nodes, "predicted_node_bytes": predicted.node_link_bytes,
                                "metered_node_bytes": summary["train_between_nodes_bytes_all_ranks"] / nodes / steps,
                                "measured_node_bytes": float(row["measured_bytes_per_step"]) / nodes})
    return out


def _profile(cfg: config.Config, profiles: dict[str, costmodel.Profile]) -> costmodel.Profile:
    """The run's model profiled once per model, data and method options (shapes and kernels)."""
    key = json.dumps({name: value for name, value in cfg.to_dict().items() if name not in ("method", "run")},
                     sort_keys=True, default=str)
    if key not in profiles:
        info = data.inspect(cfg.data.path, cfg.data.seq_len)
        model = models.build_model(cfg.model, info.input_shape, info.num_classes, info.task)
        profiles[key] = costmodel.profile_model(model, info.input_shape, cfg.data.batch_size, repeats=1, cfg=cfg,
                                                vocabulary=info.vocabulary)
    return profiles[key]


def _bytes_per_second(rate: str) -> float:
    """'20gbyte' -> 2e10; else tc's bit units ('40gbit' -> 5e9)."""
    if rate.lower().endswith("gbyte"):
        return float(rate[:-5]) * 1e9
    return config.rate_bits(rate) / 8


def _run_config(directory: Path, np_: int, label: str) -> config.Config:
    cfg = config.default_config()
    config.apply_mapping(cfg, config.read_yaml(str(directory / "runs" / run_name(np_, label) / "config.yaml")))
    return cfg


def probe(np_: int = 2) -> float:
    """Message latency (s) of Horovod on this machine, from probe_link under mpirun."""
    code = ("from hvd_lowcomm.comm import runtime; from hvd_lowcomm.auto import probe_link; runtime.init(0); "
            "link = probe_link(1.0); import json; runtime.rank() == 0 and print(json.dumps(link.latency))")
    result = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np_), sys.executable, "-c",
                             code], capture_output=True, text=True, check=True)
    return float(json.loads(result.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.costmodel_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="benchmarks.compare result directories (with runs/)")
    parser.add_argument("--latency-us", type=float, default=None, help="message latency (default: --probe's)")
    parser.add_argument("--probe", action="store_true", help="measure the latency with probe_link on 2 ranks")
    parser.add_argument("--intra-rate", default="20gbyte", metavar="RATE",
                        help="bandwidth between ranks of one node, for results on emulated nodes (tc units, or "
                             "NNgbyte) (default: %(default)s)")
    parser.add_argument("--cores", type=int, default=os.cpu_count(),
                        help="cores of the machine the runs were measured on: for results on emulated nodes with more "
                             "ranks than cores, no communication hides behind the backward pass (default: this "
                             "machine's, %(default)s)")
    parser.add_argument("--out", default="benchmarks/results/costmodel-check")
    args = parser.parse_args(argv)
    if args.latency_us is None and not args.probe:
        parser.error("give --latency-us or --probe")
    latency = probe() if args.probe else args.latency_us * 1e-6
    profiles: dict[str, costmodel.Profile] = {}
    intra = _bytes_per_second(args.intra_rate)
    rows = [row for directory in args.results for row in check(Path(directory), latency, profiles, intra, args.cores)]
    errors = [abs(r["error"]) for r in rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "results.csv", rows)
    lines = [f"# Cost model against measured steps (emulated links, latency {latency * 1e6:.0f} µs per message)", "",
             f"Mean absolute error {100 * sum(errors) / len(errors):.1f} %, largest {100 * max(errors):.1f} %, "
             f"over {len(rows)} runs.", "",
             "| results | link | np | method | measured ms | predicted ms | compute | own work | network | hidden | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['results']} | {r['link']} | {r['np']} | {r['method']} | {r['measured_ms']:.1f} | "
              f"{r['predicted_ms']:.1f} | {r['compute_ms']:.1f} | {r['own_work_ms']:.1f} | {r['network_ms']:.1f} | "
              f"{r['hidden_ms']:.1f} | {100 * r['error']:+.1f} % |" for r in rows]
    on_nodes = [r for r in rows if r.get("nodes")]
    if on_nodes:
        lines += ["", "Bytes one node sent to the others per training step (mean over nodes): the cost model's "
                  "prediction, hvd_lowcomm's meter (training only) and the nodes' interface counters (evaluation "
                  "included).", "",
                  "| results | nodes | np | method | predicted | metered | measured | predicted vs measured |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['results']} | {r['nodes']} | {r['np']} | {r['method']} | {human_bytes(r['predicted_node_bytes'])} | "
                  f"{human_bytes(r['metered_node_bytes'])} | {human_bytes(r['measured_node_bytes'])} | "
                  f"{100 * (r['predicted_node_bytes'] / r['measured_node_bytes'] - 1):+.1f} % |" for r in on_nodes]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
