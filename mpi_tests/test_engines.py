"""The two engines under the traffic meter: the same seeded job on Horovod and on
torch.distributed gives the same models and the meter the same bytes, method by method."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import RANK, SIZE, clean_env, mpirun, trainer_runs
from hvd_lowcomm.registry import method_names

JOB = textwrap.dedent("""
    import json, sys
    import torch, torch.nn as nn, torch.nn.functional as F
    import hvd_lowcomm as hl
    from hvd_lowcomm.comm import runtime
    from hvd_lowcomm.methods.powersgd import PowerSGDState
    dtype, reduce_dtype = sys.argv[2].split("/")  # the parameters' dtype, what bfloat16 travels in
    hl.init(engine=sys.argv[1], reduce_dtype=reduce_dtype)
    rank, size = hl.rank(), hl.size()
    report = {"engine": runtime.engine().name}
    for name in sys.argv[3:]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
        model.to(getattr(torch, dtype))
        initial = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).tolist()
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        named, owner = model.named_parameters(), None
        if name in ("ddp", "ddp-fp16"):
            opt = hl.DistributedOptimizer(opt, named, compression="fp16" if name == "ddp-fp16" else "none")
        elif name == "powersgd":
            opt = hl.PowerSGDOptimizer(opt, named, state=PowerSGDState(start_iter=2, min_compression_rate=0.5))
        elif name == "dad":
            opt = hl.DadOptimizer(opt, named, model=model, plan="all")
        elif name == "rank-dad":  # (as PowerSGD: its exact start, then its factors)
            opt = hl.DadOptimizer(opt, named, model=model, mode="rank", plan="all", start_iter=2)
        elif name == "diloco":
            owner = hl.DiLoCo(model, opt, total_steps=6, groups=2, sync_every=2)
        elif name == "diloco-int8-delayed":  # the column exchange on the worker thread
            owner = hl.DiLoCo(model, opt, total_steps=6, groups=2, sync_every=2, compression="int8", sync_delay=1)
        elif name == "ab":
            owner = hl.ABTraining(model, opt, total_steps=6, groups=2, sync_mode="only-b", warmup=2, sync_every=2,
                                  full_rank_steps=1)
        hl.meter.reset()
        g = torch.Generator().manual_seed(9)
        for _ in range(6):
            x = torch.randn(size, 8, 6, generator=g)[rank].to(getattr(torch, dtype))
            y = torch.randint(0, 3, (size, 8), generator=g)[rank]
            if name == "ab":
                with owner.step(x, y):
                    opt.zero_grad()
                    F.cross_entropy(model(x).float(), y).backward()
                continue
            opt.zero_grad()
            F.cross_entropy(model(x).float(), y).backward()
            (opt if owner is None else owner).step()  # DiLoCo steps the optimiser itself
        final = owner.full_model() if owner is not None else model
        report[name] = {"initial": initial,
                        "parameters": torch.cat([p.detach().float().reshape(-1) for p in final.parameters()]).tolist(),
                        "bytes": {f"{phase}/{op}/{group}": [t.payload_bytes, t.wire_bytes]
                                  for (phase, op, group), t in sorted(hl.meter.by_kind.items())}}
    if rank == 0:
        print("REPORT " + json.dumps(report), flush=True)
""")
# The library's forms that run on both engines (fsdp is torch's alone: the command-line test
# below runs it), and one DiLoCo compressor whose exchange overlaps the next steps.
METHODS = ["ddp", "ddp-fp16", "powersgd", "dad", "rank-dad", "diloco", "diloco-int8-delayed", "ab"]


def without_horovod(tmp_path) -> dict[str, str]:
    """An environment in which `import horovod` fails, as on a site where it is not installed."""
    blocker = tmp_path / "no-horovod" / "horovod"
    blocker.mkdir(parents=True, exist_ok=True)
    (blocker / "__init__.py").write_text("raise ImportError('horovod is not installed here')\n")
    env = {k: v for k, v in clean_env().items() if k != "HVD_LOWCOMM_ENGINE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(blocker.parent), env.get("PYTHONPATH")]))
    return env


def run_job(
    tmp_path, engine: str, env: dict[str, str] | None = None, dtypes: str = "float32/float32", ranks: int = 2
) -> dict:
    """The job's report; `dtypes`: the parameters' dtype / what bfloat16 travels in."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = env or {k: v for k, v in clean_env().items() if k != "HVD_LOWCOMM_ENGINE"}
    done = subprocess.run(
        mpirun(ranks, "-x", "PYTHONPATH", sys.executable, str(script), engine, dtypes, *METHODS),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("REPORT "))
    return json.loads(line[len("REPORT ") :])


@pytest.mark.skipif(SIZE > 1, reason="launches jobs of its own")
def test_every_method_trains_alike_on_both_engines_and_the_meter_counts_the_same_bytes(tmp_path):
    import torch

    # the torch engine's job on a site without Horovod: the library needs none there
    horovod, torch_engine = run_job(tmp_path, "horovod"), run_job(tmp_path, "auto", without_horovod(tmp_path))
    assert (horovod["engine"], torch_engine["engine"]) == ("horovod", "torch")
    for name in METHODS:
        assert horovod[name]["bytes"] == torch_engine[name]["bytes"], name
        a, b = (torch.tensor(report[name]["parameters"]) for report in (horovod, torch_engine))
        # Sums of two ranks' numbers are the same whichever library adds them; what may differ
        # is float32 rounding in the order of fused buffers.
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(SIZE > 1, reason="launches jobs of its own")
def test_bfloat16_on_the_wire_halves_the_bytes_and_trains_as_float32_sums_do(tmp_path):
    import torch

    # at 4 ranks (2 groups of 2 for AB and DiLoCo), where a bfloat16 sum rounds its partial sums
    as_float32, as_bfloat16 = (
        run_job(tmp_path, "torch", dtypes=f"bfloat16/{wire}", ranks=4) for wire in ("float32", "bfloat16")
    )
    for name in METHODS:
        a, b = as_float32[name], as_bfloat16[name]
        final, initial = torch.tensor(a["parameters"]), torch.tensor(a["initial"])
        # bfloat16 sums round each partial sum, where float32 sums round only the result
        off, moved = float((torch.tensor(b["parameters"]) - final).norm()), float((final - initial).norm())
        assert off <= 0.1 * moved, f"{name}: {off:.3g} from the float32 sums' run, which moved by {moved:.3g}"
        if name == "ddp":  # every gradient, 2 bytes a number instead of 4
            assert 2 * b["bytes"]["train/allreduce/world"][0] == a["bytes"]["train/allreduce/world"][0]


@pytest.mark.skipif(SIZE > 1, reason="launches jobs of its own")
def test_without_horovod_every_method_trains_from_the_command_line(tmp_path):
    methods = method_names()  # every registered method, fsdp on the torch engine Horovod's absence picks
    common = ["--train.max_steps", "4", "--train.epochs", "1", "--run.progress", "false"]
    files = ["--run.dir", str(tmp_path / "runs"), "--data.path", str(tmp_path / "digits.h5")]
    argvs = [["--method", method, *common, *files, "--run.name", method] for method in methods]
    done = trainer_runs(tmp_path, 2, argvs, env=without_horovod(tmp_path))  # one job, every method in turn
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "engine torch (auto: Horovod is not installed)" in output, output[-5000:]
    for method in methods:
        assert (tmp_path / "runs" / method / "summary.json").is_file(), method


def test_the_engine_and_reduce_dtype_are_said_and_cannot_change_after_init(world):
    import torch

    from hvd_lowcomm.comm import runtime
    from hvd_lowcomm.config import ConfigError

    other = "torch" if runtime.engine().name == "horovod" else "horovod"
    assert runtime.engine_line().startswith(runtime.engine().name)
    with pytest.raises(ConfigError, match="chosen once per job"):
        runtime.init(engine=other)
    assert runtime.bf16_wire_dtype() == torch.float32  # the suites start with the default
    with pytest.raises(ConfigError, match="reduce_dtype is chosen once per job"):
        runtime.init(reduce_dtype="bfloat16")
    assert runtime.init() is runtime.init(reduce_dtype="float32") is world  # a later init() takes what is set
    if os.environ.get("HVD_LOWCOMM_ENGINE") in ("horovod", "torch"):  # the suites' way to pick one
        assert runtime.engine().name == os.environ["HVD_LOWCOMM_ENGINE"]


def test_the_rendezvous_agrees_on_an_address_every_rank_reaches_and_binds_gloo_to_its_route(world, monkeypatch):
    from mpi4py import MPI

    from hvd_lowcomm.comm import rendezvous
    from hvd_lowcomm.config import ConfigError

    for name in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.setenv(name, "")  # (recorded, so that what agree sets is undone after the test)
        monkeypatch.delenv(name)
    assert rendezvous.agree(MPI.COMM_WORLD, one_node=True, beside_root=True) == "127.0.0.1"  # nothing leaves the node
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    if not any(not a.startswith("127.") for a in MPI.COMM_WORLD.allgather(list(rendezvous.interfaces().values()))[0]):
        pytest.skip("rank 0 has no address beside the loopback")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    # as on several nodes, these ranks on rank 0's
    address = rendezvous.agree(MPI.COMM_WORLD, one_node=False, beside_root=True)
    assert set(MPI.COMM_WORLD.allgather(address)) == {address} and not address.startswith("127.")
    interface = os.environ["GLOO_SOCKET_IFNAME"]
    assert rendezvous.interfaces()[interface] == rendezvous.route_source(address)
    assert os.environ["NCCL_SOCKET_IFNAME"] == interface
    monkeypatch.setenv("MASTER_ADDR", address)  # the user's choice stands
    assert rendezvous.agree(MPI.COMM_WORLD, one_node=False, beside_root=True) == address
    if SIZE > 1:  # a rank said to be on another node that holds rank 0's address reaches itself there, not rank 0
        monkeypatch.delenv("MASTER_ADDR")
        with pytest.raises(ConfigError, match="no address of rank 0"):
            rendezvous.agree(MPI.COMM_WORLD, one_node=False, beside_root=RANK == 0)
