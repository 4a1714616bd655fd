"""Configuration: precedence, validation messages naming the option, --help."""

from __future__ import annotations

import pytest

from hvd_lowcomm import config
from hvd_lowcomm.config import ConfigError


def test_defaults_are_valid_and_train_ddp_on_digits():
    cfg = config.load([])
    assert cfg.method == "ddp"
    assert cfg.data.path == "data/digits.h5"
    assert cfg.model.name == "mlp"


def test_yaml_then_command_line_precedence(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  epochs: 3\n  lr: 0.01\nmodel:\n  hidden: [32, 16]\ncomm:\n  compression: fp16\n")
    cfg = config.load(["--config", str(path), "--train.epochs", "5", "--model.hidden", "8,4"])
    assert cfg.train.epochs == 5  # command line beats YAML
    assert cfg.train.lr == 0.01  # YAML beats default
    assert cfg.model.hidden == [8, 4]  # lists parse from "8,4"
    assert cfg.comm.compression == "fp16"
    assert cfg.data.batch_size == 32  # untouched default


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--train.epochs", "0"], "train.epochs must be a positive integer, got 0"),
        (["--data.batch_size", "-4"], "data.batch_size must be a positive integer, got -4"),
        (["--train.lr", "0"], "train.lr must be positive"),
        (["--comm.compression", "fp8"], "comm.compression must be one of none, fp16; got 'fp8'"),
        (["--train.optimizer", "lamb"], "train.optimizer must be one of sgd, adam, adamw"),
        (["--model.hidden", "64,-1"], "model.hidden must be positive widths"),
    ],
)
def test_bad_values_are_rejected_with_the_option_named(argv, expected):
    with pytest.raises(ConfigError) as err:
        config.load(argv)
    assert expected in str(err.value)


def test_badly_typed_command_line_values_name_the_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        config.load(["--train.epochs", "two"])
    assert exit_info.value.code == 2
    assert "argument --train.epochs: train.epochs expects INT, got 'two'" in capsys.readouterr().err


def test_badly_typed_yaml_values_name_the_option(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  batch_size: 2.5\n")
    with pytest.raises(ConfigError, match=r"data.batch_size expects INT, got 2.5"):
        config.load(["--config", str(path)])


def test_unknown_yaml_keys_and_methods_are_rejected_with_suggestions(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  epoch: 3\n")
    with pytest.raises(ConfigError, match=r"unknown option train.epoch \(did you mean 'epochs'\?\)"):
        config.load(["--config", str(path)])
    path.write_text("trian:\n  epochs: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config section 'trian' \(did you mean 'train'\?\)"):
        config.load(["--config", str(path)])
    path.write_text("method: dpp\n")
    with pytest.raises(ConfigError, match=r"unknown method 'dpp' \(did you mean 'ddp'\?\)"):
        config.load(["--config", str(path)])
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(["--config", str(tmp_path / "missing.yaml")])


def test_unknown_command_line_options_are_one_line_with_the_nearest_name():
    with pytest.raises(
        ConfigError,
        match=r"^unknown option --train.epochz \(did you mean '--train.epochs'\?\); "
        r"`python -m hvd_lowcomm.train --help` lists every option$",
    ):
        config.load(["--train.epochz", "3"])
    with pytest.raises(ConfigError, match=r"^unexpected argument\(s\) extra: every option is --section.key VALUE"):
        config.load(["--train.epochs", "3", "extra"])


def test_help_lists_every_option_with_its_default():
    cfg = config.default_config()
    text = config.build_parser(cfg, "prog").format_help()
    for name, section in cfg.sections().items():
        for key, value in config.dataclasses.asdict(section).items():
            assert f"--{name}.{key}" in text, f"--{name}.{key} missing from --help"
    flat = " ".join(text.split())  # argparse wraps help text at the terminal width
    assert "(default: 20)" in flat and "(default: data/digits.h5)" in flat
