"""A user's own model factory and dataset, from the command line."""

from __future__ import annotations

import json

import pytest

from conftest import RANK
from hvd_lowcomm.train import main


@pytest.mark.parametrize("method", ["ddp", "powersgd"])
def test_a_user_model_trains_on_a_user_dataset_from_the_cli(shared_tmp, method):
    argv = [
        "--method",
        method,
        "--model.name",
        "user_code:build",
        "--model.kwargs",
        "{width: 32}",
        "--data.source",
        "user_code:load",
        "--train.epochs",
        "4",
        "--train.lr",
        "0.01",
        "--run.dir",
        str(shared_tmp / "runs"),
        "--run.name",
        "own",
        "--run.progress",
        "false",
    ]
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
