"""Every wrapper at its defaults on many Hugging Face architectures, in a user's own loop.

    python -m benchmarks.hf_zoo --data data/shakespeare.h5 --np 2 --steps 40 \\
        --out benchmarks/results/hf-zoo

Each architecture is built from a small config (random weights, no download: 2 layers of
width 64, the family's own attention, positions, norms, heads and ties) and trained for --steps
steps of AdamW on random windows of the dataset's byte tokens, once per method, every method
from the same weights and the same batches, in the loop Hugging Face users write
(`model(input_ids=x, labels=x).loss`; BERT and RoBERTa as masked LMs, 15 % of the tokens
masked; an encoder-decoder hands AB-training its keyword arguments). One mpirun per
architecture runs the methods in turn; a method that fails ends that launch and is recorded
with its error, and the next launch goes on after it, so a failure costs one row. Writes
results.md and results.csv: per architecture and method, the training loss (mean of the last
5 steps) against ddp's, and the bytes a rank sent per step against ddp's. The question is
"does it run and learn like ddp on this family", not a tuned quality.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

METHODS = ("ddp", "ddp-fp16", "powersgd", "dad", "rank-dad", "ab", "diloco")
VOCAB, WIDTH, HEADS, LAYERS = 256, 64, 4, 2  # byte tokens; every config below is this small


def configs() -> dict[str, Callable[[], Any]]:
    """Architecture name -> a function building it (imports transformers on call)."""
    import transformers as T

    seq = 128  # position tables longer than any window used here
    common = dict(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=2 * WIDTH,
        max_position_embeddings=seq,
    )
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    decoder_ids = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return {
        "gpt2": lambda: T.GPT2LMHeadModel(
            T.GPT2Config(
                vocab_size=VOCAB,
                n_positions=seq,
                n_embd=WIDTH,
                n_layer=LAYERS,
                n_head=HEADS,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        ),
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**common, num_key_value_heads=2, **decoder_ids)),
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**common, num_key_value_heads=1, **decoder_ids)),
        "qwen2": lambda: T.Qwen2ForCausalLM(
            T.Qwen2Config(**common, num_key_value_heads=1, tie_word_embeddings=True, **decoder_ids)
        ),
        "gemma": lambda: T.GemmaForCausalLM(
            T.GemmaConfig(**common, num_key_value_heads=1, head_dim=WIDTH // HEADS, **decoder_ids)
        ),
        "mixtral": lambda: T.MixtralForCausalLM(
            T.MixtralConfig(**common, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, **decoder_ids)
        ),
        "phi": lambda: T.PhiForCausalLM(T.PhiConfig(**common, resid_pdrop=0.0, embd_pdrop=0.0)),
        "gpt-neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**common)),
        "gptj": lambda: T.GPTJForCausalLM(
            T.GPTJConfig(
                vocab_size=VOCAB,
                n_positions=seq,
                n_embd=WIDTH,
                n_layer=LAYERS,
                n_head=HEADS,
                rotary_dim=8,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        ),
        "gpt-bigcode": lambda: T.GPTBigCodeForCausalLM(
            T.GPTBigCodeConfig(
                vocab_size=VOCAB,
                n_positions=seq,
                n_embd=WIDTH,
                n_layer=LAYERS,
                n_head=HEADS,
                multi_query=True,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        ),
        "opt": lambda: T.OPTForCausalLM(
            T.OPTConfig(
                vocab_size=VOCAB,
                hidden_size=WIDTH,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
                ffn_dim=2 * WIDTH,
                max_position_embeddings=seq,
                word_embed_proj_dim=WIDTH,
                dropout=0.0,
                pad_token_id=1,
            )
        ),
        "falcon": lambda: T.FalconForCausalLM(
            T.FalconConfig(
                vocab_size=VOCAB,
                hidden_size=WIDTH,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
                hidden_dropout=0.0,
                attention_dropout=0.0,
            )
        ),
        "bloom": lambda: T.BloomForCausalLM(
            T.BloomConfig(
                vocab_size=VOCAB,
                hidden_size=WIDTH,
                n_layer=LAYERS,
                n_head=HEADS,
                hidden_dropout=0.0,
                attention_dropout=0.0,
            )
        ),
        "bert": lambda: T.BertForMaskedLM(T.BertConfig(**common, **no_dropout)),
        "roberta": lambda: T.RobertaForMaskedLM(
            T.RobertaConfig(**{**common, "max_position_embeddings": seq + 2}, pad_token_id=1, **no_dropout)
        ),
        "t5": lambda: T.T5ForConditionalGeneration(
            T.T5Config(
                vocab_size=VOCAB,
                d_model=WIDTH,
                d_kv=WIDTH // HEADS,
                d_ff=2 * WIDTH,
                num_layers=LAYERS,
                num_heads=HEADS,
                dropout_rate=0.0,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
        ),
        "bart": lambda: T.BartForConditionalGeneration(
            T.BartConfig(
                vocab_size=VOCAB,
                d_model=WIDTH,
                encoder_layers=LAYERS,
                decoder_layers=LAYERS,
                encoder_attention_heads=HEADS,
                decoder_attention_heads=HEADS,
                encoder_ffn_dim=2 * WIDTH,
                decoder_ffn_dim=2 * WIDTH,
                max_position_embeddings=seq,
                dropout=0.0,
                pad_token_id=1,
                bos_token_id=0,
                eos_token_id=2,
                decoder_start_token_id=2,
            )
        ),
    }


TIMED_OUT = 124  # what a launch past --timeout returns, as timeout(1) does
ENCODER_DECODERS = ("t5",)  # whose forward needs the decoder's inputs too (BART makes them from input_ids)
# Encoders trained as their users do: 15 % of the tokens masked (to token 0), the loss on those
# alone (with labels = inputs and nothing masked, an encoder only learns to copy its input).
MASKED_LMS = ("bert", "roberta")
MASK_SHARE, MASK_TOKEN = 0.15, 0


# ---------------------------------------------------------------------------------------------
# one launch: an architecture, the methods in turn (under mpirun)


def train_one(arch: str, method: str, tokens: Any, steps: int, batch: int, seq: int) -> dict[str, Any]:
    import numpy as np
    import torch

    import hvd_lowcomm as hl
    from hvd_lowcomm.comm.traffic import meter

    rank, size = hl.rank(), hl.size()
    torch.manual_seed(0)  # the same weights on every rank and for every method
    model = configs()[arch]()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ab = diloco = None
    if method in ("ddp", "ddp-fp16"):
        compression = "fp16" if method == "ddp-fp16" else "none"
        opt = hl.DistributedOptimizer(opt, model.named_parameters(), compression=compression)
    elif method == "powersgd":
        opt = hl.PowerSGDOptimizer(opt, model.named_parameters())
    elif method in ("dad", "rank-dad"):
        opt = hl.DadOptimizer(opt, model, mode="rank" if method == "rank-dad" else "exact")
    elif method == "ab":
        ab = hl.ABTraining(model, opt, total_steps=steps)
    else:
        diloco = hl.DiLoCo(model, opt, total_steps=steps)
    meter.reset()
    windows = np.random.default_rng(0)  # the same batches for every method
    losses = []
    for _ in range(steps):
        starts = windows.integers(0, len(tokens) - seq, size * batch)[rank * batch : (rank + 1) * batch]
        x = labels = torch.from_numpy(np.stack([tokens[s : s + seq] for s in starts]).astype(np.int64))
        if arch in MASKED_LMS:
            masked = torch.from_numpy(windows.random(x.shape) < MASK_SHARE)
            x, labels = x.masked_fill(masked, MASK_TOKEN), labels.masked_fill(~masked, -100)
        inputs = {"input_ids": x, "labels": labels} if arch in ENCODER_DECODERS else x
        with ab.step(inputs) if ab else torch.enable_grad():
            opt.zero_grad()
            loss = model(input_ids=x, labels=labels).loss
            loss.backward()
        if diloco:
            diloco.step()
        elif not ab:
            opt.step()
        losses.append(loss.item())
        meter.next_step()
    return {
        "arch": arch,
        "method": method,
        "first_loss": float(np.mean(losses[:5])),
        "last_loss": float(np.mean(losses[-5:])),
        "bytes_per_step": meter.total("train") / steps,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def worker(args: argparse.Namespace) -> None:
    import h5py

    import hvd_lowcomm as hl

    hl.init()
    with h5py.File(args.data) as f:
        tokens = f["train/tokens"][: 1 << 20]  # a megabyte of text is plenty for these steps
    for method in args.methods.split(","):
        row = train_one(args.worker, method, tokens, args.steps, args.batch_size, args.seq_len)
        if hl.rank() == 0:
            with open(Path(args.out) / "rows.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{args.worker} {method}: loss {row['first_loss']:.3f} -> {row['last_loss']:.3f}", flush=True)


# ---------------------------------------------------------------------------------------------
# the driver


def launch(args: argparse.Namespace, arch: str, methods: list[str], log: Path) -> int:
    command = [
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        str(args.np),
        "-x",
        "OMP_NUM_THREADS=1",
        sys.executable,
        "-m",
        "benchmarks.hf_zoo",
        "--worker",
        arch,
        "--methods",
        ",".join(methods),
        "--data",
        args.data,
        "--out",
        args.out,
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
    ]
    with open(log, "a") as out:
        # A session of its own: a launch past --timeout is ended with all of its ranks.
        job = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return job.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGTERM)
            try:
                job.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
            end_session(job.pid)
            out.write(f"\nhf_zoo: TimeoutError: the launch took more than {args.timeout:g} s\n")
            return TIMED_OUT


def session_members(session: int) -> list[int]:
    """The processes still running in a session (on Linux, from /proc; zombies, which hold
    nothing but a process-table entry until they are reaped, left out)."""
    members = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if os.getsid(int(entry)) == session and state != "Z":
                members.append(int(entry))
        except (OSError, IndexError):  # it ended while we looked
            pass
    return members


def end_session(session: int, patience: float = 30.0) -> None:
    """Kill what is left of a launch's session and wait until it is gone. mpirun puts each rank
    in a process group of its own, so killing mpirun's group leaves the ranks to mpirun's
    forwarded signal, and a rank busy importing torch on loaded cores can outlive mpirun by
    seconds, still holding memory and cores when the next launch starts."""
    deadline = time.monotonic() + patience
    while (members := session_members(session)) and time.monotonic() < deadline:
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def last_error(log: Path) -> str:
    lines = [
        line.strip()
        for line in log.read_text(errors="replace").splitlines()
        if "Error" in line and not line.startswith(("File ", "raise "))
    ]
    return lines[-1][:160] if lines else "the launch failed (see its log)"


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    rows_file = out / "rows.jsonl"
    rows_file.unlink(missing_ok=True)
    methods, archs = args.methods.split(","), args.archs.split(",")
    failed = []
    for number, arch in enumerate(archs, 1):
        print(
            f"[{number}/{len(archs)}] {arch}: {len(methods)} methods, one launch (log: {out / 'logs' / arch}.log)",
            flush=True,
        )
        log, remaining = out / "logs" / f"{arch}.log", list(methods)
        log.unlink(missing_ok=True)
        while remaining:
            code = launch(args, arch, remaining, log)
            done = {r["method"] for r in read_rows(rows_file) if r["arch"] == arch}
            remaining = [m for m in remaining if m not in done]
            if code == 0 or not remaining:
                break
            failed.append({"arch": arch, "method": remaining[0], "error": last_error(log)})
            print(f"{arch} {remaining[0]}: FAILED ({failed[-1]['error']})", flush=True)
            remaining = remaining[1:]
    return read_rows(rows_file) + failed


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_tables(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    out = Path(args.out)
    ddp = {r["arch"]: r for r in rows if r["method"] == "ddp" and "error" not in r}
    for r in rows:
        base = ddp.get(r["arch"])
        if base and "error" not in r:
            r["loss_vs_ddp"] = r["last_loss"] / base["last_loss"] - 1
            r["bytes_vs_ddp"] = r["bytes_per_step"] / base["bytes_per_step"] if base["bytes_per_step"] else float("nan")
    fields = [
        "arch",
        "method",
        "parameters",
        "first_loss",
        "last_loss",
        "loss_vs_ddp",
        "bytes_per_step",
        "bytes_vs_ddp",
        "error",
    ]
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows({k: r.get(k, "") for k in fields} for r in rows)
    archs = list(dict.fromkeys(r["arch"] for r in rows))
    methods = args.methods.split(",")
    lines = [
        f"# Every wrapper at its defaults on Hugging Face architectures (2 layers x {WIDTH}, random init), "
        f"{args.steps} steps of AdamW, batch {args.batch_size} x {args.seq_len} byte tokens per rank, "
        f"np {args.np}, {args.data}",
        "",
        "Each cell: training loss (mean of the last 5 steps) vs ddp's, and bytes a rank sent per step × ddp's.",
        "",
        "| architecture | " + " | ".join(methods) + " |",
        "|---|" + "---|" * len(methods),
    ]
    for arch in archs:
        cells = []
        for method in methods:
            r = next((r for r in rows if r["arch"] == arch and r["method"] == method), None)
            if r is None:
                cells.append("–")
            elif "error" in r:
                cells.append(f"FAILED: {r['error']}")
            elif method == "ddp":
                cells.append(f"{r['last_loss']:.3f}")
            else:
                cells.append(f"{100 * r['loss_vs_ddp']:+.1f} % ({r['bytes_vs_ddp']:.2f}×)")
        lines.append(f"| {arch} | " + " | ".join(cells) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--data", required=True, help="a byte-level text dataset from data_prep (train/tokens)")
    p.add_argument("--out", required=True, help="directory for results.md, results.csv, rows.jsonl and logs/")
    p.add_argument("--np", type=int, default=2, help="ranks per launch")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8, help="windows per rank per step")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per window")
    p.add_argument("--archs", default=",".join(configs()), help="architectures, comma-separated")
    p.add_argument("--methods", default=",".join(METHODS), help="methods, comma-separated (ddp first: the reference)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one launch may take")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # set by the driver: the architecture this launch trains
    return p.parse_args(argv)


def check_data(path: str) -> None:
    import h5py

    try:
        with h5py.File(path) as f:
            if "train/tokens" not in f:
                raise SystemExit(
                    f"hf_zoo: {path} holds no train/tokens: give a byte-level text dataset "
                    f"(python -m data_prep shakespeare --out data/shakespeare.h5)"
                )
    except OSError as e:
        raise SystemExit(f"hf_zoo: cannot read {path} ({e}); prepare one with python -m data_prep shakespeare") from e


def main(argv: list[str] | None = None) -> int:
    """0 when every architecture ran every method; 1 when any failed (its row says how)."""
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    for kind, asked, known in (("architectures", args.archs, list(configs())), ("methods", args.methods, METHODS)):
        unknown = sorted(set(asked.split(",")) - set(known))
        if unknown:
            raise SystemExit(f"hf_zoo: unknown {kind} {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.methods.split(",")[0] != "ddp":
        raise SystemExit("hf_zoo: --methods must start with ddp, the reference every other row is compared to")
    check_data(args.data)
    rows = run_all(args)
    write_tables(rows, args)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
