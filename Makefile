# hvd_lowcomm: each target is one script or command; see README.rst.
PY      ?= .venv/bin/python
NP      ?= 2
# --allow-run-as-root: containers and CI run as root; --oversubscribe: more ranks than cores.
MPIRUN  ?= mpirun --allow-run-as-root --oversubscribe
# Every suite runs under mpirun on CPU processes; a failing rank aborts its job (see
# mpi_tests/conftest.py) and --timeout ends a job that still hangs.
PYTEST  = $(MPIRUN) --timeout 1500 -np $(1) $(PY) -m pytest -p no:cacheprovider --timeout=600 $(PYTEST_ARGS) mpi_tests

.PHONY: install demo test test-1 test-2 test-4 test-8 clean

install:          ## MPI (if missing), .venv, torch, the package, horovod (cached wheel)
	bash scripts/install.sh

demo:             ## the embedded default: MLP on handwritten digits, data-parallel on NP ranks
	$(MPIRUN) -np $(NP) $(PY) -m hvd_lowcomm.train

test: test-1 test-2 test-4 test-8

test-1:
	$(call PYTEST,1)
test-2:
	$(call PYTEST,2)
test-4:
	$(call PYTEST,4)
# np 8 only for what needs that many ranks (SIL with several ranks per partition).
test-8:
	$(call PYTEST,8) -k at_scale

clean:
	rm -rf runs build *.egg-info
