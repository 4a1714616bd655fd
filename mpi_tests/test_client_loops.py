"""Client code as users write it, through every drop-in wrapper: Horovod's example idioms and a
DDP/nanoGPT loop (accumulation, clip before step, GradScaler, set_to_none, weight-decay groups,
tied weights, LR written into param_groups), each against one process training on the pooled
batch; and ABTraining / DiLoCo with the loop's GradScaler."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_lowcomm as hl
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.comm import runtime
from conftest import SIZE, clean_env, mpirun

WRAPPERS = ("ddp", "ddp-fp16", "powersgd", "dad", "rank-dad")
# How close each wrapper's model comes to one process on the pooled batch after a few steps
# (rtol, atol): exact ones to float32 rounding; fp16 on the wire (PowerSGD's warm-up steps send
# the plain mean in float16) to its rounding, which a clip applied before the exchange exceeds;
# rank-dAD at full rank (see wrap) to its float16 rows' rounding.
TOLERANCE = {
    "ddp": (1e-4, 1e-5),
    "dad": (1e-4, 1e-5),
    "edad": (1e-4, 1e-5),
    "ddp-fp16": (1e-4, 1e-3),
    "powersgd": (1e-4, 1e-3),
    "rank-dad": (1e-4, 2e-4),
}


class TinyGPT(nn.Module):
    """nanoGPT's shape in miniature: tied embedding and head, a pre-norm MLP block, and
    `model(idx)` giving the last position's logits unless targets are passed."""

    def __init__(self, vocab: int = 16, width: int = 8, context: int = 6) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as nanoGPT's

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        x = x + self.proj(F.gelu(self.fc(self.ln(x))))
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def wrap(name: str, optimizer: torch.optim.Optimizer, model: nn.Module, **horovod_arguments):
    """The one changed line, with Horovod's arguments as its examples pass them."""
    import horovod.torch as hvd

    arguments = {
        "named_parameters": model.named_parameters(),
        "op": hvd.Average,
        "gradient_predivide_factor": 1.0,
        "compression": hvd.Compression.fp16 if name == "ddp-fp16" else hvd.Compression.none,
        **horovod_arguments,
    }
    if name in ("ddp", "ddp-fp16"):
        return hl.DistributedOptimizer(optimizer, **arguments)
    if name == "powersgd":
        return hl.PowerSGDOptimizer(optimizer, **arguments)
    # plan "all": rows shared for every layer that has them (these small layers would be
    # allreduced by the cost rule, and the rows are the path under test); rank-dAD at a rank
    # above these layers' sizes: its factors are then exact (bar float16 rounding), so that a
    # lost clip shows beyond their approximation; and from the first step (no exact start)
    mode = {
        "dad": {"mode": "exact"},
        "rank-dad": {"mode": "rank", "rank": 32, "start_iter": 0},
        "edad": {"mode": "edad"},
    }[name]
    return hl.DadOptimizer(optimizer, **arguments, model=model, plan="all", **mode)


def gpt_batches(steps: int, micro: int, rows: int = 4, context: int = 6, vocab: int = 16):
    """Every rank's micro-batches of every step, the same on every rank (each takes its own)."""
    g = torch.Generator().manual_seed(11)
    data = torch.randint(0, vocab, (steps, runtime.size(), micro, rows, context + 1), generator=g)
    return data[..., :-1], data[..., 1:]


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """nanoGPT's optimizer groups: matrices decay, vectors do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def nanogpt_loop(
    model: nn.Module, optimizer, steps: int, micro: int, accumulate: str, clip: float, scaler, rank: int | None
) -> list[float]:
    """nanoGPT's train loop: LR written into param_groups each iteration, `micro` micro-batches
    (the loss divided by their count), the sync held back on all but the last, the gradient
    unscaled and clipped before the step, zero_grad(set_to_none=True) after it. `rank` None:
    the reference, one process over every rank's micro-batches."""
    inputs, targets = gpt_batches(steps, micro)
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = 0.5 * (step + 1) / steps
        ranks = range(runtime.size()) if rank is None else [rank]
        parts = [(r, m) for r in ranks for m in range(micro)]
        for index, (r, m) in enumerate(parts):
            last = index == len(parts) - 1
            if accumulate == "require_backward_grad_sync":
                optimizer.require_backward_grad_sync = last
            context = optimizer.no_sync() if accumulate == "no_sync" and not last else _nothing()
            with context:
                _, loss = model(inputs[step, r, m], targets[step, r, m])
                loss = loss / len(parts)
                (scaler.scale(loss) if scaler is not None else loss).backward()
            losses.append(float(loss.detach()))
        if scaler is not None:
            scaler.unscale_(optimizer)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def trained_gpt(
    wrapper: str | None,
    accumulate: str = "backward_passes_per_step",
    clip: float = 0.0,
    scaled: bool = False,
    steps: int = 3,
    micro: int = 2,
) -> nn.Module:
    """TinyGPT after the nanoGPT loop through `wrapper` on this rank's data (None: the
    reference on the pooled data in one process)."""
    torch.manual_seed(0)
    model = TinyGPT()
    # SGD rather than nanoGPT's AdamW: Adam divides most of a clip's effect away, which would
    # hide a lost clip from these tests
    optimizer = torch.optim.SGD(decay_groups(model, 0.1), lr=0.5, momentum=0.9)
    if wrapper is not None:
        passes = micro if accumulate == "backward_passes_per_step" else 1
        optimizer = wrap(wrapper, optimizer, model, backward_passes_per_step=passes)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaled else None
    nanogpt_loop(model, optimizer, steps, micro, accumulate, clip, scaler, None if wrapper is None else runtime.rank())
    return model


def same_on_every_rank(model: nn.Module) -> None:
    from mpi4py import MPI

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    rank0 = flat.copy()
    MPI.COMM_WORLD.Bcast(rank0, root=0)
    assert (flat == rank0).all(), "the ranks' models differ"


def distance(model: nn.Module, other: nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(model.parameters(), other.parameters()))


def assert_close_to(model: nn.Module, reference: nn.Module, rtol: float, atol: float) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# -- one wrapping line, Horovod's arguments ------------------------------------------------------


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_every_wrapper_takes_horovods_arguments(world, wrapper):
    import horovod.torch as hvd

    model = TinyGPT()
    opt = wrap(
        wrapper,
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        backward_passes_per_step=2,
        sparse_as_dense=True,
        num_groups=0,
        groups=None,
        process_set=hvd.global_process_set,
    )
    assert isinstance(opt, torch.optim.SGD) and opt.backward_passes_per_step == 2


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_what_a_wrapper_cannot_honour_is_refused_at_construction_with_the_reason(world, wrapper):
    import horovod.torch as hvd

    model = TinyGPT()
    with pytest.raises(ConfigError, match="not hvd.Adasum: Adasum"):
        wrap(wrapper, torch.optim.SGD(model.parameters(), lr=0.1), model, op=hvd.Adasum)
    with pytest.raises(ConfigError, match="needs op=hvd.Average"):
        wrap(wrapper, torch.optim.SGD(model.parameters(), lr=0.1), model, op=hvd.Sum, gradient_predivide_factor=2.0)


def test_exact_dad_refuses_fp16_compression_saying_what_to_use(world):
    import horovod.torch as hvd

    model = TinyGPT()
    with pytest.raises(ConfigError, match="rows are exact.*mode='rank'"):
        hl.DadOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            compression=hvd.Compression.fp16,
            model=model,
        )
    with pytest.raises(ConfigError, match="needs the model"):
        hl.DadOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_op_sum_gives_the_sum_over_ranks(world, wrapper):
    import horovod.torch as hvd

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    _opt = wrap(wrapper, torch.optim.SGD(model.parameters(), lr=0.1), model, op=hvd.Sum)  # its hooks reduce
    x = torch.randn(runtime.size(), 8, 6, generator=torch.Generator().manual_seed(3))
    model(x[runtime.rank()]).pow(2).mean().backward()
    summed = model[2].bias.grad.clone()
    reference = copy.deepcopy(model)
    reference.zero_grad()
    sum(reference(x[r]).pow(2).mean() for r in range(runtime.size())).backward()
    torch.testing.assert_close(summed, reference[2].bias.grad, rtol=2e-3, atol=1e-5)


# -- Horovod's MNIST example idioms --------------------------------------------------------------


@pytest.mark.parametrize("wrapper", WRAPPERS + ("edad",))
def test_horovods_example_loop_with_broadcast_after_the_wrap(world, fresh_meter, wrapper):
    """hvd.broadcast_parameters / broadcast_optimizer_state after the wrap (Horovod's examples),
    then zero_grad, forward, backward, step: no phantom exchange, every rank the same model,
    the exact wrappers equal to one process on the pooled batch."""
    import horovod.torch as hvd

    torch.manual_seed(runtime.rank())  # different on each rank until the broadcast
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4))
    opt = wrap(wrapper, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), model)
    # Horovod's own functions on its engine; hvd_lowcomm's, which take the same arguments, on torch's
    broadcasts = hvd if runtime.engine().name == "horovod" else hl
    broadcasts.broadcast_parameters(model.state_dict(), root_rank=0)
    broadcasts.broadcast_optimizer_state(opt, root_rank=0)
    assert fresh_meter.total("train", op="allgather") == 0
    reference = copy.deepcopy(model)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.5)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x, y = torch.randn(runtime.size(), 8, 4, 4, generator=g), torch.randint(0, 4, (runtime.size(), 8), generator=g)
        opt.zero_grad()
        F.nll_loss(F.log_softmax(model(x[runtime.rank()]), 1), y[runtime.rank()]).backward()
        opt.step()
        reference_opt.zero_grad()
        F.nll_loss(F.log_softmax(reference(x.flatten(0, 1)), 1), y.flatten()).backward()
        reference_opt.step()
    same_on_every_rank(model)
    if wrapper == "powersgd":
        assert opt.powersgd.iter == 3, "broadcast_optimizer_state's step was taken for a training step"
    assert_close_to(model, reference, *TOLERANCE[wrapper])


# -- a DDP / nanoGPT loop -----------------------------------------------------------------------


@pytest.mark.parametrize("accumulate", ["backward_passes_per_step", "no_sync", "require_backward_grad_sync"])
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_nanogpt_loop_with_accumulation_matches_one_process_on_the_pooled_batch(world, wrapper, accumulate):
    model = trained_gpt(wrapper, accumulate)
    same_on_every_rank(model)
    assert_close_to(model, trained_gpt(None), *TOLERANCE[wrapper])


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_accumulation_exchanges_once_per_optimizer_step(world, fresh_meter, wrapper):
    def exchanges() -> int:
        calls = sum(t.calls for (phase, _, _), t in fresh_meter.by_kind.items() if phase == "train")
        fresh_meter.reset()
        return calls

    trained_gpt(wrapper, "no_sync", steps=2, micro=1)
    once = exchanges()
    for accumulate in ("no_sync", "backward_passes_per_step", "require_backward_grad_sync"):
        trained_gpt(wrapper, accumulate, steps=2, micro=3)
        assert exchanges() == once, accumulate


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_clip_between_backward_and_step_takes_effect_on_every_rank(world, wrapper):
    """With the clip lost, the model would be the unclipped reference's, farther away."""
    clipped = trained_gpt(wrapper, clip=0.05)
    same_on_every_rank(clipped)
    reference, unclipped = trained_gpt(None, clip=0.05), trained_gpt(None)
    assert_close_to(clipped, reference, *TOLERANCE[wrapper])
    assert distance(clipped, reference) < distance(clipped, unclipped) / 4


@pytest.mark.parametrize("clip", [0.0, 0.05])
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_gradscaler_unscales_before_the_clip_and_steps_through_the_wrapper(world, wrapper, clip):
    """Unscaled (a lost unscale_ steps with the gradient times 1024), then clipped."""
    scaled = trained_gpt(wrapper, clip=clip, scaled=True)
    same_on_every_rank(scaled)
    assert_close_to(scaled, trained_gpt(None, clip=clip), *TOLERANCE[wrapper])


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_horovods_synchronize_then_skip_synchronize_idiom_still_clips_the_pooled_gradient(world, wrapper):
    def run(horovod_idiom: bool) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        if horovod_idiom:
            opt = wrap(wrapper, opt, model)
        g = torch.Generator().manual_seed(4)
        for _ in range(3):
            x = torch.randn(runtime.size(), 8, 6, generator=g)
            opt.zero_grad()
            if horovod_idiom:
                model(x[runtime.rank()]).pow(2).mean().backward()
                opt.synchronize()
            else:
                model(x.flatten(0, 1)).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            if horovod_idiom:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        return model

    assert_close_to(run(True), run(False), *TOLERANCE[wrapper])


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_state_dict_loaded_after_the_wrap_with_tensor_swapping_still_exchanges(world, wrapper):
    """torch.__future__.set_swap_module_params_on_conversion(True) makes load_state_dict swap a
    parameter's contents, its gradient hook with them: the step must still pool the gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    opt = wrap(wrapper, torch.optim.SGD(model.parameters(), lr=0.5), model)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.load_state_dict(copy.deepcopy(model.state_dict()))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    x = torch.randn(runtime.size(), 8, 6, generator=torch.Generator().manual_seed(4))
    for _ in range(2):
        opt.zero_grad()
        model(x[runtime.rank()]).pow(2).mean().backward()
        opt.step()
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(2):
        reference_opt.zero_grad()
        reference(x.flatten(0, 1)).pow(2).mean().backward()
        reference_opt.step()
    same_on_every_rank(model)
    assert_close_to(model, reference, *TOLERANCE[wrapper])


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_sparse_embedding_gradient_is_pooled_dense(world, wrapper):
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 4, sparse=True)
    model = nn.Sequential(embedding, nn.Flatten(), nn.Linear(8, 2))
    _opt = wrap(wrapper, torch.optim.SGD(model.parameters(), lr=0.1), model, sparse_as_dense=True)  # its hooks reduce
    idx = torch.randint(0, 10, (runtime.size(), 5, 2), generator=torch.Generator().manual_seed(6))
    model(idx[runtime.rank()]).sum().backward()
    pooled = embedding.weight.grad.clone()
    reference = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 2))
    reference.load_state_dict(model.state_dict())
    sum(reference(idx[r]).sum() for r in range(runtime.size())).backward()
    torch.testing.assert_close(pooled, reference[0].weight.grad / runtime.size(), rtol=1e-3, atol=2e-3)


# -- PyTorch's optimizer contract ---------------------------------------------------------------


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_state_loaded_before_the_wrap_is_kept(world, wrapper):
    model = TinyGPT()
    trained = torch.optim.AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():
        trained.state[p] = {"step": torch.tensor(7.0), "exp_avg": torch.ones_like(p), "exp_avg_sq": torch.ones_like(p)}
    saved = copy.deepcopy(trained.state_dict())
    fresh = torch.optim.AdamW(model.parameters(), lr=0.01)
    fresh.load_state_dict(saved)
    opt = wrap(wrapper, fresh, model)
    state = opt.state_dict()["state"]
    assert len(state) == len(saved["state"]) and all(float(s["step"]) == 7.0 for s in state.values())


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_parameter_group_added_after_the_wrap_is_exchanged(world, wrapper):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    extra = nn.Parameter(torch.zeros(3))
    opt = wrap(wrapper, torch.optim.SGD(model.parameters(), lr=0.1), model)
    opt.add_param_group({"params": [extra]})
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(runtime.rank()))
    (model(x) + extra).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    from mpi4py import MPI

    values = MPI.COMM_WORLD.allgather(extra.detach().clone())
    assert all(torch.equal(v, values[0]) for v in values)


def test_a_process_set_averages_inside_it(world):
    group, groups = runtime.split_world(num_groups=min(2, runtime.size()), label="clientset")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    # Horovod's process set on its engine; hvd_lowcomm's group (which either engine takes) on torch's
    where = {"process_set": group.process_set} if runtime.engine().name == "horovod" else {"group": group}
    opt = hl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), **where)
    model(torch.full((1, 4), float(runtime.rank()))).sum().backward()
    expected = sum(group.ranks) / group.size
    torch.testing.assert_close(model.weight.grad, torch.full((2, 4), expected))
    opt.step()


# -- AB-training and DiLoCo ---------------------------------------------------------------------


def test_ab_refuses_a_model_whose_output_does_not_fit_the_labels_before_training(world):
    model = TinyGPT()
    inputs, targets = gpt_batches(1, 1)
    x, y = inputs[0, runtime.rank(), 0], targets[0, runtime.rank(), 0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ConfigError, match=r"ab.step\(\{'idx': x, 'targets': y\}\)"):
        hl.ABTraining(model, opt, total_steps=20, groups=2, sync_mode="only-b", example=(x, y.reshape(-1)))


def test_ab_with_keyword_inputs_trains_and_its_full_model_loads_into_the_users_class(world):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ab = hl.ABTraining(
        model,
        opt,
        total_steps=6,
        groups=min(2, runtime.size()),
        sync_mode="only-b",
        warmup=2,
        sync_every=2,
        full_rank_steps=1,
    )
    inputs, targets = gpt_batches(6, 1)
    for step in range(6):
        x, y = inputs[step, runtime.rank(), 0], targets[step, runtime.rank(), 0]
        with ab.step({"idx": x, "targets": y}):
            opt.zero_grad(set_to_none=True)
            model(x, y)[1].backward()
    state = ab.full_model().state_dict()
    TinyGPT().load_state_dict(state)  # strict: the user's own class, no .A / .B keys


@pytest.mark.parametrize("trainer", ["ab", "diloco"])
def test_a_gradscaler_given_to_ab_and_diloco_is_unscaled_before_their_step(world, trainer):
    def run(scaled: bool) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaled else None
        groups = min(2, runtime.size())
        if trainer == "ab":
            owner = hl.ABTraining(
                model,
                opt,
                total_steps=4,
                groups=groups,
                sync_mode="only-b",
                warmup=2,
                sync_every=2,
                full_rank_steps=1,
                clip_grad_norm=0.5,
                scaler=scaler,
            )
        else:
            owner = hl.DiLoCo(model, opt, total_steps=4, groups=groups, sync_every=2, clip_grad_norm=0.5, scaler=scaler)
        g = torch.Generator().manual_seed(9)
        for _ in range(4):
            x = torch.randn(runtime.size(), 8, 6, generator=g)[runtime.rank()]
            y = torch.randint(0, 3, (runtime.size(), 8), generator=g)[runtime.rank()]
            loss = lambda: F.cross_entropy(model(x), y)  # noqa: E731
            if trainer == "ab":
                with owner.step(x, y):
                    opt.zero_grad()
                    (scaler.scale(loss()) if scaled else loss()).backward()
            else:
                opt.zero_grad()
                (scaler.scale(loss()) if scaled else loss()).backward()
                owner.step()
        return owner.full_model()

    assert_close_to(run(True), run(False), rtol=1e-4, atol=1e-6)


# -- set-up order -------------------------------------------------------------------------------


@pytest.mark.skipif(SIZE > 1, reason="launches a job of its own")
def test_after_the_users_hvd_init_wrappers_train_and_groups_say_to_remove_it(tmp_path):
    """Horovod started by the script's own hvd.init() cannot be restarted with dynamic process
    sets (it finalises the MPI it started): the drop-in wrappers train on it; DiLoCo, which
    needs groups, stops with the line to change, on every rank, with a non-zero exit."""
    script = tmp_path / "client.py"
    script.write_text(
        textwrap.dedent("""
        import horovod.torch as hvd
        import torch
        import hvd_lowcomm
        hvd.init()
        hvd_lowcomm.init()
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp = hvd_lowcomm.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        model(torch.randn(3, 4)).sum().backward()
        ddp.step()
        print(f"rank {hvd.rank()} trained on {hvd.size()} ranks", flush=True)  # one write: lines stay whole
        hvd_lowcomm.DiLoCo(model, opt, sync_every=2, groups=2)
    """)
    )
    done = subprocess.run(
        mpirun(2, sys.executable, str(script)), env=clean_env(), capture_output=True, text=True, timeout=300
    )
    output = done.stdout + done.stderr
    assert "rank 0 trained on 2 ranks" in output and "rank 1 trained on 2 ranks" in output, output
    assert done.returncode != 0 and "remove the hvd.init() line" in output, output


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_an_overflow_the_gradscaler_skips_changes_no_model_and_no_method_state(world, wrapper):
    """An inf on one rank's gradient (fp16 overflow): every rank's step is skipped, and the
    wrapper's own state (PowerSGD's error buffers and step count) is as before it."""
    from hvd_lowcomm.methods.powersgd import PowerSGDState

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    if wrapper == "powersgd":  # compressing from the first step, so that error feedback is in play
        opt = hl.PowerSGDOptimizer(
            base, model.named_parameters(), state=PowerSGDState(start_iter=0, min_compression_rate=1.0, rank=1)
        )
    else:
        opt = wrap(wrapper, base, model)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    g = torch.Generator().manual_seed(2)

    def step(overflow: bool) -> None:
        x = torch.randn(8, 6, generator=g)
        if overflow and runtime.rank() == 0:
            x[0, 0] = float("inf")
        opt.zero_grad()
        scaler.scale(model(x).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()

    step(False)
    before = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(opt.powersgd.state_dict()) if wrapper == "powersgd" else None
    step(True)
    assert scaler.get_scale() == 512.0, "the scaler must have seen the overflow on every rank"
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    if state is not None:
        after = opt.powersgd.state_dict()
        assert after["iter"] == state["iter"]
        for name, error in state["errors"].items():
            torch.testing.assert_close(after["errors"][name], error, rtol=1e-5, atol=1e-6)
    step(False)
    same_on_every_rank(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_ddp_fusion_groups_average_every_gradient(world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    opt = hl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(), num_groups=2)
    x = torch.randn(runtime.size(), 8, 6, generator=torch.Generator().manual_seed(4))
    model(x[runtime.rank()]).pow(2).mean().backward()
    reference(x.flatten(0, 1)).pow(2).mean().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    opt.step()
