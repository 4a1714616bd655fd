"""DiLoCo: inner steps in groups, the sharded outer step, fragments, compression, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import RANK, SIZE, member_parts, needs_ranks
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.methods.diloco import DiLoCo, fragment_bounds, shard_length, sync_due
from hvd_lowcomm.comm.wire_codecs import BLOCK, sparse_encode
from hvd_lowcomm.train import main

INNER_LR = 0.1


def small_model() -> nn.Sequential:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 5, generator=generator), torch.randint(0, 3, (6,), generator=generator)


def reference(
    world_size: int,
    groups: int,
    steps: int,
    every: int,
    fragments: int,
    outer_lr: float,
    outer_momentum: float,
    nesterov: bool,
    delay: int = 0,
    alpha: float = 0.0,
) -> list[nn.Sequential]:
    """Every group's model after `steps` steps, in one process: G copies trained with plain SGD
    on the mean gradient of their ranks' batches; each fragment's outer step (torch's SGD on the
    global copy, gradient = mean over groups of global - local) at its own steps, or, with a
    delay, the mean taken at those steps applied `delay` steps later, each group keeping alpha
    of its progress since."""
    size = world_size // groups
    models = [small_model() for _ in range(groups)]
    global_model = small_model()
    params = list(global_model.parameters())
    bounds = fragment_bounds([p.numel() for p in params], fragments)
    outer = torch.optim.SGD(params, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov and outer_momentum > 0)
    pending = {}  # fragment -> (step applied, mean pseudo-gradient per tensor, each group's parameters at the start)
    for step in range(1, steps + 1):
        inner_step(models, size, step)
        started = [f for f in range(fragments) if sync_due(step, f, every, fragments)]
        for f in started:
            pending[f] = (
                step + delay,
                [
                    torch.stack([params[i].detach() - list(m.parameters())[i].detach() for m in models]).mean(0)
                    for i in range(bounds[f], bounds[f + 1])
                ],
                [[p.detach().clone() for p in m.parameters()] for m in models],
            )
        due = [f for f in pending if pending[f][0] == step]
        if not due:
            continue
        outer.zero_grad(set_to_none=True)
        for f in due:
            for i, mean in zip(range(bounds[f], bounds[f + 1]), pending[f][1]):
                params[i].grad = mean
        outer.step()
        with torch.no_grad():
            for g, model in enumerate(models):
                for f in due:
                    for i in range(bounds[f], bounds[f + 1]):
                        p = list(model.parameters())[i]
                        p.copy_(params[i] + (alpha * (p - pending[f][2][g][i]) if delay else 0))
        for f in due:
            del pending[f]
    return models


def inner_step(models: list[nn.Sequential], size: int, step: int) -> None:
    """One inner step of every group's copy: plain SGD on the mean gradient of its ranks' batches."""
    for g, model in enumerate(models):
        grads = []
        for rank in range(g * size, (g + 1) * size):
            model.zero_grad()
            x, y = batch(rank, step)
            F.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= INNER_LR * torch.stack([gr[i] for gr in grads]).mean(0)


def eager_reference(
    world_size: int, groups: int, steps: int, every: int, outer_lr: float
) -> tuple[list[nn.Sequential], list[torch.Tensor]]:
    """Eager updates in one process: every group's model after `steps` steps, and the model a
    sync would give then. At each sync a group steps its own global copy by outer_lr times its
    own pseudo-gradient / G plus the previous sync's mean less its own part of that mean; the
    sync adds the other groups' outstanding parts and the mean of the progress since."""
    size = world_size // groups
    models = [small_model() for _ in range(groups)]
    copies = [[p.detach().clone() for p in small_model().parameters()] for _ in range(groups)]
    previous = None  # (mean, each group's own) of the last sync

    def exchange() -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        own = [[c - p.detach() for c, p in zip(copies[g], models[g].parameters())] for g in range(groups)]
        return [torch.stack([o[i] for o in own]).mean(0) for i in range(len(own[0]))], own

    def others(g: int, i: int) -> torch.Tensor:
        return previous[0][i] - previous[1][g][i] / groups if previous else 0

    for step in range(1, steps + 1):
        inner_step(models, size, step)
        if step % every:
            continue
        mean, own = exchange()
        for g in range(groups):
            copies[g] = [c - outer_lr * (o / groups + others(g, i)) for i, (c, o) in enumerate(zip(copies[g], own[g]))]
            with torch.no_grad():
                for p, c in zip(models[g].parameters(), copies[g]):
                    p.copy_(c)
        previous = mean, own
    mean, _ = exchange()
    synced = [c - outer_lr * (m + others(0, i)) for i, (c, m) in enumerate(zip(copies[0], mean))]
    return models, synced


def train(steps: int, **options) -> tuple[nn.Sequential, DiLoCo]:
    """DiLoCo on small_model for `steps` steps; the exchange is fp32 unless `compression` says
    otherwise, as the references compute it."""
    options.setdefault("compression", "none")
    model = small_model()
    diloco = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=INNER_LR), **options)
    for step in range(1, steps + 1):
        diloco.optimizer.zero_grad()
        x, y = batch(RANK, step)
        F.cross_entropy(model(x), y).backward()
        diloco.step()
    return model, diloco


CASES = [  # (fragments, outer_lr, outer_momentum, nesterov)
    (1, 0.7, 0.9, True),  # the paper's outer optimiser
    (1, 1.0, 0.0, False),  # plain periodic averaging
    (2, 0.7, 0.9, True),  # streaming: two fragments at staggered steps
    (3, 0.5, 0.5, False),  # heavy-ball momentum, three fragments
]


@needs_ranks(2)
@pytest.mark.parametrize("fragments, outer_lr, outer_momentum, nesterov", CASES)
def test_outer_steps_match_a_single_process_reference(world, fragments, outer_lr, outer_momentum, nesterov):
    groups = 2 if SIZE % 2 == 0 else SIZE
    model, diloco = train(
        11,
        groups=groups,
        sync_every=4,
        fragments=fragments,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        outer_nesterov=nesterov,
    )
    expected = reference(SIZE, groups, 11, 4, fragments, outer_lr, outer_momentum, nesterov)[diloco.group.index]
    for (name, got), want in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    assert diloco.outer_steps == sum(any(sync_due(s, f, 4, fragments) for f in range(fragments)) for s in range(1, 12))


@needs_ranks(2)
@pytest.mark.parametrize(
    "compression, momentum", [("none", 0.9), ("int2", 0.9), ("sparse", 0.9), ("lowrank", 0.9), ("int2", 0.0)]
)
def test_an_evaluations_trial_sync_gives_the_outer_step_and_leaves_no_trace(world, compression, momentum):
    """synced() at step 3 gives, bit for bit, the model of a run whose first outer step is at 3;
    trial syncs at steps 3, 6 and 7 (after an outer step: momentum and error feedback held)
    leave the run bitwise the run without them. The trial steps copies, never the global slices
    or outer state (sharded groups have no memory for clones of them)."""
    groups = 2 if SIZE % 2 == 0 else SIZE
    options = dict(groups=groups, sync_every=4, outer_lr=0.7, outer_momentum=momentum, compression=compression)
    plain_model, plain = train(10, **options)
    synced_at_three, _ = train(3, **{**options, "sync_every": 3})
    model = small_model()
    diloco = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=INNER_LR), **options)
    for step in range(1, 11):
        diloco.optimizer.zero_grad()
        x, y = batch(RANK, step)
        F.cross_entropy(model(x), y).backward()
        diloco.step()
        if step in (3, 6, 7):
            before = flat_parameters(model)
            with diloco.synced() as synced:
                trial = flat_parameters(synced)
            assert not torch.equal(trial, before) and torch.equal(flat_parameters(model), before)
            if step == 3 and compression != "sparse":  # sparse's groups keep their unsent part: not the global model
                assert torch.equal(trial, flat_parameters(synced_at_three))
    assert torch.equal(flat_parameters(model), flat_parameters(plain_model))
    (f,), (g,) = diloco.fragments, plain.fragments
    assert torch.equal(f.global_slice, g.global_slice)
    buffers = [o.outer.state[o.global_slice].get("momentum_buffer") for o in (f, g)]
    assert (buffers[0] is None) == (momentum == 0) and (momentum == 0 or torch.equal(*buffers))
    assert f.exchange.errors.keys() == g.exchange.errors.keys()
    assert all(torch.equal(f.exchange.errors[k], g.exchange.errors[k]) for k in f.exchange.errors)


@needs_ranks(2)
@pytest.mark.parametrize("fragments, alpha", [(1, 0.0), (1, 0.5), (2, 1.0)])
def test_a_delayed_exchange_lands_sync_delay_steps_later_keeping_alpha_of_the_progress(world, fragments, alpha):
    groups = 2 if SIZE % 2 == 0 else SIZE
    model, diloco = train(
        13,
        groups=groups,
        sync_every=6,
        fragments=fragments,
        outer_lr=0.7,
        outer_momentum=0.9,
        sync_delay=2,
        update_alpha=alpha,
    )
    expected = reference(SIZE, groups, 13, 6, fragments, 0.7, 0.9, True, delay=2, alpha=alpha)[diloco.group.index]
    for (name, got), want in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    # on the worker thread; fragment 0's exchange started at step 12 would land at 14
    assert diloco.worker is not None and in_flight(diloco) == [0]
    final = diloco.full_model()  # settles what is in flight; every rank gets one model
    flat = torch.cat([p.detach().flatten() for p in final.parameters()])
    assert all(torch.equal(other, flat) for other in world.comm.allgather(flat))


@needs_ranks(2)
@pytest.mark.parametrize("outer_lr", [1.0, 0.7])
def test_eager_updates_apply_the_own_part_at_once_and_the_others_one_period_later(world, outer_lr):
    groups = 2 if SIZE % 2 == 0 else SIZE
    model, diloco = train(13, groups=groups, sync_every=4, outer_lr=outer_lr, eager=True)
    models, synced = eager_reference(SIZE, groups, 13, 4, outer_lr)
    for (name, got), want in zip(model.named_parameters(), models[diloco.group.index].parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    # the exchange started at step 12 is still on the worker thread
    assert diloco.outer_steps == 3 and diloco.worker is not None and in_flight(diloco) == [0]
    final = diloco.full_model()  # adds the other groups' parts: every group gets the same model
    for (name, got), want in zip(final.named_parameters(), synced):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    flat = torch.cat([p.detach().flatten() for p in final.parameters()])
    for other in world.comm.allgather(flat):
        torch.testing.assert_close(other, flat, rtol=1e-5, atol=1e-6)


@needs_ranks(2)
@pytest.mark.parametrize(
    "options, message",
    [
        ({"sync_delay": 1}, "leave sync_delay at 0"),
        ({"outer_momentum": 0.9}, "needs plain averaging"),
        ({"fragments": 2}, "takes one fragment"),
    ],
)
def test_eager_refuses_what_it_cannot_do(world, options, message):
    model = small_model()
    with pytest.raises(ConfigError, match=message):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=6, eager=True, **options)


@needs_ranks(2)
def test_sync_delay_must_land_before_the_next_exchange_starts(world):
    model = small_model()
    with pytest.raises(ConfigError, match="diloco.sync_delay 3 must be below H / fragments = 6 / 2"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=6, fragments=2, sync_delay=3)


@needs_ranks(2)
def test_groups_differ_between_syncs_and_agree_after_one(world):
    model, diloco = train(3, groups=2 if SIZE % 2 == 0 else SIZE, sync_every=4)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = world.comm.allgather(flat)
    mine = diloco.group.ranks
    assert all(torch.equal(gathered[r], flat) for r in mine)  # a group holds one model
    assert not torch.equal(gathered[0], gathered[-1])  # the groups ran free
    diloco.optimizer.zero_grad()
    F.cross_entropy(model(batch(RANK, 4)[0]), batch(RANK, 4)[1]).backward()
    diloco.step()  # the fourth step: an outer step
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert all(torch.equal(other, flat) for other in world.comm.allgather(flat))
    assert diloco.agreement_group() is None  # the world met in this step


def in_flight(diloco: DiLoCo) -> list[int]:
    """The fragments whose exchange is in flight."""
    return [f.index for f in diloco.fragments if f.in_flight is not None]


def flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@needs_ranks(2)
@pytest.mark.parametrize("unsent_share", [1.0, 0.0])
def test_sparse_groups_keep_their_share_of_what_they_did_not_send_and_nothing_is_lost(world, unsent_share):
    """With keep_unsent (the default) each group's model after an outer step is the new global
    model less its share (unsent_share; 0: 1/G) of what its exchange left unsent (Δ = global -
    local), so the groups differ, and the accumulator keeps the rest; the mean of their models,
    less what the accumulators and the column's owners hold back, is the mean before the step
    (plain averaging): the sparse exchange delays progress but drops none. Evaluation's synced
    model is still one for all."""
    share = unsent_share or 1 / SIZE
    model, diloco = train(
        3, groups=SIZE, sync_every=4, compression="sparse", sparse={"density": 0.1, "unsent_share": unsent_share}
    )
    diloco.optimizer.zero_grad()
    x, y = batch(RANK, 4)
    F.cross_entropy(model(x), y).backward()
    before = flat_parameters(model) - INNER_LR * torch.cat([p.grad.flatten() for p in model.parameters()])
    numbers, part = len(before), -(-len(before) // SIZE)
    delta = diloco.fragments[0].global_slice.detach()[:numbers] - before  # the first outer step: no error yet
    parts = member_parts(delta, SIZE) if SIZE > 2 else [delta]
    unsent = delta - torch.cat([sparse_encode(p, 0.1)[1] for p in parts])[:numbers]
    diloco.step()  # the fourth step: inner SGD, then the outer step
    after = flat_parameters(model)
    # the share handed to the model (the next Δ carries it), the rest left in the accumulator
    kept = diloco.fragments[0].exchange.errors.get(0, torch.zeros(numbers))
    torch.testing.assert_close(kept, (1 - share) * unsent, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(
        diloco.fragments[0].global_slice.detach()[:numbers] - after, share * unsent, atol=1e-6, rtol=1e-5
    )
    # beyond 2 groups each column member owns a part of the mean and holds back what its second
    # selection left out (in Δ's units: the global model stays that much above the mean)
    owned = diloco.fragments[0].exchange.owner_errors.get(0, torch.zeros(part))
    owners = torch.cat(world.comm.allgather(owned))[:numbers]
    mean_after, mean_before = (torch.stack(world.comm.allgather(v)).mean(0) for v in (after, before))
    waiting = torch.stack(world.comm.allgather(kept)).mean(0)
    torch.testing.assert_close(mean_after - owners - waiting, mean_before, atol=1e-6, rtol=1e-5)
    gathered = world.comm.allgather(after)
    assert not torch.equal(gathered[0], gathered[1])  # each group kept its own unsent progress
    final = flat_parameters(diloco.full_model())
    assert all(torch.equal(final, other) for other in world.comm.allgather(final))


@needs_ranks(2)
def test_without_keep_unsent_sparse_groups_restart_from_the_global_model(world):
    model, diloco = train(
        4, groups=SIZE, sync_every=4, compression="sparse", sparse={"density": 0.1, "keep_unsent": False}
    )
    after = flat_parameters(model)
    assert all(torch.equal(after, other) for other in world.comm.allgather(after))
    assert diloco.fragments[0].exchange.errors[0].abs().max() > 0  # the exchange holds the unsent part instead


@needs_ranks(2)
def test_the_exchange_between_groups_is_sharded_and_int8_sends_a_quarter(world, fresh_meter):
    groups = 2 if SIZE % 2 == 0 else SIZE
    _, plain = train(4, groups=groups, sync_every=4)
    numbers = sum(p.numel() for p in small_model().parameters())
    slice_numbers = shard_length(numbers, plain.group.size)
    column = [t for (phase, op, group), t in fresh_meter.by_kind.items() if group.startswith("column")]
    assert sum(t.payload_bytes for t in column) == 4 * slice_numbers  # one fp32 slice, once
    fresh_meter.reset()
    model, quantised = train(4, groups=groups, sync_every=4, compression="int8")
    column = {op: t for (phase, op, group), t in fresh_meter.by_kind.items() if group.startswith("column")}
    # reduce-scatter: chunk j of the slice to column member j, int8 values + fp32 scales per block
    chunk = -(-slice_numbers // groups)
    chunk_bytes = chunk + 4 * -(-chunk // BLOCK)
    assert column["alltoall"].payload_bytes == groups * chunk_bytes
    assert column["allgather"].payload_bytes == chunk_bytes  # the mean of its own chunk, requantised
    assert quantised.fragments[0].exchange.errors[0].abs().max() > 0  # what rounding dropped waits for the next sync
    reference_model, _ = train(4, groups=groups, sync_every=4)
    for got, want in zip(model.parameters(), reference_model.parameters()):  # int8 is close to fp32's step
        assert (got - want).abs().max() < 0.02 * want.abs().max() + 1e-3


def test_a_group_count_that_does_not_divide_the_ranks_stops_before_training(shared_tmp, capsys):
    code = main(
        [
            "--method",
            "diloco",
            "--diloco.groups",
            str(SIZE + 1),
            "--data.path",
            str(shared_tmp / "d.h5"),
            "--run.dir",
            str(shared_tmp / "runs"),
        ]
    )
    assert code == 2
    if RANK == 0:
        assert f"cannot split {SIZE} ranks into {SIZE + 1} equal groups" in capsys.readouterr().err


@needs_ranks(2)
def test_diloco_trains_from_the_command_line_and_keeps_its_traffic_between_groups_small(shared_tmp):
    common = [
        "--train.epochs",
        "3",
        "--data.path",
        str(shared_tmp / "digits.h5"),
        "--run.dir",
        str(shared_tmp),
        "--run.progress",
        "false",
    ]
    assert main(["--method", "diloco", "--run.name", "diloco", *common]) == 0
    assert main(["--method", "ddp", "--run.name", "ddp", *common]) == 0
    if RANK == 0:
        diloco, ddp = (json.loads((shared_tmp / name / "summary.json").read_text()) for name in ("diloco", "ddp"))
        assert diloco["outer_steps"] > 0 and diloco["final_test_acc"] > 0.7
        # between groups: one slice per H steps against ddp's whole-model allreduce every step
        assert diloco["inter_group_wire_bytes"] < 0.5 * ddp["train_wire_bytes"]
        assert (shared_tmp / "diloco" / "model.pt").exists()
