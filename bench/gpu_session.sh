#!/usr/bin/env bash
# Every GPU check in one device call, in priority order, each step time-boxed so
# that what finished comes back: GPU tests, `bitfuse verify`, the op benchmark,
# the LTX-2 benchmark. Results land in $OUT/results (copy them to bench/results).
# diffusers travels as wheels in .whl (README of the device tool).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
step() {  # step SECONDS NAME COMMAND...
  local secs=$1 name=$2; shift 2
  echo "=== $name"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name: exit $?"
  tail -n "${TAIL:-12}" "$OUT/$name.log"
}
step "${T_TESTS:-170}" gpu_tests python3 -m pytest tests/gpu -q -p no:cacheprovider -rf
step 90 verify sh -c 'python3 -m bitfuse verify --quick --json > "$OUT/results/verify.json"; python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({s: sum(p[\"status\"]==s for p in r[\"paths\"]) for s in {p[\"status\"] for p in r[\"paths\"]}})" "$OUT/results/verify.json"'
step "${T_OPS:-170}" bench_ops python3 bench/ops.py --norm-shapes "${NORM_SHAPES:-main}" --out "$OUT/results"
step "${T_LTX2:-200}" bench_ltx2 python3 bench/ltx2.py --layers 4 --iters 30 --out "$OUT/results"
