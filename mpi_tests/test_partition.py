"""SIL and model parallelism: partitions, codes, cross-group evaluation and gradients, traffic."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import RANK, SIZE, needs_ranks
from hvd_lowcomm import config
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.data import DatasetInfo
from hvd_lowcomm.methods.mp import ModelParallel
from hvd_lowcomm.methods.sil import SyntheticIntermediateLabels, class_codes
from hvd_lowcomm.models import cnn, mlp
from hvd_lowcomm.methods.partition import pipeline_evaluate, pipeline_train_step
from hvd_lowcomm.train import main

INFO = DatasetInfo("mem", ("mem",), 3, (6,), (64,), (16,), "test", "float32", None, None)


def six_layer_mlp() -> nn.Sequential:
    torch.manual_seed(21)
    return mlp((6,), 3, [12, 10, 8, 8, 6])


@needs_ranks(2)
def test_an_explicit_cut_that_leaves_a_partition_affine_is_warned():
    method, _ = make(SyntheticIntermediateLabels, "sil", "--sil.cuts", "3")
    (warning,) = method.partition_warnings()
    assert "leave partition 0 (Flatten, Linear 6->12, ReLU)" in warning and "affine map" in warning
    method, _ = make(SyntheticIntermediateLabels, "sil")
    assert method.partition_warnings() == []


@needs_ranks(2)
def test_an_explicit_cut_inside_a_conv_net_is_warned_and_its_codes_are_channel_means():
    method = SyntheticIntermediateLabels(
        config.load(["--method", "sil", "--model.name", "cnn", "--sil.cuts", "8"]),
        DatasetInfo("mem", ("mem",), 3, (1, 8, 8), (64,), (16,), "test", "float32", None, None),
    )
    method.check_world(method.cfg, SIZE)
    method.setup(cnn((1, 8, 8), 3, [4, 4, 8, 8]))
    (warning,) = method.partition_warnings()
    assert "inside its convolutional part (cut 1, a 4x2x2 activation; its codes are per-channel means)" in warning
    assert method.codes[1].shape == (3, 4)  # one value per channel and class
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 1, 8, 8, generator=generator), torch.tensor([0, 1, 2, 0, 1])
    with torch.no_grad():  # looked at, not trained on
        loss = method.sil.loss(x, y)
    if method.layout.first:  # the channel means of its output are regressed onto the codes
        expected = F.mse_loss(method.model(x).mean((2, 3)), method.codes[1][y])
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    else:  # it learns from the codes spread over the 4x2x2 activation (plus noise)
        method.sil.noise = 0.0
        inputs = method.codes[1][y][:, :, None, None].expand(-1, 4, 2, 2)
        with torch.no_grad():
            assert method.sil.loss(x, y).item() == pytest.approx(
                F.cross_entropy(method.model(inputs), y).item(), rel=1e-5
            )


def test_partition_count_that_does_not_divide_the_world_is_rejected():
    method = ModelParallel(config.load(["--method", "mp", "--mp.partitions", str(SIZE + 1)]))
    with pytest.raises(ConfigError, match=f"cannot split {SIZE} ranks into {SIZE + 1} equal groups"):
        method.check_world(method.cfg, SIZE)


def make(method_cls, name: str, *argv: str):
    method = method_cls(config.load(["--method", name, "--train.lr", "0.01", *argv]), INFO)
    model = six_layer_mlp()
    method.check_world(method.cfg, SIZE)
    method.setup(copy.deepcopy(model))
    return method, model


def pooled_batch(seed: int = 4, n: int = 10):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=generator), torch.randint(0, 3, (n,), generator=generator)


@needs_ranks(2)
def test_codes_are_identical_on_all_ranks(world):
    method, _ = make(SyntheticIntermediateLabels, "sil", "--sil.kappa", "2.5")
    codes = method.codes[1]
    assert codes.shape == (3, *method.layout.shapes[1]) and 0 <= codes.min() and codes.max() <= 2.5
    assert codes.max() > 1.0  # scaled by kappa
    gathered = world.comm.allgather(codes.numpy())
    assert all((c == gathered[0]).all() for c in gathered)
    assert torch.equal(class_codes(method.code_seed, 1, 3, method.layout.shapes[1], 2.5, "uniform"), codes)


@needs_ranks(2)
def test_recovery_epochs_get_their_own_learning_rate_schedule(world, fresh_meter):
    """The loop's cosine spans training and recovery; recovery restarts it from recovery_lr ×
    the peak, rather than training the joined network at the tail of the training schedule."""
    method, _ = make(
        SyntheticIntermediateLabels, "sil", "--sil.recovery_epochs", "2", "--train.epochs", "4", "--train.lr", "0.01"
    )
    method.set_total_steps(60)  # 6 epochs of 10 steps: 40 training, 20 recovery
    rates = []
    for step in range(60):
        fresh_meter.step = step
        method.set_lr(123.0)  # whatever the loop's schedule says is overridden
        rates.append(method.optimizer.param_groups[0]["lr"] / method.lr_scale)
    assert rates[0] == pytest.approx(0.01) and rates[39] < 1e-4  # training: one cosine over 40 steps
    assert rates[40] == pytest.approx(0.003) and rates[59] < 6e-5  # recovery: a fresh one over 20,
    assert rates[50] == pytest.approx(0.0015, rel=0.05)  # from recovery_lr (0.3) x the peak


@needs_ranks(2)
def test_recovery_starts_from_a_fresh_optimiser_state(world, fresh_meter):
    """Adam's moments from the partition's own objective would set the size of the recovery
    steps; they are forgotten once, when recovery starts (not when a resumed run re-enters it)."""
    method, _ = make(SyntheticIntermediateLabels, "sil", "--sil.recovery_epochs", "1", "--train.epochs", "2")
    x, y = pooled_batch()
    method.start_epoch(1)
    method.train_step(x, y)
    assert method.optimizer.state  # Adam keeps moments per parameter
    method.start_epoch(2)
    method.train_step(x, y)
    moments = {id(p): state["exp_avg_sq"].clone() for p, state in method.optimizer.state.items()}
    method.start_epoch(3)  # the recovery epoch
    assert method.stage == "recovery" and not method.optimizer.state
    method.train_step(x, y)
    assert all(not torch.equal(state["exp_avg_sq"], moments[id(p)]) for p, state in method.optimizer.state.items())
    assert all(state["step"].item() == 1 for state in method.optimizer.state.values())
    method.start_epoch(3)  # entered again (a resumed run): the state is kept
    assert method.optimizer.state


@needs_ranks(2)
def test_cross_group_evaluation_equals_the_single_process_output(world):
    method, model = make(ModelParallel, "mp")
    x, y = pooled_batch()
    correct, count, loss_sum = pipeline_evaluate(method.layout, [(x, y)])
    if method.layout.last:
        with torch.no_grad():
            logits = model(x)
        assert count == 10 and correct == (logits.argmax(1) == y).sum().item()
        assert loss_sum == pytest.approx(F.cross_entropy(logits, y, reduction="sum").item(), rel=1e-6, abs=1e-6)
    else:
        assert (correct, count, loss_sum) == (0, 0, 0.0)


@needs_ranks(2)
def test_mp_gradients_equal_single_process_autograd(world, fresh_meter):
    method, model = make(ModelParallel, "mp", "--train.optimizer", "sgd", "--train.momentum", "0")
    # Each position in a group has its own batch; a group's ranks average their gradients.
    position, g = method.layout.group.rank_of(world.comm.Get_rank()), method.layout.group.size
    batches = [pooled_batch(seed=10 + p) for p in range(g)]
    reference = copy.deepcopy(model)
    sum(F.cross_entropy(reference(x), y) for x, y in batches).div(g).backward()
    for group in method.optimizer.param_groups:  # lr 0: only the gradients matter here
        group["lr"] = 0.0
    pipeline_train_step(method.layout, method.optimizer, *batches[position])
    start = method.layout.boundaries[method.layout.index]
    for name, param in method.model.named_parameters():
        index, attr = name.split(".", 1)
        expected = reference[int(index) + start].get_parameter(attr).grad
        torch.testing.assert_close(param.grad, expected, rtol=1e-5, atol=1e-6)
    sends = [r for r in fresh_meter.step_records if r.op == "send"]
    assert sends and all(r.name in ("mp.activations", "mp.gradients") for r in sends)
    # the partition's own passes are timed (the summary's step split), on every rank
    assert method.pass_seconds is method.layout.pass_seconds
    assert method.pass_seconds["forward"] > 0 and method.pass_seconds["backward"] > 0


@needs_ranks(2)
@pytest.mark.parametrize("mode, epochs", [("parallel", 2), ("sequential", 5)])
def test_sil_training_traffic_between_partitions(shared_tmp, mode, epochs):
    # sil6 by default; cut after its second layer, so the cut is 64 wide.
    # lr by the documented rule for Adam (docs/methods/sil.rst): × √(ranks per partition) (SIZE / 2), from 2e-3 for one
    argv = [
        "--method",
        "sil",
        "--sil.mode",
        mode,
        "--train.epochs",
        str(epochs),
        "--model.hidden",
        "64,64,32,32,32",
        "--train.lr",
        f"{0.002 * max(SIZE // 2, 1) ** 0.5:g}",
        "--sil.cuts",
        "5",
        "--data.path",
        str(shared_tmp / "digits.h5"),
        "--run.dir",
        str(shared_tmp / "runs"),
        "--run.name",
        mode,
        "--run.progress",
        "false",
    ]
    assert main(argv) == 0
    if RANK == 0:  # rank 0 holds the first partition
        rows = [json.loads(line) for line in (shared_tmp / "runs" / mode / "metrics.jsonl").read_text().splitlines()]
        epochs = [r for r in rows if r["type"] == "epoch"]
        summary = rows[-1]
        if mode == "parallel":
            assert len(epochs) == 2 and all(e["between_partitions_bytes"] == 0 for e in epochs)
            assert summary.get("train_send_world_wire_bytes", 0) == 0
            # the step is split like every method's: this partition's own passes are measured
            assert summary["step_ms_forward"] > 0 and summary["step_ms_backward"] > 0, summary
        else:  # the one transfer: outputs of the first partition for its share of the training set
            assert len(epochs) == 10  # 5 epochs per partition, one after the other
            rows_sent = len(range(0, 1438, SIZE // 2))
            assert epochs[-1]["between_partitions_bytes"] == rows_sent * 64 * 4
            assert epochs[-1]["test_acc"] > 0.5  # the joined network really learned
        assert epochs[-1]["parameter_fraction"] < 1.0
        joined = torch.load(shared_tmp / "runs" / mode / "model.pt")
        mlp((1, 8, 8), 10, [64, 64, 32, 32, 32]).load_state_dict(joined)  # the whole model, as one state dict


@needs_ranks(2)
def test_a_collapsed_partition_is_detected_at_evaluation(world):
    method, _ = make(SyntheticIntermediateLabels, "sil")
    x, y = pooled_batch(n=60)
    method.stage = "train"
    method.evaluate([(x, y)])
    if not method.layout.last:
        assert not method.diagnostics["collapsed"]  # untrained, but its outputs follow its inputs
        last_linear = [m for m in method.model if isinstance(m, nn.Linear)][-1]
        with torch.no_grad():  # its output no longer depends on the input: a constant
            last_linear.weight.zero_()
            last_linear.bias.fill_(1.0)
    method.evaluate([(x, y)])
    if not method.layout.last:
        assert method.diagnostics["collapsed"] and method.diagnostics["cut_spread"] == pytest.approx(0.0, abs=1e-6)
        # every sample lands on the same code, so the nearest code is right only for one class
        largest_class = max((y == c).sum().item() for c in range(3))
        assert round(method.diagnostics["code_accuracy"] * len(y)) <= largest_class


@needs_ranks(2)
def test_sil_refuses_a_shallow_model_on_every_rank_before_training(shared_tmp, capsys):
    argv = [
        "--method",
        "sil",
        "--model.name",
        "mlp",
        "--model.hidden",
        "32,32",
        "--data.path",
        str(shared_tmp / "digits.h5"),
        "--run.dir",
        str(shared_tmp / "runs"),
        "--run.progress",
        "false",
    ]
    assert main(argv) == 2
    if RANK == 0:
        assert "at least 4 weight layers; this model has 3" in capsys.readouterr().err
    assert not (shared_tmp / "runs").exists()


@needs_ranks(8)
@pytest.mark.parametrize("partitions", [2, 4])
def test_sil_at_scale_each_partition_trains_data_parallel_and_keeps_its_accuracy(shared_tmp, partitions):
    hidden = "64,64,64,64,64,64,64"
    # The documented rule for Adam (docs/methods/sil.rst): the learning rate grows with the square
    # root of the ranks that
    # average one partition's gradients (8 / K here; 1e-3 is the default for one).
    lr = f"{0.001 * (SIZE / partitions) ** 0.5:g}"
    argv = [
        "--method",
        "sil",
        "--sil.partitions",
        str(partitions),
        "--model.name",
        "mlp",
        "--model.hidden",
        hidden,
        "--train.lr",
        lr,
        "--data.path",
        str(shared_tmp / "digits.h5"),
        "--run.dir",
        str(shared_tmp / "runs"),
        "--run.name",
        f"k{partitions}",
        "--run.progress",
        "false",
    ]
    assert main(argv) == 0
    if RANK == 0:
        summary = json.loads((shared_tmp / "runs" / f"k{partitions}" / "summary.json").read_text())
        assert summary["world_size"] == 8 and len(summary["partitions"]) == partitions
        assert all(p["can_learn"] for p in summary["partitions"])
        assert summary["between_partitions_bytes"] == 0
        assert summary["within_partition_wire_bytes"] > 0  # 8 / K ranks average each partition's gradients
        assert summary["final_test_acc"] > 0.85, summary["final_test_acc"]


@needs_ranks(2)
def test_joined_state_dict_is_an_ordinary_state_dict_of_the_whole_model(world):
    method, model = make(ModelParallel, "mp")
    joined = method.joined_state_dict()
    if world.comm.Get_rank() == 0:
        assert set(joined) == set(model.state_dict())
        fresh = six_layer_mlp()
        fresh.load_state_dict(joined)
        for (name, a), b in zip(fresh.state_dict().items(), model.state_dict().values()):
            assert torch.equal(a, b), name
    else:
        assert joined is None
