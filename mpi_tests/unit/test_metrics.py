"""The metrics module formats what the loop hands it: the epoch lines and the summary table."""

from __future__ import annotations

import io
import sys

from hvd_lowcomm.metrics import RunLogger, quality_text, summary_rows

SUMMARY = {
    "method": "diloco",
    "world_size": 4,
    "engine_name": "torch",
    "final_test_acc": 0.5,
    "best_test_acc": 0.625,
    "final_test_loss": 2.25,
    "steps": 100,
    "seconds": 12.0,
    "step_seconds_mean": 0.1,
    **{f"step_ms_{name}": 10.0 for name in ("forward", "backward", "exchange", "other")},
    "lr_schedule": "cosine",
    "peak_lr": 0.001,
    "data_wait_fraction": 0.05,
    "train_wire_bytes": 2_000_000,
    "train_wire_bytes_per_step": 20_000,
    "nodes": 2,
    "train_between_nodes_bytes_all_ranks": 3_000_000,
    "eval_wire_bytes": 1000,
    "setup_wire_bytes": 500,
    "peak_rss_bytes_max_rank": 2**30,
    "train_wire_bytes_by_kind": {"allreduce in column": 1_500_000, "allgather in row": 500_000},
}


def test_the_summary_table_shows_the_run_s_numbers_formatted():
    rows = dict(summary_rows(SUMMARY, {"outer_steps": 5, "inter_group_bytes": 4096, "per_layer": [1, 2]}))
    assert rows["method"] == "diloco on 4 rank(s), engine torch"
    assert rows["test accuracy"] == "50.00% (best 62.50%)"
    assert rows["steps"] == "100 in 12.0 s (100.0 ms/step)"
    assert rows["lr schedule"] == "cosine, peak 0.001"
    assert rows["between nodes (all ranks)"] == "3.00 MB (2 nodes)"
    assert rows["  allreduce in column"] == "1.50 MB" and rows["  allgather in row"] == "500.00 kB"
    assert rows["diloco: outer_steps (rank 0)"] == "5" and rows["diloco: inter_group_bytes (rank 0)"] == "4.10 kB"
    assert not any("per_layer" in label for label in rows)  # structured figures: summary.json only


def test_a_language_model_s_summary_reads_its_validation_loss_and_one_node_shows_no_link_row():
    lm = {**SUMMARY, "nodes": 1, "final_perplexity": 9.49, "final_bits_per_byte": 3.246}
    rows = dict(summary_rows({**lm, "tokens_per_step_per_rank": 4096}, {}))
    assert rows["validation"].startswith("val loss 2.2500 (ppl 9.49, 3.246 bits/byte), next-token accuracy 50.00%")
    assert "4,096 tokens per step per rank" in rows["validation"] and "between nodes (all ranks)" not in rows
    assert quality_text({"test_acc": 0.25}) == "test acc  25.00%"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_progress_bar_only_where_stderr_is_a_terminal_and_a_log_gets_none(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())  # a pipe or a file, as mpirun gives a rank
    log = RunLogger(tmp_path / "log", progress=True)
    assert list(log.progress(range(3), 3, "epoch 1")) == [0, 1, 2] and not log.show_progress
    assert "epoch 1" not in sys.stderr.getvalue()
    monkeypatch.setattr("sys.stderr", Terminal())
    assert RunLogger(tmp_path / "tty", progress=True).show_progress
    assert not RunLogger(tmp_path / "off", progress=False).show_progress
