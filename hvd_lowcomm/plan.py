"""`python -m hvd_lowcomm.plan`: predicted step time of every method for your model, batch,
rank counts and network, from the α-β cost model (hvd_lowcomm.costmodel).

    python -m hvd_lowcomm.plan --accelerator h100 --gpus-per-node 4 --ranks 64,256,1024 \\
        --links 25gbit,200gbit --model.name gpt --model.layers 12 --model.width 768 \\
        --model.heads 12 --data.path data/shakespeare.h5 --data.seq_len 1024 --train.amp bf16

Model and data options are those of `python -m hvd_lowcomm.train` (the data file gives the
input shape and classes). The compute is the model's FLOPs at --accelerator's peak (bf16 with
--train.amp bf16, else fp32) times the share a training step reaches, or at --tflops, the rate
it reaches; the methods' own kernels (SVDs, power iterations, row products, QRs) are counted
too. With neither, the step and the kernels are timed on this machine (a model whose step would
take long here is counted at this CPU's measured rates instead). AB-training's step is the mean
over a run of --run-steps steps with cuts that keep --ab-rank-share of each factorised layer's
smaller side, never below the cuts' floor (ab.cut.min_rank_share) (both unknown before training).
Prints, and with --out writes (predicted.md, predicted.csv), the compute floor (a step with no
communication, `--method local`), one table per link (step ms per method and rank count, × ddp),
the break-even bandwidth of each method (the bandwidth below which it steps faster than ddp),
memory per rank beside step time for ddp, DiLoCo and PowerSGD and their sharded forms (fsdp,
diloco.shard, powersgd.shard_group_size), and what each may lose against ddp's quality: exact, or
its error target and its measured result on
the held-out suite (what `--method auto` chooses among: exact methods and those that held).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from data_prep import prepare_if_bundled
from hvd_lowcomm import config, costmodel, data, models
from hvd_lowcomm.comm.traffic import FLOAT_BYTES
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.metrics import write_csv
from hvd_lowcomm.registry import specs

# The method with no communication: its step is the floor every other method's stands on.
FLOOR = "local"
# Between the ranks of one node without NVLink: PCIe or shared memory.
NODE_LINK = "160gbit"


def parser() -> argparse.ArgumentParser:
    ib, eth = costmodel.LATENCY_US["ib"], costmodel.LATENCY_US["eth"]
    accelerators = "|".join([*costmodel.ACCELERATORS, "cpu"])
    parser = argparse.ArgumentParser(
        prog="python -m hvd_lowcomm.plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    parser.add_argument("--ranks", default="64,256,1024", help="comma-separated rank counts (default: %(default)s)")
    parser.add_argument(
        "--links",
        default="10gbit,25gbit,100gbit,200gbit",
        help="comma-separated networks between nodes: a rate, or ib:RATE / eth:RATE to name "
        "InfiniBand or Ethernet (default: %(default)s)",
    )
    parser.add_argument(
        "--latency-us",
        type=float,
        default=None,
        help=f"message latency in µs (default: by the link's kind: {ib:g} for InfiniBand, ib:RATE or "
        f"a rate from {costmodel.IB_FROM / 1e9:g}gbit up; {eth:g} for Ethernet, eth:RATE or a "
        f"slower rate)",
    )
    parser.add_argument(
        "--accelerator",
        default="",
        metavar=accelerators,
        help=f"compute at this device's peak for the run's precision (bf16 with --train.amp bf16, "
        f"else fp32) x {costmodel.UTILISATION * 100:g}%% (cpu: this machine's measured peak) "
        f"(default: timed on this machine)",
    )
    parser.add_argument(
        "--tflops",
        type=float,
        default=0.0,
        help="compute at this achieved rate, TFLOP/s: the step's (with --accelerator), else the "
        "step's and the methods' kernels' (default: from --accelerator)",
    )
    parser.add_argument(
        "--gpus-per-node", type=int, default=0, help="accelerators per node, a rank each (default: one rank per node)"
    )
    parser.add_argument(
        "--ranks-per-node", type=int, default=0, help="ranks sharing a node (default: --gpus-per-node, else 1)"
    )
    parser.add_argument(
        "--node-link",
        default="",
        help=f"rate between the ranks of one node (default: the --accelerator's NVLink, e.g. h100's "
        f"{costmodel.ACCELERATORS['h100'].nvlink_gbit:g}gbit; else {NODE_LINK}, PCIe or shared "
        f"memory)",
    )
    parser.add_argument(
        "--run-steps",
        type=int,
        default=10_000,
        help="steps of the run, over which AB's schedule and one-off SVDs spread (default: %(default)s)",
    )
    parser.add_argument(
        "--ab-rank-share",
        type=float,
        default=0.02,
        help="rank AB's cuts are assumed to keep, as a share of each factorised layer's smaller "
        "side (learned in training; never below ab.cut.min_rank_share, the cuts' floor; default: %(default)s)",
    )
    parser.add_argument("--out", default="", help="directory for predicted.md and predicted.csv")
    parser.add_argument("-h", "--help", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args, rest = parser().parse_known_args(argv)
    if args.help:
        parser().print_help()
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
    """The tables (markdown) and their rows (for the CSV) for the parsed options and the
    training options in `train_argv`."""
    own = tuple("--" + dest.replace("_", "-") for dest in vars(args))  # plan's options, for a typo's hint
    cfg = config.load(train_argv, prog="python -m hvd_lowcomm.plan", other_options=own)
    ranks = [int(r) for r in args.ranks.split(",")]
    if min(ranks) < 2:
        raise ConfigError("--ranks needs counts of at least 2")
    links = networks(args)
    device = costmodel.compute_device(args.accelerator, args.tflops, cfg.train.amp)
    if args.run_steps < 1 or not 0 < args.ab_rank_share <= 1:
        raise ConfigError("--run-steps needs at least 1 step and --ab-rank-share a share in (0, 1]")
    assumptions = costmodel.RunAssumptions(run_steps=args.run_steps, rank_share=args.ab_rank_share)
    if not cfg.data.source:
        prepare_if_bundled(cfg.data.path)  # as the trainer does: only the shapes are read
    info = data.from_source(cfg.data.source) if cfg.data.source else data.inspect(cfg.data.path, cfg.data.seq_len)
    model = _model(cfg, info)  # on the meta device: the profile's, and the memory table's facts
    profile = costmodel.profile_model(
        model, info.input_shape, cfg.data.batch_size, cfg=cfg, vocabulary=info.vocabulary, device=device
    )
    methods = [m for m in costmodel.predicted_methods() if m != FLOOR and _applies(profile, m, cfg, assumptions)]
    timed = profile.device == costmodel.Profile.device
    where = profile.device + (f" ({profile.flop_rate / 1e9:.1f} GFLOP/s)" if timed else "")
    node = links[0][1]
    lines = [
        f"# Predicted step time: {_describe_model(cfg)}, {profile.params:,} parameters, batch "
        f"{cfg.data.batch_size} per rank; {node.ranks_per_node} rank(s) per node"
        + (f" linked at {node.intra_bandwidth * 8 / 1e9:g} Gbit/s" if node.ranks_per_node > 1 else ""),
        "",
        f"Compute floor (a step with no communication, as `--method {FLOOR}`): "
        f"{profile.step_seconds * 1e3:.2f} ms per step ({3 * profile.flops / 1e12:.3g} TFLOP forward and "
        f"backward; {where})",
        "",
    ]
    rows: list[dict[str, Any]] = []
    for name, link in links:
        lines += [
            f"## {name}",
            "",
            f"{link.describe()}",
            "",
            "| method | " + " | ".join(f"{p} ranks: ms (× ddp)" for p in ranks) + " | quality risk (held-out suite) |",
            "|---|" + "---|" * (len(ranks) + 1),
        ]
        for method in methods:
            cells, risk = [], _measured_risk(method, cfg)
            for p in ranks:
                q = costmodel.predict(profile, method, p, link, cfg, assumptions)
                ddp = costmodel.predict(profile, "ddp", p, link, cfg, assumptions)
                cells.append(f"{q.step * 1e3:.2f} ({q.step / ddp.step:.2f})")
                rows.append(
                    {
                        "link": name,
                        "ranks": p,
                        "method": method,
                        "step_ms": q.step * 1e3,
                        "ratio_to_ddp": q.step / ddp.step,
                        "compute_ms": q.compute * 1e3,
                        "method_compute_ms": q.method_compute * 1e3,
                        "network_ms": q.communication * 1e3,
                        "hidden_ms": q.hidden * 1e3,
                        "bytes_per_rank": q.bytes_per_rank,
                        "quality_risk": risk,
                    }
                )
            lines.append(f"| {method} | " + " | ".join(cells) + f" | {risk} |")
        lines.append("")
    lines += [
        "## Break-even bandwidth (below it the method steps faster than ddp)",
        "",
        f"With the rest of the first link ({links[0][0]}) as it is.",
        "",
        "| method | " + " | ".join(f"{p} ranks" for p in ranks) + " |",
        "|---|" + "---|" * len(ranks),
    ]
    for method in (m for m in methods if m != "ddp"):
        cells = []
        for p in ranks:
            bandwidth = costmodel.break_even(profile, method, p, links[0][1], cfg, assumptions)
            cells.append(
                "never"
                if bandwidth == 0
                else "always"
                if math.isinf(bandwidth)
                else f"{bandwidth * 8 / 1e9:.3g} Gbit/s"
            )
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", *memory_table(profile, model, info, cfg, ranks, links[0], assumptions)]
    lines += [
        "",
        "## Quality against ddp (`--method auto` chooses only exact methods and those whose defaults held on "
        "the held-out suite)",
        "",
        "| method | quality |",
        "|---|---|",
    ]
    lines += [f"| {method} | {_quality(method, cfg)} |" for method in methods]
    lines += [
        "",
        "## What `--method auto` would choose (the fastest of those that keep quality; ddp unless "
        f"another is {costmodel.MIN_GAIN:.0%} faster)",
        "",
        "| link | " + " | ".join(f"{p} ranks" for p in ranks) + " |",
        "|---|" + "---|" * len(ranks),
    ]
    lines += [
        f"| {name} | " + " | ".join(costmodel.choose(profile, p, link, cfg)[0] for p in ranks) + " |"
        for name, link in links
    ]
    return "\n".join(lines), rows


def memory_forms() -> list[tuple[str, str, dict[str, Any]]]:
    """The memory table's rows: every registered method at its defaults, then the forms its cost
    names (MethodCost.memory_forms), as (row, method, options set on its section)."""
    rows = []
    for name, spec in specs().items():
        rows.append((name, name, {}))
        rows += [(label, name, options) for label, options in spec.cost.memory_forms]
    return rows


def memory_table(
    profile: costmodel.Profile,
    model: Any,
    info: data.DatasetInfo,
    cfg: config.Config,
    ranks: list[int],
    link: tuple[str, costmodel.Link],
    assumptions: costmodel.RunAssumptions,
) -> list[str]:
    """Memory per rank (weights, gradients, optimiser and method state) beside the step's time
    on the first link, for the replicated methods and their sharded forms."""
    name, network = link
    node = network.ranks_per_node
    lines = [
        f"## Memory per rank and step time ({name})",
        "",
        "Weights, gradients, optimiser state and the method's own state in float32, with what FSDP holds "
        "gathered at once (the root and the largest block, twice in backward); activations are not counted."
        + ("" if node > 1 else " One rank per node: --gpus-per-node N shows sharding inside nodes."),
        "",
        "| method | " + " | ".join(f"{p} ranks: GiB, ms (× ddp)" for p in ranks) + " |",
        "|---|" + "---|" * len(ranks),
    ]
    for row, method, options in memory_forms():
        if node < 2 and costmodel.NODE in options.values():
            continue
        variant = copy.deepcopy(cfg)
        section = variant.method_options[method] if method in variant.method_options else None
        for key, value in options.items():
            setattr(section, key, node if value == costmodel.NODE else value)
        facts = specs()[method].cost.model_facts
        shaped = (
            replace(profile, facts={**profile.facts, method: facts(model, info.input_shape, section, variant)})
            if facts
            else profile
        )
        cells = []
        for p in ranks:
            if p % node:
                cells.append("-")
                continue
            try:
                step = costmodel.predict(shaped, method, p, network, variant, assumptions).step
            except ConfigError:  # the method cannot train this model or rank count
                cells.append("-")
                continue
            ddp = costmodel.predict(profile, "ddp", p, network, cfg, assumptions).step
            gib = memory_per_rank(shaped, method, section, p, node, variant) / 2**30
            cells.append(f"{gib:.3g}, {step * 1e3:.2f} ({step / ddp:.2f})")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return lines


def memory_per_rank(
    profile: costmodel.Profile, method: str, options: Any, ranks: int, ranks_per_node: int, cfg: config.Config
) -> float:
    """Bytes a rank holds for `method` on `ranks` ranks: what the method's own cost says it holds
    (MethodCost.memory: its share of the weights, gradients and optimiser state, what a sharded
    model holds gathered, the method's own state), in float32."""
    t = cfg.train
    slots = 2 if t.optimizer in ("adam", "adamw") else (1 if t.momentum else 0)
    held = specs()[method].cost.memory(profile, ranks, ranks_per_node, options, cfg)
    return FLOAT_BYTES * held.numbers(profile.params, slots)


def networks(args: argparse.Namespace) -> list[tuple[str, costmodel.Link]]:
    """Each of --links as the cost model sees it, with --latency-us (default: the link kind's),
    the ranks per node (--ranks-per-node, else --gpus-per-node, else 1) and --node-link between
    them (default: the accelerator's NVLink, else NODE_LINK)."""
    if args.ranks_per_node < 0 or args.gpus_per_node < 0:
        raise ConfigError("--ranks-per-node and --gpus-per-node need counts of at least 1 (0: the default)")
    ranks_per_node = args.ranks_per_node or args.gpus_per_node or 1
    accelerator = costmodel.ACCELERATORS.get(args.accelerator)
    node_link = args.node_link or (f"{accelerator.nvlink_gbit:g}gbit" if accelerator else NODE_LINK)
    return [
        (
            name,
            costmodel.Link.parse(
                name, args.latency_us, ranks_per_node=ranks_per_node, intra_bandwidth=config.rate_bits(node_link) / 8
            ),
        )
        for name in args.links.split(",")
    ]


def _model(cfg: config.Config, info: data.DatasetInfo) -> Any:
    """The model on the meta device: shapes without weights, which the plan does not need (a
    large model's would take long to initialise); built on this machine if it cannot be."""
    try:
        with torch.device("meta"):
            return models.build_model(cfg.model, info.input_shape, info.num_classes, info.task)
    except (RuntimeError, NotImplementedError):  # a factory that reads its weights' values back
        return models.build_model(cfg.model, info.input_shape, info.num_classes, info.task)


def _measured_risk(method: str, cfg: config.Config) -> str:
    """What the held-out suite measured of the method's defaults against ddp: its worst judged
    result, or exact, or that it was not measured (at these options)."""
    if method == "ddp" or costmodel.quality_risk(method, cfg) == "":
        return "exact"
    measured = costmodel.measured_quality(method, cfg)
    if measured is None:
        return "not measured"
    return f"{'held' if measured.held else 'failed'}: worst {measured.worst} ({measured.sets} sets)"


def _quality(method: str, cfg: config.Config) -> str:
    """What the method's result may lose against ddp's, as `--method auto` sees it."""
    if method not in costmodel.drop_in_methods():
        return "not a drop-in gradient exchange: your choice, never auto's"
    risk, why_not = costmodel.quality_risk(method, cfg), costmodel.left_out(method, cfg)
    if not risk and risk is not None:
        return "exact: the same gradient as ddp"
    measured = costmodel.measured_quality(method, cfg)
    verdict = f"measured: {measured.risk()}" if measured else "not measured on the held-out suite at these options"
    return f"{risk or 'no error target (a fixed rank)'}; {verdict}" + ("; auto leaves it out" if why_not else "")


def _describe_model(cfg: config.Config) -> str:
    m = cfg.model
    if m.name == "gpt":
        return f"gpt {m.layers} layers x {m.width} ({m.heads} heads), windows of {cfg.data.seq_len} tokens"
    if m.name == "vit":
        return f"vit {m.layers} layers x {m.width} ({m.heads} heads), patches of {m.patch_size}"
    if ":" in m.name:  # hf:PATH, tv:NAME, module:factory: the name says what it is
        return m.name
    return f"{m.name} {','.join(map(str, m.hidden)) or 'default widths'}"


def _applies(
    profile: costmodel.Profile, method: str, cfg: config.Config, assumptions: costmodel.RunAssumptions
) -> bool:
    """Whether the method can train this model at all (SIL needs a cut it accepts, edAD an MLP,
    AB a layer to factorise...): its prediction says so by refusing."""
    try:
        costmodel.predict(profile, method, 4, costmodel.Link.parse("10gbit"), cfg, assumptions)
    except ConfigError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
