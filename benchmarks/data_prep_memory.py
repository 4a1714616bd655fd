"""Peak memory of data_prep's streaming text conversions against the corpus size.

    python -m benchmarks.data_prep_memory --sizes 64,256,1024 --out benchmarks/results/data-prep-memory

For each size (MB) it writes a .jsonl corpus and nanoGPT-style uint16 token files of that
size into a scratch directory, converts each in a child process (`data_prep text ... --column
text` with the byte tokenizer, `data_prep tokens ...`), and records the child's peak resident
memory (VmHWM) and wall time. Streaming means the peak stays flat while the corpus grows:
the bound is one document plus one copy block (data_prep.writer.BLOCK_BYTES, 64 MiB), not the
corpus. Writes results.md and results.csv to --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from data_prep.writer import BLOCK_BYTES
from hvd_lowcomm.metrics import human_bytes, write_csv

# The child's own peak: VmHWM (kB) of its address space. Not ru_maxrss, which Linux carries over
# from the parent at fork/exec (this script's own arrays would show up in it).
CHILD = (
    "import re, sys; from data_prep.__main__ import main; code = main(sys.argv[1:]); "
    "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)); sys.exit(code)"
)


def convert(argv: list[str]) -> tuple[int, float]:
    """(peak resident bytes, seconds) of one data_prep run in a child process."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"data_prep {' '.join(argv)} failed:\n{done.stderr}")
    return int(done.stdout.split()[-1]) * 1024, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64,256,1024", help="corpus sizes in MB")
    parser.add_argument("--out", default="benchmarks/results/data-prep-memory")
    args = parser.parse_args()
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="data-prep-memory-"))
    try:
        line = json.dumps({"id": 0, "text": "It is a truth universally acknowledged, that a single man " * 80}) + "\n"
        for megabytes in (int(v) for v in args.sizes.split(",")):
            corpus = scratch / "corpus.jsonl"
            with open(corpus, "w") as fh:
                for _ in range(megabytes * 2**20 // len(line)):
                    fh.write(line)
            peak, seconds = convert(["text", str(corpus), "--column", "text", "--out", str(scratch / "text.h5")])
            rows.append(
                {
                    "source": "jsonl, bytes tokenizer",
                    "corpus_mb": megabytes,
                    "peak_rss_mb": peak / 2**20,
                    "seconds": seconds,
                }
            )
            corpus.unlink()
            tokens = np.arange(megabytes * 2**19, dtype=np.uint32) % 50257  # uint16: 2 bytes per token
            tokens.astype(np.uint16).tofile(scratch / "train.bin")
            tokens[: len(tokens) // 10].astype(np.uint16).tofile(scratch / "val.bin")
            del tokens
            peak, seconds = convert(
                [
                    "tokens",
                    str(scratch / "train.bin"),
                    str(scratch / "val.bin"),
                    "--vocab-size",
                    "50257",
                    "--out",
                    str(scratch / "tokens.h5"),
                ]
            )
            rows.append(
                {
                    "source": "nanoGPT uint16 .bin",
                    "corpus_mb": megabytes * 1.1,
                    "peak_rss_mb": peak / 2**20,
                    "seconds": seconds,
                }
            )
            for name in ("text.h5", "tokens.h5", "train.bin", "val.bin"):
                (scratch / name).unlink(missing_ok=True)
            print(rows[-2], rows[-1], flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "results.csv", rows)
    lines = [
        f"# data_prep peak resident memory against corpus size (copy block {human_bytes(BLOCK_BYTES)})",
        "",
        "| source | corpus MB | peak RSS MB | seconds |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['source']} | {r['corpus_mb']:.0f} | {r['peak_rss_mb']:.0f} | {r['seconds']:.1f} |" for r in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
