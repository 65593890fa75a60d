#!/usr/bin/env bash
# Every GPU check in one device call, in priority order, each step time-boxed so
# that what finished comes back: GPU tests, `bitfuse verify`, the op benchmark,
# the LTX-2 benchmark (STEPS picks; `timeline` adds bench/timeline.py, `accuracy`
# bench/norm_accuracy.py). Results
# land in $OUT/results (copy them to bench/results).
# diffusers travels as wheels in .whl (README of the device tool).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
SLUG=$(python3 -c "import re, torch; print(re.sub('[^a-z0-9]+', '-', torch.cuda.get_device_name().lower()).strip('-'))")
export OUT SLUG
step() {  # step SECONDS NAME COMMAND...
  local secs=$1 name=$2; shift 2
  echo "=== $name"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name: exit $?"
  tail -n "${TAIL:-12}" "$OUT/$name.log"
}
STEPS=${STEPS:-"tests verify ops ltx2"}  # a subset per call keeps each under the device's 10-minute limit; GPU_TESTS narrows the tests
for s in $STEPS; do
  case $s in
    tests) step "${T_TESTS:-200}" gpu_tests python3 -m pytest ${GPU_TESTS:-tests/gpu} -q -p no:cacheprovider -rf ;;
    verify) step 90 verify sh -c 'python3 -m bitfuse verify --quick > "$OUT/results/verify-$SLUG.txt"; tail -n 3 "$OUT/results/verify-$SLUG.txt"' ;;
    ops) step "${T_OPS:-170}" bench_ops python3 bench/ops.py --norm-shapes "${NORM_SHAPES:-main}" --out "$OUT/results" ;;
    ltx2) step "${T_LTX2:-200}" bench_ltx2 python3 bench/ltx2.py --layers 4 --iters 30 --out "$OUT/results" ;;
    accuracy) step 150 accuracy python3 bench/norm_accuracy.py --out "$OUT/results" ;;
    timeline) step 120 timeline sh -c 'python3 bench/timeline.py --iters 10 > "$OUT/results/timeline-$SLUG.txt"' ;;
    *) echo "unknown step $s" ;;
  esac
done
