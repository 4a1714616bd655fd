"""The loop of a user who trains at scale, through every drop-in wrapper, AB and DiLoCo:
bfloat16 parameters, a parameter some ranks skip, accumulation exchanged at every micro-batch
or declared on the model (nanoGPT's flag, DDP's no_sync), activation checkpointing (both forms,
and Hugging Face's), torch.compile. Each wrapper against one process on the pooled batch."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import hvd_lowcomm as hl
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.methods.powersgd import PowerSGDState
from conftest import SIZE, clean_env, mpirun

WRAPPERS = ("ddp", "ddp-fp16", "powersgd", "dad", "rank-dad")
# rank-dAD's factors from the first step: these tests are about them (the exact start has its own)
DAD_MODES = {
    "dad": {"mode": "exact"},
    "rank-dad": {"mode": "rank", "rank": 64, "start_iter": 0},
    "edad": {"mode": "edad"},
}
# (rtol, atol) of a float32 wrapper against one process on the pooled batch: exact ones to
# float32 rounding; fp16 on the wire to its rounding; rank-dAD at full rank (`wrap`) to its
# float16 rows' rounding; PowerSGD at full rank to its QR's rounding.
TOLERANCE = {
    "ddp": (1e-4, 1e-5),
    "dad": (1e-4, 1e-5),
    "dad-auto": (1e-4, 1e-5),
    "edad": (1e-4, 1e-5),
    "ddp-fp16": (1e-4, 1e-3),
    "powersgd": (1e-4, 1e-4),
    "rank-dad": (1e-4, 2e-4),
}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class GPT(nn.Module):
    """nanoGPT's shape in miniature: tied embedding and head, two pre-norm blocks (each
    checkpointed when `checkpointing` names a form), and an auxiliary layer used only on the
    batches that ask for it (a branch some ranks skip)."""

    def __init__(self, vocab: int = 16, width: int = 8, context: int = 6, checkpointing: str | None = None) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.aux = nn.Linear(width, width)
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.checkpointing = checkpointing

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, use_aux: bool = False) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            if self.checkpointing:
                x = checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
            else:
                x = block(x)
        if use_aux:
            x = x + self.aux(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def wrap(name: str, optimizer: torch.optim.Optimizer, model: nn.Module, **arguments):
    """The one changed line. PowerSGD compresses from the first step at a rank no matrix here
    exceeds, and rank-dAD keeps more components than these layers have: both are then exact but
    for rounding, so that what is under test shows beyond their approximation."""
    # model=: where DDP's accumulation flags are read (nanoGPT sets them on the model)
    arguments = {"named_parameters": model.named_parameters(), "model": model, **arguments}
    if name in ("ddp", "ddp-fp16"):
        return hl.DistributedOptimizer(optimizer, compression="fp16" if name == "ddp-fp16" else "none", **arguments)
    if name == "powersgd":
        state = PowerSGDState(start_iter=0, min_compression_rate=0.01, rank=64, warm_start=False)
        return hl.PowerSGDOptimizer(optimizer, state=state, **arguments)
    if name == "dad-auto":  # the cost rule's plan: rows where they are cheaper, else allreduce
        return hl.DadOptimizer(optimizer, plan="auto", **arguments)
    return hl.DadOptimizer(optimizer, plan="all", **DAD_MODES[name], **arguments)


def batches(steps: int, micro: int, rows: int = 4, context: int = 6, vocab: int = 16):
    g = torch.Generator().manual_seed(11)
    data = torch.randint(0, vocab, (steps, SIZE, micro, rows, context + 1), generator=g)
    return data[..., :-1], data[..., 1:]


def uses_aux(step: int, rank: int, unused: bool) -> bool:
    """With `unused`, the auxiliary layer runs on every other rank, alternating by step."""
    return unused and (step + rank) % 2 == 0


def train(
    wrapper: str | None,
    *,
    steps: int = 3,
    micro: int = 1,
    accumulate: str = "declared",
    unused: bool = False,
    checkpointing: str | None = None,
    dtype: torch.dtype = torch.float32,
    compiled: bool = False,
) -> tuple[nn.Module, nn.Module]:
    """(initial, trained) GPT after SGD through `wrapper` on this rank's micro-batches (None:
    one process on every rank's). accumulate: "declared" (backward_passes_per_step), "undeclared"
    (every pass exchanges), "model_flag" (nanoGPT's model.require_backward_grad_sync),
    "model_no_sync" (DDP's `with model.no_sync():`)."""
    torch.manual_seed(0)
    model = GPT(checkpointing=checkpointing).to(dtype)
    initial = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    if wrapper is not None:
        optimizer = wrap(wrapper, optimizer, model, backward_passes_per_step=micro if accumulate == "declared" else 1)
    forward = torch.compile(model, backend="aot_eager") if compiled else model
    inputs, targets = batches(steps, micro)
    ranks = range(SIZE) if wrapper is None else [runtime.rank()]
    for step in range(steps):
        for m in range(micro):
            last = m == micro - 1
            if accumulate == "model_flag":
                model.require_backward_grad_sync = last
            holding = accumulate == "model_no_sync" and not last
            with model.no_sync() if holding else _nothing():
                loss = sum(
                    forward(inputs[step, r, m], targets[step, r, m], uses_aux(step, r, unused)) for r in ranks
                ) / (len(ranks) * micro)
                loss.backward()
        if wrapper is None:  # a parameter no rank used gets a zero gradient, as Horovod gives it
            for p in model.parameters():
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return initial, model


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def same_on_every_rank(model: nn.Module) -> None:
    from mpi4py import MPI

    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).numpy()
    rank0 = flat.copy()
    MPI.COMM_WORLD.Bcast(rank0, root=0)
    assert (flat == rank0).all(), "the ranks' models differ"


def assert_close_to(model: nn.Module, reference: nn.Module, rtol: float, atol: float) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(
            p.detach().float(), q.detach().float(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}"
        )


def assert_tracks(model: nn.Module, reference: nn.Module, initial: nn.Module, share: float) -> None:
    """Every parameter within `share` of how far the reference moved it, in norm (a wrong
    scale or a lost term moves a parameter by about as much as the update itself; bfloat16's
    rounding of each weight is noise that the norm averages)."""
    for (name, p), q, q0 in zip(model.named_parameters(), reference.parameters(), initial.parameters()):
        moved = float((q.detach().float() - q0.detach().float()).norm())
        off = float((p.detach().float() - q.detach().float()).norm())
        assert off <= share * moved, f"{name}: {off:.3g} from the reference, which moved it by {moved:.3g}"


def pooled(**kwargs) -> nn.Module:
    return train(None, **kwargs)[1]


# -- bfloat16 parameters ------------------------------------------------------------------------


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_bfloat16_parameters_train_through_every_wrapper_reduced_in_float32(world, fresh_meter, wrapper):
    initial, model = train(wrapper, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    same_on_every_rank(model)
    # bfloat16 rounds each of the three updates to 8 bits: the reference's own rounding.
    assert_tracks(model, pooled(dtype=torch.bfloat16), initial, share=0.1)
    if wrapper == "ddp" and SIZE > 1:  # what is on the wire: every gradient as float32
        params = sum(p.numel() for p in model.parameters())
        assert fresh_meter.total("train", op="allreduce", field="payload_bytes") == 3 * 4 * params


def train_grouped(
    trainer: str,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    forward=None,
    dtype: torch.dtype = torch.float32,
    before_step=lambda step: None,
    **diloco,
) -> nn.Module:
    """`model` trained `steps` steps by ABTraining or DiLoCo (`diloco`: its options) on this
    rank's batches, through `forward` (default: the model); returns the full synced model."""
    groups = min(2, SIZE)
    if trainer == "ab":
        owner = hl.ABTraining(
            model, opt, total_steps=steps, groups=groups, sync_mode="only-b", warmup=2, sync_every=3, full_rank_steps=1
        )
    else:
        owner = hl.DiLoCo(model, opt, total_steps=steps, groups=groups, sync_every=2, **diloco)
    forward = forward or model
    g = torch.Generator().manual_seed(9)
    for step in range(steps):
        x = torch.randn(SIZE, 8, 6, generator=g)[runtime.rank()].to(dtype)
        y = torch.randint(0, 3, (SIZE, 8), generator=g)[runtime.rank()]
        before_step(step)
        if trainer == "ab":
            with owner.step(x, y):
                opt.zero_grad()
                F.cross_entropy(forward(x).float(), y).backward()
        else:
            opt.zero_grad()
            F.cross_entropy(forward(x).float(), y).backward()
            owner.step()
    return owner.full_model()


@pytest.mark.parametrize("trainer", ["ab", "diloco", "diloco-int2"])
def test_bfloat16_parameters_train_through_ab_and_diloco_as_float32_does(world, trainer):
    def run(dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)).to(dtype)
        initial = copy.deepcopy(model)
        # steps well above bfloat16's resolution (2**-8 of a weight), which rounds smaller ones away
        opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
        # (the float32 exchange: 2-bit codes of nearly equal numbers need not be equal)
        exchange = {"compression": "none"} if trainer == "diloco" else {}
        return initial, train_grouped(trainer.replace("-int2", ""), model, opt, 8, dtype=dtype, **exchange)

    initial, half = run(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    same_on_every_rank(half)
    if trainer != "diloco-int2":
        # bfloat16's rounding of a single SGD step is already a sizeable share of its update.
        assert_tracks(half, run(torch.float32)[1], initial, share=0.25)


@pytest.mark.skipif(SIZE % 2, reason="SIL needs 2 partitions")
def test_bfloat16_parameters_train_through_sil(world):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    ).to(torch.bfloat16)
    sil = hl.SIL(model, input_shape=(6,), num_classes=3, partitions=2)
    opt = torch.optim.SGD(sil.module.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, 6, generator=g).to(torch.bfloat16)
    y = torch.randint(0, 3, (64,), generator=g)
    losses = [sil.step(opt, x, y) for _ in range(30)]
    assert all(p.dtype == torch.bfloat16 for p in sil.module.parameters())
    assert losses[-1] < losses[0], losses
    correct, count, _ = sil.evaluate([(x, y)])
    if sil.layout.last:
        assert count == 64


# -- a parameter some ranks skip ----------------------------------------------------------------


# (edAD takes nn.Sequential MLPs only, which run every layer on every rank.)
@pytest.mark.parametrize("wrapper", WRAPPERS + ("dad-auto",))
def test_a_layer_used_on_some_ranks_only_neither_hangs_nor_makes_ranks_differ(world, wrapper):
    _, model = train(wrapper, unused=True, steps=4)
    same_on_every_rank(model)
    assert_close_to(model, pooled(unused=True, steps=4), *TOLERANCE[wrapper])


class Branchy(nn.Module):
    """An MLP with a branch taken only where `take` is set (a router's choice, per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.branch, self.head = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.take = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return self.head(h + torch.relu(self.branch(h)) if self.take else h)


@pytest.mark.parametrize("trainer", ["ab", "diloco"])
def test_a_branch_some_ranks_skip_trains_through_ab_and_diloco_and_ranks_agree(world, trainer):
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)

    def take(step: int) -> None:
        model.take = uses_aux(step, runtime.rank(), unused=True)

    full = train_grouped(trainer, model, opt, 8, before_step=take)
    assert all(torch.isfinite(p).all() for p in full.parameters())
    same_on_every_rank(full)


UNUSED_ON_ONE_RANK = textwrap.dedent("""
    import sys
    import torch, torch.nn as nn, torch.nn.functional as F
    import hvd_lowcomm as hl
    from hvd_lowcomm.methods.powersgd import PowerSGDState
    hl.init()
    rank = hl.rank()
    for name in sys.argv[1:]:
        torch.manual_seed(0)
        body, aux = nn.Linear(6, 8), nn.Linear(8, 8)
        head = nn.Linear(8, 3)
        model = nn.ModuleDict({"body": body, "aux": aux, "head": head})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        named = model.named_parameters()
        owner = None
        if name == "ddp":
            opt = hl.DistributedOptimizer(opt, named)
        elif name == "powersgd":
            opt = hl.PowerSGDOptimizer(opt, named, state=PowerSGDState(start_iter=1, min_compression_rate=0.1))
        elif name in ("dad", "rank-dad"):
            modes = {"dad": {"mode": "exact"}, "rank-dad": {"mode": "rank", "start_iter": 0}}  # factors from step 1
            opt = hl.DadOptimizer(opt, named, model=model, plan="all", **modes[name])
        elif name == "diloco":
            owner = hl.DiLoCo(model, opt, total_steps=4, groups=2, sync_every=2)
        for step in range(4):
            h = body(torch.randn(4, 6))
            if rank == 1:  # the branch only rank 1 takes
                h = h + aux(h)
            opt.zero_grad()
            F.cross_entropy(head(h), torch.randint(0, 3, (4,))).backward()
            (opt if owner is None else owner).step()  # DiLoCo steps the optimiser itself
        sys.stdout.write(f"rank {rank} {name} done\\n")  # one write: lines stay whole
        sys.stdout.flush()
""")


@pytest.mark.skipif(SIZE > 1, reason="launches a job of its own")
def test_an_unused_parameter_on_one_rank_makes_no_rank_wait_in_any_wrapper(tmp_path):
    """Fails by its timeout, not by hanging CI, if a rank waits for a gradient that never comes."""
    script = tmp_path / "unused.py"
    script.write_text(UNUSED_ON_ONE_RANK)
    names = ["ddp", "powersgd", "dad", "rank-dad", "diloco"]
    try:
        done = subprocess.run(
            mpirun(2, sys.executable, str(script), *names), env=clean_env(), capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"a rank waited: the job did not end within 240 s\n{expired.stdout}\n{expired.stderr}")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for name in names:
        assert f"rank 0 {name} done" in output and f"rank 1 {name} done" in output, output


# -- accumulation -------------------------------------------------------------------------------


@pytest.mark.parametrize("accumulate", ["undeclared", "model_flag", "model_no_sync"])
@pytest.mark.parametrize("wrapper", WRAPPERS + ("dad-auto",))
def test_accumulation_gives_the_pooled_gradient_however_it_is_declared(world, wrapper, accumulate):
    _, model = train(wrapper, micro=2, accumulate=accumulate)
    same_on_every_rank(model)
    assert_close_to(model, pooled(micro=2), *TOLERANCE[wrapper])


@pytest.mark.parametrize("accumulate", ["model_flag", "model_no_sync"])
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_wrappers_given_the_model_read_ddps_flags_on_it_and_exchange_once_per_step(
    world, fresh_meter, wrapper, accumulate
):
    def exchanges(**kwargs) -> int:
        fresh_meter.reset()
        train(wrapper, steps=2, **kwargs)
        return sum(t.calls for (phase, _, _), t in fresh_meter.by_kind.items() if phase == "train")

    assert exchanges(micro=3, accumulate=accumulate) == exchanges(micro=1)


def test_undeclared_accumulation_is_said_once_on_rank_0_and_a_flag_on_an_unknown_model_too(world, capsys):
    train("ddp", steps=2, micro=3, accumulate="undeclared")
    said = capsys.readouterr().out
    torch.manual_seed(0)
    model = GPT()
    opt = hl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters())
    inputs, targets = batches(1, 2)
    for m in range(2):
        model.require_backward_grad_sync = m == 1  # set on a model the wrapper was not given
        (model(inputs[0, runtime.rank(), m], targets[0, runtime.rank(), m]) / 2).backward()
    unseen = capsys.readouterr().out
    opt.step()
    reference = pooled(steps=1, micro=2)
    same_on_every_rank(model)
    assert_close_to(model, reference, *TOLERANCE["ddp"])
    if runtime.rank() == 0:
        assert said.count("exchanged again") == 1 and "backward_passes_per_step" in said, said
        assert "not seen by this wrapper" not in said and "not seen by this wrapper" in unseen, unseen
    else:
        assert "exchanged again" not in said + unseen


# -- activation checkpointing -------------------------------------------------------------------


@pytest.mark.parametrize("form", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_activation_checkpointing_keeps_every_wrapper_on_the_pooled_gradient(world, wrapper, form):
    _, model = train(wrapper, checkpointing=form)
    same_on_every_rank(model)
    assert_close_to(model, pooled(), *TOLERANCE[wrapper])


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_edad_through_checkpoint_sequential_is_exact(world, use_reentrant):
    def run(wrapped: bool) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 3))
        opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
        if wrapped:
            opt = hl.DadOptimizer(opt, model.named_parameters(), model=model, mode="edad")
        g = torch.Generator().manual_seed(4)
        for _ in range(3):
            x = torch.randn(SIZE, 8, 6, generator=g, requires_grad=True)
            opt.zero_grad()
            mine = x[runtime.rank()] if wrapped else x.flatten(0, 1)
            checkpoint_sequential(model, 2, mine, use_reentrant=use_reentrant).pow(2).mean().backward()
            opt.step()
        return model

    assert_close_to(run(True), run(False), *TOLERANCE["edad"])


@pytest.mark.parametrize("wrapper", ["dad", "rank-dad"])
def test_hugging_face_gradient_checkpointing_keeps_dad_exact(world, wrapper):
    transformers = pytest.importorskip("transformers")

    def run(wrapped: bool, checkpointed: bool) -> nn.Module:
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=16, n_positions=8, n_embd=8, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
        )
        model = transformers.GPT2LMHeadModel(config)
        if checkpointed:
            model.gradient_checkpointing_enable()
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
        if wrapped:
            opt = wrap(wrapper, opt, model)
        inputs, _ = batches(3, 1, context=8)
        for step in range(3):
            opt.zero_grad()
            ranks = [runtime.rank()] if wrapped else range(SIZE)
            (
                sum(model(input_ids=inputs[step, r, 0], labels=inputs[step, r, 0]).loss for r in ranks) / len(ranks)
            ).backward()
            opt.step()
        return model

    reference = run(False, False)
    model = run(True, True)
    same_on_every_rank(model)
    assert_close_to(model, reference, *TOLERANCE[wrapper])


# -- torch.compile ------------------------------------------------------------------------------


@pytest.mark.parametrize("wrapper", WRAPPERS + ("edad",))
def test_a_compiled_model_trains_through_every_wrapper(world, wrapper):
    if wrapper == "edad":  # edAD's MLP

        def run(wrapped: bool) -> nn.Module:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
            opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
            if wrapped:
                opt = hl.DadOptimizer(opt, model.named_parameters(), model=model, mode="edad")
            forward = torch.compile(model, backend="aot_eager")
            g = torch.Generator().manual_seed(4)
            for _ in range(3):
                x = torch.randn(SIZE, 8, 6, generator=g)
                opt.zero_grad()
                forward(x[runtime.rank()] if wrapped else x.flatten(0, 1)).pow(2).mean().backward()
                opt.step()
            return model

        model, reference = run(True), run(False)
    else:
        _, model = train(wrapper, compiled=True)
        reference = pooled()
    same_on_every_rank(model)
    assert_close_to(model, reference, *TOLERANCE[wrapper])


@pytest.mark.parametrize("trainer", ["ab", "diloco"])
def test_a_compiled_model_trains_through_ab_and_diloco_as_the_eager_one(world, trainer):
    def run(compiled: bool) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        forward = torch.compile(model, backend="aot_eager") if compiled else model
        return train_grouped(trainer, model, opt, 6, forward=forward)

    assert_close_to(run(True), run(False), rtol=1e-4, atol=1e-6)
