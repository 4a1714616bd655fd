"""A user's own model factory and dataset, resolved from the command line."""

from __future__ import annotations

import pytest

from hvd_lowcomm import config
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.models import build_model


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


@pytest.mark.parametrize(
    "name, message",
    [
        ("no_such_module:build", "cannot be loaded: No module named 'no_such_module'"),
        ("user_code:missing", "cannot be loaded.*has no attribute 'missing'"),
        ("user_code:load", "load\\(input_shape=\\(3, 4\\), num_classes=7\\) failed"),
    ],
)
def test_a_factory_that_cannot_be_used_gets_a_clear_error(name, message):
    with pytest.raises(ConfigError, match=message):
        build_model(config.load(["--model.name", name]).model, (3, 4), 7)


def test_kwargs_for_a_zoo_model_are_refused():
    with pytest.raises(ConfigError, match="model.kwargs is for a 'module:factory' model"):
        build_model(config.load(["--model.kwargs", "{width: 3}"]).model, (3, 4), 7)
