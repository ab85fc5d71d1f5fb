#!/usr/bin/env bash
# GPU check of the transfer engine: runs the gpu-marked tests, then prints the bandwidth table
# (GB/s of the engine, the per-block copy loop and one large copy; D2H, H2D and both at once).
# Without a CUDA device the tests skip and the table is measured in CPU mode with small sizes.
#
# The package comes from a prebuilt abi3 wheel when there is one (a GPU host needs no Rust and no
# network): $KVOFFLOAD_WHEEL, else the newest *.whl in dist/, target/wheels/, the checkout root or
# the folder that holds the checkout. It is installed with `pip install --no-deps --target` into a
# temporary folder put on PYTHONPATH, for $PYTHON (default python3). Without a wheel the
# checkout's .venv is used (`make build` installs the package there).
# When $OUT is set, the test log and the table are also written there.
#
# Every stage runs under `timeout`: install 60 s, the gpu tests 120 s, the ordering tests again
# under TORCH_CUDA_SANITIZER=1 60 s, the table 90 s, the pool's start-up (8 GiB pinned up front
# against in the background) 45 s.
# A stage that times out reports exit code 124 and the next stage still runs.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
shopt -s nullglob
wheel=${KVOFFLOAD_WHEEL:-}
if [[ -z $wheel ]]; then
    candidates=("$root"/dist/*.whl "$root"/target/wheels/*.whl "$root"/*.whl "$root"/../*.whl)
    if ((${#candidates[@]})); then
        wheel=$(ls -t "${candidates[@]}" | head -n 1)
    fi
fi

if [[ -n $wheel ]]; then
    py=${PYTHON:-python3}
    site=$(mktemp -d)
    trap 'rm -rf "$site"' EXIT
    timeout 60 "$py" -m pip install --quiet --no-deps --no-index --disable-pip-version-check \
        --target "$site" "$wheel"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "kvoffload from $wheel"
elif [[ -x $root/.venv/bin/python ]]; then
    py=$root/.venv/bin/python
    echo "kvoffload from $root/.venv (no wheel found)"
else
    echo "gpu_check: no wheel (set KVOFFLOAD_WHEEL or put one in dist/: maturin build --release)" \
        "and no .venv (make build)" >&2
    exit 2
fi

timeout 30 "$py" - <<'PY'
import sys

import torch

import kvoffload

cuda = torch.cuda.is_available()
device = torch.cuda.get_device_name() if cuda else "none (CPU mode)"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA device: {device}")
print(f"kvoffload {kvoffload.__version__} at {kvoffload.__file__}")
PY

out=${OUT:-}
[[ -n $out ]] && mkdir -p "$out"
status=0
if "$py" -c "import pytest" 2>/dev/null; then
    # -p no:cacheprovider: the checkout may be read-only.
    timeout 120 "$py" -m pytest "$root/tests/transfer" -m gpu -q -p no:cacheprovider \
        --rootdir "$root" 2>&1 | tee ${out:+"$out/gpu_tests.txt"} || status=$?
    # The stream-ordering tests again under PyTorch's CUDA sanitizer, which reports any access
    # of a tensor from two streams without an ordering between them.
    TORCH_CUDA_SANITIZER=1 timeout 60 "$py" -m pytest "$root/tests/transfer" -m gpu -q \
        -p no:cacheprovider --rootdir "$root" -k "waits or in_flight" \
        2>&1 | tee ${out:+"$out/gpu_sanitizer.txt"} || status=$?
else
    echo "gpu_check: pytest is not installed for $py; the GPU tests did not run" >&2
    status=3
fi

timeout 90 "$py" -m kvoffload.transfer.bandwidth ${out:+--out "$out"} || status=$?
timeout 45 "$py" - <<'PY' 2>&1 | tee ${out:+"$out/pool_startup.txt"} || status=$?
import time

import torch

from kvoffload.transfer import CpuPool

if not torch.cuda.is_available():
    print("pool start-up: no CUDA device, not measured")
    raise SystemExit
device = torch.device("cuda", 0)
slots, slot = 4096, 2 << 20  # 8 GiB of 2 MiB chunks, pinned in 1 GiB pieces
t0 = time.monotonic()
CpuPool(slots, slot, pin_device=device).close()
up_front = time.monotonic() - t0
t0 = time.monotonic()
pool = CpuPool(slots, slot, pin_device=device, background=True)
while pool.usable_slots == 0:
    time.sleep(0.0005)
first = time.monotonic() - t0
pool.wait_ready()
whole = time.monotonic() - t0
pool.close()
print(
    f"pool start-up, 8 GiB pinned: up front {up_front:.2f} s; in the background: first piece "
    f"{first:.2f} s, whole pool {whole:.2f} s"
)
PY
exit "$status"
