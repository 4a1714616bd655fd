"""Which engine runs: comm.engine and comm.reduce_dtype, decided before MPI starts."""

from __future__ import annotations

import pytest

from hvd_lowcomm import config
from hvd_lowcomm.comm import engines
from hvd_lowcomm.config import ConfigError


def test_bfloat16_on_the_wire_picks_the_torch_engine_and_is_refused_on_horovod():
    assert engines.choose("auto", "bfloat16") == ("torch", "auto: bfloat16 on the wire, which Horovod refuses")
    assert engines.choose("torch", "bfloat16") == ("torch", "as requested")
    with pytest.raises(ConfigError, match="needs the torch engine"):
        engines.choose("horovod", "bfloat16")
    with pytest.raises(ConfigError, match="reduce_dtype must be one of float32, bfloat16"):
        engines.choose("auto", "float16")


def test_the_command_line_refuses_bfloat16_on_horovod_before_training():
    with pytest.raises(ConfigError, match="use --comm.engine torch, or --comm.reduce_dtype float32"):
        config.load(["--comm.engine", "horovod", "--comm.reduce_dtype", "bfloat16"])
    assert config.load(["--comm.reduce_dtype", "bfloat16"]).comm.reduce_dtype == "bfloat16"
