"""AB-training: factorised layers, rank choice, groups, schedule, sync modes, optimiser state,
the final model, reporting."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from conftest import RANK, SIZE, needs_ranks
from hvd_lowcomm import config
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.methods.ab import AB
from hvd_lowcomm.checkpoint import Checkpointer
from hvd_lowcomm.train import main


def spectrum_matrix(spectrum: list[float], rows: int = 12, cols: int = 6, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, len(spectrum), generator=generator))
    v, _ = torch.linalg.qr(torch.randn(cols, len(spectrum), generator=generator))
    return u @ torch.diag(torch.tensor(spectrum)) @ v.T


def test_group_count_defaults_to_two_on_one_host_or_an_odd_count_s_divisor_and_is_checked(world):
    method = AB(config.load(["--method", "ab"]))
    # the tests run on one host: 2 groups, or on an odd rank count its smallest divisor (3 at np 3)
    expected = 2 if SIZE % 2 == 0 or SIZE == 1 else min(d for d in range(3, SIZE + 1, 2) if SIZE % d == 0)
    assert runtime.default_group_count(method.cfg.options.groups, SIZE) == expected
    if SIZE > 1:
        method.check_world(method.cfg, SIZE)
    else:
        with pytest.raises(ConfigError, match="cannot split 1 ranks into 2 equal groups"):
            method.check_world(method.cfg, SIZE)
    method = AB(config.load(["--method", "ab", "--ab.groups", str(SIZE + 1)]))
    with pytest.raises(ConfigError, match=f"cannot split {SIZE} ranks into {SIZE + 1} equal groups"):
        method.check_world(method.cfg, SIZE)
    with pytest.raises(ConfigError, match="needs at least 2 groups"):
        AB.check_world(config.load(["--method", "ab", "--ab.groups", "1"]), SIZE)
    AB.check_world(config.load(["--method", "ab", "--ab.groups", "1", "--ab.sync_mode", "only-b"]), SIZE)


def ab_method(*argv: str) -> AB:
    """AB on a tiny MLP; its cuts from the first re-factorisation on and without the rank floor
    unless argv says otherwise (these tests are about the rule, the floor of output error and
    the guards)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3))
    method = AB(
        config.load(
            [
                "--method",
                "ab",
                "--ab.groups",
                "2",
                "--train.lr",
                "0.01",
                "--ab.cut.min_rank_share",
                "0",
                "--ab.first_cut",
                "0",
                *argv,
            ]
        )
    )
    method.check_world(method.cfg, SIZE)
    method.setup(model)
    method.set_total_steps(100)  # resolves the schedule's fractions
    return method


def record_step_lrs(optimizer) -> list[float]:
    """The learning rate each optimizer.step() runs with, appended as it happens."""
    lrs: list[float] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: lrs.append(opt.param_groups[0]["lr"]))
    return lrs


def batch(step: int):
    generator = torch.Generator().manual_seed(100 * step + RANK)
    return torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)


@needs_ranks(2)
def test_group_phase_sends_nothing_across_groups_and_a_sync_leaves_every_rank_with_the_same_w(world, fresh_meter):
    method = ab_method("--ab.warmup", "2", "--ab.sync_every", "3", "--ab.full_rank_steps", "1")
    training_labels: dict[str, set[str]] = {}
    for step in range(6):
        method.train_step(*batch(step))
        records = fresh_meter.step_records
        training_labels.setdefault(method.trainer.phase, set()).update(
            r.group for r in records if r.name.startswith("ab.grad.")
        )
        if method.trainer.phase == "group":  # the first factorisation keeps every rank: nothing to agree on
            assert {r.name for r in records if r.group == "world"} == set()
        fresh_meter.next_step()
        if step == 4:  # last group step: the groups' models differ
            assert method.trainer.phase == "group" and method.trainer.layers["2"].factorized
    assert training_labels["group"] == {method.trainer.group.label}  # gradients averaged in this rank's group only
    assert training_labels["warmup"] == training_labels["full"] == {"world"}
    # step 5 began with a sync; afterwards every rank holds the same W
    weights = world.comm.allgather(method.trainer.layers["2"].layer.weight.detach().numpy())
    for w in weights[1:]:
        assert (w == weights[0]).all()


@needs_ranks(2)
@pytest.mark.parametrize("mode", ["with-stale", "only-learned"])
def test_sync_modes_combine_the_factors_as_specified(world, mode):
    method = ab_method("--ab.warmup", "0", "--ab.sync_mode", mode)
    method.train_step(*batch(0))  # factorises at step 0
    layer = method.trainer.layers["2"]
    generator = torch.Generator().manual_seed(9)  # the same on every rank
    a0, b0 = torch.randn(*layer.A.shape, generator=generator), torch.randn(*layer.B.shape, generator=generator)
    delta_a, delta_b = torch.randn(*a0.shape, generator=generator), torch.randn(*b0.shape, generator=generator)
    layer.A.data = a0 + delta_a if method.trainer.role == "A" else a0.clone()
    layer.B.data = b0 + delta_b if method.trainer.role == "B" else b0.clone()
    method.trainer._sync()
    expected = (a0 + delta_a / 2) @ (b0 + delta_b / 2) if mode == "with-stale" else (a0 + delta_a) @ (b0 + delta_b)
    torch.testing.assert_close(layer.tall_matrix(), expected, rtol=1e-5, atol=1e-5)
    assert not layer.factorized


@needs_ranks(2)
def test_lr_rebounds_after_a_switch_and_moments_follow_rank_changes(world):
    method = ab_method(
        "--ab.warmup",
        "2",
        "--ab.sync_every",
        "3",
        "--ab.full_rank_steps",
        "2",
        "--ab.rebound_steps",
        "4",
        "--ab.rebound_lr",
        "1e-5",
        "--ab.cut.rank_rule",
        "tau",
        "--ab.cut.tau",
        "0.3",
        "--ab.cut.max_output_error",
        "0.9",
        "--ab.cut.max_accuracy_drop",
        "1",
        "--ab.cut.max_loss_rise",
        "100",
        "--train.lr_schedule",
        "constant",
    )
    lrs = record_step_lrs(method.optimizer)
    for step in range(10):
        method.set_lr(0.01)
        method.train_step(*batch(step))
    assert method.optimizer.param_groups[0]["lr"] == 0.01  # the schedule's value is left as it was
    assert lrs[:2] == [0.01, 0.01]  # warm-up: no switch yet
    assert lrs[2] == pytest.approx(1e-5)  # step 2: switch to the group phase
    assert lrs[3] == pytest.approx(1e-5 + (0.01 - 1e-5) / 4)  # ramps back linearly
    assert lrs[5] == pytest.approx(1e-5)  # step 5: switch to the full phase
    layer = method.trainer.layers["2"]
    assert method.trainer.phase == "group" and layer.rank < 12  # step 7 re-factorised with truncation
    factor = getattr(layer, method.trainer.role)
    for value in method.optimizer.state[factor].values():
        if torch.is_tensor(value) and value.dim() == 2:
            assert value.shape == factor.shape


@needs_ranks(2)
def test_a_run_goes_through_every_phase_and_its_loss_decreases(shared_tmp):
    argv = [
        "--method",
        "ab",
        "--train.epochs",
        "6",
        "--data.path",
        str(shared_tmp / "digits.h5"),
        "--run.dir",
        str(shared_tmp / "runs"),
        "--run.name",
        "ab",
        "--run.progress",
        "false",
    ]
    assert main(argv) == 0
    if RANK == 0:
        rows = [json.loads(line) for line in (shared_tmp / "runs" / "ab" / "metrics.jsonl").read_text().splitlines()]
        epochs = [r for r in rows if r["type"] == "epoch"]
        assert {"warmup", "group", "full"} >= {e["phase"] for e in epochs} and len({e["phase"] for e in epochs}) >= 2
        assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
        assert epochs[-1]["test_acc"] > 0.8
        assert epochs[-1]["rank/3"] < 128  # re-factorised with truncation at least once
        assert epochs[-1]["inter_group_wire_bytes"] > 0 and epochs[-1]["intra_group_wire_bytes"] >= 0
        assert epochs[-1]["compression_ratio"] > 1.0
        assert (shared_tmp / "runs" / "ab" / "rank.png").exists()
        # model.pt is the synced model as a plain network: it scores what the last epoch reported
        import numpy as np

        from hvd_lowcomm import data, models

        info = data.inspect(shared_tmp / "digits.h5")
        model = models.build_model(config.load(argv).model, info.input_shape, info.num_classes)
        model.load_state_dict(torch.load(shared_tmp / "runs" / "ab" / "model.pt"))
        test = data.H5Split(info, "test")
        x, y = test.read(np.arange(len(test)))
        with torch.no_grad():
            accuracy = (model(x).argmax(1) == y).float().mean().item()
        assert accuracy == pytest.approx(epochs[-1]["test_acc"], abs=1e-6)  # one sample is 3e-3


@needs_ranks(2)
def test_lr_rebounds_at_every_sync_when_there_are_no_full_rank_steps(world):
    method = ab_method(
        "--ab.warmup",
        "2",
        "--ab.sync_every",
        "3",
        "--ab.full_rank_steps",
        "0",
        "--ab.rebound_steps",
        "2",
        "--ab.rebound_lr",
        "1e-5",
    )
    lrs = record_step_lrs(method.optimizer)
    for step in range(9):
        method.set_lr(0.01)
        method.train_step(*batch(step))
    # switches at step 2 (factorise), 5 and 8 (sync + re-factorise), each followed by the ramp
    assert lrs == pytest.approx([0.01, 0.01, 1e-5, 0.005005, 0.01, 1e-5, 0.005005, 0.01, 1e-5])


@needs_ranks(2)
def test_groups_run_free_the_loop_checks_group_steps_inside_the_group(world, fresh_meter):
    """No world collective during a group phase, not even the loop's per-step checks; a
    preemption signal is acted on at the first step where all ranks meet."""
    from types import SimpleNamespace

    method = ab_method("--ab.warmup", "2", "--ab.sync_every", "4", "--ab.full_rank_steps", "1")
    signal = SimpleNamespace(received=None)
    keeper = Checkpointer(method.cfg, method, None, signal)
    world_groups = {}
    for step in range(8):
        method.train_step(*batch(step))
        if step == 3:
            signal.received = 15  # SIGTERM arrives during the group phase
        assert keeper.agree(False) is False
        world_groups[step] = {r.group for r in fresh_meter.step_records if r.group == "world"}
        stopping = keeper.stopping
        fresh_meter.next_step()
        if step in (2, 3, 4):  # group steps whose next step is a group step too
            assert world_groups[step] == set() and not stopping, step
    assert world_groups[5] == {"world"} and keeper.stopping  # step 6 starts with a sync: the world meets


@needs_ranks(2)
def test_inter_group_bytes_count_every_world_collective(world, fresh_meter):
    method = ab_method("--ab.warmup", "1", "--ab.sync_every", "2", "--ab.full_rank_steps", "1")
    keeper = Checkpointer(method.cfg, method, None, None)
    for step in range(5):
        method.train_step(*batch(step))
        keeper.agree(False)
        fresh_meter.next_step()
    world = sum(
        t.wire_bytes
        for (phase, _, group), t in fresh_meter.by_kind.items()
        if group == "world" and phase in ("train", "control")
    )
    assert fresh_meter.total("control", group="world") > 0
    assert method.epoch_metrics()["inter_group_wire_bytes"] == world


@needs_ranks(2)
def test_individual_mode_trains_each_rank_s_own_factor_until_the_sync(world, fresh_meter):
    method = ab_method(
        "--ab.warmup", "1", "--ab.sync_every", "3", "--ab.full_rank_steps", "1", "--ab.comm", "individual"
    )
    for step in range(3):
        method.train_step(*batch(step))
        names = {r.name for r in fresh_meter.step_records}
        fresh_meter.next_step()
    assert not any(n.endswith((".A", ".B")) for n in names if n.startswith("ab.grad."))
    assert any(n.startswith("ab.grad.") for n in names)  # 1-D and dense layers still averaged in the group
    factor = getattr(method.trainer.layers["2"], method.trainer.role).detach()
    copies = world.comm.allgather(factor.numpy())
    group_copies = [copies[r] for r in method.trainer.group.ranks]
    if len(group_copies) > 1:  # each rank trained on its own batches
        assert not (group_copies[0] == group_copies[1]).all()
    for step in range(3, 5):  # step 4 syncs: one W everywhere
        method.train_step(*batch(step))
    weights = world.comm.allgather(method.trainer.layers["2"].layer.weight.detach().numpy())
    assert all((w == weights[0]).all() for w in weights)


@needs_ranks(2)
def test_only_b_trains_b_everywhere_and_may_use_one_group(world):
    method = ab_method(
        "--ab.warmup",
        "1",
        "--ab.sync_every",
        "2",
        "--ab.full_rank_steps",
        "1",
        "--ab.sync_mode",
        "only-b",
        "--ab.groups",
        "1",
    )
    assert method.trainer.role == "B" and len(method.trainer.all_groups) == 1
    method.train_step(*batch(0))
    method.train_step(*batch(1))  # group phase: B trained, A frozen
    layer = method.trainer.layers["2"]
    assert layer.B.requires_grad and not layer.A.requires_grad
    a_before = layer.A.detach().clone()
    method.train_step(*batch(2))
    method.train_step(*batch(3))  # sync: W = A0 B̄
    torch.testing.assert_close(layer.A.detach(), a_before)
    weights = world.comm.allgather(layer.layer.weight.detach().numpy())
    assert all((w == weights[0]).all() for w in weights)


@needs_ranks(2)
def test_ortho_sigma_init_sets_every_singular_value_to_one_on_every_rank(world):
    method = ab_method("--ab.init", "ortho-sigma", "--ab.warmup", "5")
    for name, p in method.model.named_parameters():
        if p.dim() == 2 and not name.endswith((".A", ".B")):
            torch.testing.assert_close(torch.linalg.svdvals(p.detach()), torch.ones(min(p.shape)), rtol=1e-4, atol=1e-4)
            copies = world.comm.allgather(p.detach().numpy())
            assert all((c == copies[0]).all() for c in copies)


def learnable_batch(step: int, n: int = 64):
    """A task the tiny model learns to high accuracy: the class is the argmax of a fixed map."""
    generator = torch.Generator().manual_seed(1000 * step + RANK)
    x = torch.randn(n, 6, generator=generator)
    return x, x[:, :3].argmax(1)


@needs_ranks(2)
@pytest.mark.parametrize(
    "guard",
    [
        ["--ab.cut.max_accuracy_drop", "0.02", "--ab.cut.max_loss_rise", "100"],
        ["--ab.cut.max_accuracy_drop", "1", "--ab.cut.max_loss_rise", "0.01"],
    ],
    ids=["accuracy", "loss"],
)
def test_a_cut_that_costs_accuracy_or_loss_is_undone_by_keeping_more_rank(world, guard):
    # A drastic rule (rank 1) with no floor; each guard alone must bring the batch's accuracy back.
    method = ab_method(
        "--ab.warmup",
        "60",
        "--ab.sync_every",
        "2",
        "--ab.full_rank_steps",
        "1",
        "--ab.cut.rank_rule",
        "tau",
        "--ab.cut.tau",
        "0.99",
        "--ab.cut.max_output_error",
        "0.99",
        *guard,
        "--ab.first_full_rank",
        "true",
    )
    for step in range(63):
        method.train_step(*learnable_batch(step))
    x, y = learnable_batch(63)
    method.train_step(x, y)  # step 63: re-factorisation
    assert method.trainer.undone_cuts >= 1 and method.trainer.layers["2"].rank > 1
    assert all(
        0.0 <= c["output_error"] <= 1.0 and 0.0 <= c["weight_error"] <= 1.0 for c in method.trainer.cuts.values()
    )
    with torch.no_grad():
        accuracy = (method.model(x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.8


@needs_ranks(2)
@pytest.mark.parametrize("share, floor", [(0.25, 3), (0.5, 6)])
def test_a_cut_keeps_at_least_its_share_of_the_smaller_side(world, share, floor):
    # the drastic rule (rank 1), no guard: the floor alone decides the 16 x 12 layer's rank
    method = ab_method(
        "--ab.warmup",
        "2",
        "--ab.sync_every",
        "2",
        "--ab.full_rank_steps",
        "1",
        "--ab.cut.rank_rule",
        "tau",
        "--ab.cut.tau",
        "0.99",
        "--ab.cut.max_output_error",
        "0.99",
        "--ab.cut.max_accuracy_drop",
        "1",
        "--ab.cut.max_loss_rise",
        "100",
        "--ab.cut.min_rank_share",
        str(share),
    )
    for step in range(6):  # factorised at 2 (full rank), cut at 5
        method.train_step(*batch(step))
    assert method.trainer.cuts["2"]["rank"] == floor == method.trainer.layers["2"].rank


@needs_ranks(2)
def test_re_factorisations_before_the_first_cut_keep_every_singular_value(world):
    # the drastic rule (rank 1), no guard, first_cut at step 9: re-factorised at 5 and 8 with
    # every singular value, cut at 11, the first re-factorisation from step 9 on
    method = ab_method(
        "--ab.warmup",
        "2",
        "--ab.sync_every",
        "2",
        "--ab.full_rank_steps",
        "1",
        "--ab.cut.rank_rule",
        "tau",
        "--ab.cut.tau",
        "0.99",
        "--ab.cut.max_output_error",
        "0.99",
        "--ab.cut.max_accuracy_drop",
        "1",
        "--ab.cut.max_loss_rise",
        "100",
        "--ab.first_cut",
        "9",
    )
    layer, ranks, cut = method.trainer.layers["2"], [], []
    for step in range(12):
        method.train_step(*batch(step))
        ranks.append(layer.rank)
        cut.append(bool(method.trainer.cuts))
    assert ranks[2:11] == [12] * 9 and not any(cut[:11])  # factorised at 2, re-factorised at 5 and 8: all kept
    assert ranks[11] == 1 == method.trainer.cuts["2"]["rank"]  # the rule's rank 1 at the first cut


@needs_ranks(2)
def test_the_final_model_is_the_synced_model_the_same_on_every_rank(world):
    method = ab_method("--ab.warmup", "1", "--ab.sync_every", "4", "--ab.full_rank_steps", "1")
    for step in range(3):  # ends inside the group phase: the groups' models differ
        method.train_step(*batch(step))
    final = method.final_state_dict()
    assert (final is not None) == (RANK == 0)
    synced = method.trainer.full_model().state_dict()
    assert set(synced) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}  # a plain model
    copies = world.comm.allgather({k: v.numpy() for k, v in synced.items()})
    for copy_ in copies:
        assert all((copy_[k] == copies[0][k]).all() for k in copy_)
    if RANK == 0:
        assert all(torch.equal(final[k], synced[k]) for k in synced)
    assert (
        method.trainer.phase == "group" and method.trainer.layers["2"].factorized
    )  # the groups' own state is untouched


@needs_ranks(2)
def test_compression_counts_a_and_b_of_every_factorised_layer_and_everything_dense(world):
    method = ab_method(
        "--ab.warmup",
        "1",
        "--ab.sync_every",
        "2",
        "--ab.full_rank_steps",
        "1",
        "--ab.cut.rank_rule",
        "tau",
        "--ab.cut.tau",
        "0.5",
        "--ab.cut.max_output_error",
        "0.99",
        "--ab.cut.max_accuracy_drop",
        "1",
        "--ab.cut.max_loss_rise",
        "100",
    )
    assert method.trainer.compression_ratio() == 1.0  # dense before the first factorisation
    for step in range(5):  # re-factorised at step 4
        method.train_step(*batch(step))
    r = method.trainer.layers["2"].rank
    assert r < 12
    dense = 6 * 16 + 16 + 12 + 12 * 3 + 3  # first and last layer, every bias
    full = dense + 16 * 12
    assert method.trainer.compression_ratio() == pytest.approx(full / (dense + r * (16 + 12)))
    metrics = method.epoch_metrics()
    assert metrics["compression_bound"] == pytest.approx(full / (dense + 16 + 12))
    assert metrics["low_rank_parameters"] == dense + r * (16 + 12)
    assert metrics["compression/2"] == pytest.approx(16 * 12 / (r * 28))


@needs_ranks(2)
@pytest.mark.parametrize("floor", [0.25, 1e-5])
def test_re_factorisations_after_a_cut_compute_only_the_leading_triplets_and_more_when_the_cut_needs_them(world, floor):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 3))
    with torch.no_grad():  # as if trained: a few learned directions over a small random bulk
        model[2].weight.copy_(
            spectrum_matrix([80.0, 60.0, 50.0, 40.0, 30.0, 20.0], 512, 512) + 0.3 * torch.randn(512, 512) / 512**0.5
        )
    method = AB(
        config.load(
            [
                "--method",
                "ab",
                "--ab.groups",
                "2",
                "--train.lr",
                "1e-4",
                "--ab.warmup",
                "1",
                "--ab.cut.min_rank_share",
                "0",
                "--ab.first_cut",
                "0",
                "--ab.sync_every",
                "2",
                "--ab.full_rank_steps",
                "1",
                "--ab.cut.max_accuracy_drop",
                "1",
                "--ab.cut.max_loss_rise",
                "100",
            ]
        )
    )  # an untrained model: its batch accuracy is noise
    method.setup(model)
    method.set_total_steps(100)
    layer = method.trainer.layers["2"]
    computed = []  # (leading asked for, complete) of every spectrum the re-factorisations take
    spectrum = layer.spectrum
    layer.spectrum = lambda leading=None: computed.append((leading, (s := spectrum(leading)).complete)) or s
    for step in range(8):  # factorise at 1 (full rank), cut at 4 (full SVD), cut again at 7
        method.train_step(*learnable_batch(step))
        if step == 4:
            assert computed[-1] == (512, True) and layer.rank == 6  # the learned directions
            method.trainer.options.cut.max_output_error = floor
            computed.clear()
    assert computed[0] == (6, False), computed  # the second cut starts from the last rank's triplets
    assert method.trainer.cuts["2"]["output_error"] <= floor
    ranks = world.comm.allgather(layer.rank)
    assert ranks == [ranks[0]] * SIZE
    if floor < 0.01:  # that floor needs the optimiser's updates too: the leading triplets did not suffice
        assert len(computed) > 1 and layer.rank > 6 + 8
    else:
        assert computed == [(6, False)] and layer.rank == 6


@needs_ranks(2)
def test_an_outer_step_at_the_sync_moves_every_weight_from_where_the_group_phase_began(world):
    """With ab.outer_lr and ab.outer_momentum, a sync is DiLoCo's outer step on W = A B and the
    dense parameters: pseudo-gradient (start - plain synced value), first Nesterov step
    (1 + momentum) times it; lr 1 and momentum 0 leave the plain average."""

    def run(*argv):
        method = ab_method("--ab.warmup", "2", "--ab.sync_every", "3", "--ab.full_rank_steps", "1", *argv)
        for step in range(5):  # warm-up 0-1, factorised at full rank at 2, group steps 2-4
            method.train_step(*learnable_batch(step))
            if step == 1:
                start = dense(method.model)
        with method.trainer.synced() as model:  # the sync the next step would take
            synced = dense(model)
        return start, synced

    def dense(model):  # the weights (W, not its factors) and biases
        return [p.detach().clone() for n, p in model.named_parameters() if not n.endswith((".A", ".B"))]

    start, plain = run()
    lr, momentum = 0.5, 0.9
    same_start, outer = run("--ab.outer_lr", str(lr), "--ab.outer_momentum", str(momentum))
    for s, s2, p, o in zip(start, same_start, plain, outer):
        torch.testing.assert_close(s, s2)
        torch.testing.assert_close(o, s - lr * (1 + momentum) * (s - p), rtol=1e-4, atol=1e-5)
    assert any((o - p).abs().max() > 1e-4 for p, o in zip(plain, outer))  # the outer step did move them
