"""Muon with AdamW as one optimiser (hvd_lowcomm.optimizers): which parameters each steps,
that the pair steps as the two optimisers would, and that it survives what wrappers and
checkpoints do to an optimiser."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from hvd_lowcomm.methods.drop_in import wrap_optimizer
from hvd_lowcomm.optimizers import CombinedOptimizer, as_one_optimizer, muon_parameters, muon_with_adamw


class TinyLM(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 11, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.embed(x))))


def loss_of(model: nn.Module) -> torch.Tensor:
    x = torch.arange(6).reshape(2, 3) % 11
    return model(x).logsumexp(-1).mean()


@pytest.mark.parametrize("tied", [False, True])
def test_muon_steps_the_hidden_matrices_and_adamw_the_embeddings_head_norms_and_biases(tied):
    model = TinyLM(tied)
    matrices, rest = muon_parameters(model)
    assert [id(p) for p in matrices] == [id(model.block[0].weight), id(model.block[2].weight)]
    assert {id(p) for p in rest} == {id(p) for p in model.parameters()} - {id(p) for p in matrices}
    assert id(model.head.weight) in {id(p) for p in rest} and id(model.embed.weight) in {id(p) for p in rest}


def test_the_pair_steps_as_the_two_optimisers_would_and_one_lr_reaches_both():
    torch.manual_seed(0)
    model = TinyLM()
    twin = copy.deepcopy(model)
    combined = muon_with_adamw(model, lr=0.01, weight_decay=0.1)
    matrices, rest = muon_parameters(twin)
    muon = torch.optim.Muon(matrices, lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest, lr=0.01, weight_decay=0.1)
    for step in range(3):
        lr = 0.01 / (step + 1)
        for group in combined.param_groups:
            group["lr"] = lr
        for group in muon.param_groups + adamw.param_groups:
            group["lr"] = lr
        for m, opts in ((model, [combined]), (twin, [muon, adamw])):
            for o in opts:
                o.zero_grad()
            loss_of(m).backward()
            for o in opts:
                o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b)
    assert len(combined.state) == len(list(model.parameters()))


def test_a_wrapper_rebuilds_it_and_a_state_dict_round_trip_keeps_both_optimisers():
    from hvd_lowcomm.methods.drop_in import GradientExchange

    class Plain(GradientExchange):  # the rebuild Horovod-style wrappers do, without an exchange
        pass

    torch.manual_seed(0)
    model = TinyLM()
    combined = muon_with_adamw(model, lr=0.01)
    loss_of(model).backward()
    combined.step()
    wrapped = wrap_optimizer(combined, Plain)
    assert isinstance(wrapped, CombinedOptimizer) and [type(o).__name__ for o in wrapped.inner] == ["Muon", "AdamW"]
    assert wrapped.inner[0].state is wrapped.state  # the moments made before the wrap are still there
    restored = muon_with_adamw(model, lr=0.5)
    restored.load_state_dict(wrapped.state_dict())
    assert restored.inner[1].param_groups[0]["lr"] == 0.01 and restored.inner[0].param_groups is not None
    assert all(restored.inner[0].state[p]["momentum_buffer"] is not None for p in muon_parameters(model)[0])


def test_a_pair_given_as_a_tuple_is_combined_and_overlapping_optimisers_are_refused():
    model = TinyLM()
    matrices, rest = muon_parameters(model)
    pair = (torch.optim.Muon(matrices), torch.optim.AdamW(rest))
    assert isinstance(as_one_optimizer(pair), CombinedOptimizer)
    with pytest.raises(ValueError, match="in two of the optimisers"):
        CombinedOptimizer.of(torch.optim.AdamW(model.parameters()), torch.optim.Muon(matrices))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_on_hugging_face_models_muon_takes_every_hidden_projection_and_adamw_the_rest(family):
    """GPT-2's Conv1D projections and Llama's Linear ones go to Muon; the embeddings, the (tied
    or untied) head and the norms to AdamW; one step of the pair moves every parameter."""
    import transformers

    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=50
        )
        model = transformers.LlamaForCausalLM(config)
    matrices, rest = muon_parameters(model)
    projections = [
        m.weight
        for name, m in model.named_modules()
        if (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D") and not name.endswith("lm_head")
    ]
    assert [id(p) for p in matrices] == [id(p) for p in projections] and len(matrices) == 2 * (
        4 if family == "gpt2" else 7
    )
    assert id(model.get_input_embeddings().weight) in {id(p) for p in rest}
    assert id(model.get_output_embeddings().weight) in {id(p) for p in rest}
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = muon_with_adamw(model, lr=1e-2)
    model(torch.randint(0, 50, (2, 8)), labels=torch.randint(0, 50, (2, 8))).loss.backward()
    optimizer.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
