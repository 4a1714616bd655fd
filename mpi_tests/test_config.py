"""Configuration: precedence, validation messages, --help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import RANK, clean_env


@pytest.mark.skipif(RANK != 0, reason="one subprocess is enough")
def test_train_command_rejects_bad_config_before_starting():
    proc = subprocess.run(
        [sys.executable, "-m", "hvd_lowcomm.train", "--train.epochs", "0"],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
    )
    assert proc.returncode == 2
    assert "error: train.epochs must be a positive integer, got 0" in proc.stderr
    assert "epoch " not in proc.stdout  # nothing trained
