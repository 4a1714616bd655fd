"""Muon with AdamW through every method: the command line's --train.optimizer muon, and the
library's wrappers given the user's own (Muon, AdamW) pair."""

from __future__ import annotations

import copy
import os
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_lowcomm as hl
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.optimizers import muon_parameters
from hvd_lowcomm.registry import method_names
from conftest import SIZE, clean_env, trainer_runs


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def pair(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    matrices, rest = muon_parameters(model)
    return (
        torch.optim.Muon(matrices, lr=0.02, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(rest, lr=0.02),
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4 * SIZE, 12, generator=g), torch.randint(0, 4, (4 * SIZE,), generator=g)


def test_ddp_with_the_users_muon_pair_steps_as_one_process_on_the_pooled_batch(world):
    model, alone = mlp(), mlp()
    opt = hl.DistributedOptimizer(pair(model), named_parameters=model.named_parameters())
    muon, adamw = pair(alone)
    for step in range(3):
        x, y = batch(step)
        mine = slice(4 * runtime.rank(), 4 * (runtime.rank() + 1))
        opt.zero_grad()
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
        muon.zero_grad(), adamw.zero_grad()
        F.cross_entropy(alone(x), y).backward()  # the pooled batch's mean, in one process
        muon.step(), adamw.step()
    for a, b in zip(model.parameters(), alone.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(SIZE < 2, reason="DiLoCo needs two groups")
def test_diloco_with_a_muon_inner_optimiser_ends_every_group_on_one_model(world):
    model = mlp()
    diloco = hl.DiLoCo(model, pair(model), total_steps=4, sync_every=2, groups=2)
    for step in range(4):
        x, y = batch(step)
        mine = slice(4 * runtime.rank(), 4 * (runtime.rank() + 1))
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        diloco.optimizer.step()
        diloco.optimizer.zero_grad()
    final = copy.deepcopy(diloco.full_model())  # refuses a model that differs between groups
    moved = sum(float((a - b).norm()) for a, b in zip(final.parameters(), mlp().parameters()))
    assert moved > 0  # the inner steps and outer steps changed the model
    diloco.close()


@pytest.mark.skipif(
    SIZE != 2 or os.environ.get("HVD_LOWCOMM_ENGINE") == "torch",
    reason="one job of its own at 2 ranks, on the torch engine whichever suite launches it",
)
def test_every_method_trains_with_muon_from_the_command_line(tmp_path):
    methods = method_names()
    common = ["--train.optimizer", "muon", "--train.max_steps", "4", "--train.epochs", "1", "--run.progress", "false"]
    files = ["--run.dir", str(tmp_path / "runs"), "--data.path", str(tmp_path / "digits.h5")]
    argvs = [["--method", m, *common, *files, "--run.name", m] for m in methods]
    # one job, so one engine: torch's, on which every method runs (fsdp's FSDP2 needs it)
    done = trainer_runs(tmp_path, 2, argvs, env={**clean_env(), "HVD_LOWCOMM_ENGINE": "torch"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    for method in methods:
        summary = json.loads((tmp_path / "runs" / method / "summary.json").read_text())
        assert math.isfinite(summary["final_test_loss"]), method
        assert summary["optimizer"].startswith("Muon ("), (method, summary.get("optimizer"))
