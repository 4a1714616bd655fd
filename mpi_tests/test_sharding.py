"""Sharding inside groups (hvd_lowcomm.comm.mesh): a user's loop that applies FSDP2's
fully_shard on hvd_lowcomm's mesh trains the zoo's GPT as ddp does, step for step, as plain FSDP
(np 2: one group of 2) and as HSDP (np 4: 2 groups of 2), resumes bit for bit from a sharded
(DCP) checkpoint, and the meter counts FSDP's all-gathers, reduce-scatters and all-reduces
across groups."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import SIZE, clean_env, mpirun, trainer_runs

JOB = textwrap.dedent("""
    import json, sys
    import torch, torch.nn.functional as F
    import hvd_lowcomm as hl
    from hvd_lowcomm.models.transformer import gpt
    from hvd_lowcomm.comm.traffic import FLOAT_BYTES
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                         set_state_dict)
    hl.init(engine="torch")
    rank, size, group_size = hl.rank(), hl.size(), int(sys.argv[1])
    vocab, context, steps = 40, 16, 4

    def batch():
        g = torch.Generator().manual_seed(100)  # one batch per rank, fitted step by step
        tokens = torch.randint(0, vocab, (size, 4, context + 1), generator=g)[rank]
        return tokens[:, :-1], tokens[:, 1:]

    def build(seed):
        torch.manual_seed(seed)
        return gpt(vocab, context, layers=2, width=32, heads=2)

    def sharded(seed):
        model = build(seed)
        mesh = hl.device_mesh(group_size=group_size)
        for block in list(model)[1:-1]:
            hl.fully_shard(block, mesh)
        hl.fully_shard(model, mesh)
        return model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)  # over the shards

    def train(model, opt, steps):
        losses = []
        for step in range(steps):
            x, y = batch()
            opt.zero_grad()
            loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
            loss.backward()
            opt.step()
            hl.meter.next_step()
            losses.append(hl.meter.allreduce(loss.detach().reshape(1), "loss").item())
        return losses

    params = sum(p.numel() for p in build(0).parameters())
    in_blocks = sum(p.numel() for block in list(build(0))[1:-1] for p in block.parameters())
    report = {}
    for name in ("ddp", "fsdp", "fsdp-resumed"):
        if name == "ddp":
            model = build(0)
            # SGD: a wrong gradient scale shows in the parameters (Adam would normalise it away)
            opt = hl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                                          model.named_parameters())
        else:
            model, opt = sharded(0)
            report["shard_share"] = sum(p.to_local().numel() for p in model.parameters()) / params
        hl.meter.reset()
        if name == "fsdp-resumed":  # half the steps, a DCP checkpoint, a fresh job's model from it
            losses = train(model, opt, steps // 2)
            dcp.save(dict(zip(("model", "optim"), get_state_dict(model, opt))), checkpoint_id=sys.argv[2] + "/dcp")
            model, opt = sharded(1)  # another initialisation: what the checkpoint holds must replace it
            state = dict(zip(("model", "optim"), get_state_dict(model, opt)))
            dcp.load(state, checkpoint_id=sys.argv[2] + "/dcp")
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            losses += train(model, opt, steps - steps // 2)
        else:
            losses = train(model, opt, steps)
        full = (model.state_dict() if name == "ddp" else
                get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
        report[name] = {"losses": losses,
                        "parameters": torch.cat([v.float().reshape(-1) for v in full.values()]).tolist(),
                        "bytes": {f"{op}/{group}": t.wire_bytes / steps for (phase, op, group), t in
                                  hl.meter.by_kind.items() if phase == "train" and op != "allreduce" or
                                  (op == "allreduce" and group.startswith("replicate"))},
                        "model_bytes": params * FLOAT_BYTES, "block_bytes": in_blocks * FLOAT_BYTES}
    if group_size and size > group_size:  # PowerSGD at full rank across groups, each sharding the model
        for name in ("powersgd", "powersgd-sharded"):
            model = build(0)
            if name == "powersgd-sharded":
                hl.shard_model(model, hl.device_mesh(group_size=group_size, replicate=False))
            state = hl.PowerSGDState(rank=256, min_compression_rate=0.001, start_iter=2)
            opt = hl.PowerSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                                       model.named_parameters(), state=state)
            losses = train(model, opt, steps)
            full = (model.state_dict() if name == "powersgd" else
                    get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
            report[name] = {"losses": losses, "compressed": len(state.qs),
                            "parameters": torch.cat([v.float().reshape(-1) for v in full.values()]).tolist()}
    with open(f"{sys.argv[2]}/report{rank}.json", "w") as f:
        json.dump(report, f)
""")


def run_job(tmp_path, ranks: int, group_size: int) -> list[dict]:
    """Every rank's report."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {k: v for k, v in clean_env().items() if k != "HVD_LOWCOMM_ENGINE"}
    done = subprocess.run(
        mpirun(ranks, "-x", "PYTHONPATH", sys.executable, str(script), str(group_size), str(tmp_path)),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads((tmp_path / f"report{rank}.json").read_text()) for rank in range(ranks)]


@pytest.mark.skipif(SIZE > 1, reason="launches jobs of its own")
@pytest.mark.parametrize("ranks,group_size", [(2, 0), (4, 2)], ids=["fsdp-1x2", "hsdp-2x2"])
def test_a_loop_sharded_on_the_mesh_trains_as_ddp_resumes_from_dcp_and_the_meter_counts_fsdp(
    tmp_path, ranks, group_size
):
    import torch

    shard = group_size or ranks
    for report in run_job(tmp_path, ranks, group_size):
        ddp, fsdp = report["ddp"], report["fsdp"]
        # each rank holds about 1/shard of the parameters (FSDP pads a dim-0 split)
        assert abs(report["shard_share"] - 1 / shard) < 0.05, report["shard_share"]
        torch.testing.assert_close(torch.tensor(fsdp["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            torch.tensor(fsdp["parameters"]), torch.tensor(ddp["parameters"]), rtol=1e-4, atol=1e-5
        )
        assert fsdp["losses"][-1] < fsdp["losses"][0]  # it trained
        # resumed from a DCP checkpoint halfway, into a differently initialised model: bit for bit
        resumed = report["fsdp-resumed"]
        assert resumed["losses"] == fsdp["losses"] and resumed["parameters"] == fsdp["parameters"]
        # inside a group, (shard-1)/shard of what is sent per step: the blocks' parameters
        # gathered in forward and again in backward (the root's stay gathered), every gradient
        # reduce-scattered
        model_bytes, block_bytes = fsdp["model_bytes"], fsdp["block_bytes"]
        ring = (shard - 1) / shard
        gathered = sum(v for k, v in fsdp["bytes"].items() if k.startswith("allgather/"))
        scattered = sum(v for k, v in fsdp["bytes"].items() if k.startswith("reduce_scatter/"))
        assert gathered == pytest.approx(ring * (model_bytes + block_bytes), rel=0.02), fsdp["bytes"]
        assert scattered == pytest.approx(ring * model_bytes, rel=0.02), fsdp["bytes"]
        across = sum(v for k, v in fsdp["bytes"].items() if k.startswith("allreduce/replicate"))
        groups = ranks // shard
        # HSDP: each rank's gradient shard all-reduced across the groups
        assert across == pytest.approx(2 * (groups - 1) / groups * model_bytes / shard, rel=0.02), fsdp["bytes"]
        if group_size:  # a user's PowerSGDOptimizer on a model sharded in each group joins the groups itself
            plain, sharded = report["powersgd"], report["powersgd-sharded"]
            assert plain["compressed"] > 0 and sharded["compressed"] == plain["compressed"]
            torch.testing.assert_close(
                torch.tensor(sharded["parameters"]), torch.tensor(plain["parameters"]), rtol=1e-4, atol=1e-5
            )


def test_the_mesh_is_refused_with_how_to_fix_it_where_it_cannot_be_made():
    import hvd_lowcomm as hl
    from hvd_lowcomm.comm import runtime
    from hvd_lowcomm.config import ConfigError

    if runtime.engine().name == "horovod":  # every rank runs the same engine: all refuse alike
        with pytest.raises(ConfigError, match="engine='torch'"):
            hl.device_mesh()
        return
    with pytest.raises(ConfigError, match=f"do not divide {SIZE} ranks"):
        hl.device_mesh(group_size=SIZE + 1)
    mesh = hl.device_mesh(group_size=SIZE)  # one group: plain FSDP over every rank
    assert mesh.mesh_dim_names == ("shard",) and mesh.size() == SIZE


# ---------------------------------------------------------------------------------------------
# the built-in trainer's --method fsdp


def text_dataset(folder):
    """A small byte-level text dataset made by data_prep (words over a few sentences)."""
    from data_prep.__main__ import main as data_prep_main

    rng = random.Random(3)
    words = "the cat sat on a mat while dogs ran past two red birds and one old fox".split()
    (folder / "text").mkdir()
    (folder / "text" / "a.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(8)) for _ in range(300)))
    assert data_prep_main(["text", str(folder / "text"), "--out", str(folder / "text.h5")]) == 0
    return folder / "text.h5"


# The trainer's options every run below shares: the torch engine, a 2-layer GPT on text_dataset's
# words, SGD with momentum (a wrong gradient scale shows), accumulation and clipping.
TRAINER_OPTIONS = (
    "--comm.engine", "torch", "--model.name", "gpt", "--model.layers", "2", "--model.width", "32",
    "--model.heads", "2", "--data.seq_len", "16", "--data.batch_size", "8", "--train.optimizer", "sgd",
    "--train.lr", "0.1", "--train.momentum", "0.9", "--train.lr_schedule", "constant",
    "--train.accumulate", "2", "--train.clip_grad_norm", "0.5", "--train.epochs", "1", "--run.progress", "false",
)  # fmt: skip


def train_jobs(tmp_path, ranks: int, runs: list[tuple[str, ...]]) -> list[tuple[dict, dict]]:
    """(summary, final model) of each run (its name, then its options) of the trainer, run in
    order in one job of `ranks` ranks on the torch engine."""
    import torch

    data = ("--data.path", str(tmp_path / "text.h5"), "--run.dir", str(tmp_path / "runs"))
    argvs = [[*TRAINER_OPTIONS, *data, "--run.name", name, *options] for name, *options in runs]
    done = trainer_runs(tmp_path, ranks, argvs)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    results = []
    for name, *_ in runs:
        run = tmp_path / "runs" / name
        results.append((json.loads((run / "summary.json").read_text()), torch.load(run / "model.pt")))
    return results


def refused_resume(tmp_path, checkpoint: Path) -> str:
    """stderr of a ddp job at np 2 asked to resume from `checkpoint` (it must fail)."""
    done = subprocess.run(
        mpirun(2, sys.executable, "-m", "hvd_lowcomm.train", "--method", "ddp", "--comm.engine", "torch",
               "--data.path", str(tmp_path / "text.h5"), "--resume", str(checkpoint)),
        env=clean_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0
    return done.stderr


@pytest.mark.skipif(SIZE > 1, reason="launches jobs of its own")
@pytest.mark.parametrize("ranks,group_size", [(2, 0), (4, 2)], ids=["fsdp-1x2", "hsdp-2x2"])
def test_the_trainer_s_fsdp_trains_as_ddp_and_resumes_bit_for_bit(tmp_path, ranks, group_size):
    """Through the trainer, with accumulation (the first micro-batch skips the reduce-scatter)
    and clipping (the norm over every shard): fsdp's model after 8 steps is ddp's, and 4 steps,
    a checkpoint and a resume to 8 give the same model bit for bit."""
    import torch

    text_dataset(tmp_path)
    steps = ["--train.max_steps", "8"]
    sharding = ["--method", "fsdp", "--fsdp.group_size", str(group_size)]
    (ddp, ddp_model), (fsdp, fsdp_model), _, (_, resumed) = train_jobs(
        tmp_path,
        ranks,
        [
            ("ddp", "--method", "ddp", *steps),
            ("fsdp", *sharding, *steps),
            ("parts", *sharding, "--train.max_steps", "4", "--run.checkpoint_every", "0"),
            ("parts", *sharding, *steps, "--resume", "auto"),
        ],
    )
    assert fsdp_model.keys() == ddp_model.keys()
    for key in ddp_model:  # the same gradient to float32 rounding: SGD shows any wrong scale or term
        torch.testing.assert_close(fsdp_model[key], ddp_model[key], rtol=1e-4, atol=1e-5, msg=key)
    assert fsdp["final_test_loss"] == pytest.approx(ddp["final_test_loss"], rel=1e-4)
    assert fsdp["parameter_share_per_rank"] == pytest.approx(1 / (group_size or ranks), abs=0.05)
    for key in fsdp_model:
        assert torch.equal(resumed[key], fsdp_model[key]), key


@pytest.mark.skipif(SIZE > 1, reason="launches jobs of its own")
def test_fsdp_s_dcp_checkpoint_resumes_on_another_group_size_and_rank_count(tmp_path):
    """A checkpoint of HSDP at np 4 (2 x 2) after 4 steps, in DCP's sharded form: resumed as
    plain FSDP over the 4 ranks (model and momentum resharded) its 8th step is the
    uninterrupted run's to float32 rounding; resumed on 2 ranks it holds the same model. A
    ddp or another method's checkpoint is refused with the fix."""
    import torch

    text_dataset(tmp_path)
    hsdp = ["--method", "fsdp", "--fsdp.group_size", "2"]
    (_, whole), (_, at_four) = train_jobs(
        tmp_path, 4, [("whole", *hsdp, "--train.max_steps", "8"), ("parts", *hsdp, "--train.max_steps", "4")]
    )
    written = sorted((tmp_path / "runs" / "parts" / "checkpoints").iterdir())[-1]
    assert (written / "sharded" / ".metadata").is_file() and len(list((written / "sharded").glob("*.distcp"))) == 4
    (tmp_path / "runs" / "parts2").mkdir()
    shutil.copytree(written.parent, tmp_path / "runs" / "parts2" / "checkpoints")
    regrouped = ("--method", "fsdp", "--fsdp.group_size", "0", "--train.max_steps", "8", "--resume", "auto")
    # and a ddp run, whose replica state is its rank count's
    (_, regrouped), _ = train_jobs(
        tmp_path, 4, [("parts", *regrouped), ("ddp", "--method", "ddp", "--train.max_steps", "2")]
    )
    for key in whole:
        torch.testing.assert_close(regrouped[key], whole[key], rtol=1e-4, atol=1e-5, msg=key)
    ((_, on_two),) = train_jobs(
        tmp_path, 2, [("parts2", "--method", "fsdp", "--train.max_steps", "4", "--resume", "auto")]
    )
    for key in at_four:
        assert torch.equal(on_two[key], at_four[key]), key
    assert "written by fsdp; resume it with --method fsdp" in refused_resume(tmp_path, written)
    assert "written by 4 ranks; resume it with mpirun -np 4" in refused_resume(tmp_path, tmp_path / "runs" / "ddp")


@pytest.mark.skipif(SIZE > 1, reason="launches jobs of its own")
def test_the_trainer_refuses_fsdp_on_horovod_and_a_group_size_that_does_not_divide(tmp_path):
    for options, reason in (
        (["--comm.engine", "horovod"], "not Horovod's: use --comm.engine torch"),
        (["--fsdp.group_size", "3"], "fsdp.group_size 3 does not divide the 2 ranks"),
    ):
        done = subprocess.run(
            mpirun(
                2,
                sys.executable,
                "-m",
                "hvd_lowcomm.train",
                "--method",
                "fsdp",
                "--train.max_steps",
                "1",
                "--run.dir",
                str(tmp_path),
                *options,
            ),
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode != 0 and reason in done.stderr, done.stdout + done.stderr


@pytest.mark.skipif(SIZE > 1, reason="launches jobs of its own")
def test_diloco_across_sharded_groups_trains_as_diloco_and_resumes_bit_for_bit(tmp_path):
    """np 4 as 2 DiLoCo groups, each sharding the model over its 2 ranks: with fp32 exchanges
    the model after 8 steps (two outer steps and a trial sync) is unsharded DiLoCo's; with the
    default int2 exchange (error feedback in the checkpoint) a resume halfway is bit for bit,
    and its bytes between groups are unsharded DiLoCo's."""
    import torch

    text_dataset(tmp_path)
    diloco = ["--method", "diloco", "--diloco.groups", "2", "--diloco.sync_every", "3", "--train.max_steps", "8"]
    fp32 = ["--diloco.compression", "none"]
    parts = [*diloco[:-1], "4", "--diloco.shard", "true"]
    (_, plain), (summary, sharded), (int2, whole), (unsharded, _), _, (_, resumed) = train_jobs(
        tmp_path,
        4,
        [
            ("plain", *diloco, *fp32),
            ("sharded", *diloco, *fp32, "--diloco.shard", "true"),
            ("int2", *diloco, "--diloco.shard", "true"),
            ("int2-plain", *diloco),
            ("parts", *parts),
            ("parts", *diloco, "--diloco.shard", "true", "--resume", "auto"),
        ],
    )
    for key in plain:
        torch.testing.assert_close(sharded[key], plain[key], rtol=1e-5, atol=1e-6, msg=key)
    assert summary["intra_group_wire_bytes"] > 0
    # each rank sends its shards' pseudo-gradient: as many numbers as an unsharded slice
    assert int2["inter_group_wire_bytes"] == pytest.approx(unsharded["inter_group_wire_bytes"], rel=0.02)
    for key in whole:
        assert torch.equal(resumed[key], whole[key]), key


@pytest.mark.skipif(SIZE > 1, reason="launches jobs of its own")
def test_the_cost_model_predicts_the_sharded_methods_bytes_at_np4_on_torch():
    """The suites at np 4 run on Horovod, which cannot shard: the cost model's exact-bytes test
    for fsdp, HSDP, DiLoCo and PowerSGD across sharded groups (2 x 2), here on the torch engine."""
    env = {**clean_env(), "HVD_LOWCOMM_ENGINE": "torch"}
    done = subprocess.run(
        mpirun(
            4,
            "-x",
            "HVD_LOWCOMM_ENGINE",
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "mpi_tests/test_costmodel.py",
            "-k",
            "fsdp or shard",
        ),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0 and "6 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.skipif(SIZE > 1, reason="launches jobs of its own")
def test_powersgd_across_sharded_groups_trains_as_powersgd_and_resumes_bit_for_bit(tmp_path):
    """np 4 as 2 groups sharding the model over 2 ranks each, PowerSGD compressing each rank's
    gradient shard (rows of each matrix) across the groups: at full rank it trains as unsharded
    PowerSGD; adaptive (ranks this small model's matrices can pay for), with error feedback and
    warm start, it compresses and a resume halfway is bit for bit."""
    import torch

    text_dataset(tmp_path)
    steps = ["--train.max_steps", "8"]
    full = [
        "--method",
        "powersgd",
        "--powersgd.rank",
        "256",
        "--powersgd.min_compression_rate",
        "0.001",
        "--powersgd.start_iter",
        "2",
    ]
    defaults = [
        "--method",
        "powersgd",
        "--powersgd.shard_group_size",
        "2",
        "--powersgd.start_iter",
        "2",
        "--powersgd.min_rank",
        "2",
        "--powersgd.max_rank",
        "4",
        "--powersgd.adapt_every",
        "3",
    ]
    (_, plain), (_, sharded), (compressed, whole), _, (_, resumed) = train_jobs(
        tmp_path,
        4,
        [
            ("plain", *full, *steps),
            ("sharded", *full, "--powersgd.shard_group_size", "2", *steps),
            ("defaults", *defaults, *steps),
            ("parts", *defaults, "--train.max_steps", "4"),
            ("parts", *defaults, *steps, "--resume", "auto"),
        ],
    )
    for key in plain:
        torch.testing.assert_close(sharded[key], plain[key], rtol=1e-4, atol=1e-5, msg=key)
    assert compressed["powersgd_compression_rate"] > 1
    for key in whole:
        assert torch.equal(resumed[key], whole[key]), key
