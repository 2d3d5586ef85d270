#!/usr/bin/env bash
# README command 1: set up, serve the bundled model with entropic decoding, run the demo program.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/serve_and_run.sh .venv/bin/python programs/demo.py
