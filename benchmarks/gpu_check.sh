#!/usr/bin/env bash
# GPU readiness on one CUDA device, in 8-15 minutes on a fresh machine (most of it compiling): the memory benchmark (NCCL backend,
# torch.cuda allocated/reserved peaks per phase, step times), the update kernels (Triton through
# torch.compile) against torch's fused AdamW, sharded checkpoints on the GPU over NCCL, the
# example GPT trained for 60 steps in bf16, and offload="cpu" against no offload (benchmarks/bench_offload.py).
#
#     bash benchmarks/gpu_check.sh            # PYTHON=... to choose the interpreter (default: .venv, else python3)
#     OFFLOAD_ONLY=1 bash benchmarks/gpu_check.sh   # only the offload part
#     QUICK=1 bash benchmarks/gpu_check.sh          # under five minutes: the profile of one step (NCCL's calls at one
#                                                   # rank, shardopt's ranges, a trace), the checkpoint check, and the
#                                                   # multi-GPU tests where there are two GPUs or more
#
# Results: benchmarks/results/memory_cuda.{md,csv,png}, offload_cuda.md; logs in $LOG_DIR (default /tmp/shardopt-gpu-check).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
LOG_DIR=${LOG_DIR:-/tmp/shardopt-gpu-check}
mkdir -p "$LOG_DIR"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS

"$PY" - <<'EOF'
import sys, torch, torch.distributed as dist
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
             "install a CUDA build of torch")
if not dist.is_nccl_available():
    sys.exit("gpu_check: this torch build has no NCCL")
p = torch.cuda.get_device_properties(0)
print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
EOF

FAILED=()
step() {  # step NAME SECONDS COMMAND...: run with a time limit, keep the log, show its tail
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    if ! timeout "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1; then
        tail -n 40 "$LOG_DIR/$name.log"
        echo "gpu_check: $name FAILED (log: $LOG_DIR/$name.log)"
        FAILED+=("$name")
        return 0
    fi
    tail -n "${TAIL:-12}" "$LOG_DIR/$name.log"
}

# One step under torch.profiler at one rank on NCCL: the collective calls a multi-GPU run makes (there is no one-rank
# shortcut), shardopt's ranges by name, and a Chrome/Perfetto trace; fails when a range is missing.
if [ -z "${OFFLOAD_ONLY:-}" ]; then
TAIL=30 step profile 180 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 benchmarks/profile_step.py \
    --device cuda --n-layer 12 --n-embd 768 --bucket-cap-mb 25 --trace "$LOG_DIR/step_trace.json"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge 2 ]; then  # NCCL between GPUs: parity with averaged AdamW, hybrid (4 GPUs), offload
    TAIL=8 step multi-gpu 600 "$PY" -m pytest -q -rs tests/test_multi_gpu.py
else
    echo "== multi-gpu: skipped, $GPUS GPU(s) (tests/test_multi_gpu.py needs 2, its hybrid case 4)"
fi
fi

if [ -n "${QUICK:-}" ]; then
    step checkpoint 180 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 tests/test_elastic.py cuda \
        "$(mktemp -d)"
    grep -q "cuda checkpoint ok" "$LOG_DIR/checkpoint.log" || { echo "gpu_check: checkpoint check printed no success"; FAILED+=(checkpoint-ok); }
    if [ ${#FAILED[@]} -gt 0 ]; then
        echo "gpu_check: FAILED: ${FAILED[*]} ($((SECONDS - start))s)"
        exit 1
    fi
    echo "gpu_check: quick check passed in $((SECONDS - start))s"
    exit 0
fi

if [ -z "${OFFLOAD_ONLY:-}" ]; then  # OFFLOAD_ONLY=1: only the offload part below (under five minutes)
# GPT-2 small shapes over bytes (85M parameters): large enough for the GPU to matter, built in seconds.
MODEL=(--n-layer 12 --n-embd 768 --n-head 12 --block-size 1024 --batch-size 8)
TAIL=30 step kernels 300 "$PY" benchmarks/bench_kernels.py --device cuda --numel 64e6 --repeats 5

TAIL=40 step memory 240 "$PY" benchmarks/bench_memory.py --device cuda --world-sizes 1 "${MODEL[@]}" \
    --bucket-cap-mb 25 --warmup 2 --steps 5 --timeout 230


step checkpoint 180 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 tests/test_elastic.py cuda \
    "$(mktemp -d)"
grep -q "cuda checkpoint ok" "$LOG_DIR/checkpoint.log" || { echo "gpu_check: checkpoint check printed no success"; FAILED+=(checkpoint-ok); }

step example 180 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 examples/train_gpt.py --device cuda \
    --param-dtype bf16 --compute-dtype bf16 "${MODEL[@]}" --steps 60 --log-every 10 --bucket-cap-mb 25

# Three configurations at 10M (each costs about 15 s, most of it start-up and compilation).
step step 120 "$PY" benchmarks/bench_step.py --device cuda --sizes 10M --configs ddp,shardopt2-fp32,shardopt2-bf16 \
    --steps 8 --warmup 3
fi

# offload="cpu" (under five minutes): whether the host kernels train bit for bit as the GPU's, then bf16, a model that
# fits in 12 GiB without offload (0.5B) and one that fits only with it (1B), with and without offload, offload_fraction
# 0.5, and torchao's CPUOffloadOptimizer beside them when it installs.
python_has() { "$PY" -c "import $1" >/dev/null 2>&1; }
python_has torchao || timeout 60 "$PY" -m pip install -q torchao >/dev/null 2>&1 || echo "gpu_check: torchao did not install; its rows say so"
TAIL=6 step offload-exact 180 "$PY" benchmarks/offload_exact.py --device cuda
TAIL=12 step offload 300 "$PY" benchmarks/bench_offload.py --device cuda --sizes 0.5B,1B --gpu-memory-gib 12 \
    --steps 3 --warmup 1 --timeout 60

if [ ${#FAILED[@]} -gt 0 ]; then
    echo "gpu_check: FAILED: ${FAILED[*]} ($((SECONDS - start))s)"
    exit 1
fi
echo "gpu_check: passed in $((SECONDS - start))s"
