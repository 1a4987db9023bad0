#!/usr/bin/env bash
# What a session lent a GPU machine runs, in the order that matters, each part within one
# device call (at most 10 minutes): the accelerator tests first (correctness on CUDA), plain
# and again under the CUDA stream sanitizer; then the step benchmark eager and compiled and
# the optimizer step and the MoE step with expert parallelism; then the checkpoint benchmark
# from GPU memory, verification off and on.
# tests/accelerator covers (besides float64/bf16/inductor/post-optimizer-event training):
# HSDP on a (1, 1) mesh (a real NCCL all-reduce on one GPU), CPU offload on CUDA, activation
# checkpointing, async_save through a small staging budget, loads checked and unchecked with
# 1 and 2 reader threads into strided device tensors, and release() unpinning the slabs;
# tests/accelerator/test_accel_paths.py the paths the CPU suite checks with recording fakes
# (16 KiB pinned slabs side by side, a host shard broadcast over NCCL through a device copy,
# the HSDP all-reduce on its own stream). `accel` runs only that file, plain and sanitized
# (a minute), for a session short of device time. `tests` then runs the object-store loads
# into device memory (tests/checkpoint/test_object_store_failures.py). `cp` (also the start of
# `tests` and `all`) runs benchmarks/cp_gpu_checks.py (the CP block kernels and ring attention
# on this GPU against the plain ops and SDPA), then the context-parallel tests: the machine has one GPU, so its ranks are
# gloo ranks on the CPU cores (ring attention and the Llama model under CP, exact against one
# process, and the recipe's CP runs), checked on that machine's CUDA build of torch.
#
#   benchmarks/gpu_session.sh accel|cp|tests|step|checkpoint|moe|all
#
# Logs go to $OUT (the device tool's output folder; default ./gpu_out): one log per run and
# summary.txt with each command and its exit status. On the GPU machine the recipe's three
# small wheels (hydra-core, omegaconf, antlr4-python3-runtime) must travel with the checkout in
# .whl/ when that machine has no network; they are installed here
# first. Record what it measured in benchmarks/RESULTS.md by hand.
set -uo pipefail
OUT=${OUT:-gpu_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps .whl/*.whl
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())") || exit 2
if [ "$NGPU" -lt 1 ]; then
    echo "no CUDA device visible" >&2
    exit 2
fi

run() {  # run NAME COMMAND...: log to $OUT/NAME.log, show its tail
    local name=$1
    shift
    echo "== $name: $*" | tee -a "$OUT/summary.txt"
    local start=$SECONDS
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    tail -n 30 "$OUT/$name.log"
}

step() {
    run "fsdp_step_${1}" "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
        benchmarks/fsdp_step.py --device cuda --steps 6 --json "$OUT/fsdp_step_${1}.json" "${@:2}"
}

part=${1:-all}
case $part in
accel)
    run accel_paths "$PY" -m pytest -q -p no:cacheprovider tests/accelerator/test_accel_paths.py
    run accel_paths_sanitizer env TORCH_CUDA_SANITIZER=1 "$PY" -m pytest -q -p no:cacheprovider \
        tests/accelerator/test_accel_paths.py
    ;;
cp | tests | all)
    # Context parallelism's kernels on this GPU (a minute): each fused block kernel (flash
    # attention, memory-efficient attention) against the plain ops in bf16/fp16/fp32 (output,
    # log-sum-exp, dq/dk/dv; `out` handed over in both layouts), ring attention on a one-rank
    # NCCL group against SDPA with each kernel; rc=1 if an error exceeds its dtype's bound.
    run cp_gpu_checks "$PY" benchmarks/cp_gpu_checks.py --device cuda
    ;;&
cp | tests | all)
    run context_parallel_tests "$PY" -m pytest -q -p no:cacheprovider tests/test_context_parallel.py \
        tests/test_ring_attention.py tests/recipes/test_cp_recipe.py
    ;;&
tests | all)
    nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
    "$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" \
        | tee -a "$OUT/summary.txt"
    run accelerator_tests "$PY" -m pytest -q -p no:cacheprovider tests/accelerator
    # The sanitizer reports kernels that touch a tensor on two streams without an event
    # between them (stream-order bugs the plain run may not show); the ranks inherit it.
    run accelerator_tests_sanitizer env TORCH_CUDA_SANITIZER=1 "$PY" -m pytest -q -p no:cacheprovider \
        tests/accelerator
    # Object-store loads (needs fsspec; the module skips without it): destinations in GPU memory
    # through the pinned slabs and the copy stream, plain and under the sanitizer; its 2-rank
    # tests (a failing rank, forwarded pieces) run on gloo ranks on CPU beside them (NCCL needs
    # one GPU per rank).
    run object_store_tests env HP_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
        tests/checkpoint/test_object_store_failures.py
    run object_store_tests_sanitizer env HP_TEST_DEVICE=cuda TORCH_CUDA_SANITIZER=1 "$PY" -m pytest -q \
        -p no:cacheprovider tests/checkpoint/test_object_store_failures.py -k "filled"
    ;;&
step | all)
    step eager
    step compiled --compile
    run optimizer_step "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
        benchmarks/optimizer_step.py --device cuda
    if [ "$NGPU" -ge 2 ]; then  # expert parallelism: EP2 x FSDP on the rest (needs 2+ GPUs)
        run moe_step "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
            benchmarks/moe_step.py --device cuda --eps 2 --seq 1024 --dim 256 --json "$OUT/moe_step.json"
    fi
    ;;&
checkpoint | all)
    for verify in off on; do
        run "checkpoint_io_verify_$verify" "$PY" benchmarks/checkpoint_io.py --device cuda --gb 2 --reps 2 \
            --verify "$verify" --dir /tmp/hp_ckpt_bench
    done
    ;;&
# ---- MoE layer (appended block; `moe` alone, or within `all`) ------------------------------
# One process, one GPU, bf16: the host syncs of one MoE layer step counted under
# torch.cuda.set_sync_debug_mode("warn") (expected 0: no expert parallelism), and its step
# time with the experts as grouped GEMM (torch._grouped_mm) against the split fallback, and
# against a plain grouped-GEMM layer (benchmarks/moe_layer.py; it runs on CPU too).
moe | all)
    run moe_layer "$PY" benchmarks/moe_layer.py --device cuda --skip-torchtitan --experts 64 128 \
        --tokens 16384 --dim 2048 --hidden 768 --steps 20 --json "$OUT/moe_layer.json"
    ;;
accel | cp | tests | step | checkpoint) ;;
*)
    echo "usage: $0 accel|cp|tests|step|checkpoint|moe|all" >&2
    exit 2
    ;;
esac
