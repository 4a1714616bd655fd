"""The α-β cost model, the planner and --method auto."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch

from conftest import RANK, SIZE, needs_ranks, skip_where_its_engine_is_not_running
from hvd_lowcomm import config, costmodel, data, models
from hvd_lowcomm.costmodel import ACCELERATORS, UTILISATION, Link, RunAssumptions, predict, profile_model
from hvd_lowcomm.models.transformer import gpt
from hvd_lowcomm.train import main


def test_communication_hides_behind_backward_only_when_a_core_is_free(mlp_profile):
    free = predict(mlp_profile, "ddp", 4, Link(1e8))
    busy = predict(mlp_profile, "ddp", 4, Link(1e8, overlap=0.0))  # ranks outnumber cores
    assert free.hidden > 0 and free.hidden == pytest.approx(min(free.communication, mlp_profile.backward_seconds))
    assert busy.hidden == 0 and busy.step == pytest.approx(free.step + free.hidden)


# Options under which a method's traffic does not depend on what it learns (so the prediction
# can be exact), the assumptions that then hold, and the tolerance: AB sends a few integers to
# check its cuts beside what the model counts.
EXACT = {
    # a fixed rank (an adaptive one follows what is learned), measured at steps 0, 10, 20, 30 of
    # 40: the probes' average per step is exact
    "powersgd": (["--powersgd.rank", "2", "--powersgd.start_iter", "0", "--powersgd.adapt_every", "10"], {}, 1e-6),
    # 4 of the 8-row gradients' components, none dropped as rounding noise: k is 4 on every rank;
    # factors from the first step (the model, as PowerSGD's, predicts the steps after start_iter)
    "rank-dad": (["--rank-dad.rank", "4", "--rank-dad.tol", "1e-9", "--rank-dad.start_iter", "0"], {}, 1e-6),
    "ab": (
        [
            "--ab.groups",
            "2",
            "--ab.warmup",
            "0.1",
            "--ab.sync_every",
            "0.1",
            "--ab.full_rank_steps",
            "0.05",
            "--ab.cut.rank_rule",
            "tau",
            "--ab.cut.tau",
            "0.01",
            "--ab.cut.max_output_error",
            "0",
        ],  # the floor keeps all
        {"rank_share": 1.0},
        2e-3,
    ),
    # cuts to exactly half of each layer's smaller side (the floor; the rule and the guard let
    # it through), the first at step 22 of 40 (first_cut 20): full-rank factors in the group
    # phases and syncs before it, cut ones after
    "ab-first-cut": (
        [
            "--ab.groups",
            "2",
            "--ab.warmup",
            "0.1",
            "--ab.sync_every",
            "0.1",
            "--ab.full_rank_steps",
            "0.05",
            "--ab.first_cut",
            "0.5",
            "--ab.cut.rank_rule",
            "tau",
            "--ab.cut.tau",
            "0.99",
            "--ab.cut.max_output_error",
            "0.99",
            "--ab.cut.min_rank_share",
            "0.5",
            "--ab.cut.max_loss_rise",
            "100",
            "--ab.cut.max_accuracy_drop",
            "1",
        ],
        {"rank_share": 0.5},
        2e-3,
    ),
    "diloco": (["--diloco.groups", "2"], {}, 1e-6),  # the model's default is a group per node
    # every form of DiLoCo's exchange between groups (at H = 4: ten exchanges in the run)
    **{
        f"diloco-{form}": (
            ["--method", "diloco", "--diloco.groups", "2", "--diloco.sync_every", "4", "--diloco.compression", form],
            {},
            1e-6,
        )
        for form in ("fp16", "int8", "int2", "sparse", "lowrank")
    },
    # a group per rank: beyond 2 groups (np 4) the sparse contributions are reduced by owner
    "diloco-sparse-by-owner": (
        [
            "--method",
            "diloco",
            "--diloco.groups",
            str(SIZE),
            "--diloco.sync_every",
            "4",
            "--diloco.compression",
            "sparse",
        ],
        {},
        1e-6,
    ),
    "diloco-delay": (
        ["--method", "diloco", "--diloco.groups", "2", "--diloco.sync_every", "4", "--diloco.sync_delay", "2"],
        {},
        1e-6,
    ),
    "diloco-eager": (
        ["--method", "diloco", "--diloco.groups", "2", "--diloco.sync_every", "4", "--diloco.eager", "true"],
        {},
        1e-6,
    ),
    # FSDP inside each group (at np 4: 2 shards), each rank's shards exchanged across groups
    **{
        f"diloco-shard-{form}": (
            [
                "--method",
                "diloco",
                "--diloco.groups",
                "2",
                "--diloco.sync_every",
                "4",
                "--diloco.shard",
                "true",
                "--diloco.compression",
                form,
            ],
            {},
            1e-6,
        )
        for form in ("none", "int2", "lowrank")
    },
    # FSDP inside groups of half the ranks, each rank's gradient rows compressed across them
    "powersgd-shard": (
        [
            "--method",
            "powersgd",
            "--powersgd.rank",
            "2",
            "--powersgd.start_iter",
            "0",
            "--powersgd.adapt_every",
            "10",
            "--powersgd.shard_group_size",
            str(max(1, SIZE // 2)),
        ],
        {},
        1e-6,
    ),
    "fsdp-hsdp": (["--method", "fsdp", "--fsdp.group_size", str(max(1, SIZE // 2))], {}, 1e-6),
}
STEPS = 40


@needs_ranks(2)
@pytest.mark.parametrize(
    "method", costmodel.predicted_methods() + [k for k in EXACT if k not in costmodel.predicted_methods()]
)
def test_predicted_bytes_per_step_are_what_the_busiest_rank_sends(world, fresh_meter, shared_tmp, method):
    """For every registered method (and every form of DiLoCo's exchange, and AB's first cut): the cost model's bytes
    per step equal the meter's over a real run through the trainer (the rank that sends most;
    AB's B-groups and mp's partitions send less or other things)."""
    argv, assumed, tolerance = EXACT.get(method, ([], {}, 1e-6))
    method = method if method in costmodel.predicted_methods() else method.split("-")[0]  # a variant's method
    skip_where_its_engine_is_not_running(method, argv)
    argv = [
        "--method",
        method,
        "--model.name",
        "mlp",
        "--model.hidden",
        "128,96,64",
        "--data.batch_size",
        "8",
        "--train.epochs",
        "1",
        "--train.max_steps",
        str(STEPS),
        "--data.path",
        str(shared_tmp / "digits.h5"),
        "--run.dir",
        str(shared_tmp),
        "--run.name",
        method,
        "--run.progress",
        "false",
        *argv,
    ]
    assert main(argv) == 0
    assert fresh_meter.step == STEPS
    sent = max(world.comm.allgather(fresh_meter.total("train") / STEPS))
    cfg = config.load(argv)
    info = data.inspect(cfg.data.path)
    profile = profile_model(
        models.build_model(cfg.model, info.input_shape, info.num_classes),
        info.input_shape,
        cfg.data.batch_size,
        repeats=1,
        cfg=cfg,
        methods=(method,),
    )
    predicted = predict(profile, method, SIZE, Link(1e9), cfg, RunAssumptions(run_steps=STEPS, **assumed))
    assert sent == pytest.approx(predicted.bytes_per_rank, rel=tolerance), (sent, predicted.bytes_per_rank)


@needs_ranks(2)
@pytest.mark.parametrize(
    "link, expected", [("10000gbit", {"ddp"}), ("10mbit", {"powersgd", "dad", "rank-dad", "diloco"})]
)
def test_method_auto_trains_with_the_method_the_cost_model_chose(
    world, fresh_meter, shared_tmp, capsys, link, expected
):
    argv = [
        "--method",
        "auto",
        "--auto.link",
        link,
        "--model.hidden",
        "512,512",
        "--train.epochs",
        "1",
        "--train.max_steps",
        "3",
        "--data.path",
        str(shared_tmp / "digits.h5"),
        "--run.dir",
        str(shared_tmp),
        "--run.name",
        "auto",
        "--run.progress",
        "false",
    ]
    assert main(argv) == 0
    world.comm.Barrier()  # rank 0 has written the summary
    summary = json.loads((shared_tmp / "auto" / "summary.json").read_text())
    choice = summary["auto_choice"]
    assert choice in expected, summary["auto_reason"]
    assert summary["method"] == choice
    # Every rank trained with that method: its training tensors carry the method's names
    # (PowerSGD's first start_iter steps are plain means named "powersgd.warmup.<parameter>").
    trained = {name.split(".")[0] for name, t in fresh_meter.by_name.items() if t.calls}
    marker = {"dad": "dad", "rank-dad": "rank-dad", "powersgd": "powersgd", "diloco": "diloco"}.get(choice)
    assert (marker in trained) if marker else not trained & {"dad", "rank-dad", "powersgd", "diloco"}, trained
    if RANK == 0:  # rank 0 prints the choice
        out = capsys.readouterr().out
        assert f"auto: chose {summary['auto_choice']}: predicted" in out and "predicted per step:" in out


@needs_ranks(2)
def test_method_auto_leaves_out_a_fixed_rank_and_says_so(world, shared_tmp, capsys):
    argv = [
        "--method",
        "auto",
        "--auto.link",
        "10mbit",
        "--model.hidden",
        "512,512",
        "--train.max_steps",
        "2",
        "--powersgd.rank",
        "2",
        "--rank-dad.rank",
        "8",
        "--diloco.sync_every",
        "7",  # DiLoCo at options other than those measured at equal time: no candidate either
        "--data.path",
        str(shared_tmp / "digits.h5"),
        "--run.dir",
        str(shared_tmp),
        "--run.name",
        "auto-fixed",
        "--run.progress",
        "false",
    ]
    assert main(argv) == 0
    world.comm.Barrier()  # rank 0 has written the summary
    summary = json.loads((shared_tmp / "auto-fixed" / "summary.json").read_text())
    assert summary["auto_choice"] == "dad" and summary["auto_reason"].endswith("Quality: the same gradient as ddp")
    if RANK == 0:
        out = capsys.readouterr().out
        for method in ("powersgd", "rank-dad"):
            assert f"left out: {method}: a fixed rank, or no error feedback: no bound on what it loses" in out


@needs_ranks(2)
def test_method_auto_measures_the_network_when_not_told(shared_tmp):
    from hvd_lowcomm.auto import probe_link

    link = probe_link(probe_mb=1.0)
    assert 0 < link.latency < 1.0 and link.bandwidth > 1e6  # bytes/s: more than 8 Mbit/s on any host
    assert math.isfinite(link.bandwidth)


def test_the_planner_command_writes_its_tables(tmp_path, capsys):
    from hvd_lowcomm.plan import main as plan_main

    data = tmp_path / "digits.h5"  # a bundled set, missing: plan prepares it, as the trainer does
    code = plan_main(
        [
            "--ranks",
            "8,64",
            "--links",
            "1gbit,100gbit",
            "--tflops",
            "10",
            "--out",
            str(tmp_path / "plan"),
            "--model.name",
            "sil6",
            "--data.path",
            str(data),
        ]
    )
    assert code == 0 and data.exists() and f"preparing {data} from the bundled 'digits'" in capsys.readouterr().out
    text = (tmp_path / "plan" / "predicted.md").read_text()
    assert "## 1gbit" in text and "## 100gbit" in text and "| sil |" in text and "Break-even bandwidth" in text
    assert "8 ranks: ms (× ddp)" in text and "TFLOP forward and backward; 10 TFLOP/s)" in text
    steps = text.split("## Memory per rank")[0]
    assert "Compute floor (a step with no communication, as `--method local`)" in text and "| local |" not in steps
    # memory per rank beside step time: fsdp over 8 ranks holds about an eighth of ddp's
    # weights, gradients and Adam state, plus what it gathers at once
    memory = {
        line.split(" | ")[0].strip("| "): float(line.split(" | ")[1].split(",")[0])
        for line in text.split("## Memory per rank")[1].split("## Quality")[0].splitlines()
        if line.startswith("| ") and " GiB" not in line
    }
    assert memory["fsdp"] < memory["ddp"] / 4 < memory["diloco"] and "powersgd" in memory
    assert memory["mp"] < memory["ddp"]  # a partition of the model per rank
    # auto's choice per link and rank count: always one that keeps quality or held at equal
    # time, and on 1 Gbit/s, with 10 TFLOP/s of compute, one that sends less than ddp
    keeping = costmodel.auto_candidates(config.default_config())
    choices = {
        line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ")[1:]
        for line in text.split("would choose")[1].splitlines()
        if line.startswith("| ") and "gbit" in line
    }
    assert set(choices) == {"1gbit", "100gbit"} and all(c in keeping for cells in choices.values() for c in cells)
    assert "ddp" not in choices["1gbit"]
    rows = (tmp_path / "plan" / "predicted.csv").read_text().splitlines()
    # sil6 is an MLP every method trains; local is the floor, not a row
    assert len(rows) == 1 + 2 * 2 * (len(costmodel.predicted_methods()) - 1)
    assert plan_main(["--links", "fast", "--data.path", str(data)]) == 2
    assert "use a rate such as 1gbit" in capsys.readouterr().err

    def ddp_network_ms(node_link: str) -> float:  # ddp on 16 ranks, 4 per node, a 400 Gbit/s network
        out = tmp_path / node_link
        assert (
            plan_main(
                [
                    "--ranks",
                    "16",
                    "--links",
                    "400gbit",
                    "--ranks-per-node",
                    "4",
                    "--node-link",
                    node_link,
                    "--tflops",
                    "10",
                    "--out",
                    str(out),
                    "--model.name",
                    "sil6",
                    "--data.path",
                    str(data),
                ]
            )
            == 0
        )
        rows = {row["method"]: row for row in csv.DictReader(open(out / "predicted.csv"))}
        return float(rows["ddp"]["network_ms"])  # the α-β time alone

    # nodes whose own links are slower than the network pace the ring (by their rate); faster ones do not
    slow, fast, faster = ddp_network_ms("40gbit"), ddp_network_ms("4000gbit"), ddp_network_ms("40000gbit")
    # 2⌈log2 16⌉ messages at InfiniBand's latency (400 Gbit/s); the bytes' time scales with 1 / the pacing rate
    latency_ms = 2 * 4 * costmodel.LATENCY_US["ib"] * 1e-3
    assert slow - latency_ms == pytest.approx(10 * (fast - latency_ms), rel=1e-6) and fast == pytest.approx(faster)


def test_a_model_too_large_to_time_quickly_is_counted_at_this_cpus_measured_rates():
    with torch.device("meta"):  # GPT-2 small's shapes; its weights are never needed
        model = gpt(vocab_size=50257, context=1024, layers=12, width=768, heads=12)
    profile = profile_model(model, (1024,), 8, methods=("ddp",), vocabulary=50257)
    here = costmodel.measured_device("cpu", "none")
    assert profile.device == here.name and profile.step_seconds == pytest.approx(3 * profile.flops / here.step_rate)


def test_a_gpt2_sized_plan_for_16_nodes_of_4_gpus_on_25gbit_ethernet(tmp_path):
    """GPT-2 small (12 layers of width 768, its vocabulary and context, tied embeddings) planned
    in-process for 64 ranks on 16 nodes of 4 H100s from its FLOPs, the floor apart."""
    from data_prep.writer import write_text_dataset
    from hvd_lowcomm.plan import parser, plan

    vocabulary, context, layers, width, batch, params = 50257, 1024, 12, 768, 8, 124_439_808
    ids = np.random.default_rng(0).integers(0, vocabulary, 4 * context)
    write_text_dataset(tmp_path / "gpt2.h5", ids, ids, vocabulary, "random ids")
    args, rest = parser().parse_known_args(
        [
            "--accelerator",
            "h100",
            "--gpus-per-node",
            "4",
            "--ranks",
            "64",
            "--links",
            "25gbit",
            "--model.name",
            "gpt",
            "--model.layers",
            str(layers),
            "--model.width",
            str(width),
            "--model.heads",
            "12",
            "--model.tie_weights",
            "true",
            "--data.path",
            str(tmp_path / "gpt2.h5"),
            "--data.seq_len",
            str(context),
            "--data.batch_size",
            str(batch),
            "--train.amp",
            "bf16",
        ]
    )
    text, rows = plan(args, rest)
    assert f"{params:,} parameters" in text and "4 rank(s) per node" in text  # the tied matrix counted once
    flops = batch * context * (layers * (24 * width**2 + 4 * context * width) + 2 * width * vocabulary)
    floor = 3 * flops / (ACCELERATORS["h100"].bf16_tflops * 1e12 * UTILISATION)
    steps = text.split("## Memory per rank")[0]  # local is the floor there, not a row
    assert f"as `--method local`): {floor * 1e3:.2f} ms per step" in text and "| local |" not in steps
    assert "25 Gbit/s, 30 µs, 4 ranks per node" in text  # Ethernet's latency
    by_method = {row["method"]: row for row in rows}
    assert {"ddp", "powersgd", "diloco"} <= set(by_method) and "local" not in by_method
    # ddp's allreduce of every fp32 gradient over 64 ranks across nodes: 2⌈log2 64⌉ messages and
    # 2·63/64 of the bytes at 25 Gbit/s
    network = 2 * 6 * costmodel.LATENCY_US["eth"] * 1e-6 + 2 * 63 / 64 * 4 * params / (25e9 / 8)
    assert by_method["ddp"]["network_ms"] == pytest.approx(network * 1e3, rel=1e-9)
    assert by_method["ddp"]["compute_ms"] == pytest.approx(floor * 1e3, rel=1e-9)
