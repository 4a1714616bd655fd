"""Every method with its model on a device that is not the CPU: the second device of
second_device.py, which refuses to mix with CPU tensors or generators as a GPU does, and which
Horovod cannot read (so collectives stage it through host memory). Each run is compared with
the same run on the CPU: the device computes on the CPU, so both must agree to rounding."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_lowcomm as hl
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.traffic import meter
from hvd_lowcomm.registry import method_names
from conftest import RANK, SIZE
from second_device import DEVICE, register

register()


def mlp(depth: int = 3, width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    hidden = [layer for _ in range(depth - 2) for layer in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(nn.Flatten(), nn.Linear(12, width), nn.ReLU(), *hidden, nn.Linear(width, 4))


def batches(steps: int, device: torch.device):
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(runtime.size(), 8, 12, generator=g)[runtime.rank()]
        y = torch.randint(0, 4, (runtime.size(), 8), generator=g)[runtime.rank()]
        yield x.to(device), y.to(device)


def on_host(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().cpu() for p in model.parameters()]


def assert_same_run(device_params: list[torch.Tensor], cpu_params: list[torch.Tensor], half_sums: bool = False) -> None:
    """The same to float32 rounding; with float16 sums on the wire (`half_sums`) to theirs:
    from 3 ranks on, Horovod's fusion may add the ranks' parts in another order."""
    rtol, atol = (1e-3, 1e-4) if half_sums else (1e-5, 1e-6)
    for got, expected in zip(device_params, cpu_params):
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


def test_a_device_tensor_is_staged_through_host_memory_and_metered_once(world, fresh_meter):
    values = torch.full((5,), float(runtime.rank() + 1)).to(DEVICE)
    (summed,) = meter.allreduce_many([("staged", values)], op="sum")
    assert summed.device == DEVICE
    torch.testing.assert_close(summed.cpu(), torch.full((5,), float(sum(range(1, runtime.size() + 1)))))
    assert [r.name for r in fresh_meter.step_records] == ["staged"]
    assert fresh_meter.step_records[0].payload_bytes == 20


def test_a_dcp_checkpoint_of_host_tensors_saves_and_loads_while_a_device_is_available(tmp_path):
    """DCP writes through the available device's stream (here the second device's), as on a GPU
    machine: an fsdp checkpoint of CPU shards in the same process must still save."""
    import torch.distributed.checkpoint as dcp

    state = {"weight": torch.arange(6.0).view(2, 3), "step": torch.tensor(7)}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    loaded = {"weight": torch.zeros(2, 3), "step": torch.tensor(0)}
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert torch.equal(loaded["weight"], state["weight"]) and int(loaded["step"]) == 7


def test_the_second_device_refuses_what_a_gpu_refuses(world):
    on_device = torch.ones(3, 3).to(DEVICE)
    with pytest.raises(RuntimeError, match="same device"):
        on_device @ torch.ones(3, 3)
    with pytest.raises(RuntimeError, match="generator"):
        torch.randn(3, generator=torch.Generator(), device=DEVICE)


# -- the library, method by method --------------------------------------------------------------

WRAPPERS = {
    "ddp": lambda opt, model: hl.DistributedOptimizer(opt, model.named_parameters()),
    "ddp-fp16": lambda opt, model: hl.DistributedOptimizer(opt, model.named_parameters(), compression="fp16"),
    "powersgd": lambda opt, model: hl.PowerSGDOptimizer(
        opt, model.named_parameters(), state=hl.PowerSGDState(start_iter=1, min_compression_rate=1.0, adapt_every=2)
    ),
    "dad": lambda opt, model: hl.DadOptimizer(opt, model, plan="all"),
    "rank-dad": lambda opt, model: hl.DadOptimizer(opt, model, mode="rank", plan="all", start_iter=1),
    "edad": lambda opt, model: hl.DadOptimizer(opt, model, mode="edad"),
}


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_every_wrapper_trains_a_model_on_the_device_as_on_the_cpu(world, name):
    def run(device: torch.device) -> list[torch.Tensor]:
        model = mlp().to(device)
        opt = WRAPPERS[name](torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
        for x, y in batches(4, device):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        return on_host(model)

    assert_same_run(run(DEVICE), run(torch.device("cpu")), half_sums=name in ("ddp-fp16", "powersgd", "rank-dad"))


def test_ab_training_cuts_and_syncs_a_model_on_the_device_as_on_the_cpu(world):
    def run(device: torch.device) -> list[torch.Tensor]:
        model = mlp(width=160).to(device)  # wide enough that a re-cut takes the leading triplets alone
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ab = hl.ABTraining(
            model,
            opt,
            total_steps=18,
            groups=min(2, runtime.size()),
            sync_mode="only-b",
            warmup=2,
            sync_every=3,
            full_rank_steps=1,
            first_cut=0,
            cut={"min_rank_share": 0.02},
        )
        for x, y in batches(18, device):
            with ab.step(x, y):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
        assert ab.cuts, "a cut must have been taken"
        return on_host(ab.full_model())

    assert_same_run(run(DEVICE), run(torch.device("cpu")))


DILOCO_FORMS = {
    "fp32": {},
    "fp16": {"compression": "fp16"},
    "int8": {"compression": "int8"},
    "sparse": {"compression": "sparse"},
    "lowrank": {"compression": "lowrank"},
    "streaming, delayed": {"fragments": 2, "sync_delay": 1},
    "eager": {"eager": True},
}


@pytest.mark.parametrize("form", sorted(DILOCO_FORMS))
def test_diloco_in_every_form_trains_a_model_on_the_device_as_on_the_cpu(world, form):
    def run(device: torch.device) -> list[torch.Tensor]:
        model = mlp().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        diloco = hl.DiLoCo(
            model, opt, total_steps=12, groups=min(2, runtime.size()), sync_every=4, **DILOCO_FORMS[form]
        )
        for x, y in batches(12, device):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            diloco.step()
        return on_host(diloco.full_model())

    assert_same_run(run(DEVICE), run(torch.device("cpu")), half_sums=form != "fp32")


@pytest.mark.skipif(SIZE < 2, reason="SIL needs a rank per partition")
def test_sil_trains_its_partition_on_the_device_as_on_the_cpu(world):
    def run(device: torch.device) -> list[torch.Tensor]:
        sil = hl.SIL(mlp(depth=4), input_shape=(12,), num_classes=4, partitions=2)
        sil.module.to(device)
        opt = torch.optim.SGD(sil.module.parameters(), lr=0.1)
        for x, y in batches(4, device):
            sil.step(opt, x, y)
        return on_host(sil.module)

    assert_same_run(run(DEVICE), run(torch.device("cpu")))


# -- the command line ---------------------------------------------------------------------------

CLI_METHODS = method_names()  # every registered method: a new one is checked without an edit
NEEDS_TWO_RANKS = ("sil", "mp", "ab", "diloco")  # a rank per partition or group
NEEDS_TORCH_ENGINE = ("fsdp",)  # FSDP2 runs on torch.distributed's groups


@pytest.mark.parametrize("method", CLI_METHODS)
def test_the_command_line_trains_every_method_on_the_device_as_on_the_cpu(shared_tmp, method):
    from hvd_lowcomm.train import main

    if method in NEEDS_TWO_RANKS and SIZE < 2:
        pytest.skip("needs a rank per partition or group")
    if method in NEEDS_TORCH_ENGINE and runtime.engine().name != "torch":
        pytest.skip("shards with FSDP2: the torch engine's suite (make test-2-torch) runs it")

    def run(device: str) -> dict | None:
        argv = [
            "--method",
            method,
            "--train.device",
            device,
            "--train.epochs",
            "1",
            "--train.max_steps",
            "6",
            "--data.path",
            str(shared_tmp / "digits.h5"),
            "--run.dir",
            str(shared_tmp / device),
            "--run.name",
            method,
            "--run.progress",
            "false",
            *(["--rank-dad.start_iter", "2"] if method == "rank-dad" else []),  # its factors within the 6 steps
        ]
        assert main(argv) == 0
        if RANK != 0:
            return None
        return json.loads((shared_tmp / device / method / "summary.json").read_text())

    on_device, on_cpu = run(str(DEVICE.type)), run("cpu")
    if RANK == 0:
        assert on_device["final_test_loss"] == pytest.approx(on_cpu["final_test_loss"], rel=1e-3)  # (float16 sums)


@pytest.mark.skipif(SIZE > 1 or torch.cuda.is_available(), reason="checks the refusal on one rank without a GPU")
def test_the_gpu_check_says_there_is_no_gpu_and_fails(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from conftest import clean_env

    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    done = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and "no CUDA GPU here" in done.stderr, done.stdout + done.stderr
    assert "torch " in done.stdout  # what the machine has, first


@pytest.mark.skipif(SIZE > 1, reason="launches jobs of its own")
def test_the_gpu_check_dry_run_checks_the_torch_engine_first_and_names_it_in_every_row(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from conftest import clean_env

    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--device",
            "testdev",
            "--methods",
            "ddp,diloco",
            "--engines",
            "torch",
            "--out",
            str(tmp_path),
        ],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [(r["engine"], r["ranks"], r["method"]) for r in rows] == [
        ("torch", 1, "ddp"),
        ("torch", 2, "ddp"),
        ("torch", 2, "diloco"),
        ("torch", 2, "ddp resume"),
    ]
    assert all(r["ok"] for r in rows), rows
    assert "| torch | 2 | diloco |" in (tmp_path / "results.md").read_text()
