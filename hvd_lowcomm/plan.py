"""`python -m hvd_lowcomm.plan`: predicted step time of every method for your model, batch,
rank counts and network, from the α-β cost model (hvd_lowcomm.costmodel).

    python -m hvd_lowcomm.plan --ranks 64,256,1024 --links 10gbit,25gbit,100gbit,200gbit \\
        --latency-us 2 --ranks-per-node 4 --tflops 50 --model.hidden 2048,2048 --data.batch_size 64

Model and data options are those of `python -m hvd_lowcomm.train` (the data file gives the
input shape and classes). The model's compute is timed on this machine; --tflops replaces it
by what a device reaching that rate would take (the rate the weight layers reach, not the
device's peak). AB-training's step is the mean over a run of --run-steps steps with cuts that
keep --ab-rank-share of each factorised layer's smaller side, never below the cuts' floor
(ab.min_rank_share) (both unknown before training).
Prints, and with --out writes (predicted.md, predicted.csv), one table per link
(step ms per method and rank count, × ddp), the break-even bandwidth of each method (the
bandwidth below which it steps faster than ddp) and what each may lose against ddp's quality
(exact, held to an error target, or unbounded: what `--method auto` chooses among).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from hvd_lowcomm import config, costmodel, data, models
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.metrics import write_csv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvd_lowcomm.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    parser.add_argument("--ranks", default="64,256,1024", help="comma-separated rank counts (default: %(default)s)")
    parser.add_argument("--links", default="10gbit,25gbit,100gbit,200gbit",
                        help="comma-separated network rates between nodes (default: %(default)s)")
    parser.add_argument("--latency-us", type=float, default=2.0, help="message latency (default: %(default)s)")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="ranks sharing a node (default: %(default)s)")
    parser.add_argument("--node-link", default="160gbit",
                        help="rate between the ranks of one node (PCIe or shared memory: the default, "
                             "20 GB/s; NVLink nodes: 2400gbit or more) (default: %(default)s)")
    parser.add_argument("--tflops", type=float, default=0.0,
                        help="compute at this achieved rate, TFLOP/s (default: as timed on this machine)")
    parser.add_argument("--run-steps", type=int, default=10_000,
                        help="steps of the run, over which AB's schedule and one-off SVDs spread (default: %(default)s)")
    parser.add_argument("--ab-rank-share", type=float, default=0.02,
                        help="rank AB's cuts are assumed to keep, as a share of each factorised layer's smaller "
                             "side (learned in training; never below ab.min_rank_share, the cuts' floor; default: %(default)s)")
    parser.add_argument("--out", default="", help="directory for predicted.md and predicted.csv")
    parser.add_argument("-h", "--help", action="store_true")
    args, rest = parser.parse_known_args(argv)
    if args.help:
        parser.print_help()
        print("\nModel and data options: those of python -m hvd_lowcomm.train (see its --help).")
        return 0
    try:
        tables, rows = plan(args, rest)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(tables)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "predicted.md").write_text(tables + "\n")
        write_csv(out / "predicted.csv", rows)
        print(f"written to {out}/predicted.md and predicted.csv")
    return 0


def plan(args: argparse.Namespace, train_argv: list[str]) -> tuple[str, list[dict[str, Any]]]:
    cfg = config.load(train_argv, prog="python -m hvd_lowcomm.plan")
    ranks = [int(r) for r in args.ranks.split(",")]
    node_link = config.rate_bits(args.node_link) / 8
    links = [(rate, costmodel.Link.parse(rate, args.latency_us, ranks_per_node=args.ranks_per_node,
                                         intra_bandwidth=node_link))
             for rate in args.links.split(",")]
    if min(ranks) < 2 or args.ranks_per_node < 1:
        raise ConfigError("--ranks needs counts of at least 2 and --ranks-per-node at least 1")
    info = data.from_source(cfg.data.source) if cfg.data.source else data.inspect(cfg.data.path, cfg.data.seq_len)
    model = models.build_model(cfg.model, info.input_shape, info.num_classes, info.task)
    if args.run_steps < 1 or not 0 < args.ab_rank_share <= 1:
        raise ConfigError("--run-steps needs at least 1 step and --ab-rank-share a share in (0, 1]")
    assumptions = costmodel.RunAssumptions(run_steps=args.run_steps, rank_share=args.ab_rank_share)
    profile = costmodel.profile_model(model, info.input_shape, cfg.data.batch_size, cfg=cfg,
                                       vocabulary=info.vocabulary)
    device = f"{args.tflops:g} TFLOP/s" if args.tflops else f"this machine ({profile.flop_rate / 1e9:.1f} GFLOP/s)"
    if args.tflops:
        profile = profile.at_flop_rate(args.tflops * 1e12)
    methods = [m for m in costmodel.predicted_methods() if _applies(profile, m, cfg, assumptions)]
    lines = [f"# Predicted step time: {_describe_model(cfg)}, {profile.params:,} parameters, batch "
             f"{cfg.data.batch_size} per rank, compute {profile.step_seconds * 1e3:.2f} ms per step at {device}; "
             f"latency {args.latency_us:g} µs, {args.ranks_per_node} rank(s) per node"
             + (f" linked at {args.node_link}" if args.ranks_per_node > 1 else ""), ""]
    rows: list[dict[str, Any]] = []
    for rate, link in links:
        lines += [f"## {rate}", "", "| method | " + " | ".join(f"{p} ranks: ms (× ddp)" for p in ranks) + " |",
                  "|---|" + "---|" * len(ranks)]
        for method in methods:
            cells = []
            for p in ranks:
                q = costmodel.predict(profile, method, p, link, cfg, assumptions)
                ddp = costmodel.predict(profile, "ddp", p, link, cfg, assumptions)
                cells.append(f"{q.step * 1e3:.2f} ({q.step / ddp.step:.2f})")
                rows.append({"link": rate, "ranks": p, "method": method, "step_ms": q.step * 1e3,
                             "ratio_to_ddp": q.step / ddp.step, "compute_ms": q.compute * 1e3,
                             "method_compute_ms": q.method_compute * 1e3, "network_ms": q.communication * 1e3,
                             "hidden_ms": q.hidden * 1e3, "bytes_per_rank": q.bytes_per_rank})
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Break-even bandwidth (below it the method steps faster than ddp)", "",
              "| method | " + " | ".join(f"{p} ranks" for p in ranks) + " |", "|---|" + "---|" * len(ranks)]
    for method in (m for m in methods if m != "ddp"):
        cells = []
        for p in ranks:
            bandwidth = costmodel.break_even(profile, method, p, links[0][1], cfg, assumptions)
            cells.append("never" if bandwidth == 0 else "always" if math.isinf(bandwidth) else
                         f"{bandwidth * 8 / 1e9:.3g} Gbit/s")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "## Quality against ddp (`--method auto` chooses only among the first two kinds)", "",
              "| method | quality |", "|---|---|"]
    lines += [f"| {method} | {_quality(method, cfg)} |" for method in methods]
    lines += ["", "## What `--method auto` would choose (the fastest of those that keep quality; ddp unless "
              f"another is {costmodel.MIN_GAIN:.0%} faster)", "",
              "| link | " + " | ".join(f"{p} ranks" for p in ranks) + " |", "|---|" + "---|" * len(ranks)]
    lines += [f"| {rate} | " + " | ".join(costmodel.choose(profile, p, link, cfg)[0] for p in ranks) + " |"
              for rate, link in links]
    return "\n".join(lines), rows


def _quality(method: str, cfg: config.Config) -> str:
    """What the method's result may lose against ddp's, as `--method auto` sees it."""
    if method not in costmodel.drop_in_methods():
        return "not a drop-in gradient exchange: your choice, never auto's"
    risk = costmodel.quality_risk(method, cfg)
    if risk is None:
        return "compresses without an error target (a fixed rank): auto leaves it out"
    return f"bounded: {risk}" if risk else "exact: the same gradient as ddp"


def _describe_model(cfg: config.Config) -> str:
    m = cfg.model
    if m.name == "gpt":
        return f"gpt {m.layers} layers x {m.width} ({m.heads} heads), windows of {cfg.data.seq_len} tokens"
    if m.name == "vit":
        return f"vit {m.layers} layers x {m.width} ({m.heads} heads), patches of {m.patch_size}"
    if ":" in m.name:  # hf:PATH, tv:NAME, module:factory: the name says what it is
        return m.name
    return f"{m.name} {','.join(map(str, m.hidden)) or 'default widths'}"


def _applies(profile: costmodel.Profile, method: str, cfg: config.Config,
             assumptions: costmodel.RunAssumptions) -> bool:
    """Whether the method can train this model at all (SIL needs a cut it accepts, edAD an MLP,
    AB a layer to factorise...): its prediction says so by refusing."""
    try:
        costmodel.predict(profile, method, 4, costmodel.Link.parse("10gbit"), cfg, assumptions)
    except ConfigError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
