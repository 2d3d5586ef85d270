#!/usr/bin/env bash
# README command 2: set up, then run the test suite (it starts its own real server).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --router  # tests/test_router.py runs SGLang's router
exec .venv/bin/python -m pytest "$@"
