#!/usr/bin/env bash
# README command 2: set up, then run the tests (they start their own real servers).
#   bash scripts/test.sh           the default tier: before every commit (19-23 min on 2 cores, docs/tests.md)
#   bash scripts/test.sh --slow    the slow tier: long load and benchmark-like tests
#   bash scripts/test.sh --all     both tiers
# Any other argument goes to pytest (e.g. -q, -k pattern, a test file). The 15 slowest tests are listed.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=(-m "not slow")
args=()
for arg in "$@"; do
  case "$arg" in
    --slow) tier=(-m slow) ;;
    --all) tier=() ;;
    *) args+=("$arg") ;;
  esac
done
# tests/test_router.py runs smg, tests/test_docs.py builds the docs site, tests/test_gemma_runtime.py serves Gemma
bash scripts/setup.sh --router --docs --lint --model gemma3-270m
.venv/bin/ruff check .  # the linter and the formatter first: seconds, and either failing fails the tier
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest ${tier[@]+"${tier[@]}"} --durations=15 ${args[@]+"${args[@]}"}
