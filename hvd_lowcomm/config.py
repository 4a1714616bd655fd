"""Run configuration: plain dataclasses, loaded from YAML and `--section.key value` overrides.

Precedence: defaults < YAML file (`--config run.yaml`) < command-line overrides. Everything is
validated here, before MPI or Horovod start, so a bad config never costs an allocation.

A method with its own options registers an options dataclass with it (see
`hvd_lowcomm.methods`); it appears here as a section named after the method (`--ab.groups 4`),
so adding a method never means editing this file. This module knows methods only through that
registry, which imports none of them until asked. Options that only one form of a method reads
are grouped under it (`subsection`: `--diloco.sparse.density`).

This module holds the base sections, the run's `Config` and how it is loaded (YAML, command
line, --help); the option machinery they are built on (fields, conversion, renames, errors) is
hvd_lowcomm.options, whose public names are importable from here too.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hvd_lowcomm.options import (  # the machinery's public names stay importable from here
    RENAMED as RENAMED,
    ConfigError as ConfigError,
    check_choices,
    convert_argument,
    did_you_mean,
    field_type,
    first_line,
    import_object as import_object,
    is_subsection,
    leaves,
    make_options as make_options,
    metavar,
    option as option,
    option_holder,
    renamed,
    renamed_arguments,
    set_option,
    show,
    subsection as subsection,
    unknown_arguments,
)
from hvd_lowcomm.registry import option_sections, specs


def rate_bits(rate: str) -> float:
    """'1gbit' -> 1e9, '100mbit' -> 1e8 bits per second (tc's units, decimal)."""
    units = {"tbit": 1e12, "gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    text = rate.strip().lower()
    for unit, factor in units.items():
        if text.endswith(unit):
            try:
                return float(text[: -len(unit)]) * factor
            except ValueError:
                break
    raise ConfigError(f"link rate {rate!r}: use a rate such as 1gbit, 100mbit, 25gbit")


@dataclass
class DataConfig:
    """Where the samples come from and how many each rank takes per step."""

    path: str = option(
        "data/digits.h5",
        "HDF5 dataset file or shard directory written by `python -m "
        "data_prep`; a missing file named after a bundled dataset (digits.h5, mnist5k.h5, "
        "shakespeare.h5) "
        "is prepared on first use",
    )
    batch_size: int = option(32, "training samples per rank per step")
    test_batch_size: int = option(512, "samples per rank per evaluation batch")
    normalize: bool = option(True, "standardise uint8 images with the stored per-channel mean/std")
    verify: bool = option(
        True,
        "recompute every file's checksum before training (the ranks share the work); "
        "turn off for huge datasets already checked with `python -m data_prep verify`",
    )
    source: str = option(
        "",
        "your own data instead of an HDF5 file: 'module:function' returning (train, test) "
        "torch Datasets of (x, y) items, or (train, test, num_classes); each rank calls it",
    )
    seq_len: int = option(128, "text datasets: tokens per training window (the language model's context)")
    driver: str = option(
        "default",
        "HDF5 driver for reads: default (independent POSIX reads per rank) or mpio (MPI-IO; needs h5py built with MPI)",
        choices=("default", "mpio"),
    )

    def validate(self) -> None:
        _positive(self, "batch_size", "test_batch_size", "seq_len")
        if not self.path:
            raise ConfigError("data.path is empty: give the HDF5 file to train on (--data.path data/digits.h5)")
        if self.driver == "mpio":
            import h5py

            if not h5py.get_config().mpi:
                raise ConfigError(
                    "data.driver mpio needs h5py built with MPI support, which this h5py is not "
                    "(reinstall it with CC=mpicc HDF5_MPI=ON pip install --no-binary h5py h5py "
                    "against a parallel HDF5), or use --data.driver default"
                )


@dataclass
class ModelConfig:
    """Which network to train."""

    name: str = option(
        "",
        "model from hvd_lowcomm.models: mlp, cnn, sil6 (six fully connected layers), gpt (a "
        "language model, for text datasets), vit (a vision transformer), tv:NAME (torchvision, "
        "the [vision] extra), hf:PATH (a Hugging Face model from a local config.json or "
        "pretrained directory, the [hf] extra: a causal LM on text, an image classifier on "
        "images), or your own 'module:factory' called as factory(input_shape, num_classes, "
        "**model.kwargs); empty: the method's default (sil6 for sil and mp, mlp otherwise)",
    )
    kwargs: dict = option(
        {}, "keyword arguments for a 'module:factory' model, a YAML mapping (e.g. '{depth: 4, width: 128}')"
    )
    hidden: list[int] = option(
        [],
        "hidden widths of the MLP, or channels of the CNN's conv blocks; empty: the "
        "model's default (mlp 256,128; cnn 32,64; sil6 256,256,256,256,256)",
    )
    dropout: float = option(
        0.0, "dropout probability after each hidden layer (transformers: on embeddings, attention and MLP outputs)"
    )
    layers: int = option(4, "transformer blocks of gpt and vit")
    width: int = option(128, "gpt and vit: the residual stream's width (the MLP is four times as wide)")
    heads: int = option(4, "gpt and vit: attention heads (a divisor of model.width)")
    patch_size: int = option(4, "vit: side of the square image patches (a divisor of the image's height and width)")
    pool: str = option(
        "cls", "vit: classify from the class token or the mean of the patch tokens", choices=("cls", "mean")
    )
    tie_weights: bool = option(
        False,
        "gpt: the output layer shares the token embedding's matrix (GPT-2); not with "
        "sil or mp, whose partitions hold the two ends apart",
    )

    def validate(self) -> None:
        if any(h <= 0 for h in self.hidden):
            raise ConfigError(f"model.hidden must be positive widths, got {self.hidden} (e.g. --model.hidden 128,64)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        _positive(self, "layers", "width", "heads", "patch_size")


@dataclass
class TrainConfig:
    """Optimisation: epochs, optimiser, learning rate, seed."""

    epochs: int = option(20, "passes over the training set")
    optimizer: str = option(
        "adam",
        "optimiser (ab: adamw unless set); muon: Muon (torch.optim.Muon, its update scaled to "
        "AdamW's size) for the hidden layers' weight matrices and AdamW for embeddings, the "
        "output layer, biases, norms and convolutions, both at train.lr and train.weight_decay",
        choices=("sgd", "adam", "adamw", "muon"),
    )
    # 1e-3, Adam's own default: at 1e-2 wide layers lose accuracy under every method and SIL's
    # partitions can collapse (a partition's output stops depending on its input).
    lr: float = option(0.001, "peak learning rate (not scaled by the number of ranks)")
    lr_schedule: str = option("cosine", "learning-rate schedule over the whole run", choices=("cosine", "constant"))
    warmup_steps: int = option(0, "linear learning-rate warm-up from 0 over this many steps")
    momentum: float = option(0.9, "SGD momentum")
    weight_decay: float = option(0.0, "weight decay (ab: 0.1 unless set, as the AB-training paper trains)")
    device: str = option(
        "auto",
        "where each rank computes: cuda (the GPU the rank is given: the one it sees, else "
        "its local rank's; collectives on the GPU with NCCL where Horovod has it, else "
        "through host memory), cpu, auto (cuda when available), or the name of another "
        "device PyTorch has a backend for",
    )
    seed: int = option(42, "seed for initialisation, shuffling and every random choice")
    max_steps: int = option(
        -1,
        "stop after this many training steps (-1: no limit; 0: start up, "
        "evaluate once and stop, which measures start-up traffic)",
    )
    max_time: float = option(
        0.0,
        "stop after this many seconds of training (evaluation excluded; 0: no limit): "
        "the run ends at whichever of epochs, max_steps and max_time comes first, every "
        "rank at the same step, and the learning-rate schedule spans the steps that fit "
        "(planned from the slowest rank's step time, revised as the run goes)",
    )
    accumulate: int = option(
        1,
        "split each rank's batch into this many micro-batches, forward and backward one "
        "at a time (less activation memory), and exchange once per step on their summed "
        "gradient (Horovod's backward_passes_per_step; not for sil and mp)",
    )
    amp: str = option(
        "none",
        "autocast the forward pass: bf16 (CPU and GPU) or none; parameters, gradients "
        "and what is exchanged stay fp32 (not for sil and mp)",
        choices=("none", "bf16"),
    )
    clip_grad_norm: float = option(
        0.0,
        "clip the norm of the pooled (synchronised) gradient over all parameters "
        "to this before each optimiser step, as with Horovod's synchronize() "
        "(0: off; not for sil and mp, whose partitions each hold part of it)",
    )
    skip_nonfinite: bool = option(
        False,
        "skip (undo) a step whose loss or parameters become NaN/inf and go "
        "on, counting it in the metrics; otherwise such a step stops the run",
    )

    def validate(self) -> None:
        _positive(self, "epochs", "accumulate")
        if self.max_steps < -1:
            raise ConfigError(f"train.max_steps must be -1 (no limit) or >= 0, got {self.max_steps}")
        if self.max_time < 0:
            raise ConfigError(f"train.max_time must be >= 0 seconds (0: no limit), got {self.max_time}")
        if self.warmup_steps < 0:
            raise ConfigError(f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be positive, got {self.lr}")
        if self.clip_grad_norm < 0:
            raise ConfigError(f"train.clip_grad_norm must be >= 0 (0: off), got {self.clip_grad_norm}")


@dataclass
class CommConfig:
    """How gradients travel in data-parallel methods."""

    compression: str = option(
        "none", "gradient compression on the wire for ddp (refused for other methods)", choices=("none", "fp16")
    )
    engine: str = option(
        "auto",
        "what moves the tensors: horovod, torch (torch.distributed: Gloo on CPUs, NCCL on "
        "GPUs; needs no Horovod) or auto (HVD_LOWCOMM_ENGINE where set, else Horovod where "
        "it is installed, and built with NCCL on a GPU machine, else torch)",
        choices=("auto", "horovod", "torch"),
    )
    reduce_dtype: str = option(
        "float32",
        "what bfloat16 tensors travel and are summed in: float32 (sums exact "
        "to bfloat16's rounding, twice the bytes) or bfloat16 (half the bytes, "
        "each partial sum rounded; the torch engine only: Horovod refuses "
        "bfloat16, and auto then picks torch)",
        choices=("float32", "bfloat16"),
    )

    def validate(self) -> None:
        if self.engine == "horovod" and self.reduce_dtype == "bfloat16":
            raise ConfigError(
                "comm.reduce_dtype bfloat16 needs the torch engine (Horovod refuses bfloat16 tensors): "
                "use --comm.engine torch, or --comm.reduce_dtype float32"
            )


@dataclass
class AutoConfig:
    """--method auto: the cost model chooses the method from the measured compute and network."""

    link: str = option(
        "",
        "the network between nodes, a rate such as 25gbit, or its kind and rate, ib:200gbit or "
        "eth:100gbit (a rate alone is InfiniBand from 100gbit up; empty: measure this job's own "
        "with a short allreduce probe)",
    )
    latency_us: float = option(
        -1.0, "message latency with auto.link, in microseconds (-1: the link kind's, 2 for InfiniBand, 30 for Ethernet)"
    )
    ranks_per_node: int = option(
        0, "ranks sharing a node, with auto.link (0: this job's own when it spans several nodes, else 1)"
    )
    probe_mb: float = option(8.0, "size of the bandwidth probe's allreduce, in MB")

    def validate(self) -> None:
        if self.link:
            kind, _, rate = self.link.rpartition(":")
            rate_bits(rate)
            if kind.lower() not in ("", "ib", "eth"):
                raise ConfigError(f"auto.link {self.link!r}: the kind before the rate is ib or eth (ib:200gbit)")
        if (self.latency_us < 0 and self.latency_us != -1) or self.ranks_per_node < 0 or self.probe_mb <= 0:
            raise ConfigError(
                "auto.latency_us must be >= 0 (or -1: the link kind's), auto.ranks_per_node >= 0 and auto.probe_mb > 0"
            )


LOGGERS = ("tensorboard", "wandb")  # run.loggers (hvd_lowcomm.trackers)


@dataclass
class RunConfig:
    """Where results go and how much is shown while training."""

    dir: str = option("runs", "parent directory of run directories")
    name: str = option("", "run directory name (default: <method>-<timestamp>)")
    log_every: int = option(10, "write a step record to metrics.jsonl every N steps")
    progress: bool = option(True, "show a progress bar on rank 0 where its stderr is a terminal (mpirun pipes it)")
    eval_every: int = option(
        0,
        "also evaluate every N steps within an epoch (0: at epoch ends only; methods "
        "whose ranks take different steps, such as sil, evaluate at epoch ends only)",
    )
    eval_every_seconds: float = option(
        0.0,
        "also evaluate every S seconds of training (evaluation excluded) within an epoch, at "
        "the steps the ranks' agreed step time predicts, for a loss-against-time curve "
        "(0: off; sil evaluates at epoch ends only)",
    )
    checkpoint_every: int = option(500, "write a checkpoint every N steps (0: only at the end and on preemption)")
    keep_checkpoints: int = option(3, "keep the newest K checkpoints")
    resume: str = option(
        "",
        "continue a run: 'auto' (the run run.dir/run.name from its newest usable "
        "checkpoint, or from scratch if it has none), or a run / checkpoint directory; "
        "also --resume",
    )
    loggers: list[str] = option(
        [],
        "also log step, epoch and summary records to: tensorboard (event files in the "
        "run dir), wandb (offline unless WANDB_MODE is set); a resumed run continues "
        "the same tracker run; needs the [trackers] extra",
    )

    def validate(self) -> None:
        _positive(self, "log_every", "keep_checkpoints")
        unknown = [name for name in self.loggers if name not in LOGGERS]
        if unknown:
            raise ConfigError(f"run.loggers: unknown logger(s) {', '.join(unknown)}; choose from {', '.join(LOGGERS)}")
        for name in ("checkpoint_every", "eval_every", "eval_every_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"run.{name} must be >= 0, got {getattr(self, name)}")


BASE_SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "comm": CommConfig,
    "auto": AutoConfig,
    "run": RunConfig,
}
# Not a method but a choice among them, made before training (hvd_lowcomm.auto).
AUTO = "auto"


@dataclass
class Config:
    method: str = "ddp"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    auto: AutoConfig = field(default_factory=AutoConfig)
    run: RunConfig = field(default_factory=RunConfig)
    # One options object per registered options section (a method's name), keyed by it.
    method_options: dict[str, Any] = field(default_factory=dict)

    def sections(self) -> dict[str, Any]:
        return {**{name: getattr(self, name) for name in BASE_SECTIONS}, **self.method_options}

    @property
    def options(self) -> Any:
        """The options of the method this run uses (None if it has none)."""
        spec = specs().get(self.method)
        return self.method_options.get(spec.section) if spec is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, **{name: dataclasses.asdict(sec) for name, sec in self.sections().items()}}

    def validate(self) -> None:
        methods = method_names()
        if self.method not in methods:
            raise ConfigError(
                f"unknown method {self.method!r}{did_you_mean(self.method, methods)}; available: {', '.join(methods)}"
            )
        if self.comm.compression != "none" and (
            self.method == AUTO or not specs()[self.method].method.honours_compression
        ):
            raise ConfigError(
                f"comm.compression {self.comm.compression} is for ddp's allreduce; {self.method} sends "
                f"what it sends its own way and would ignore it: drop --comm.compression or use "
                f"--method ddp"
            )
        for name, section in self.sections().items():
            check_choices(name, section)
            if hasattr(section, "validate"):
                section.validate()


def default_config() -> Config:
    return Config(method_options={name: cls() for name, cls in option_sections().items()})


def method_names() -> list[str]:
    """Every name --method accepts: the registered methods and their variants, and auto."""
    return sorted([*specs(), AUTO])


def apply_presets(cfg: Config, presets: dict[str, Any], explicit: set[str] = frozenset()) -> None:
    """Set each 'section.key' of `presets` on `cfg`, except those in `explicit` (the user's)."""
    for dotted, value in presets.items():
        if dotted not in explicit:
            set_option(cfg.sections(), dotted, value)


# ---------------------------------------------------------------------------------------------
# YAML + command line


def load(
    argv: list[str] | None = None, prog: str = "python -m hvd_lowcomm.train", other_options: tuple[str, ...] = ()
) -> Config:
    """Parse `argv` (YAML file and overrides) into a validated Config; exits with --help.
    `other_options`: the calling command's own options, offered too when a name is mistyped."""
    cfg = default_config()
    parser = build_parser(cfg, prog)
    args, unknown = parser.parse_known_args(renamed_arguments(sys.argv[1:] if argv is None else argv))
    if unknown:  # one line with the nearest name, not argparse's page of usage
        raise ConfigError(unknown_arguments(unknown, ["--" + dest for dest in vars(args)] + list(other_options), prog))
    explicit = apply_mapping(cfg, read_yaml(args.config)) if args.config else set()
    if args.method is not None:
        cfg.method = args.method
    for dest, value in vars(args).items():
        if "." in dest and value is not None:
            set_option(cfg.sections(), dest, value)
            explicit.add(dest)
    spec = specs().get(cfg.method)
    if not cfg.model.name:
        cfg.model.name = spec.method.default_model if spec else "mlp"
    if spec is not None:  # what the method's name implies, where the user chose nothing
        apply_presets(cfg, spec.presets, explicit)
    cfg.validate()
    return cfg


def read_yaml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def apply_mapping(cfg: Config, data: dict[str, Any]) -> set[str]:
    """Overlay a nested mapping ({'train': {'epochs': 3}, 'method': 'ddp'}) onto `cfg`; returns
    the options it set ('train.epochs')."""
    sections = cfg.sections()
    applied = set()
    for name, values in data.items():
        if name == "method":
            cfg.method = str(values)
            continue
        if name not in sections:
            raise ConfigError(f"unknown config section {name!r}{did_you_mean(name, [*sections, 'method'])}")
        if not isinstance(values, dict):
            raise ConfigError(f"config section {name!r} must be a mapping of keys to values")
        pending = [(f"{name}.{given}", value) for given, value in values.items()]
        while pending:
            dotted, value = pending.pop(0)
            dotted = renamed(dotted)
            section, *path = dotted.split(".")
            holder, f = option_holder(sections[section], path, dotted)
            if is_subsection(f):  # a form's options, as a mapping
                if not isinstance(value, dict):
                    raise ConfigError(f"{dotted} holds options: give it a mapping ({dotted}: {{key: value}})")
                pending += [(f"{dotted}.{key}", inner) for key, inner in value.items()]
                continue
            set_option(sections, dotted, value, convert=True)
            applied.add(dotted)
    return applied


# Options used often enough on the command line (and in job scripts) to have a short flag.
SHORT_FLAGS = {"run.resume": ("--resume",)}


def build_parser(cfg: Config, prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train a PyTorch model across MPI ranks with hvd_lowcomm. Options come from "
        "their defaults, then --config FILE (YAML sections as below), then the command line.",
        epilog="Example: mpirun -np 4 python -m hvd_lowcomm.train --config run.yaml --train.epochs 5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", help="YAML file with sections data, model, train, ...")
    parser.add_argument(
        "--method", default=None, choices=method_names(), help=f"training method (default: {cfg.method})"
    )
    groups: dict[str, Any] = {}
    for opt in describe_options(cfg):
        if opt.section not in groups:
            groups[opt.section] = parser.add_argument_group(f"{opt.section} options", opt.section_help)
        help_text = opt.help + (f" {{{', '.join(opt.choices)}}}" if opt.choices else "")
        groups[opt.section].add_argument(
            f"--{opt.name}",
            *SHORT_FLAGS.get(opt.name, ()),
            dest=opt.name,
            default=None,
            type=lambda text, _n=opt.name, _t=opt.type: convert_argument(_n, _t, text),
            metavar=opt.metavar,
            help=f"{help_text} (default: {opt.default})",
        )
    return parser


@dataclass(frozen=True)
class OptionDoc:
    """One `--section.key` option as --help and the documentation's option reference show it."""

    section: str  # 'train', or a method's section ('ab')
    section_help: str | None  # first line of the section dataclass's docstring
    name: str  # 'train.lr'
    type: Any  # the field's declared type (int, list[int], ...)
    metavar: str  # how --help names the type: INT, FLOAT[,...], YAML
    default: str  # the default as --help prints it
    help: str  # the field's help text ('' if it has none: a test forbids that)
    choices: tuple[str, ...] | None


def describe_options(cfg: Config | None = None) -> list[OptionDoc]:
    """Every option of every section (base sections, then each method's), from the dataclass
    fields that define them: the one source of --help and the generated option reference."""
    cfg = cfg or default_config()
    docs = []
    for name, section in cfg.sections().items():
        for dotted, holder, f in leaves(section, name):
            ftype = field_type(holder, f.name)
            choices = f.metadata.get("choices")
            docs.append(
                OptionDoc(
                    name,
                    first_line(type(section).__doc__),
                    dotted,
                    ftype,
                    metavar(ftype),
                    show(getattr(holder, f.name)),
                    f.metadata.get("help", ""),
                    tuple(map(str, choices)) if choices else None,
                )
            )
    return docs


def _positive(section: Any, *names: str) -> None:
    prefix = _section_name(section)
    for name in names:
        value = getattr(section, name)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(
                f"{prefix}.{name} must be a positive integer, got {value!r} "
                f"(e.g. --{prefix}.{name} {getattr(type(section)(), name)})"
            )


def _section_name(section: Any) -> str:
    for name, cls in {**BASE_SECTIONS, **option_sections()}.items():
        if isinstance(section, cls):
            return name
    return type(section).__name__
