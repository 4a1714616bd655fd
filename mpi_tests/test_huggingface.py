"""Hugging Face models (GPT-2: Conv1D projections and a tied head; Llama: nn.Linear; and, through
the same loops, T5, BERT and Mixtral's experts) in a user's own loop written as HF users write
it: `model(input_ids=x, labels=x).loss`, models built from small configs with random weights
(no download)."""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

import hvd_lowcomm as hl
from conftest import RANK, SIZE
from hvd_lowcomm.methods.ab import ABTraining
from hvd_lowcomm.methods.dad import DadOptimizer, sharing_is_cheaper
from hvd_lowcomm.methods.diloco import DiLoCo

VOCAB, SEQ, BATCH = 64, 8, 2  # short windows: dAD's rows are then cheaper than the gradients


def gpt2() -> torch.nn.Module:
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def llama() -> torch.nn.Module:
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    )


def t5() -> torch.nn.Module:  # encoder-decoder: relative position biases, a tied head, cross-attention
    return T5ForConditionalGeneration(
        T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=16,
            d_ff=64,
            num_layers=2,
            num_heads=2,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
    )


def bert() -> torch.nn.Module:  # encoder with a masked-LM head tied to its embedding
    return BertForMaskedLM(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


def mixtral() -> torch.nn.Module:  # mixture of experts: each rank's tokens reach different experts
    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=32,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    )


MODELS = {"gpt2": gpt2, "llama": llama}
# Other families, through the same loops: every wrapper must take them too.
OTHER_MODELS = {"t5": t5, "bert": bert, "mixtral": mixtral}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return {**MODELS, **OTHER_MODELS}[name]()


def global_batch(step: int) -> torch.Tensor:
    """Every rank's windows of this step, rows [rank * BATCH, (rank + 1) * BATCH) being this
    rank's: counting up from a random token (all but the first token are predictable)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (SIZE * BATCH, 1), generator=g)
    return (start + torch.arange(SEQ)) % VOCAB


def local(batch: torch.Tensor) -> torch.Tensor:
    return batch[RANK * BATCH : (RANK + 1) * BATCH]


def hf_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


@pytest.mark.parametrize("name", [*MODELS, *OTHER_MODELS])
@pytest.mark.parametrize("wrap", ["ddp", "dad"])
def test_exact_wrappers_give_the_single_process_gradient_of_the_pooled_batch(name, wrap):
    model = build(name)
    reference = copy.deepcopy(model)
    batch = global_batch(0)
    hf_loss(reference, batch).backward()  # one process, every rank's windows: the pooled gradient
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hl.DistributedOptimizer(opt, model.named_parameters()) if wrap == "ddp" else DadOptimizer(opt, model)
    hf_loss(model, local(batch)).backward()
    opt.synchronize()
    # A gradient that is zero by structure (BERT's key bias: softmax ignores what it adds to a
    # row) is rounding noise in both: it is judged against the model's whole gradient instead.
    whole = math.sqrt(sum(float(ref.grad.norm()) ** 2 for ref in reference.parameters()))
    for (pname, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        error = float((p.grad - ref.grad).norm()) / max(float(ref.grad.norm()), 1e-3 * whole)
        assert error <= 1e-4, (RANK, pname, error)


def test_dad_shares_rows_of_gpt2_conv1d_layers_and_allreduces_the_tied_head(capsys):
    model = build("gpt2")
    opt = DadOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    hf_loss(model, local(global_batch(0))).backward()
    opt.step()
    conv1d = {n: module for n, module in model.named_modules() if type(module).__name__ == "Conv1D"}
    assert set(conv1d) == {n for n in opt.plan if n.startswith("transformer.h.")} and len(conv1d) == 8
    for name, module in conv1d.items():  # the cost rule, on the Conv1D's d_in x d_out weight
        d_in, d_out = module.weight.shape
        cheaper = sharing_is_cheaper(SIZE * BATCH * SEQ, d_in, d_out, d_in * d_out + d_out)
        assert opt.plan[name].choice == ("dad" if cheaper else "allreduce"), (name, opt.plan[name])
    if SIZE <= 2:  # 2 windows of 8 tokens per rank: every projection's rows are cheaper than its gradient
        assert all(opt.plan[n].choice == "dad" for n in conv1d)
    assert "lm_head" not in opt.plan  # tied to transformer.wte: allreduced, and said so
    if RANK == 0:
        printed = capsys.readouterr().out
        assert "lm_head" in printed and "weight tied to another module's" in printed
        assert "transformer.wte" in printed and "Embedding" in printed


def train(name: str, method: str, steps: int = 40) -> tuple[list[float], torch.nn.Module, object]:
    """A user's loop, changed on the optimiser line (or a few lines for AB and DiLoCo)."""
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ab = diloco = None
    if method == "ddp":
        opt = hl.DistributedOptimizer(opt, model.named_parameters())
    elif method == "powersgd":
        opt = hl.PowerSGDOptimizer(opt, model.named_parameters())
    elif method == "dad":
        opt = DadOptimizer(opt, model)
    elif method == "rank-dad":
        opt = DadOptimizer(opt, model, mode="rank", rank=4, start_iter=0)  # the factors from the first step
    elif method == "ab":
        ab = ABTraining(model, opt, total_steps=steps)
    else:
        # fp32 between groups: what this checks is the model's fit, in a run of a few outer
        # steps; the default exchange's quality is the held-out suite's to judge
        diloco = DiLoCo(model, opt, total_steps=steps, sync_every=3, compression="none")
    losses = []
    for step in range(steps):
        x = local(global_batch(step))
        # no labels: the cut guard agrees with the dense model; an encoder-decoder's decoder needs inputs
        inputs = {"input_ids": x, "labels": x} if name == "t5" else x
        with ab.step(inputs) if ab else torch.enable_grad():
            opt.zero_grad()
            loss = hf_loss(model, x)
            loss.backward()
        if diloco:
            diloco.step()
        elif not ab:
            opt.step()
        losses.append(loss.item())
    return losses, model, ab or diloco


@pytest.mark.skipif(SIZE != 2, reason="the wrappers' run on HF models is checked at np 2")
@pytest.mark.parametrize("name", [*MODELS, *OTHER_MODELS])
@pytest.mark.parametrize("method", ["ddp", "powersgd", "dad", "rank-dad", "ab", "diloco"])
def test_every_wrapper_lowers_the_loss_of_a_hugging_face_model(name, method):
    losses, _, _ = train(name, method)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.7 * first, (method, name, losses)


@pytest.mark.skipif(SIZE != 2, reason="AB on HF models is checked at np 2")
@pytest.mark.parametrize("name", MODELS)
def test_ab_factorises_the_projections_and_its_full_model_loads_into_a_fresh_hf_model(name):
    losses, model, ab = train(name, "ab", steps=12)
    kinds = {layer.kind.name for layer in ab.layers.values()}
    assert kinds == ({"Conv1D"} if name == "gpt2" else {"Linear"}), kinds
    assert len(ab.layers) == 2 * (4 if name == "gpt2" else 7) - 1  # every projection but the first
    assert "lm_head" not in ab.layers
    first = "transformer.h.0.attn.c_attn" if name == "gpt2" else "model.layers.0.self_attn.q_proj"
    assert ab.kept_dense == {first: "ab.full_rank", "lm_head": "ab.full_rank"}
    assert min(layer.rank for layer in ab.layers.values()) < 32  # the cuts kept less than full rank
    full = ab.full_model()
    fresh = build(name)
    fresh.load_state_dict(full.state_dict(), strict=True)
    x = global_batch(99)
    with torch.no_grad():
        assert torch.allclose(fresh(x).logits, full(x).logits, atol=1e-5)
    if name == "gpt2":  # still tied in the user's class
        assert fresh.lm_head.weight.data_ptr() == fresh.transformer.wte.weight.data_ptr()


@pytest.mark.skipif(SIZE != 2, reason="AB on HF models is checked at np 2")
def test_ab_measures_its_cuts_on_an_encoder_decoder_called_with_keyword_arguments():
    """A T5 cannot run on input_ids alone (its decoder needs inputs too): `ab.step` takes the
    model's keyword arguments, and the cut guard runs the model on them."""
    losses, _, ab = train("t5", "ab", steps=12)
    assert ab.cuts and min(cut["rank"] for cut in ab.cuts.values()) < 32  # the guard measured real cuts
    assert losses[-1] < 0.8 * losses[0], losses


# ---------------------------------------------------------------------------------------------
# the command line: --model.name hf:PATH

TRAINS = ("ddp", "ddp-fp16", "powersgd", "dad", "rank-dad", "ab", "diloco", "auto")
REFUSES = {"edad": "edAD is exact only for nn.Sequential MLPs", "sil": "nn.Sequential", "mp": "nn.Sequential"}


@pytest.fixture(scope="module")
def hf_files(tmp_path_factory):
    """Small GPT-2 and Llama configs as JSON, and a byte-level text dataset (vocabulary 256)."""
    from hvd_lowcomm.comm import runtime
    from data_prep.__main__ import main as data_prep_main

    root = None
    if RANK == 0:
        root = tmp_path_factory.mktemp("hf")
        GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2).to_json_file(root / "gpt2.json")
        LlamaConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
        ).to_json_file(root / "llama.json")
        LlamaConfig(
            vocab_size=100,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=64,
        ).to_json_file(root / "small-vocab.json")
        (root / "corpus.txt").write_text("To be, or not to be, that is the question. " * 400)
        assert data_prep_main(["text", str(root / "corpus.txt"), "--out", str(root / "text.h5")]) == 0
    return runtime.world().comm.bcast(root, root=0)


def cli(files, run: str, *argv: str) -> int:
    from hvd_lowcomm.train import main

    return main(
        [
            "--data.path",
            str(files / "text.h5"),
            "--data.seq_len",
            "16",
            "--data.batch_size",
            "4",
            "--train.epochs",
            "1",
            "--train.max_steps",
            "3",
            "--run.dir",
            str(files / "runs"),
            "--run.name",
            run,
            "--run.progress",
            "false",
            *argv,
        ]
    )


@pytest.mark.skipif(SIZE != 2, reason="the command line on HF models is checked at np 2")
@pytest.mark.parametrize("config", ["gpt2", "llama"])
@pytest.mark.parametrize("method", [*TRAINS, *REFUSES])
def test_the_cli_trains_a_hugging_face_config_with_every_method_or_refuses_before_training(
    hf_files, config, method, capsys
):
    run = f"{config}-{method}"
    code = cli(hf_files, run, "--model.name", f"hf:{hf_files / f'{config}.json'}", "--method", method)
    if method in TRAINS:
        assert code == 0
        if RANK == 0:
            summary = json.loads((hf_files / "runs" / run / "summary.json").read_text())
            assert summary["steps"] == 3 and math.isfinite(summary["final_test_loss"])
    else:
        assert code == 2 and not (hf_files / "runs" / run).exists()  # nothing trained, no run directory
        if RANK == 0:
            assert REFUSES[method] in capsys.readouterr().err


def test_a_model_that_cannot_embed_the_dataset_s_tokens_is_refused_before_training(hf_files, capsys):
    assert cli(hf_files, "small-vocab", "--model.name", f"hf:{hf_files / 'small-vocab.json'}") == 2
    if RANK == 0:
        assert "embeds 100 token ids, but the dataset's vocabulary has 256" in capsys.readouterr().err
    assert cli(hf_files, "long", "--model.name", f"hf:{hf_files / 'gpt2.json'}", "--data.seq_len", "128") == 2
    if RANK == 0:
        assert "takes at most 64 positions" in capsys.readouterr().err


def test_a_saved_pretrained_directory_loads_its_weights(hf_files):
    from hvd_lowcomm.config import ModelConfig
    from hvd_lowcomm.models import build_model

    directory = hf_files / "pretrained"
    if RANK == 0:
        torch.manual_seed(3)
        GPT2LMHeadModel(GPT2Config.from_json_file(hf_files / "gpt2.json")).save_pretrained(directory)
    hl.meter.barrier("test.saved")
    model = build_model(ModelConfig(name=f"hf:{directory}"), (16,), 256, "lm")
    saved = GPT2LMHeadModel.from_pretrained(directory)
    for (name, mine), (_, theirs) in zip(model.state_dict().items(), saved.state_dict().items()):
        assert torch.equal(mine, theirs), name


def test_tensorboard_records_are_read_back_and_a_resumed_run_keeps_its_tracker_run(hf_files):
    argv = [
        "--model.name",
        f"hf:{hf_files / 'gpt2.json'}",
        "--run.loggers",
        "tensorboard,wandb",
        "--run.log_every",
        "1",
    ]
    assert cli(hf_files, "tracked", *argv) == 0
    if RANK == 0:
        ids = json.loads((hf_files / "runs" / "tracked" / "trackers.json").read_text())
    assert cli(hf_files, "tracked", *argv, "--train.max_steps", "5", "--resume", "auto") == 0
    if RANK != 0:
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(hf_files / "runs" / "tracked" / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("step/loss")]
    assert steps == [0, 1, 2, 3, 4], steps  # the first run's three steps, then the resumed run's two
    assert {
        "step/lr",
        "step/grad_norm",
        "step/tokens_per_second",
        "step/peak_memory_bytes",
        "epoch/test_loss",
        "summary/final_test_loss",
    } <= set(events.Tags()["scalars"])
    assert all(e.value > 0 for e in events.Scalars("step/grad_norm"))
    assert json.loads((hf_files / "runs" / "tracked" / "trackers.json").read_text()) == ids  # same W&B run
    # no second W&B run: every session's directory carries the first run's id (W&B names them
    # offline-run-<second>-<id>, adding -1, -2... when two sessions start in the same second)
    sessions = list((hf_files / "runs" / "tracked" / "wandb").glob("offline-run-*"))
    same_run = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(ids['wandb'])}(-\d+)?")
    assert sessions and all(same_run.fullmatch(d.name) for d in sessions), sessions


@pytest.mark.skipif(SIZE != 2, reason="the command line on HF models is checked at np 2")
def test_an_hf_image_classifier_config_trains_on_an_image_dataset(hf_files, shared_tmp):
    from transformers import ViTConfig

    from hvd_lowcomm.train import main

    config = hf_files / "vit.json"
    if RANK == 0:
        ViTConfig(
            image_size=8,
            patch_size=4,
            num_channels=1,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
        ).to_json_file(config)
    hl.meter.barrier("test.vit")
    argv = [
        "--model.name",
        f"hf:{config}",
        "--data.path",
        str(shared_tmp / "digits.h5"),
        "--train.epochs",
        "3",
        "--train.lr",
        "0.003",
        "--run.dir",
        str(shared_tmp),
        "--run.name",
        "vit",
        "--run.progress",
        "false",
    ]
    assert main([*argv, "--method", "dad"]) == 0
    if RANK == 0:
        summary = json.loads((shared_tmp / "vit" / "summary.json").read_text())
        assert summary["final_test_acc"] > 0.5, summary  # ten classes: chance is 0.1
    wrong_size = hf_files / "vit16.json"
    if RANK == 0:
        ViTConfig(image_size=16, patch_size=4, num_channels=1).to_json_file(wrong_size)
    hl.meter.barrier("test.vit16")
    refused = [
        "--model.name",
        f"hf:{wrong_size}",
        "--data.path",
        str(shared_tmp / "digits.h5"),
        "--run.dir",
        str(shared_tmp),
        "--run.name",
        "vit16",
        "--run.progress",
        "false",
    ]
    assert main(refused) == 2 and not (shared_tmp / "vit16").exists()
