#!/usr/bin/env bash
# The GPU check: MegaTier on the lent GPU machine in one prepared call (make gpu-check), or, with --dry (make
# gpu-check DRY=1, also run by the test suite), every phase that needs no GPU, on this machine's CPU.
#
#   device:  bash tools/gpu/check.sh         with build/gpu-wheels carried (make gpu-wheels fetches them here)
#   here:    bash tools/gpu/check.sh --dry
#   PHASES="bench recovery" bash tools/gpu/check.sh    only those phases (a second call on the still-warm machine
#                                                       reuses the megatier._C the build phase left in place)
#
# Phases, each with its own time limit, each writing $OUT/<phase>.log and one line to $OUT/summary.txt as it
# ends, so a phase that runs out of time loses nothing the earlier ones found:
#   env       GPU, driver, torch, nvcc, /dev/shm, cores; host<->device copy bandwidth (pinned and pageable)
#   build     the carried wheels installed with no index into a folder on PYTHONPATH; megatier._C built with
#             CUDA for sm_90 in place (a prebuilt build/gpu-prebuilt/_C*.so if the build fails)
#   tests     pytest tests/gpu (the CUDA kernels against the CPU ones, the NCCL tiered run, the lossless drill)
#   compress  bench_compression: a 124M-element shard compressed the batched way (no host sync) and chunk by
#             chunk, time and host syncs side by side (compress.json beside the log)
#   syncs     tools/gpu/sync_points: every place a tiered-checkpointing job on gpt2_124m makes the host wait for
#             the GPU after its warm-up steps, ranked by count
#   bench     bench_overhead on gpt2_124m, bf16, seq 1024: none, megatier (a diff every step, a base every
#             50), DCP async_save and torch.save every 25 (bench.json beside the log)
#   throughput  tools/gpu/throughput on gpt2_124m, bf16, seq 1024: tokens/s and MFU of MegaTier's step with
#             model.compile off and on, and of a plain PyTorch loop of the same model, eager and compiled
#             (throughput.json beside the log)
#   recovery  bench_recovery's software drill on the GPU
# Dry: the pure-Python wheels into a temporary folder, setup.py's build settings read (GPU_CHECK_BUILD=1 also
# builds the CPU kernels in a copy of the tree: minutes on 2 cores, which make install spends already), tests/gpu
# collected, bench_compression on 1M elements, sync_points for 4 steps, the benchmark's megatier row on
# model=tiny for 3 steps and the throughput phase's rows on model=tiny (compiled with aot_eager), all on the CPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=0
[ "${1:-}" = "--dry" ] && DRY=1
WHEELS="${GPU_WHEELS:-build/gpu-wheels}"
if ! compgen -G "$WHEELS/*.whl" > /dev/null; then  # every phase but env needs them: say so once, run none
    echo "gpu-check: no wheels in $WHEELS; run \`make gpu-wheels\` first (it fetches the pure-Python wheels the GPU machine lacks)" >&2
    exit 2
fi
OUT="${OUT:-$(mktemp -d /tmp/megatier-gpu-check.XXXXXX)}"
PY="${PYTHON:-python3}"
SITE="$(mktemp -d /tmp/megatier-site.XXXXXX)"
mkdir -p "$OUT"
: > "$OUT/summary.txt"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled

PHASES="${PHASES:-env build tests compress syncs bench throughput recovery}"

phase() {  # phase NAME SECONDS COMMAND: run COMMAND in bash under a time limit, log it, say how it ended
    local name=$1 limit=$2 cmd=$3 t0 rc
    case " $PHASES " in *" $name "*) ;; *) return 0 ;; esac
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" bash -c "$cmd" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc after $(( $(date +%s) - t0 )) s (limit $limit s); log $OUT/$name.log" | tee -a "$OUT/summary.txt"
    return 0
}

if [ "$DRY" = 1 ]; then
    phase env 60 "$PY -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda)'; nproc; df -h /dev/shm"
    phase build 600 "set -e
        ls $WHEELS/*.whl
        $PY -m pip install -q --no-index --no-deps --no-compile --target $SITE $WHEELS/*-py3-none-any.whl
        PYTHONPATH=$SITE $PY -c 'import hydra, omegaconf, antlr4, boto3, botocore; print(\"wheels import\")'
        MEGATIER_CUDA=auto $PY setup.py --version
        if [ \"\${GPU_CHECK_BUILD:-0}\" = 1 ]; then
            copy=\$(mktemp -d /tmp/megatier-build.XXXXXX)
            git ls-files -z | xargs -0 -I{} cp --parents {} \$copy
            cd \$copy && MEGATIER_CUDA=0 MAX_JOBS=2 $PY setup.py -q build_ext --inplace && ls megatier/_C*.so
        fi"
    phase tests 120 "$PY -m pytest -q -p no:cacheprovider --collect-only tests/gpu"
    phase compress 60 "$PY benchmarks/bench_compression.py --device cpu --size 1M --reps 1"
    phase syncs 120 "$PY -m tools.gpu.sync_points --device cpu --iters 4 --warmup 1 -- data.seq_len=64 \
        train.global_batch_size=4 train.micro_batch_size=2"
    phase bench 300 "set -e
        $PY benchmarks/bench_overhead.py --model tiny --rows megatier --repeats 1 --iters 3 --warmup 1 \
            --out-json $OUT/bench.json -- train.device=cpu data.default_corpus_mib=1 data.seq_len=64
        $PY -m tools.gpu.summarize $OUT/bench.json"
    phase throughput 300 "$PY -m tools.gpu.throughput --model tiny --precision fp32 --seq 64 --batch 4 --steps 3 \
        --warmup 1 --device cpu --rows megatier,megatier_compile,plain --compile-backend aot_eager \
        --json $OUT/throughput.json -- data.default_corpus_mib=1"
else
    nvcc_bin=$(command -v nvcc || true)
    export CUDA_HOME="${CUDA_HOME:-$( [ -n "$nvcc_bin" ] && dirname "$(dirname "$(readlink -f "$nvcc_bin")")" )}"
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    phase env 90 "nvidia-smi; $PY -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name())'
        nvcc --version; echo CUDA_HOME=$CUDA_HOME; df -h /dev/shm; nproc; free -g
        $PY benchmarks/bench_transfer.py --mib 256 --repeats 5"
    # every phase imports them, so they go in first whichever phases run
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl > "$OUT/wheels.log" 2>&1 \
        && rm "$OUT/wheels.log" || echo "wheels: install failed; log $OUT/wheels.log" | tee -a "$OUT/summary.txt"
    phase build 300 "set -e
        if ! MEGATIER_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 $PY setup.py -q build_ext --inplace; then
            echo 'build failed; using build/gpu-prebuilt' && cp build/gpu-prebuilt/_C*.so megatier/
        fi
        $PY -c 'import torch, megatier._C as c; print(\"megatier._C\", c.__file__, \"cuda\", c.WITH_CUDA)'"
    # every test runs (one failure must not hide the next); the jobs' logs come back as one archive
    phase tests 240 "$PY -m pytest -q -p no:cacheprovider -rfEs --basetemp=/tmp/megatier-gpu-tests tests/gpu; rc=\$?
        cd /tmp/megatier-gpu-tests && find . -name '*.log' -o -name '*.json' -o -name '*.txt' | tar czf $OUT/test-logs.tgz -T -
        exit \$rc"
    phase compress 60 "$PY benchmarks/bench_compression.py --device cuda --size 124M --reps 5 --json $OUT/compress.json"
    phase syncs 150 "$PY -m tools.gpu.sync_points --iters 12 --warmup 4 -- model=gpt2_124m train.precision=bf16 \
        data.seq_len=1024 train.global_batch_size=8 train.micro_batch_size=8 data.default_corpus_mib=8"
    phase bench 300 "set -e
        $PY benchmarks/bench_overhead.py --model gpt2_124m --rows none,megatier,dcp_async_save,sync_torch_save \
            --k 25 --repeats 1 --iters 60 --warmup 20 --base-interval 50 --out-json $OUT/bench.json -- \
            train.device=cuda train.precision=bf16 data.seq_len=1024 train.global_batch_size=8 \
            train.micro_batch_size=8 data.default_corpus_mib=8 checkpoint.remote.fsync=false
        $PY -m tools.gpu.summarize $OUT/bench.json"
    phase throughput 420 "$PY -m tools.gpu.throughput --model gpt2_124m --precision bf16 --seq 1024 --batch 8 \
        --steps 40 --warmup 15 --json $OUT/throughput.json -- data.default_corpus_mib=8"
    phase recovery 150 "$PY benchmarks/bench_recovery.py --part classes --classes software --points 2 --quick \
        --nodes 1 --procs-per-node 1 -- train.device=cuda"
fi
echo "gpu-check ($([ $DRY = 1 ] && echo dry || echo device)): results in $OUT"
cat "$OUT/summary.txt"
! grep -qv ': exit 0 ' "$OUT/summary.txt"
