"""The package's layout shows its layers: no module imports one above it or in a circle, and
the package's own modules are imported at the top of a module, never inside a function."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import RANK

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top; a module may import its own layer and those below. A package's __init__.py
# belongs to the package's layer. The registry imports no method: it finds them by name at
# run time, so everything that asks for a method by name may sit above it.
# Imports that may stay inside functions: importing mpi4py's MPI module initialises MPI (a bad
# config is reported before that), Horovod's loads the MPI library, and the rest are optional
# or heavy dependencies of one feature.


@pytest.mark.skipif(RANK != 0, reason="one rank builds the wheel")
def test_job_templates_ship_inside_the_wheel(tmp_path):
    source = tmp_path / "source"  # a copy: building writes build/ beside the sources
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "data", "runs", "build", "benchmarks", "*.egg-info", "__pycache__"
        ),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("hvd_lowcomm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    templates = {Path(n).name for n in names if n.startswith("hvd_lowcomm/templates/")}
    assert {"slurm.sh.j2", "pbs.sh.j2", "_body.sh.j2", "_run.sh.j2"} <= templates, names
