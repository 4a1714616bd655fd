"""The compatibility matrix: methods refuse the options they cannot honour, before training."""

from __future__ import annotations

import pytest

from hvd_lowcomm import config
from hvd_lowcomm.config import ConfigError


@pytest.mark.parametrize("name", ["powersgd", "dad", "rank-dad", "ab", "sil", "mp"])
def test_comm_compression_is_refused_by_methods_that_would_ignore_it(name):
    with pytest.raises(ConfigError, match=f"comm.compression fp16 is for ddp's allreduce; {name} sends"):
        config.load(["--method", name, "--comm.compression", "fp16"])
    assert config.load(["--method", "ddp", "--comm.compression", "fp16"]).comm.compression == "fp16"
