#!/usr/bin/env bash
# One GPU-machine call: set up from the carried wheels, then run the named steps.
#
#   scripts/gpu/run.sh STEP [ARGS...] [STEP [ARGS...]]...
#
# Steps (each word after a step that is not a step name is that step's argument):
#   test [PYTEST ARGS]   pytest -m cuda tests, a per-test timeout (GPU_TEST_TIMEOUT, 120 s);
#                        GPU_TEST_PATHS names the test paths, in order (default tests)
#   bench [BENCH ARGS]   benchmarks/benchmark_gpu.py ARGS --json-out $OUT/bench-K.json
#   serve-smoke [ARGS]   scripts/gpu/serve_smoke.py: vllm serve, default and continuum
#   offload [ARGS]       benchmarks/benchmark_offload.py ARGS --json-out $OUT/offload-K.json
#                        (the KV tier's load against recompute; --shape llama-3.1-8b)
#   moe [ARGS]           benchmarks/benchmark_moe.py ARGS --json-out $OUT/moe-K.json
#                        (one MoE layer's experts: grouped GEMM, loop, dense)
#   sampler [ARGS]       benchmarks/benchmark_sampler.py ARGS --json-out $OUT/sampler-K.json
#                        (a batch's sampling together against row by row)
#   api [ARGS]           benchmarks/benchmark_api_server.py ARGS --json-out $OUT/api-K.json
#                        (the API server's CPU per streamed token; --shape llama-3.1-8b)
#   study [ARGS]         scripts/gpu/study.py: the agent workload on a random-weight
#                        model (run_sweep.py ARGS), $OUT/study-LABEL.tar.gz
#   fp8gemm [ARGS]       benchmarks/benchmark_fp8_gemm.py ARGS --json-out $OUT/fp8gemm-K.json
#                        (block-scaled FP8 layers and experts against their bf16 twins)
#   mla-decode [ARGS]    benchmarks/benchmark_mla_decode.py ARGS --json-out $OUT/mla-decode-K.json
#   mla-prefill [ARGS]   benchmarks/benchmark_mla_prefill.py ARGS --json-out $OUT/mla-prefill-K.json
#                        (one MLA layer's step: the Triton latent kernels against SDPA)
#   draft-pass [ARGS]    benchmarks/benchmark_draft_pass.py ARGS --json-out $OUT/draft-pass-K.json
#                        (a draft model's pass, graphs and eager, against a target step)
# e.g.  scripts/gpu/run.sh test bench --shape llama-3.1-8b --hf-static serve-smoke
#
# Run from the repository root with .whl/ carried (`make gpu-wheels` fills it). Writes
# run.log (everything printed), test.xml, bench-K.json, serve_smoke.json and the server
# logs under $OUT (default /tmp/gpu-out). Never hangs: every step runs under
# scripts/gpu/reap.py with a time limit, which also ends whatever the step left running
# (servers in sessions of their own included); the steps together stay inside
# GPU_RUN_BUDGET_S (default 570 s: a device call's limit is 600). Exit status: 0 when
# every step passed, else the last failing step's.
#   GPU_RUN_NO_WHEELS=1   skip the wheel install (a CPU check with the project venv)
#   PYTHON=...            the interpreter (default python3)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-out}
PYTHON=${PYTHON:-python3}
BUDGET=${GPU_RUN_BUDGET_S:-570}
SITE=${GPU_RUN_SITE:-/tmp/site}
STEPS="test bench serve-smoke offload moe sampler api study fp8gemm mla-decode mla-prefill draft-pass"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1

CHILD=
on_signal() {
    echo "[run] interrupted: stopping the current step"
    [ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null && wait "$CHILD"
    exit 130
}
trap on_signal INT TERM

left() { echo $((BUDGET - SECONDS)); }

# Run "$@" under reap.py for at most $1 seconds (less if the budget is nearly spent).
limited() {
    local limit=$1
    shift
    local remaining=$(($(left) - 5))
    [ "$limit" -gt "$remaining" ] && limit=$remaining
    if [ "$limit" -le 10 ]; then
        echo "[run] no time left in the ${BUDGET} s budget: skipped"
        return 124
    fi
    "$PYTHON" scripts/gpu/reap.py "$limit" "$@" &
    CHILD=$!
    wait "$CHILD"
    local rc=$?
    CHILD=
    return $rc
}

setup() {
    if [ -z "${GPU_RUN_NO_WHEELS:-}" ]; then
        if ! ls .whl/*.whl >/dev/null 2>&1; then
            echo "[run] no .whl/*.whl: run \`make gpu-wheels\` here and carry .whl"
            return 1
        fi
        timeout 180 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || return 1
        export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    else
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
    timeout 30 nvidia-smi 2>&1 || echo "[run] nvidia-smi: not available"
    timeout 120 "$PYTHON" - <<'PY'
import platform, torch, transformers
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}),"
      f" transformers {transformers.__version__}")
if torch.cuda.is_available():
    print(f"device: {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}")
else:
    print("device: no CUDA device")
PY
}

BENCH_RUNS=0
OFFLOAD_RUNS=0
MOE_RUNS=0
SAMPLER_RUNS=0
API_RUNS=0
FP8GEMM_RUNS=0
MLA_DECODE_RUNS=0
MLA_PREFILL_RUNS=0
DRAFT_PASS_RUNS=0
run_step() {
    local step=$1
    shift
    echo "[run] === $step $* ($(left) s of the budget left)"
    case $step in
    test)
        # GPU_TEST_PATHS: which tests, in that order (default: all of tests/).
        # shellcheck disable=SC2086
        # Each failure's report printed as it happens (tests/conftest.py): a step killed
        # at its limit never reaches pytest's summary.
        VLLM_TEST_PRINT_FAILURES=1 \
        limited "${GPU_TEST_STEP_TIMEOUT:-300}" "$PYTHON" -m pytest -m cuda ${GPU_TEST_PATHS:-tests} \
            -q -rs --durations=12 -p no:cacheprovider --continue-on-collection-errors \
            --timeout "${GPU_TEST_TIMEOUT:-120}" --junitxml "$OUT/test.xml" "$@"
        local rc=$?
        # 5: nothing collected (no cuda test matched); not a failure of the code.
        [ $rc -eq 5 ] && rc=0
        return $rc
        ;;
    bench)
        BENCH_RUNS=$((BENCH_RUNS + 1))
        limited "${GPU_BENCH_TIMEOUT:-480}" "$PYTHON" benchmarks/benchmark_gpu.py \
            --json-out "$OUT/bench-$BENCH_RUNS.json" "$@"
        ;;
    offload)
        OFFLOAD_RUNS=$((OFFLOAD_RUNS + 1))
        limited "${GPU_OFFLOAD_TIMEOUT:-240}" "$PYTHON" benchmarks/benchmark_offload.py \
            --json-out "$OUT/offload-$OFFLOAD_RUNS.json" "$@"
        ;;
    moe)
        MOE_RUNS=$((MOE_RUNS + 1))
        limited "${GPU_MOE_TIMEOUT:-120}" "$PYTHON" benchmarks/benchmark_moe.py \
            --json-out "$OUT/moe-$MOE_RUNS.json" "$@"
        ;;
    sampler)
        SAMPLER_RUNS=$((SAMPLER_RUNS + 1))
        limited "${GPU_SAMPLER_TIMEOUT:-120}" "$PYTHON" benchmarks/benchmark_sampler.py \
            --json-out "$OUT/sampler-$SAMPLER_RUNS.json" "$@"
        ;;
    api)
        API_RUNS=$((API_RUNS + 1))
        limited "${GPU_API_TIMEOUT:-240}" "$PYTHON" benchmarks/benchmark_api_server.py \
            --json-out "$OUT/api-$API_RUNS.json" "$@"
        ;;
    fp8gemm)
        FP8GEMM_RUNS=$((FP8GEMM_RUNS + 1))
        limited "${GPU_FP8GEMM_TIMEOUT:-120}" "$PYTHON" benchmarks/benchmark_fp8_gemm.py \
            --json-out "$OUT/fp8gemm-$FP8GEMM_RUNS.json" "$@"
        ;;
    mla-decode)
        MLA_DECODE_RUNS=$((MLA_DECODE_RUNS + 1))
        limited "${GPU_MLA_TIMEOUT:-120}" "$PYTHON" benchmarks/benchmark_mla_decode.py \
            --json-out "$OUT/mla-decode-$MLA_DECODE_RUNS.json" "$@"
        ;;
    mla-prefill)
        MLA_PREFILL_RUNS=$((MLA_PREFILL_RUNS + 1))
        limited "${GPU_MLA_TIMEOUT:-120}" "$PYTHON" benchmarks/benchmark_mla_prefill.py \
            --json-out "$OUT/mla-prefill-$MLA_PREFILL_RUNS.json" "$@"
        ;;
    draft-pass)
        DRAFT_PASS_RUNS=$((DRAFT_PASS_RUNS + 1))
        limited "${GPU_DRAFT_TIMEOUT:-150}" "$PYTHON" benchmarks/benchmark_draft_pass.py \
            --json-out "$OUT/draft-pass-$DRAFT_PASS_RUNS.json" "$@"
        ;;
    serve-smoke)
        limited "${GPU_SMOKE_TIMEOUT:-240}" "$PYTHON" scripts/gpu/serve_smoke.py --out "$OUT" "$@"
        ;;
    study)
        limited "${GPU_STUDY_TIMEOUT:-540}" "$PYTHON" scripts/gpu/study.py --out "$OUT" "$@"
        ;;
    esac
}

main() {
    if [ $# -eq 0 ] || [[ " $STEPS " != *" $1 "* ]]; then
        echo "usage: scripts/gpu/run.sh STEP [ARGS...]...   steps: $STEPS"
        exit 2
    fi
    setup || { echo "[run] set-up failed"; exit 1; }
    local status=0 step="" args=()
    for word in "$@" ""; do
        if [ -z "$word" ] || [[ " $STEPS " == *" $word "* ]]; then
            if [ -n "$step" ]; then
                run_step "$step" "${args[@]}"
                local rc=$?
                echo "[run] === $step: exit status $rc after ${SECONDS} s"
                [ $rc -ne 0 ] && status=$rc
            fi
            step=$word args=()
        else
            args+=("$word")
        fi
    done
    echo "[run] done in ${SECONDS} s, exit status $status; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
    exit $status
}

main "$@"
