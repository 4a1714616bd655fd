"""A user's own model factory and dataset, from the command line."""
from __future__ import annotations

import json

import pytest

from conftest import RANK
from hvd_lowcomm import config
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.models import build_model
from hvd_lowcomm.train import main


def test_model_kwargs_are_a_yaml_mapping_from_the_command_line_or_the_file(tmp_path):
    assert config.load(["--model.name", "user_code:build", "--model.kwargs", "{width: 8}"]).model.kwargs == {"width": 8}
    (tmp_path / "run.yaml").write_text("model:\n  name: user_code:build\n  kwargs:\n    width: 4\n")
    assert config.load(["--config", str(tmp_path / "run.yaml")]).model.kwargs == {"width": 4}
    with pytest.raises(SystemExit):  # argparse reports the bad value and exits 2
        config.load(["--model.kwargs", "[1, 2]"])


def test_a_factory_model_is_built_with_the_data_shape_and_its_kwargs():
    cfg = config.load(["--model.name", "user_code:build", "--model.kwargs", "{width: 5}"]).model
    model = build_model(cfg, (3, 4), 7)
    assert type(model).__name__ == "TwoBranch" and model.head.in_features == 5 and model.head.out_features == 7
    assert model.left[0].in_features == 12


@pytest.mark.parametrize("name, message", [
    ("no_such_module:build", "cannot be loaded: No module named 'no_such_module'"),
    ("user_code:missing", "cannot be loaded.*has no attribute 'missing'"),
    ("user_code:load", "load\\(input_shape=\\(3, 4\\), num_classes=7\\) failed"),
])
def test_a_factory_that_cannot_be_used_gets_a_clear_error(name, message):
    with pytest.raises(ConfigError, match=message):
        build_model(config.load(["--model.name", name]).model, (3, 4), 7)


def test_kwargs_for_a_zoo_model_are_refused():
    with pytest.raises(ConfigError, match="model.kwargs is for a 'module:factory' model"):
        build_model(config.load(["--model.kwargs", "{width: 3}"]).model, (3, 4), 7)


@pytest.mark.parametrize("method", ["ddp", "powersgd"])
def test_a_user_model_trains_on_a_user_dataset_from_the_cli(shared_tmp, method):
    argv = ["--method", method, "--model.name", "user_code:build", "--model.kwargs", "{width: 32}",
            "--data.source", "user_code:load", "--train.epochs", "4", "--train.lr", "0.01",
            "--run.dir", str(shared_tmp / "runs"), "--run.name", "own", "--run.progress", "false"]
    assert main(argv) == 0
    if RANK == 0:
        summary = json.loads((shared_tmp / "runs" / "own" / "summary.json").read_text())
        assert summary["final_test_acc"] > 0.8, summary  # chance is 0.25
        assert summary["parameters"] == 2 * (12 * 32 + 32) + 32 * 4 + 4


def test_a_data_source_that_cannot_be_loaded_is_refused_before_training(shared_tmp, capsys):
    argv = ["--data.source", "user_code:nothing", "--run.dir", str(shared_tmp / "runs"), "--run.progress", "false"]
    assert main(argv) == 2
    if RANK == 0:
        assert "data.source 'user_code:nothing' cannot be loaded" in capsys.readouterr().err
