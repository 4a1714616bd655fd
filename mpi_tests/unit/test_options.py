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


def test_a_form_s_options_nest_under_it_on_the_command_line_in_yaml_and_as_keywords(tmp_path):
    cfg = config.load(["--method", "diloco", "--diloco.sparse.density", "0.3", "--diloco.lowrank.factor_bits", "8"])
    assert (cfg.options.sparse.density, cfg.options.lowrank.factor_bits) == (0.3, 8)
    run = tmp_path / "run.yaml"
    run.write_text(
        "method: diloco\ndiloco:\n  compression: sparse\n  sparse:\n    density: 0.2\n    keep_unsent: false\n"
    )
    cfg = config.load(["--config", str(run)])
    assert (cfg.options.compression, cfg.options.sparse.density, cfg.options.sparse.keep_unsent) == (
        "sparse",
        0.2,
        False,
    )
    from hvd_lowcomm.methods.diloco import DiLoCoOptions

    given = DiLoCoOptions()
    options = config.make_options(DiLoCoOptions, "diloco", given, sparse={"density": 0.4})
    assert options.sparse.density == 0.4 and given.sparse.density == DiLoCoOptions().sparse.density  # a copy
    with pytest.warns(FutureWarning, match="diloco.density is now diloco.sparse.density"):
        assert config.make_options(DiLoCoOptions, "diloco", density=0.05).sparse.density == 0.05


def test_a_misspelt_nested_option_or_a_value_for_a_form_is_refused_with_the_nearest_name(tmp_path):
    with pytest.raises(config.ConfigError, match="unknown option diloco.sparse.densty .*'density'"):
        config.apply_mapping(config.default_config(), {"diloco": {"sparse": {"densty": 0.1}}})
    with pytest.raises(config.ConfigError, match="diloco.sparse holds options: give it a mapping"):
        config.apply_mapping(config.default_config(), {"diloco": {"sparse": 0.1}})
    with pytest.raises(config.ConfigError, match="diloco.sparse.density must be in"):
        config.load(["--method", "diloco", "--diloco.sparse.density", "0"])
