"""Sphinx configuration of the hvd_lowcomm documentation (``make docs``)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # hvd_lowcomm, data_prep, benchmarks
sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "hvd_lowcomm"
author = "the hvd_lowcomm developers"
copyright = "2026, the hvd_lowcomm developers"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # Google/NumPy-style docstring sections
    "sphinx.ext.viewcode",
    "hvd_options",  # .. hvd-options:: the option reference from the config dataclasses
    "hvd_results",  # .. hvd-heldout::, .. hvd-results:: tables generated from results CSVs
]
# The wrappers subclass torch and Horovod classes: document what this package adds.
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_class_signature = "separated"
nitpicky = False

html_theme = "furo"
html_title = "hvd_lowcomm"
exclude_patterns = ["_build"]
