"""The α-β cost model, the planner and --method auto."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import RANK, SIZE, needs_ranks
from hvd_lowcomm import costmodel
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.costmodel import Link, MethodSettings, predict, profile_model
from hvd_lowcomm.models import cnn, mlp
from hvd_lowcomm.train import main

MB = 1e6


def test_collective_costs_follow_the_alpha_beta_formulas():
    link = Link(bandwidth=1e9, latency=1e-5)
    # 8 ranks: 2·3 messages and 2·7/8 of the bytes for an allreduce; 3 messages, 7 shares for an allgather
    assert link.allreduce(8 * MB, 8, 8) == pytest.approx(6e-5 + 2 * 7 / 8 * 8 * MB / 1e9)
    assert link.allgather(1 * MB, 8, 8) == pytest.approx(3e-5 + 7 * MB / 1e9)
    assert link.send(1 * MB, 8) == pytest.approx(1e-5 + 1e-3)
    assert link.allreduce(8 * MB, 1, 8) == 0.0  # nothing leaves a one-rank group
    # inside a node the node's own bandwidth counts; across nodes the network's
    nodes = Link(bandwidth=1e9, latency=0.0, ranks_per_node=4, intra_bandwidth=1e11)
    assert nodes.allreduce(8 * MB, 4, 16) == pytest.approx(2 * 3 / 4 * 8 * MB / 1e11)
    assert nodes.allreduce(8 * MB, 16, 16) == pytest.approx(2 * 15 / 16 * 8 * MB / 1e9)
    # on a shared medium (the emulated link) every rank's bytes cross it
    shared = Link(bandwidth=1e9, latency=0.0, shared=True)
    assert shared.allreduce(8 * MB, 4, 4) == pytest.approx(4 * 2 * 3 / 4 * 8 * MB / 1e9)


def test_link_rates_parse_and_bad_ones_are_refused():
    assert Link.parse("25gbit", latency_us=3).bandwidth == pytest.approx(25e9 / 8)
    assert Link.parse("100mbit").latency == pytest.approx(2e-6)
    for bad in ("fast", "10gb", "xgbit"):
        with pytest.raises(ConfigError, match="use a rate such as 1gbit"):
            costmodel.rate_bits(bad)


@pytest.fixture(scope="module")
def mlp_profile():
    return profile_model(mlp((64,), 10, [256, 256, 256]), (64,), 32, repeats=3)


def test_the_profile_counts_every_parameter_and_the_partitions(mlp_profile):
    model = mlp((64,), 10, [256, 256, 256])
    assert mlp_profile.params == sum(p.numel() for p in model.parameters())
    assert [layer.rows for layer in mlp_profile.layers] == [1, 1, 1, 1]
    assert mlp_profile.step_seconds > 0 and 0 < mlp_profile.backward_seconds < mlp_profile.step_seconds
    shares = mlp_profile.partitions[("sil", 2)].flop_shares
    assert len(shares) == 2 and sum(shares) == pytest.approx(1.0) and max(shares) < 0.8
    assert mlp_profile.partitions[("sil", 2)].widths == [256]  # the cut after a hidden layer of 256
    conv = profile_model(cnn((1, 12, 12), 10, [4, 8]), (1, 12, 12), 8, repeats=1)
    assert conv.layers[0].rows == 144 and conv.layers[0].fan_in == 9  # 12x12 positions of a 3x3x1 patch
    assert conv.other_params == 2 * (4 + 8)  # BatchNorm weights and biases
    assert ("sil", 2) not in conv.partitions and ("mp", 2) in conv.partitions  # SIL refuses this conv net; mp cuts it
    with pytest.raises(ConfigError, match="sil: this model has no default cut into 2 partitions"):
        predict(conv, "sil", 4, Link(1e9))
    assert predict(conv, "mp", 4, Link(1e9)).bytes_per_rank > 0


def test_more_bandwidth_never_slows_a_step_and_dad_work_grows_with_ranks(mlp_profile):
    for method in costmodel.PREDICTED:
        steps = [predict(mlp_profile, method, 16, Link.parse(rate)).step for rate in ("1gbit", "10gbit", "100gbit")]
        assert steps[0] >= steps[1] * (1 - 1e-12) and steps[1] >= steps[2] * (1 - 1e-12), method
    settings = MethodSettings()
    slow = Link.parse("100mbit")
    work = [predict(mlp_profile, "dad", p, slow, settings).method_compute for p in (2, 4)]
    # the pooled product of every rank's rows grows by one rank's product per rank (for the
    # layers it shares rows of: at most all of them)
    product = sum(layer.kernels["dad_product"] for layer in mlp_profile.layers)
    assert 0 < work[1] - work[0] <= 2 * product * (1 + 1e-9)
    # ddp's allreduce hides behind the backward pass up to its length
    fast = predict(mlp_profile, "ddp", 4, Link.parse("1000gbit"))
    assert fast.hidden == pytest.approx(fast.communication)


def test_the_planner_picks_ddp_on_a_fast_network_and_a_compressing_method_on_a_slow_one():
    profile = profile_model(mlp((784,), 10, [1024, 1024]), (784,), 32, repeats=3)
    name, predictions, why = costmodel.choose(profile, 8, Link.parse("10000gbit", latency_us=1))
    assert name == "ddp" and "a method is chosen over ddp only when 5% faster" in why
    name, predictions, why = costmodel.choose(profile, 8, Link.parse("100mbit", latency_us=1))
    assert name in ("powersgd", "rank-dad", "dad") and "ddp would take" in why
    assert predictions[0].step <= predictions[-1].step
    assert costmodel.break_even(profile, name, 8, 1e-6) > 100e6 / 8


@needs_ranks(2)
@pytest.mark.parametrize("method", ["ddp", "ddp-fp16", "powersgd", "dad", "rank-dad"])
def test_predicted_bytes_per_step_are_what_the_method_sends(world, fresh_meter, method):
    """The cost model's traffic pattern matches the implementation's: a real step after the
    first (which plans), metered."""
    import hvd_lowcomm as hl

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 96), nn.ReLU(), nn.Linear(96, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if method.startswith("ddp"):
        opt = hl.DistributedOptimizer(opt, model.named_parameters(), compression="fp16" if "16" in method else "none")
    elif method == "powersgd":
        opt = hl.PowerSGDOptimizer(opt, model.named_parameters(), hl.PowerSGDState(rank=2, start_iter=0))
    else:
        opt = hl.DadOptimizer(opt, model, mode="exact" if method == "dad" else "rank", rank=4 if method != "dad" else None,
                              tol=1e-9)
    generator = torch.Generator().manual_seed(RANK)
    x, y = torch.randn(8, 64, generator=generator), torch.randint(0, 10, (8,), generator=generator)
    for _ in range(2):
        fresh_meter.next_step()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    sent = fresh_meter.step_total()
    profile = profile_model(model, (64,), 8, repeats=1)
    settings = MethodSettings(powersgd_rank=2, rank_dad_rank=4)
    predicted = predict(profile, method, SIZE, Link(1e9), settings).bytes_per_rank
    assert sent == pytest.approx(predicted, rel=1e-6), (sent, predicted)


@needs_ranks(2)
@pytest.mark.parametrize("link, expected", [("10000gbit", {"ddp"}), ("10mbit", {"powersgd", "dad", "rank-dad"})])
def test_method_auto_trains_with_the_method_the_cost_model_chose(world, fresh_meter, shared_tmp, capsys, link,
                                                                 expected):
    argv = ["--method", "auto", "--auto.link", link, "--model.hidden", "512,512", "--train.epochs", "1",
            "--train.max_steps", "3", "--data.path", str(shared_tmp / "digits.h5"), "--run.dir", str(shared_tmp),
            "--run.name", "auto", "--run.progress", "false"]
    assert main(argv) == 0
    world.comm.Barrier()  # rank 0 has written the summary
    summary = json.loads((shared_tmp / "auto" / "summary.json").read_text())
    choice = summary["auto_choice"]
    assert choice in expected, summary["auto_reason"]
    assert summary["method"] == ("ddp" if choice == "ddp-fp16" else choice)
    # Every rank trained with that method: its training tensors carry the method's names
    # (PowerSGD's first start_iter steps are plain allreduces named "allreduce.<parameter>").
    trained = {name.split(".")[0] for name, t in fresh_meter.by_name.items() if t.calls}
    marker = {"dad": "dad", "rank-dad": "rank-dad", "powersgd": "allreduce"}.get(choice)
    assert (marker in trained) if marker else not trained & {"dad", "rank-dad", "allreduce", "powersgd"}, trained
    if RANK == 0:  # rank 0 prints the choice
        out = capsys.readouterr().out
        assert f"auto: chose {summary['auto_choice']}: predicted" in out and "predicted per step:" in out


@needs_ranks(2)
def test_method_auto_measures_the_network_when_not_told(shared_tmp):
    from hvd_lowcomm.methods.auto import probe_link

    link = probe_link(probe_mb=1.0)
    assert 0 < link.latency < 1.0 and link.bandwidth > 1e6  # bytes/s: more than 8 Mbit/s on any host
    assert math.isfinite(link.bandwidth)


def test_the_planner_command_writes_its_tables(tmp_path, capsys):
    from hvd_lowcomm.plan import main as plan_main

    from data_prep import BUNDLED, write_dataset

    data = tmp_path / "digits.h5"
    write_dataset(data, *BUNDLED["digits"]())
    code = plan_main(["--ranks", "8,64", "--links", "1gbit,100gbit", "--tflops", "10", "--out", str(tmp_path / "plan"),
                      "--model.name", "sil6", "--data.path", str(data)])
    assert code == 0
    text = (tmp_path / "plan" / "predicted.md").read_text()
    assert "## 1gbit" in text and "## 100gbit" in text and "| sil |" in text and "Break-even bandwidth" in text
    assert "8 ranks: ms (× ddp)" in text and "at 10 TFLOP/s" in text
    rows = (tmp_path / "plan" / "predicted.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 2 * len(costmodel.PREDICTED)
    assert plan_main(["--links", "fast", "--data.path", str(data)]) == 2
    assert "use a rate such as 1gbit" in capsys.readouterr().err


@needs_ranks(2)
def test_ab_predicted_bytes_are_what_ab_training_sends_over_a_run(world, fresh_meter):
    """Warm-up, group and full-rank steps, syncs, each in its group or over all ranks: a run
    whose cuts keep every singular value (the rank, learned in training, is the model's input)."""
    import hvd_lowcomm as hl

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 96), nn.ReLU(), nn.Linear(96, 10))
    profile = profile_model(model, (64,), 8, repeats=1)  # the model as the user has it, before AB wraps it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = 40
    ab = hl.ABTraining(model, opt, total_steps=steps, groups=2, warmup=0.1, sync_every=0.1, full_rank_steps=0.05,
                       rank_rule="tau", tau=0.01, max_output_error=0.0)  # the floor keeps every component
    fresh_meter.reset()
    generator = torch.Generator().manual_seed(RANK)
    for _ in range(steps):
        x, y = torch.randn(8, 64, generator=generator), torch.randint(0, 10, (8,), generator=generator)
        with ab.step(x, y):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
        fresh_meter.next_step()
    assert ab.layers["2"].rank == 96 and ab.cuts  # it did re-factorise, keeping everything
    settings = MethodSettings(ab_warmup=0.1, ab_sync_every=0.1, ab_full_rank_steps=0.05, ab_groups=2,
                              ab_rank_share=1.0, run_steps=steps)
    predicted = predict(profile, "ab", SIZE, Link(1e9), settings).bytes_per_rank
    sent = fresh_meter.total("train") / steps
    if ab.role == "A" or ab.group.size == 1:  # beside it: the cut checks' integers
        assert sent == pytest.approx(predicted, rel=2e-3), (sent, predicted)
    else:  # the model gives the A-groups' bytes (A is the larger factor, and sets the pace); B is smaller
        assert 0.9 * predicted < sent < predicted, (sent, predicted)
