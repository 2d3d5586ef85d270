#!/usr/bin/env bash
# The Triton kernels on a CUDA machine that has torch and triton but no sglang (the `device` tool's
# machine): their GPU tests at real sizes (page scores at 4k-32k context, batch 1-64, 8 KV heads, bf16
# and fp32; the entropy kernel), then a table of each kernel's time, achieved bandwidth against the
# device's peak and difference from its torch reference (8k-128k context, batch 1-64). One command,
# a few minutes. Usage: bash scripts/gpu_check.sh   (writes logs to $OUT, or /tmp/gpu_check)
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
import time, torch
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
print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
print(f"peak memory bandwidth: {spec:.0f} GB/s from the memory clock and bus width; "
      f"{copy:.0f} GB/s measured by a device-to-device copy (read + write)")
PY
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_page_scores_kernel.py tests/test_entropy_kernel.py 2>&1 \
  | tee "$out/tests.log"
python3 tests/test_page_scores_kernel.py --time 2>&1 | tee "$out/timing.txt"
python3 tests/test_entropy_kernel.py --time 2>&1 | tee -a "$out/timing.txt"
