# hvd_lowcomm: each target is one script or command; see README.rst.
PY      ?= .venv/bin/python
NP      ?= 2
ENGINE  ?= horovod
# --allow-run-as-root: containers and CI run as root; --oversubscribe: more ranks than cores.
MPIRUN  ?= mpirun --allow-run-as-root --oversubscribe
# The MPI suites run under mpirun on CPU processes; a failing rank aborts its job (see
# mpi_tests/conftest.py), pytest's --timeout ends a test that hangs and mpirun's --timeout a job
# that still does, with room for a slow 2-core machine. The unit tier is not theirs.
PYTEST  = $(MPIRUN) --timeout 2400 -np $(1) $(PY) -m pytest -p no:cacheprovider --timeout=600 $(PYTEST_ARGS) \
          --ignore=mpi_tests/unit mpi_tests

# Written by a successful install; demo and the tests install first when it is missing
# (fresh clone, .venv deleted) or older than what the install depends on.
STAMP   := .venv/.installed

.PHONY: install demo lint test test-unit test-1 test-2 test-4 test-8 test-2-torch test-cluster examples docs clean gpu-check vendor

# ENGINE=torch: no Horovod build (the torch engine, torch.distributed, needs none).
install:          ## MPI (if missing), .venv, torch, the package, horovod (cached wheel)
	ENGINE=$(ENGINE) bash scripts/install.sh
	touch $(STAMP)

$(STAMP): setup.cfg scripts/install.sh
	$(MAKE) install

demo: $(STAMP)    ## the embedded default: MLP on handwritten digits, data-parallel on NP ranks
	$(MPIRUN) -np $(NP) $(PY) -m hvd_lowcomm.train

test: lint test-unit test-1 test-2 test-4 test-8 test-2-torch

# ruff (pyproject.toml): the lint rules and the format every file is kept in.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Pure functions under plain pytest, no mpirun: seconds, so it runs first.
test-unit: $(STAMP)
	$(PY) -m pytest -p no:cacheprovider --timeout=120 $(PYTEST_ARGS) mpi_tests/unit

test-1: $(STAMP)
	$(call PYTEST,1)
test-2: $(STAMP)
	$(call PYTEST,2)
test-4: $(STAMP)
	$(call PYTEST,4)
# The MPI suites again on the torch engine (torch.distributed over Gloo), at np 2.
test-2-torch: $(STAMP)
	HVD_LOWCOMM_ENGINE=torch $(call PYTEST,2)
# np 8 only for what needs that many ranks (SIL with several ranks per partition).
test-8: $(STAMP)
	$(call PYTEST,8) -k at_scale

# The product card's scale: every method at 64 ranks as 8 emulated nodes of 8 (needs root and
# iproute2; about 8 minutes per method on 2 cores, so not part of `make test`).
test-cluster: $(STAMP)
	HVD_LOWCOMM_CLUSTER_TEST=1 $(PY) -m pytest -p no:cacheprovider -s $(PYTEST_ARGS) mpi_tests/test_cluster.py

# Each example script at NP ranks for a few steps (CI runs this: the README's API must work);
# lowcomm.py once per method it lists (every registered one it has a line for).
examples: $(STAMP)
	$(MPIRUN) -np $(NP) $(PY) examples/plain_horovod.py --steps 6
	set -e; for m in $$($(PY) examples/lowcomm.py --list-methods); do \
		$(MPIRUN) -np $(NP) $(PY) examples/lowcomm.py --method $$m --steps 6; done

# The documentation site (Sphinx, furo theme) into docs/_build/html; warnings are errors, so a
# broken reference or a docstring that does not parse fails the build (CI runs this); -E: the
# option reference is generated from the code, so every build reads the sources afresh.
docs: $(STAMP)
	$(PY) -m sphinx -E -W --keep-going -q -b html docs docs/_build/html
	@echo "docs: open docs/_build/html/index.html"

# On a machine with one CUDA GPU: every method a few steps on the GPU against the CPU, at np 1
# and 2, and one exact resume, on the torch engine (NCCL) first, then Horovod where it is there
# or buildable from vendor/ in the time left (scripts/gpu_check.py). GPU_CHECK_PY: that
# machine's own Python, with torch, mpi4py and h5py. A dry run on the CPU:
# make gpu-check GPU_CHECK_ARGS="--device testdev --engines torch"
GPU_CHECK_PY ?= python3
gpu-check:
	$(GPU_CHECK_PY) scripts/gpu_check.py $(GPU_CHECK_ARGS)

# What gpu-check needs and a machine without network lacks: Horovod's sdist, into vendor/.
vendor:
	$(PY) -m pip download -q --no-deps --no-binary :all: horovod==0.28.1 -d vendor

clean:
	rm -rf runs build *.egg-info docs/_build
