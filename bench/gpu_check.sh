#!/usr/bin/env bash
# GPU checks of evtrain, for a machine with NVIDIA GPUs; never part of CI.
#
#   bash bench/gpu_check.sh            # the checks: under 5 minutes with a ready venv
#   bash bench/gpu_check.sh --dry-run  # no GPU needed: what each check does, on CPU
#
# Environment:
#   EVTRAIN_VENV         the virtual environment to use. When it exists nothing is
#                        installed: it needs torch with CUDA (PyPI's torch==2.13.0 wheel
#                        for Linux x86-64 is one) and evtrain (pip install -e REPO). When
#                        it does not exist it is created and both are installed into it
#                        (minutes, outside the 5-minute budget). Default: REPO/.venv-gpu.
#                        The repository's own .venv has torch +cpu: torch_cuda fails.
#   GPU_CHECK_TIMEOUT_S  seconds each check may take (default 120).
#   GPU_CHECK_BUDGET_S   no check starts after this many seconds of checks (default 270).
#
# Checks, in order, each under its own timeout:
#   venv            the environment above: python, torch and evtrain import
#   torch_cuda      torch sees CUDA: versions, devices, bf16 support
#   cuda_1stage     evtrain launch examples/mlp.py --stages 1 --device cuda --steps 20 --quiet
#   bf16_1stage     the same with examples/gpt.py's job in bf16: there is no precision
#                   override, so a spec in a temp dir loads gpt.py's job and
#                   dataclasses.replace()s precision="bf16" (GPT: attention and matmuls
#                   under autocast, a better bf16 test than the MLP)
#   nccl_p2p        (2 GPUs) torchrun, 2 processes: dist.send/recv of a 64 MiB CUDA
#                   tensor over NCCL in both directions, values checked, bandwidth shown
#   pipeline_cuda   (2 GPUs) evtrain launch examples/mlp.py --stages 2 --device cuda
#                   --steps 20: activations and gradients between the stages over NCCL
#   pipeline_zbv_cuda (2 GPUs) the same with --schedule zbv --virtual-stages 2: four
#                   model chunks in a V, both directions over NCCL on each chunk's
#                   own groups, the turn on stage 0 in GPU memory
#   pipeline_bench  (2 GPUs) bench/pipeline_vs_torch.py, shortened to fit; it has no
#                   device option, so it runs on CPU (its result says so)
# Without an NVIDIA GPU (no nvidia-smi, or it lists none) every check is skipped with
# "no NVIDIA GPU" and nothing is created or installed.
#
# --dry-run needs no GPU and installs nothing (EVTRAIN_VENV, or the default, must
# exist): the same commands on CPU and shorter (--device cpu, 2 steps; the bf16 spec
# under CPU autocast; the p2p script over gloo; the bench with 2 contenders, 3 steps).
#
# Output: one line per check, then ONE JSON line:
#   {"gpus": N, "torch_gpus": N, "dry_run": false, "ok": true, "seconds": S,
#    "checks": {"NAME": {"status": "ok"|"failed"|"skipped", "seconds": S,
#                        "detail": "...", "error_tail": "..."}, ...}}
# Exit status 0 when no check failed, else 1. Logs stay in a temp dir (printed) when a
# check failed.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY_RUN=0
case "${1:-}" in
    --dry-run) DRY_RUN=1 ;;
    "") ;;
    -h | --help)
        sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "usage: bash bench/gpu_check.sh [--dry-run]" >&2
        exit 2
        ;;
esac
VENV="${EVTRAIN_VENV:-$REPO/.venv-gpu}"
CHECK_TIMEOUT="${GPU_CHECK_TIMEOUT_S:-120}"
BUDGET="${GPU_CHECK_BUDGET_S:-270}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/evtrain-gpu-check.XXXXXX")"
T0="$(date +%s.%N)"

NAMES=()
declare -A STATUS SECS DETAIL TAIL

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }

# Printable ASCII only (so the JSON is valid whatever a tool printed), last N lines.
tail_of() {
    tail -n "${2:-6}" "$1" 2>/dev/null | LC_ALL=C tr -cd '\11\12\40-\176' | tail -c 800
}

json_str() {
    local s="$1"
    s="${s//\\/\\\\}"
    s="${s//\"/\\\"}"
    s="${s//$'\t'/\\t}"
    s="${s//$'\n'/\\n}"
    printf '"%s"' "$s"
}

record() { # NAME STATUS SECONDS DETAIL [TAIL]
    NAMES+=("$1")
    STATUS[$1]="$2"
    SECS[$1]="$3"
    DETAIL[$1]="$4"
    TAIL[$1]="${5:-}"
    printf '%-15s %-8s %7ss  %s\n' "$1" "$2" "$3" "$4"
    if [[ "$2" == failed && -n "${5:-}" ]]; then
        printf '%s\n' "${5}" | sed 's/^/    | /'
    fi
}

# run_check NAME TIMEOUT_S DETAIL_REGEX CMD... : run CMD from the repository with a
# timeout (shortened to what is left of the budget), record ok/failed with the last
# two lines matching DETAIL_REGEX as detail ($DETAIL_PREFIX first). Returns CMD's
# exit status.
DETAIL_PREFIX=""
run_check() {
    local name="$1" limit="$2" pattern="$3"
    shift 3
    local left
    left="$(awk -v b="$BUDGET" -v e="$(since "$T0")" 'BEGIN { printf "%d", b - e }')"
    if ((left < 20)); then
        record "$name" skipped 0 "time budget of ${BUDGET}s spent"
        return 0
    fi
    ((limit > left)) && limit="$left"
    local log="$WORK/$name.log" start rc detail
    start="$(now)"
    (cd "$REPO" && timeout --kill-after=15 "$limit" "$@") >"$log" 2>&1
    rc=$?
    detail="$(grep -E -- "$pattern" "$log" 2>/dev/null | tail -n 2 | sed 's/^[[:space:]]*//' |
        paste -sd '|' - | sed 's/|/; /g' | LC_ALL=C tr -cd '\40-\176')"
    [[ -n "$detail" ]] && detail="${DETAIL_PREFIX}${detail}"
    if ((rc == 0)); then
        record "$name" ok "$(since "$start")" "${detail:-exit status 0}"
    elif ((rc == 124 || rc == 137)); then
        record "$name" failed "$(since "$start")" "timed out after ${limit}s" "$(tail_of "$log")"
    else
        record "$name" failed "$(since "$start")" "exit status $rc" "$(tail_of "$log")"
    fi
    return "$rc"
}

skip_all() { # REASON NAME...
    local reason="$1" name
    shift
    for name in "$@"; do
        record "$name" skipped 0 "$reason"
    done
}

finish() {
    local failed=0 name first=1 checks=""
    for name in "${NAMES[@]}"; do
        [[ "${STATUS[$name]}" == failed ]] && failed=1
        ((first)) || checks+=", "
        first=0
        checks+="$(json_str "$name"): {\"status\": $(json_str "${STATUS[$name]}"), "
        checks+="\"seconds\": ${SECS[$name]}, \"detail\": $(json_str "${DETAIL[$name]}"), "
        checks+="\"error_tail\": $(json_str "${TAIL[$name]}")}"
    done
    if ((failed)); then
        echo "logs: $WORK"
    else
        rm -rf "$WORK"
    fi
    local ok=true
    ((failed)) && ok=false
    local dry=false
    ((DRY_RUN)) && dry=true
    printf '{"gpus": %d, "torch_gpus": %d, "dry_run": %s, "ok": %s, "seconds": %s, "checks": {%s}}\n' \
        "$NV_GPUS" "$TORCH_GPUS" "$dry" "$ok" "$(since "$T0")" "$checks"
    exit "$failed"
}

ALL_CHECKS=(venv torch_cuda cuda_1stage bf16_1stage nccl_p2p pipeline_cuda pipeline_zbv_cuda
    tensor_parallel_cuda pipeline_bench)
NV_GPUS=0
TORCH_GPUS=0

# ---------------------------------------------------------------- the GPUs
echo "evtrain GPU checks: $REPO"
if command -v nvidia-smi >/dev/null 2>&1; then
    echo "nvidia-smi -L:"
    if timeout 30 nvidia-smi -L >"$WORK/nvidia-smi.txt" 2>&1; then
        sed 's/^/  /' "$WORK/nvidia-smi.txt"
        NV_GPUS="$(grep -c '^GPU ' "$WORK/nvidia-smi.txt")"
    else
        sed 's/^/  /' "$WORK/nvidia-smi.txt"
        echo "  (nvidia-smi -L failed)"
    fi
else
    echo "nvidia-smi -L: nvidia-smi not found"
fi
if ((DRY_RUN)); then
    echo "NVIDIA GPUs: $NV_GPUS (dry run: every check on CPU)"
else
    echo "NVIDIA GPUs: $NV_GPUS"
fi
if ((NV_GPUS == 0 && !DRY_RUN)); then
    skip_all "no NVIDIA GPU" "${ALL_CHECKS[@]}"
    finish
fi

# ---------------------------------------------------------------- the venv
PY="$VENV/bin/python"
if [[ -x "$PY" ]]; then
    echo "venv: $VENV (exists: nothing installed)"
    run_check venv 60 '^torch ' "$PY" -c \
        'import torch, evtrain; print("torch", torch.__version__, "cuda", torch.version.cuda)' ||
        {
            skip_all "the venv does not work (see venv)" "${ALL_CHECKS[@]:1}"
            finish
        }
elif ((DRY_RUN)); then
    record venv failed 0 "$VENV does not exist (a dry run installs nothing: set EVTRAIN_VENV)"
    skip_all "no venv" "${ALL_CHECKS[@]:1}"
    finish
else
    echo "venv: $VENV does not exist: creating it, installing torch==2.13.0 and evtrain"
    start="$(now)"
    if (timeout 1800 python3 -m venv "$VENV" &&
        timeout 1800 "$VENV/bin/pip" install -q torch==2.13.0 &&
        timeout 1800 "$VENV/bin/pip" install -q -e "$REPO") >"$WORK/venv.log" 2>&1; then
        record venv ok "$(since "$start")" "created and installed (outside the check budget)"
    else
        record venv failed "$(since "$start")" "creating $VENV failed" "$(tail_of "$WORK/venv.log")"
        skip_all "no venv" "${ALL_CHECKS[@]:1}"
        finish
    fi
    T0="$(now)" # the 5-minute budget is for the checks
fi
EVTRAIN="$VENV/bin/evtrain"
TORCHRUN="$VENV/bin/torchrun"

# ---------------------------------------------------------------- torch and CUDA
cat >"$WORK/torch_cuda.py" <<'EOF'
import sys

import torch

if sys.argv[1] == "cpu":
    print(f"torch {torch.__version__} (dry run: CUDA not used; cuda available: "
          f"{torch.cuda.is_available()})")
    print("DEVICES=0 BF16=1")
    raise SystemExit(0)
if not torch.cuda.is_available():
    raise SystemExit(
        f"torch {torch.__version__} (CUDA build {torch.version.cuda}) cannot use CUDA here"
    )
n = torch.cuda.device_count()
bf16 = torch.cuda.is_bf16_supported()
x = torch.ones(1024, device="cuda")
assert float(x.sum()) == 1024.0
names = ", ".join(torch.cuda.get_device_name(i) for i in range(n))
print(f"torch {torch.__version__} CUDA {torch.version.cuda}: {n} device(s) ({names}), bf16 {bf16}")
print(f"DEVICES={n} BF16={int(bf16)}")
EOF
MODE=cuda
((DRY_RUN)) && MODE=cpu
BF16=0
if run_check torch_cuda 60 '^torch ' "$PY" "$WORK/torch_cuda.py" "$MODE"; then
    TORCH_GPUS="$(sed -n 's/^DEVICES=\([0-9]*\).*/\1/p' "$WORK/torch_cuda.log")"
    BF16="$(sed -n 's/.*BF16=\([01]\).*/\1/p' "$WORK/torch_cuda.log")"
    TORCH_GPUS="${TORCH_GPUS:-0}"
    BF16="${BF16:-0}"
else
    skip_all "torch cannot use CUDA (see torch_cuda)" "${ALL_CHECKS[@]:2}"
    finish
fi

if ((DRY_RUN)); then
    DEVICE=cpu
    STEPS=2
else
    DEVICE=cuda
    STEPS=20
fi
SUMMARY='run completed|final loss'

# ---------------------------------------------------------------- (1) one CUDA stage
run_check cuda_1stage "$CHECK_TIMEOUT" "$SUMMARY" "$EVTRAIN" launch examples/mlp.py \
    --stages 1 --device "$DEVICE" --steps "$STEPS" --quiet --run-dir "$WORK/run-cuda-1stage"

# ---------------------------------------------------------------- (2) bf16
cat >"$WORK/gpt_bf16.py" <<EOF
"""examples/gpt.py's job in bf16 (bench/gpu_check.sh): Job has no precision override."""

import dataclasses

from evtrain.spec import load_job

job = dataclasses.replace(load_job("$REPO/examples/gpt.py"), precision="bf16")
EOF
if ((BF16 == 0)); then
    record bf16_1stage skipped 0 "torch says this GPU has no bf16 support"
else
    run_check bf16_1stage "$CHECK_TIMEOUT" "$SUMMARY" "$EVTRAIN" launch "$WORK/gpt_bf16.py" \
        --stages 1 --device "$DEVICE" --steps "$STEPS" --quiet --run-dir "$WORK/run-bf16-1stage"
fi

# ---------------------------------------------------------------- (3) NCCL p2p
cat >"$WORK/nccl_p2p.py" <<'EOF'
"""dist.send/recv of a 64 MiB tensor between 2 processes, both ways, values checked."""

import os
import time

import torch
import torch.distributed as dist

backend = os.environ.get("GPU_CHECK_BACKEND", "nccl")
rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
if backend == "nccl":
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")


def sync() -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


n = 16 * 2**20  # float32: 64 MiB
for src in (0, 1):
    if rank == src:
        dist.send(torch.arange(n, dtype=torch.float32, device=device) + src, dst=1 - src)
    else:
        got = torch.empty(n, dtype=torch.float32, device=device)
        dist.recv(got, src=src)
        want = torch.arange(n, dtype=torch.float32, device=device) + src
        if not torch.equal(got, want):
            bad = int((got != want).sum())
            raise SystemExit(f"rank {rank}: {bad} wrong values received from rank {src}")
buf = torch.zeros(n, dtype=torch.float32, device=device)
repeats = 5
sync()
dist.barrier()
start = time.perf_counter()
for _ in range(repeats):
    if rank == 0:
        dist.send(buf, dst=1)
    else:
        dist.recv(buf, src=0)
sync()
dist.barrier()
elapsed = time.perf_counter() - start
if rank == 0:
    rate = repeats * buf.numel() * 4 / elapsed / 1e9
    print(f"{backend} p2p ok: 64 MiB each way, values checked; 0->1 {rate:.1f} GB/s")
dist.destroy_process_group()
EOF
if ((!DRY_RUN && (NV_GPUS < 2 || TORCH_GPUS < 2))); then
    record nccl_p2p skipped 0 "needs 2 GPUs: nvidia-smi lists $NV_GPUS, torch sees $TORCH_GPUS"
else
    if ((DRY_RUN)); then
        export GPU_CHECK_BACKEND=gloo
    else
        export GPU_CHECK_BACKEND=nccl
    fi
    run_check nccl_p2p "$CHECK_TIMEOUT" 'p2p ok' \
        "$TORCHRUN" --standalone --nproc-per-node 2 "$WORK/nccl_p2p.py"
fi

# ---------------------------------------------------------------- (4) pipelines
if ((!DRY_RUN && (NV_GPUS < 2 || TORCH_GPUS < 2))); then
    reason="needs 2 GPUs: nvidia-smi lists $NV_GPUS, torch sees $TORCH_GPUS"
    record pipeline_cuda skipped 0 "$reason"
    record pipeline_zbv_cuda skipped 0 "$reason"
    record tensor_parallel_cuda skipped 0 "$reason"
    record pipeline_bench skipped 0 "$reason"
    finish
fi
run_check pipeline_cuda "$CHECK_TIMEOUT" "$SUMMARY" "$EVTRAIN" launch examples/mlp.py \
    --stages 2 --device "$DEVICE" --steps "$STEPS" --quiet --run-dir "$WORK/run-pipeline-cuda"
run_check pipeline_zbv_cuda "$CHECK_TIMEOUT" "$SUMMARY" "$EVTRAIN" launch examples/mlp.py \
    --stages 2 --device "$DEVICE" --schedule zbv --virtual-stages 2 --steps "$STEPS" --quiet \
    --run-dir "$WORK/run-pipeline-zbv-cuda"

# One stage split over 2 tensor ranks (NCCL all-reduces inside every block).
cat >"$WORK/tp_mlp.py" <<EOF
"""Residual MLP blocks split over 2 tensor ranks by a plan (bench/gpu_check.sh)."""

import functools
import sys

sys.path.insert(0, "$REPO/tests")

import torch
from helpers.mlp_parts import FeedForward
from torch import nn

from evtrain.job import Job, layer


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 256, generator=g)
    return x, x.sum(1, keepdim=True).tanh()


job = Job(
    name="gpu-check-tp",
    layers=[*[layer(FeedForward, 256, 1024) for _ in range(4)], layer(nn.Linear, 256, 1)],
    loss_fn=nn.functional.mse_loss,
    optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
    train_data=data,
    batch_size=256,
    num_microbatches=4,
    max_steps=20,
    stages=1,
    tensor_parallel=2,
    tp_plan={"*.up": "colwise", "*.down": "rowwise"},
)
EOF
run_check tensor_parallel_cuda "$CHECK_TIMEOUT" "$SUMMARY" "$EVTRAIN" launch "$WORK/tp_mlp.py" \
    --device "$DEVICE" --steps "$STEPS" --quiet --run-dir "$WORK/run-tp-cuda"

# bench/pipeline_vs_torch.py takes no device option: it measures the CPU engines.
if ((DRY_RUN)); then
    BENCH_ARGS=(--only "evtrain_1f1b,torch_1f1b" --grid 2x8 --steps 3 --warmup 1 --repeats 1)
else
    BENCH_ARGS=(--grid 2x8 --steps 30 --warmup 5 --repeats 1 --transformer-steps 10
        --transformer-warmup 2)
fi
DETAIL_PREFIX="CPU only (the bench has no device option): "
run_check pipeline_bench 150 '^evtrain/torch 1F1B +[0-9n]' \
    "$PY" bench/pipeline_vs_torch.py "${BENCH_ARGS[@]}"
DETAIL_PREFIX=""
finish
