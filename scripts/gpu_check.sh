#!/usr/bin/env bash
# The CUDA path's checks on a machine that has torch and triton but no sglang (the `device` tool's
# machine), one command, a few minutes (docs/gpu.md, the review table's "only checkable on a GPU"):
# - the Triton kernels' GPU tests at real sizes and at page sizes 1-64, and the entropy kernel's;
# - parity: the CUDA path's page choice (Triton kernels) equals the CPU kernel's on the same KV (point 5);
# - each kernel's time, achieved bandwidth and registers/spills (point 6);
# - scripts/gpu_crossover.py: a dense layer from a CUDA graph against a pruned layer eager (point 1).
# Usage: bash scripts/gpu_check.sh   (writes logs to $OUT, or /tmp/gpu_check)
# Without pydantic there, carry its wheels in .whl/ (README, Pruning: "GPU check").
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
# The installed layout without installing: sgl_entropic with kernels/ as sgl_entropic.kernels.
site=$(mktemp -d)
cp -r sgl_entropic "$site/"
cp -r kernels "$site/sgl_entropic/kernels"
if ! python3 -c 'import pydantic' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
fi
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
python3 - <<'PY' | tee "$out/device.txt"
import time, torch, triton
props = torch.cuda.get_device_properties(0)
clock, bus = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
y = torch.empty_like(x)
for _ in range(3):
    y.copy_(x)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(20):
    y.copy_(x)
torch.cuda.synchronize()
copy = 2 * x.numel() * 20 / (time.perf_counter() - t0) / 1e9
spec = 2 * clock * 1e3 * bus / 8 / 1e9 if clock and bus else float("nan")
print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}")
print(f"peak memory bandwidth: {spec:.0f} GB/s from the memory clock and bus width; "
      f"{copy:.0f} GB/s measured by a device-to-device copy (read + write)")
PY
status=0
python3 -P -m pytest -q -p no:cacheprovider --import-mode=append -m gpu tests/test_page_scores_kernel.py tests/test_entropy_kernel.py 2>&1 \
  | tee "$out/tests.log" || status=1
python3 tests/test_page_scores_kernel.py --time 2>&1 | tee "$out/timing.txt" || status=1
python3 tests/test_entropy_kernel.py --time 2>&1 | tee -a "$out/timing.txt" || status=1
python3 scripts/gpu_crossover.py 2>&1 | tee "$out/crossover.txt" || status=1
exit $status
