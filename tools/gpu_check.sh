#!/usr/bin/env bash
# The GPU check (tools/gpu_check.py): the gpu tests, decode speed, KV capacity and the tiny race, into $OUT.
#
#   bash tools/gpu_check.sh              # a CUDA machine: $OUT/gpu_h200.json (budget: 8 minutes on one H200)
#   bash tools/gpu_check.sh --dry-run    # the same steps on CPU at toy sizes: $OUT/gpu_dry_run.json
#
# A machine without a package registry gets missing packages as wheels in .whl/ (torchao for the FP8
# weights; see the report of the GPU issue for the exact download command); they are installed into a
# temporary folder first. The dry run installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
if [[ " $* " != *" --dry-run "* ]] && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu_check_site .whl/*.whl
  export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
exec python3 -m tools.gpu_check --out "$OUT" "$@"
