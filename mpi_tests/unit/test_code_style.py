"""Comments, docstrings, messages and option help state a rule and why; measured figures live in
results and docs."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

from hvd_lowcomm import config


PACKAGE = Path(__file__).resolve().parents[2] / "hvd_lowcomm"
# a measured-looking figure: a number with %, ×, "x" or points, or a pointer to a results set
# or a lab note: a measured fraction ("1/39 of a GPT's"), or evidence named by where it ran
MEASURED = re.compile(
    r"[+-]?\d+(?:\.\d+)?\s?(?:%|×|x\b|points?\b)|benchmarks/results/|\b\d+/\d+ of an? \w"
    r"|\bon the chosen\b|\bthis project's\b|\b(?:in|on) (?:every|our|these) (?:measurements?|runs?)\b"
    r"|\bmeasurements? here\b|\bwherever measured\b|\bhelped one\b|\bhurt another\b"
)


def comments(path: Path) -> list[tuple[int, str]]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(t.start[0], t.string) for t in tokens if t.type == tokenize.COMMENT]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_comments_quote_no_measured_figures(path):
    found = [f"{path.name}:{line}: {text}" for line, text in comments(path) if MEASURED.search(text)]
    assert not found, "comments quoting figures (state the rule; point to the docs section):\n" + "\n".join(found)


# an f-string's replacement field ({share:.0%}) formats a value, it quotes none
REPLACEMENT_FIELD = re.compile(r"\{[^{}]*\}")


def strings(path: Path) -> list[tuple[int, str]]:
    """Docstrings, messages and every other string literal, f-strings' fields left out."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(t.start[0], REPLACEMENT_FIELD.sub("", t.string)) for t in tokens if t.type == tokenize.STRING]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_docstrings_and_messages_quote_no_measured_figures(path):
    found = [
        f"{path.name}:{line}: {m.group(0)!r} in {text[:80]!r}"
        for line, text in strings(path)
        for m in [MEASURED.search(text)]
        if m
    ]
    assert not found, "strings quoting figures (state the rule; point to the docs section):\n" + "\n".join(found)


def test_option_help_quotes_no_measured_figures():
    found = [f"{o.name}: {o.help}" for o in config.describe_options() if MEASURED.search(o.help)]
    assert not found, "option help quoting figures:\n" + "\n".join(found)


def test_the_rule_catches_a_measured_comment():
    assert MEASURED.search("# on a GPT it lost +1.3 % at 0.12x ddp's bytes")
    assert not MEASURED.search("# a twentieth of the run, so the default fits a run of any length")
    for note in (
        "rank 8 in int8 sent 1/39 of a GPT's fp32 bytes",
        "lost to 10 steps on the chosen ViT",
        "it cost accuracy at this project's cycle lengths",
        "trained worse in every measurement here",
        "helped one ViT and hurt another more",
    ):
        assert MEASURED.search(note), note
