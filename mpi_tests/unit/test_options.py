"""The option surface is fenced: every --section.key option is listed in options.txt, so one is
added or renamed only on purpose, and a renamed one keeps working (config.RENAMED) for a release."""

from __future__ import annotations

from pathlib import Path

import pytest

from hvd_lowcomm import config

LISTED = Path(__file__).with_name("options.txt")


def test_every_option_is_listed_and_every_listed_option_exists():
    names = {o.name for o in config.describe_options()}
    listed = set(LISTED.read_text().split())
    assert names == listed, (
        f"options added: {sorted(names - listed)}, gone: {sorted(listed - names)}. An option is part of the "
        f"product: update {LISTED.name} on purpose, and give a renamed one its old name in config.RENAMED"
    )


def test_a_renamed_option_works_under_its_old_name_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setitem(config.RENAMED, "train.learning_rate", "train.lr")
    with pytest.warns(FutureWarning, match="train.learning_rate is now train.lr"):
        assert config.load(["--train.learning_rate=0.25"]).train.lr == 0.25
    run = tmp_path / "run.yaml"
    run.write_text("train:\n  learning_rate: 0.5\n  epochs: 3\n")
    with pytest.warns(FutureWarning):
        cfg = config.load(["--config", str(run)])
    assert (cfg.train.lr, cfg.train.epochs) == (0.5, 3)


def test_every_renamed_option_names_an_option_that_exists():
    names = {o.name for o in config.describe_options()}
    assert all(new in names and old not in names for old, new in config.RENAMED.items()), config.RENAMED
