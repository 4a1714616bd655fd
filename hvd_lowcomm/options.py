"""The option machinery under every configuration section: dataclass fields with their help
(`option`, `subsection`), dotted names (`train.lr`, `diloco.sparse.density`), setting them from
text or YAML with type conversion, checks of allowed values, renamed options, and the errors that
say what is wrong and how to fix it.

hvd_lowcomm.config builds the run's sections and the command line on this; a method's options
dataclass (hvd_lowcomm.methods) is made of `option` fields, checked by `make_options` when a
library user passes keywords.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import importlib
import typing
import warnings
from dataclasses import field
from typing import Any, Iterator

import yaml


class ConfigError(ValueError):
    """A configuration value is wrong; the message says which and how to fix it."""


def option(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A config field with its --help text (and allowed values, checked by `validate`)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, "choices": choices})
    return field(default=default, metadata={"help": help, "choices": choices})


def subsection(cls: type, help: str) -> Any:
    """A section's options that one form of its method reads, grouped under the field's name
    (`--diloco.sparse.density`; in YAML a mapping, `diloco: {sparse: {density: 0.1}}`)."""
    return field(default_factory=cls, metadata={"help": help, "subsection": True})


def is_subsection(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("subsection"))


def leaves(section: Any, prefix: str) -> Iterator[tuple[str, Any, dataclasses.Field]]:
    """Every option of `section` (its sub-sections' included) as (dotted name, the dataclass
    instance holding it, its field)."""
    for f in dataclasses.fields(section):
        if is_subsection(f):
            yield from leaves(getattr(section, f.name), f"{prefix}.{f.name}")
        else:
            yield f"{prefix}.{f.name}", section, f


def option_holder(section: Any, path: list[str], name: str) -> tuple[Any, dataclasses.Field]:
    """The dataclass instance under `section` that holds the option at `path` (its keys after the
    section's name), and its field; ConfigError naming the nearest option if there is none."""
    for depth, key in enumerate(path):
        fields = {f.name: f for f in dataclasses.fields(section)}
        if key not in fields:
            known = [n.split(".", 1)[1] for n, _, _ in leaves(section, "_")]
            where = ".".join([name.split(".")[0], *path[:depth]])
            raise ConfigError(f"unknown option {where}.{'.'.join(path[depth:])}{did_you_mean(key, known)}")
        if depth == len(path) - 1:
            return section, fields[key]
        if not is_subsection(fields[key]):
            raise ConfigError(f"{name}: {'.'.join(path[: depth + 1])} holds no options of its own")
        section = getattr(section, key)
    raise ConfigError(f"{name} names a section, not an option")


def set_option(sections: dict[str, Any], dotted: str, value: Any, convert: bool = False) -> None:
    """Set option 'section.key' (or 'section.form.key') to `value`, converted from text or YAML
    to the field's type when `convert`."""
    section, *path = dotted.split(".")
    holder, f = option_holder(sections[section], path, dotted)
    setattr(holder, f.name, convert_value(dotted, field_type(holder, f.name), value) if convert else value)


def make_options(cls: type, prefix: str, options: Any = None, **kwargs: Any) -> Any:
    """The options a library user asked for: `options` (an instance of `cls`, default: the
    defaults) with any keyword arguments set on a copy of it, checked the same way whichever
    door they came through (choices and `validate()`), with a clear error for a misspelt
    name; `prefix` names the options in messages ('ab', 'powersgd'). A sub-section's keyword
    takes a mapping of its options (`sparse={"density": 0.1}`); a renamed option's old keyword
    still works for a release (RENAMED)."""
    if options is not None and not isinstance(options, cls):
        raise ConfigError(f"{prefix}: options= must be a {cls.__name__}, got {type(options).__name__}")
    options = copy.deepcopy(options) if options is not None else cls()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in kwargs if k not in fields and f"{prefix}.{k}" not in RENAMED)
    if unknown:
        known = sorted(n.split(".", 1)[1] for n, _, _ in leaves(options, prefix))
        raise ConfigError(f"unknown {prefix} option(s) {', '.join(unknown)}; known: {', '.join(known)}")
    for key, value in kwargs.items():
        if key in fields and is_subsection(fields[key]) and isinstance(value, dict):
            for inner, inner_value in value.items():
                set_option({prefix: options}, f"{prefix}.{key}.{inner}", inner_value)
        else:
            set_option({prefix: options}, renamed(f"{prefix}.{key}") if key not in fields else f"{prefix}.{key}", value)
    check_choices(prefix, options)
    if hasattr(options, "validate"):
        options.validate()
    return options


# Old option names -> their new names: each keeps working for one release, with a one-line
# deprecation message; every other change to the option list fails mpi_tests/unit/test_options.py.
RENAMED: dict[str, str] = {
    "ab.rank_rule": "ab.cut.rank_rule",
    "ab.tau": "ab.cut.tau",
    "ab.max_output_error": "ab.cut.max_output_error",
    "ab.min_rank_share": "ab.cut.min_rank_share",
    "ab.max_loss_rise": "ab.cut.max_loss_rise",
    "ab.max_accuracy_drop": "ab.cut.max_accuracy_drop",
    "diloco.density": "diloco.sparse.density",
    "diloco.owner_density": "diloco.sparse.owner_density",
    "diloco.keep_unsent": "diloco.sparse.keep_unsent",
    "diloco.unsent_share": "diloco.sparse.unsent_share",
    "diloco.error_decay": "diloco.sparse.error_decay",
    "diloco.rank": "diloco.lowrank.rank",
    "diloco.factor_bits": "diloco.lowrank.factor_bits",
    "diloco.factor_share": "diloco.lowrank.factor_share",
}


def renamed(name: str) -> str:
    if name not in RENAMED:
        return name
    warnings.warn(
        f"option {name} is now {RENAMED[name]}: the old name goes in the next release", FutureWarning, stacklevel=3
    )
    return RENAMED[name]


def renamed_arguments(argv: list[str]) -> list[str]:
    """`argv` with every renamed --option (also --option=value) under its new name."""
    out = []
    for arg in argv:
        flag, equals, value = arg.partition("=")
        if flag.startswith("--") and flag[2:] in RENAMED:
            arg = f"--{renamed(flag[2:])}{equals}{value}"
        out.append(arg)
    return out


def import_object(spec: str, option: str) -> Any:
    """What a 'module:name' option names (a user's model factory or data loader), imported
    from where the job started; ConfigError saying which option and why otherwise."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ConfigError(f"{option} must be 'module:name' (e.g. mypkg.data:load), got {spec!r}")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            f"{option} {spec!r} cannot be loaded: {err} (is {module_name} importable from where "
            f"mpirun starts, e.g. on PYTHONPATH?)"
        ) from None


def check_choices(name: str, section: Any) -> None:
    for dotted, holder, f in leaves(section, name):
        choices = f.metadata.get("choices")
        value = getattr(holder, f.name)
        if choices and value not in choices:
            raise ConfigError(f"{dotted} must be one of {', '.join(map(str, choices))}; got {value!r}")


def field_type(section: Any, key: str) -> Any:
    return typing.get_type_hints(type(section))[key]


def convert_value(name: str, ftype: Any, value: Any) -> Any:
    """Convert a YAML value or command-line string to the field's declared type."""
    try:
        if ftype is dict:
            value = yaml.safe_load(value) if isinstance(value, str) else value
            if value is None:
                return {}
            if not isinstance(value, dict):
                raise ValueError(value)
            return dict(value)
        if typing.get_origin(ftype) is list:
            (item_type,) = typing.get_args(ftype)
            if isinstance(value, str):
                value = [v for v in value.replace(" ", "").split(",") if v]
            elif not isinstance(value, (list, tuple)):
                value = [value]
            return [item_type(v) for v in value]
        if ftype is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if ftype is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        if ftype is int and isinstance(value, str):
            return int(value, 0)
        return ftype(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} expects {metavar(ftype)}, got {value!r}") from None


def convert_argument(name: str, ftype: Any, text: str) -> Any:
    """convert_value for argparse, which reports ArgumentTypeError messages verbatim."""
    try:
        return convert_value(name, ftype, text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def metavar(ftype: Any) -> str:
    if typing.get_origin(ftype) is list:
        return f"{typing.get_args(ftype)[0].__name__.upper()}[,...]"
    return {bool: "BOOL", int: "INT", float: "FLOAT", str: "STR", dict: "YAML"}.get(ftype, "VALUE")


def show(value: Any) -> str:
    if isinstance(value, dict):
        return yaml.safe_dump(value, default_flow_style=True).strip() if value else "none"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "empty"
    return repr(value) if value == "" else str(value)


def first_line(doc: str | None) -> str | None:
    return doc.strip().splitlines()[0] if doc else None


def unknown_arguments(unknown: list[str], options: list[str], prog: str) -> str:
    option = next((word.split("=", 1)[0] for word in unknown if word.startswith("-")), None)
    if option is None:
        return f"unexpected argument(s) {' '.join(unknown)}: every option is --section.key VALUE (`{prog} --help`)"
    return f"unknown option {option}{did_you_mean(option, options)}; `{prog} --help` lists every option"


def did_you_mean(word: str, candidates: Any) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
