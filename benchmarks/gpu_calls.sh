#!/usr/bin/env bash
# What issue 13 still has to measure on a GPU (docs/benchmarks_gpu.md, "Still to do on a GPU"), as device calls of
# under 10 minutes each, in order of what the issue needs most: one call per GPU session (15 minutes of device time
# a session, the machine's start included). From the repository root, on the GPU machine:
#
#     bash benchmarks/gpu_calls.sh 1   # the GPU suite (make test-gpu); rows a, b, b+ at 18 layers; the compiled test
#     bash benchmarks/gpu_calls.sh 2   # rows a0, so (super_offload, no clipping) at 18 layers; the gradient setters'
#                                      # GPU test; the overlap profile
#     bash benchmarks/gpu_calls.sh 3   # row c+ at 49 layers (10.18B parameters; else 46): the 10B target of (c)
#     bash benchmarks/gpu_calls.sh 4   # row c at 32/28/24 layers, FSDP2 at c's depth, DeepSpeed's row at 18 layers
#     bash benchmarks/gpu_calls.sh 5   # row d (NVMe) at 14 layers
#
# Every step writes its log (and JSON, where the script makes one) under $OUT, the device tool's return folder
# (./gpu_out elsewhere), as it goes, and is bounded by `timeout`, so a call cut short still returns what finished.
# Call 4's DeepSpeed row needs its wheels (the GPU machine has no package registry); here, beforehand:
#
#     mkdir -p .git/info && echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux2014_x86_64 -d .whl hjson pydantic pydantic-core annotated-types typing-inspection \
#         typing-extensions
#     python3 -m pip download --no-deps --no-binary=:all: deepspeed==0.19.8 -d .whl
#
# and name .whl in that call's carry; without .whl/ the row is skipped and says so.
set -uo pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONPATH=src:. PYTHONUNBUFFERED=1

# `step NAME SECONDS COMMAND...`: COMMAND bounded by SECONDS, its output in $out/NAME.log and on stdout. At the
# bound it gets SIGINT (pytest then prints its failures, summary and durations; Python its traceback), and SIGKILL
# 20 s later
step() {
    local name=$1 seconds=$2
    shift 2
    echo "== $name (at most ${seconds} s): $*"
    local start=$SECONDS
    timeout -s INT -k 20 "$seconds" "$@" 2>&1 | tee "$out/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}

# `gpu_tests NAME SECONDS PATHS-AND-ARGS...`: GPU tests (what `make test-gpu` runs, called directly, as the machine
# may have no make), each test bounded, failures listed, a JUnit file beside the log
gpu_tests() {
    local name=$1 seconds=$2
    shift 2
    step "$name" "$seconds" python -m pytest -m cuda -q -rfE -p no:cacheprovider --timeout 110 \
        --junitxml "$out/$name.xml" --durations 0 "$@"
}
COMPILE=tests/gpu/test_cuda.py::test_compiled_engine_on_cuda  # ~40 cold inductor compiles: run last
SET_GRAD=tests/gpu/test_cuda_set_grad.py  # added after call 1's budget was set: run in call 2

offload() {  # `offload NAME SECONDS ARGS...`: benchmarks.gpu_offload with its JSON beside the log
    local name=$1 seconds=$2
    shift 2
    step "$name" "$seconds" python -m benchmarks.gpu_offload "$@" --json "$out/$name.json"
}

case ${1:-} in
1)
    { nvidia-smi; python -m zeroshard.cli.main report; } >"$out/machine.txt" 2>&1  # versions, pinning, disk
    # bounds with their 20 s grace each: 200 + 190 + 110 + 60 < 600 s, the device tool's limit for one command
    gpu_tests test_gpu 200 tests/gpu --deselect "$COMPILE" --deselect "$SET_GRAD"
    offload rows_ab 190 --try a:18 b:=a b+:=a --ratio 0.55 --steps 5 --warmup 2 --timeout 95
    gpu_tests test_gpu_compile 110 "$COMPILE"
    ;;
2)
    # bounds with their 20 s grace each: 300 + 60 + 170 < 600 s (two tries of at most 150 s each)
    offload rows_so 300 --try a0:18 so:=a0 --sub-group-size 200000000 --steps 5 --warmup 2 --timeout 150
    gpu_tests test_gpu_set_grad 60 "$SET_GRAD"
    step overlap 170 python -m benchmarks.overlap --ops 25 --json "$out/overlap.json"
    ;;
3)
    offload row_cplus 570 --try c+:49,46 --ratio 0.55 --steps 4 --warmup 2 --timeout 270
    ;;
4)
    offload row_c 230 --try c:32,28,24 --steps 4 --warmup 2 --timeout 110
    depth=$(python -c "import json,sys; t=[r for r in json.load(open(sys.argv[1]))['tries'] if r['ok']]; print(t[0]['layers'] if t else '')" "$out/row_c.json" 2>/dev/null)
    [ -n "$depth" ] && offload row_fsdp2 150 --try "fsdp2:$depth" --steps 4 --warmup 2 --timeout 140
    if compgen -G ".whl/deepspeed-*" >/dev/null; then
        DS_BUILD_OPS=0 python -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/* \
            >"$out/ds_install.log" 2>&1
        export PYTHONPATH=/tmp/site:$PYTHONPATH
        offload row_ds 190 --try ds:18 --steps 4 --warmup 2 --timeout 180
    else
        echo "== row_ds: skipped, no .whl/deepspeed-* carried (see the top of this script)"
    fi
    ;;
5)
    offload row_d 570 --try d:14 --steps 3 --warmup 1 --timeout 540
    ;;
*)
    echo "usage: bash benchmarks/gpu_calls.sh 1|2|3|4|5 (see the top of this file)" >&2
    exit 2
    ;;
esac
