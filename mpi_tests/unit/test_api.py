"""The package root: exported names resolve, and library options come through one checked door."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hvd_lowcomm


def test_every_exported_name_resolves_to_the_implementation():
    from hvd_lowcomm.comm import runtime, traffic
    from hvd_lowcomm.methods import dad, ddp, powersgd

    assert hvd_lowcomm.init is runtime.init and hvd_lowcomm.meter is traffic.meter
    assert hvd_lowcomm.DistributedOptimizer is ddp.DistributedOptimizer
    assert hvd_lowcomm.PowerSGDOptimizer is powersgd.PowerSGDOptimizer
    assert hvd_lowcomm.DadOptimizer is dad.DadOptimizer
    with pytest.raises(AttributeError, match="no attribute 'ABTrainer'"):
        hvd_lowcomm.ABTrainer  # noqa: B018


def test_dir_of_the_package_lists_the_exported_api_for_tab_completion():
    listed = dir(hvd_lowcomm)
    assert set(hvd_lowcomm.__all__) <= set(listed) and listed == sorted(listed)
    assert {"local_rank", "local_size", "DiLoCo", "Compression"} <= set(listed)


def test_horovods_names_mean_what_the_wrappers_take():
    from hvd_lowcomm.methods.drop_in import compression_kind, op_kind

    assert compression_kind(hvd_lowcomm.Compression.fp16) == "fp16"
    assert compression_kind(hvd_lowcomm.Compression.none) == "none"
    names = (hvd_lowcomm.Average, hvd_lowcomm.Sum, hvd_lowcomm.Adasum)
    assert [op_kind(o) for o in names] == ["average", "sum", "adasum"]


def test_library_options_come_through_one_door_checked_the_same_way():
    from hvd_lowcomm.config import ConfigError
    from hvd_lowcomm.methods.ab import ABTraining
    from hvd_lowcomm.methods.diloco import DiLoCo, DiLoCoOptions
    from hvd_lowcomm.methods.powersgd import PowerSGDOptions, PowerSGDState

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        ConfigError, match="diloco.compression must be one of none, fp16, int8, int2, sparse, lowrank; got 'int4'"
    ):
        DiLoCo(model, opt, total_steps=10, options=DiLoCoOptions(compression="int4"))
    with pytest.raises(ConfigError, match="diloco.fragments must be >= 1"):
        DiLoCo(model, opt, total_steps=10, options=DiLoCoOptions(), fragments=0)
    with pytest.raises(ConfigError, match="diloco.sync_every = 0.05 is a fraction of the run.*pass total_steps"):
        DiLoCo(model, opt)  # the default H is 5 % of a run whose length it was not told
    with pytest.raises(ConfigError, match="ab.warmup = 0.1 is a fraction of the run"):
        ABTraining(model, opt)
    state = PowerSGDState(options=PowerSGDOptions(rank=3), start_iter=7)  # options= and a keyword merge
    assert (state.options.rank, state.options.start_iter) == (3, 7)
    with pytest.raises(ConfigError, match="unknown powersgd option"):
        PowerSGDState(options=PowerSGDOptions(), rnak=2)
