"""The documentation cannot drift from the code where it is generated or checked: every option
has help text and appears in the generated reference, every method's options have a page, the
API reference covers the package root, and the README's links into the docs resolve."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import hvd_lowcomm
from hvd_lowcomm.config import build_parser, default_config, describe_options
from hvd_lowcomm.registry import option_sections


ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))
from hvd_options import option_table  # noqa: E402  (the Sphinx directive's renderer)


def test_every_option_has_help_text():
    missing = [opt.name for opt in describe_options() if len(opt.help.strip()) < 8]
    assert not missing, f"options without help text (add help= to their option(...)): {missing}"


def test_generated_reference_lists_every_option_with_its_default():
    options = describe_options()
    table = "\n".join(option_table(options))
    for opt in options:
        row = table[table.index(f"``--{opt.name}``") :]
        assert row.split("\n")[2].strip() == f"- ``{opt.default}``", opt.name
    assert table.count("   * - ``--") == len(options)


def test_help_and_reference_come_from_one_source():
    cfg = default_config()
    text = build_parser(cfg, "prog").format_help()
    for opt in describe_options(cfg):
        assert f"--{opt.name}" in text
        assert opt.help.split()[0] in text


def test_every_method_section_has_a_page_with_its_options():
    directives = {}
    for page in (DOCS / "methods").glob("*.rst"):
        for match in re.finditer(r"^\.\. hvd-options:: (.+)$", page.read_text(), re.M):
            directives.update({section: page.name for section in match.group(1).split()})
    missing = sorted(set(option_sections()) - set(directives))
    assert not missing, f"method option sections with no docs/methods page: {missing}"
    assert re.search(r"^\.\. hvd-options::\s*$", (DOCS / "configuration.rst").read_text(), re.M), (
        "configuration.rst must hold the whole generated reference"
    )


def test_api_reference_covers_the_package_root():
    api = (DOCS / "api.rst").read_text()
    missing = [name for name in hvd_lowcomm.__all__ if f"hvd_lowcomm.{name}\n" not in api]
    assert not missing, f"package-root names missing from docs/api.rst: {missing}"


def test_readme_links_into_the_docs_resolve():
    readme = (ROOT / "README.rst").read_text()
    links = re.findall(r"<(docs/[^>#]+)(?:#[^>]*)?>`_", readme)
    assert len(links) >= 8, "README.rst is the front page: it should link into the docs"
    broken = [link for link in links if not (ROOT / link).is_file()]
    assert not broken, f"README.rst links to missing docs pages: {broken}"
    pages = {p.relative_to(ROOT).as_posix() for p in DOCS.rglob("*.rst")}
    index = (DOCS / "index.rst").read_text() + (DOCS / "methods" / "index.rst").read_text()
    orphans = [p for p in pages if Path(p).stem not in index and not p.endswith("index.rst")]
    assert not orphans, f"docs pages in no toctree: {orphans}"


NARRATIVE_WORDS = 12_000  # the whole site's prose: a reader gets through it in an hour


def narrative_words(text: str) -> int:
    """Words of prose in an rst page: code blocks, directives (generated tables included) and
    their indented bodies, and section underlines left out."""
    words, skip_deeper_than = [], None
    for line in text.splitlines():
        stripped, indent = line.strip(), len(line) - len(line.lstrip())
        if skip_deeper_than is not None:
            if not stripped or indent > skip_deeper_than:
                continue
            skip_deeper_than = None
        if stripped.startswith(".. ") or stripped.endswith("::"):
            if not stripped.startswith(".. "):
                words.append(stripped[:-2])  # "text::" keeps its text
            skip_deeper_than = indent
            continue
        if not re.fullmatch(r"[=\-~^]+(\s+[=\-~^]+)*", stripped):
            words.append(line)
    return len(" ".join(words).split())


def test_narrative_words_skip_code_and_directives():
    page = (
        "Title\n=====\n\nTwo words.\n\n.. code-block:: python\n\n    not counted here\n\n"
        "Three more words::\n\n    x = 1\n"
    )
    assert narrative_words(page) == 1 + 2 + 3


def test_the_docs_narrative_is_at_most_twelve_thousand_words():
    counts = {p.relative_to(DOCS).as_posix(): narrative_words(p.read_text()) for p in DOCS.rglob("*.rst")}
    assert sum(counts.values()) <= NARRATIVE_WORDS, sorted(counts.items(), key=lambda kv: -kv[1])[:5]


def test_every_porting_page_shows_a_whole_program_the_mpi_tests_run():
    """A porting page's code is a file under examples/porting/ that mpi_tests/test_porting.py
    imports and runs, so a page whose example stops working fails the tests."""
    tests = (ROOT / "mpi_tests" / "test_porting.py").read_text()
    for page in sorted(DOCS.glob("porting-*.rst")):
        shown = re.findall(r"\.\. literalinclude:: \.\./examples/porting/(\w+)\.py", page.read_text())
        assert shown, f"{page.name} shows no program from examples/porting/"
        for program in shown:
            assert (ROOT / "examples" / "porting" / f"{program}.py").exists(), program
            assert f"import {program}" in tests, f"{program} ({page.name}) is not run by test_porting.py"


def test_no_page_names_a_results_set_git_does_not_hold():
    """A hyphenated name in double backquotes is a method, a held-out set (benchmarks/heldout.py),
    or a results set or report the repository holds (paths: test_front_page)."""
    from hvd_lowcomm.registry import specs

    held_out = (ROOT / "benchmarks" / "heldout.py").read_text()
    kept = {p.name for p in (ROOT / "benchmarks" / "results").iterdir()}
    kept |= {p.stem for p in (ROOT / "benchmarks" / "reports").glob("*.md")}
    named = re.compile(r"``([a-z][a-z0-9.]*(?:-[a-z0-9.]+)+)``")
    missing = []
    for page in sorted(DOCS.rglob("*.rst")):
        text = page.read_text()
        for name in named.findall(text):
            if name not in kept and name.split(".")[0] not in specs() and f'"{name}"' not in held_out:
                missing.append(f"{page.name}: {name}")
    assert not missing, missing
