"""The α-β cost model, the planner and --method auto."""
from __future__ import annotations

import csv
import json
import math

import pytest

from conftest import RANK, SIZE, needs_ranks
from hvd_lowcomm import config, costmodel, data, models
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.costmodel import Link, RunAssumptions, predict, profile_model
from hvd_lowcomm.registry import specs
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
    # a ring over several nodes' ranks also crosses each node's own links: the slower one paces it;
    # rings of one rank per node run by all 4 ranks of a node at once share the node's link
    fast_network = Link(bandwidth=1e11, latency=0.0, ranks_per_node=4, intra_bandwidth=2e10)
    assert fast_network.allreduce(8 * MB, 16, 16) == pytest.approx(2 * 15 / 16 * 8 * MB / 2e10)
    assert fast_network.allreduce(8 * MB, 4, 16, spans_nodes=True) == pytest.approx(2 * 3 / 4 * 8 * MB / (1e11 / 4))
    # what a node's link carries, per byte one rank sends
    assert (nodes.node_share(4), nodes.node_share(16), nodes.node_share(4, spans_nodes=True)) == (0.0, 1.0, 4.0)
    # on a shared medium (the emulated link) every rank's bytes cross it
    shared = Link(bandwidth=1e9, latency=0.0, shared=True)
    assert shared.allreduce(8 * MB, 4, 4) == pytest.approx(4 * 2 * 3 / 4 * 8 * MB / 1e9)


def test_link_rates_parse_and_bad_ones_are_refused():
    assert Link.parse("25gbit", latency_us=3).bandwidth == pytest.approx(25e9 / 8)
    assert Link.parse("100mbit").latency == pytest.approx(2e-6)
    for bad in ("fast", "10gb", "xgbit"):
        with pytest.raises(ConfigError, match="use a rate such as 1gbit"):
            config.rate_bits(bad)


@pytest.fixture(scope="module")
def mlp_profile():
    return profile_model(mlp((64,), 10, [256, 256, 256]), (64,), 32, repeats=3)


def test_communication_hides_behind_backward_only_when_a_core_is_free(mlp_profile):
    free = predict(mlp_profile, "ddp", 4, Link(1e8))
    busy = predict(mlp_profile, "ddp", 4, Link(1e8, overlap=0.0))  # ranks outnumber cores
    assert free.hidden > 0 and free.hidden == pytest.approx(min(free.communication, mlp_profile.backward_seconds))
    assert busy.hidden == 0 and busy.step == pytest.approx(free.step + free.hidden)


def test_the_profile_counts_every_parameter_and_the_partitions(mlp_profile):
    model = mlp((64,), 10, [256, 256, 256])
    assert mlp_profile.params == sum(p.numel() for p in model.parameters())
    assert [layer.rows for layer in mlp_profile.layers] == [1, 1, 1, 1]
    assert mlp_profile.step_seconds > 0 and 0 < mlp_profile.backward_seconds < mlp_profile.step_seconds
    shares = mlp_profile.facts["sil"].flop_shares(mlp_profile)
    assert len(shares) == 2 and sum(shares) == pytest.approx(1.0) and max(shares) < 0.8
    assert mlp_profile.facts["sil"].widths == [256]  # the cut after a hidden layer of 256
    conv = profile_model(cnn((1, 12, 12), 10, [4, 8]), (1, 12, 12), 8, repeats=1)
    assert conv.layers[0].rows == 144 and conv.layers[0].fan_in == 9  # 12x12 positions of a 3x3x1 patch
    assert conv.other_params == 2 * (4 + 8)  # BatchNorm weights and biases
    assert conv.facts["sil"] is None and conv.facts["mp"] is not None  # SIL refuses this conv net; mp cuts it
    with pytest.raises(ConfigError, match="sil: cannot train this model"):
        predict(conv, "sil", 4, Link(1e9))
    assert predict(conv, "mp", 4, Link(1e9)).bytes_per_rank > 0


def test_more_bandwidth_never_slows_a_step_and_dad_work_grows_with_ranks(mlp_profile):
    for method in costmodel.predicted_methods():
        steps = [predict(mlp_profile, method, 16, Link.parse(rate)).step for rate in ("1gbit", "10gbit", "100gbit")]
        assert steps[0] >= steps[1] * (1 - 1e-12) and steps[1] >= steps[2] * (1 - 1e-12), method
    slow = Link.parse("100mbit")
    work = [predict(mlp_profile, "dad", p, slow).method_compute for p in (2, 4)]
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
    assert costmodel.break_even(profile, name, 8, Link(1e9, 1e-6)) > 100e6 / 8


# Options under which a method's traffic does not depend on what it learns (so the prediction
# can be exact), the assumptions that then hold, and the tolerance: AB sends a few integers to
# check its cuts beside what the model counts.
EXACT = {
    # a fixed rank (an adaptive one follows what is learned), measured at steps 0, 10, 20, 30 of
    # 40: the probes' average per step is exact
    "powersgd": (["--powersgd.rank", "2", "--powersgd.start_iter", "0", "--powersgd.adapt_every", "10"], {}, 1e-6),
    # 4 of the 8-row gradients' components, none dropped as rounding noise: k is 4 on every rank
    "rank-dad": (["--rank-dad.rank", "4", "--rank-dad.tol", "1e-9"], {}, 1e-6),
    "ab": (["--ab.groups", "2", "--ab.warmup", "0.1", "--ab.sync_every", "0.1", "--ab.full_rank_steps", "0.05",
            "--ab.rank_rule", "tau", "--ab.tau", "0.01", "--ab.max_output_error", "0"],  # the floor keeps all
           {"rank_share": 1.0}, 2e-3),
    # cuts to exactly half of each layer's smaller side (the floor; the rule and the guard let
    # it through), the first at step 22 of 40 (first_cut 20): full-rank factors in the group
    # phases and syncs before it, cut ones after
    "ab-first-cut": (["--ab.groups", "2", "--ab.warmup", "0.1", "--ab.sync_every", "0.1", "--ab.full_rank_steps", "0.05",
                      "--ab.first_cut", "0.5", "--ab.rank_rule", "tau", "--ab.tau", "0.99", "--ab.max_output_error",
                      "0.99", "--ab.min_rank_share", "0.5", "--ab.max_loss_rise", "100", "--ab.max_accuracy_drop", "1"],
                     {"rank_share": 0.5}, 2e-3),
    "diloco": (["--diloco.groups", "2"], {}, 1e-6),  # the model's default is a group per node
    # every form of DiLoCo's exchange between groups (at H = 4: ten exchanges in the run)
    **{f"diloco-{form}": (["--method", "diloco", "--diloco.groups", "2", "--diloco.sync_every", "4",
                           "--diloco.compression", form], {}, 1e-6) for form in ("fp16", "int8", "sparse", "lowrank")},
    # a group per rank: beyond 2 groups (np 4) the sparse contributions are reduced by owner
    "diloco-sparse-by-owner": (["--method", "diloco", "--diloco.groups", str(SIZE), "--diloco.sync_every", "4",
                                "--diloco.compression", "sparse"], {}, 1e-6),
    "diloco-delay": (["--method", "diloco", "--diloco.groups", "2", "--diloco.sync_every", "4", "--diloco.sync_delay",
                      "2"], {}, 1e-6),
    "diloco-eager": (["--method", "diloco", "--diloco.groups", "2", "--diloco.sync_every", "4", "--diloco.eager",
                      "true"], {}, 1e-6),
}
STEPS = 40


@needs_ranks(2)
@pytest.mark.parametrize("method", costmodel.predicted_methods() + [k for k in EXACT if k not in costmodel.predicted_methods()])
def test_predicted_bytes_per_step_are_what_the_busiest_rank_sends(world, fresh_meter, shared_tmp, method):
    """For every registered method (and every form of DiLoCo's exchange, and AB's first cut): the cost model's bytes
    per step equal the meter's over a real run through the trainer (the rank that sends most;
    AB's B-groups and mp's partitions send less or other things)."""
    argv, assumed, tolerance = EXACT.get(method, ([], {}, 1e-6))
    method = method if method in costmodel.predicted_methods() else method.split("-")[0]  # a variant's method
    argv = ["--method", method, "--model.name", "mlp", "--model.hidden", "128,96,64", "--data.batch_size", "8",
            "--train.epochs", "1", "--train.max_steps", str(STEPS), "--data.path", str(shared_tmp / "digits.h5"),
            "--run.dir", str(shared_tmp), "--run.name", method, "--run.progress", "false", *argv]
    assert main(argv) == 0
    assert fresh_meter.step == STEPS
    sent = max(world.comm.allgather(fresh_meter.total("train") / STEPS))
    cfg = config.load(argv)
    info = data.inspect(cfg.data.path)
    profile = profile_model(models.build_model(cfg.model, info.input_shape, info.num_classes), info.input_shape,
                            cfg.data.batch_size, repeats=1, cfg=cfg, methods=(method,))
    predicted = predict(profile, method, SIZE, Link(1e9), cfg, RunAssumptions(run_steps=STEPS, **assumed))
    assert sent == pytest.approx(predicted.bytes_per_rank, rel=tolerance), (sent, predicted.bytes_per_rank)


def test_every_registered_method_has_a_cost_and_auto_chooses_only_among_drop_ins_that_keep_quality():
    assert set(costmodel.predicted_methods()) == set(specs())  # a new method cannot skip the test above
    assert set(costmodel.drop_in_methods()) == {"ddp", "ddp-fp16", "powersgd", "dad", "rank-dad"}
    # at the defaults every drop-in is exact or adaptive with an error target
    assert set(costmodel.quality_keeping_methods()) == set(costmodel.drop_in_methods())
    assert costmodel.quality_risk("ddp") == costmodel.quality_risk("dad") == ""
    assert "fp16" in costmodel.quality_risk("ddp-fp16") and "15%" in costmodel.quality_risk("powersgd")
    # a fixed rank has no error target: auto leaves it out, and says so
    fixed = config.load(["--powersgd.rank", "2", "--rank-dad.rank", "8"])
    assert set(costmodel.quality_keeping_methods(fixed)) == {"ddp", "ddp-fp16", "dad"}
    # so has an adaptive rank whose dropped part is lost (no error feedback)
    dropped = config.load(["--powersgd.error_feedback", "false", "--rank-dad.error_feedback", "false"])
    assert set(costmodel.quality_keeping_methods(dropped)) == {"ddp", "ddp-fp16", "dad"}
    profile = profile_model(mlp((784,), 10, [1024, 1024]), (784,), 32, repeats=1)
    name, predictions, why = costmodel.choose(profile, 8, Link.parse("100mbit", latency_us=1), fixed)
    assert name == "dad" and {q.method for q in predictions} == {"ddp", "ddp-fp16", "dad"}
    assert why.endswith("Quality: the same gradient as ddp")


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
    assert summary["method"] == choice
    # Every rank trained with that method: its training tensors carry the method's names
    # (PowerSGD's first start_iter steps are plain means named "powersgd.warmup.<parameter>").
    trained = {name.split(".")[0] for name, t in fresh_meter.by_name.items() if t.calls}
    marker = {"dad": "dad", "rank-dad": "rank-dad", "powersgd": "powersgd"}.get(choice)
    assert (marker in trained) if marker else not trained & {"dad", "rank-dad", "powersgd"}, trained
    if RANK == 0:  # rank 0 prints the choice
        out = capsys.readouterr().out
        assert f"auto: chose {summary['auto_choice']}: predicted" in out and "predicted per step:" in out


@needs_ranks(2)
def test_method_auto_leaves_out_a_fixed_rank_and_says_so(world, shared_tmp, capsys):
    argv = ["--method", "auto", "--auto.link", "10mbit", "--model.hidden", "512,512", "--train.max_steps", "2",
            "--powersgd.rank", "2", "--rank-dad.rank", "8", "--data.path", str(shared_tmp / "digits.h5"),
            "--run.dir", str(shared_tmp), "--run.name", "auto-fixed", "--run.progress", "false"]
    assert main(argv) == 0
    world.comm.Barrier()  # rank 0 has written the summary
    summary = json.loads((shared_tmp / "auto-fixed" / "summary.json").read_text())
    assert summary["auto_choice"] == "dad" and summary["auto_reason"].endswith("Quality: the same gradient as ddp")
    if RANK == 0:
        assert "left out: powersgd, rank-dad (a fixed rank, or no error feedback, compresses without" in capsys.readouterr().out


@needs_ranks(2)
def test_method_auto_measures_the_network_when_not_told(shared_tmp):
    from hvd_lowcomm.auto import probe_link

    link = probe_link(probe_mb=1.0)
    assert 0 < link.latency < 1.0 and link.bandwidth > 1e6  # bytes/s: more than 8 Mbit/s on any host
    assert math.isfinite(link.bandwidth)


def test_the_planner_command_writes_its_tables(tmp_path, capsys):
    from hvd_lowcomm.plan import main as plan_main

    from data_prep import prepare_bundled

    data = tmp_path / "digits.h5"
    prepare_bundled("digits", data)
    code = plan_main(["--ranks", "8,64", "--links", "1gbit,100gbit", "--tflops", "10", "--out", str(tmp_path / "plan"),
                      "--model.name", "sil6", "--data.path", str(data)])
    assert code == 0
    text = (tmp_path / "plan" / "predicted.md").read_text()
    assert "## 1gbit" in text and "## 100gbit" in text and "| sil |" in text and "Break-even bandwidth" in text
    assert "8 ranks: ms (× ddp)" in text and "at 10 TFLOP/s" in text
    # auto's choice per link and rank count: always one that keeps quality, and on 1 Gbit/s,
    # with 10 TFLOP/s of compute, one that sends less than ddp
    keeping = costmodel.quality_keeping_methods(config.default_config())
    choices = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ")[1:]
               for line in text.split("would choose")[1].splitlines() if line.startswith("| ") and "gbit" in line}
    assert set(choices) == {"1gbit", "100gbit"} and all(c in keeping for cells in choices.values() for c in cells)
    assert "ddp" not in choices["1gbit"]
    rows = (tmp_path / "plan" / "predicted.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 2 * len(costmodel.predicted_methods())  # sil6 is an MLP every method trains
    assert plan_main(["--links", "fast", "--data.path", str(data)]) == 2
    assert "use a rate such as 1gbit" in capsys.readouterr().err

    def ddp_network_ms(node_link: str) -> float:  # ddp on 16 ranks, 4 per node, a 400 Gbit/s network
        out = tmp_path / node_link
        assert plan_main(["--ranks", "16", "--links", "400gbit", "--ranks-per-node", "4", "--node-link", node_link,
                          "--tflops", "10", "--out", str(out), "--model.name", "sil6", "--data.path", str(data)]) == 0
        rows = {row["method"]: row for row in csv.DictReader(open(out / "predicted.csv"))}
        return float(rows["ddp"]["network_ms"])  # the α-β time alone: compute is timed afresh on each run

    # nodes whose own links are slower than the network pace the ring (by their rate); faster ones do not
    slow, fast, faster = ddp_network_ms("40gbit"), ddp_network_ms("4000gbit"), ddp_network_ms("40000gbit")
    latency_ms = 2 * 4 * 2e-3  # 2⌈log2 16⌉ messages of 2 µs; the bytes' time scales with 1 / the pacing rate
    assert slow - latency_ms == pytest.approx(10 * (fast - latency_ms), rel=1e-6) and fast == pytest.approx(faster)
