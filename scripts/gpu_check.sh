#!/usr/bin/env bash
# The prepared GPU check (scripts/gpu_check.py says what it measures and how to prepare the
# carried .gpu-check folder). On the device machine: bash scripts/gpu_check.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/gpu-check-out}"
mkdir -p "$OUT"
python3 "$(dirname "$0")/gpu_check.py" --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
