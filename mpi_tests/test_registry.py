"""A method is one module: registering it brings its options to YAML, the CLI and --help,
and its rank-layout check runs on every rank before training."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from conftest import RANK, SIZE
from hvd_lowcomm import config, registry
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.config import option
from hvd_lowcomm.methods.ddp import DataParallel
from hvd_lowcomm.train import main


@dataclass
class GroupedOptions:
    """Options of a method that trains in groups."""

    groups: int = option(3, "independent groups of ranks")


@pytest.fixture
def grouped_method():
    @registry.register("grouped-test", options=GroupedOptions)
    class Grouped(DataParallel):
        @classmethod
        def check_world(cls, cfg, world_size: int) -> None:
            runtime.group_layout(world_size, num_groups=cfg.options.groups)

    yield Grouped
    registry.unregister("grouped-test")


@pytest.mark.skipif(SIZE % 3 == 0, reason="needs a world size that 3 groups do not divide")
def test_a_group_count_that_does_not_divide_the_world_stops_before_training(grouped_method, shared_tmp, capsys):
    code = main(
        [
            "--method",
            "grouped-test",
            "--grouped-test.groups",
            "3",
            "--data.path",
            str(shared_tmp / "digits.h5"),
            "--run.dir",
            str(shared_tmp / "runs"),
        ]
    )
    assert code == 2
    if RANK == 0:
        assert (
            f"error (all ranks): cannot split {SIZE} ranks into 3 equal groups: use a group count that divides {SIZE}"
        ) in capsys.readouterr().err
    assert not (shared_tmp / "runs").exists()


def test_a_registered_method_gets_a_config_section_and_cli_options(grouped_method, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("method: grouped-test\ngrouped-test:\n  groups: 5\n")
    cfg = config.load(["--config", str(path)])
    assert cfg.options.groups == 5 and isinstance(cfg.options, GroupedOptions)
    assert config.load(["--method", "grouped-test", "--grouped-test.groups", "2"]).options.groups == 2
    text = config.build_parser(config.default_config(), "prog").format_help()
    assert "--grouped-test.groups INT" in text and "independent groups of ranks (default: 3)" in text
