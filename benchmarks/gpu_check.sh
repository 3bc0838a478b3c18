#!/usr/bin/env bash
# GPU check (issue 36): the one prepared script a session with a lent H100/H200 runs there.
#
# On the GPU machine (the `device` tool runs one command in the repository root; what the
# script writes under $OUT comes back):
#
#     bash benchmarks/gpu_check.sh           # device tool: carry [".gpu_wheels"], timeout_s 600
#
# With less device time left than that, give a smaller timeout_s and GPU_CHECK_BUDGET about
# 60 s under it (GPU_CHECK_BUDGET=300 bash benchmarks/gpu_check.sh).
#
# Here, on a CPU, the same steps shrunk (under a minute; every step should end with rc 0).
# Smoke mode installs nothing: it names the carried wheels it would install.
#
#     . .venv/bin/activate && bash benchmarks/gpu_check.sh --smoke    # or GPU_CHECK_SMOKE=1
#
# The GPU machine reaches no package registry. Its python3 has torch (CUDA), lightning,
# torchmetrics, transformers, pytest and hypothesis, but not jsonargparse (nor its helpers
# docstring-parser and typeshed-client), schedulefree, litgpt (nor litgpt's psutil). Fill
# .gpu_wheels/ here first: pure-Python wheels plus psutil's abi3 one, so this one command
# serves Python 3.10-3.13 alike (jsonargparse stays at 4.41, where litgpt 0.5.13 caps it;
# about 1.5 MB):
#
#     pip download --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
#         --python-version 3.12 --implementation cp -d .gpu_wheels jsonargparse==4.41.0 \
#         docstring-parser==0.18.0 typeshed-client==2.15.0 schedulefree==1.4.1 litgpt==0.5.13 psutil
#
# Optional, in case the GPU machine lacks matplotlib too (the PNGs of the main job and of
# studies/scale_model.py): binary wheels, so one download per Python version (about 49 MB
# for 3.11 and 3.12 together; pip picks the one that fits there):
#
#     for v in 3.11 3.12; do pip download --no-deps --only-binary=:all: \
#         --platform manylinux2014_x86_64 --python-version $v --implementation cp -d .gpu_wheels \
#         matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil six; done
#
# .gpu_wheels/ is git-ignored: name it in the device tool's carry list. The install step installs from that
# folder only (pip --no-index --no-deps --find-links) each distribution the machine does not
# have yet, so nothing already there (torch above all) is replaced. Then the project itself:
# pip install --no-index --no-deps --no-build-isolation -e . (PYTHONPATH holds the repository
# root as well, so the steps import it even if that fails).
#
# Every step runs under its own `timeout`, and the run under one overall budget
# (GPU_CHECK_BUDGET seconds, default 540 on the GPU, 120 in smoke mode): a step gets
# min(its cap, what is left), and a step with under 15 s left is skipped (rc "budget"; rc
# "skip": a step named in GPU_CHECK_SKIP). A failed step does not stop the others. The
# summary table (step, rc, seconds) is printed last and
# written to $OUT/summary.txt; each step's whole output is in $OUT/logs/NN_step.log, the
# benchmarks' JSON and PNGs beside them in $OUT. Exit status 0 when every step that ran
# returned 0.
#
# Order: the steps that need the GPU come first; the numerics and distributed tests (on the
# CPU and gloo even there) and the other tables of benchmarks/bench_optimizer.py come last
# and take what the budget leaves.
#
# Nothing here changes a GPU setting: nvidia-smi is only read (no -r, -pm, -pl, -ac, -mig).
#
# Environment: OUT (default: a new temporary folder), PYTHON (default python3),
# GPU_CHECK_SMOKE=1 (as --smoke), GPU_CHECK_BUDGET, GPU_CHECK_WHEELS (default .gpu_wheels),
# GPU_CHECK_TAIL (log lines echoed after each step, default 6), GPU_CHECK_SKIP (step names to
# skip, space-separated: a rerun of what failed, say GPU_CHECK_SKIP="main_job cli_fit").
#
# The device tool brings back at most 8 files: at the end everything under $OUT but
# summary.txt is packed into $OUT/gpu_check.tgz (and removed), so all of it comes back.
#
set -uo pipefail # no -e: a failed step must not stop the others

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

SMOKE="${GPU_CHECK_SMOKE:-0}"
for arg in "$@"; do
    case "$arg" in
    --smoke) SMOKE=1 ;;
    -h | --help)
        sed -n '2,/^$/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "gpu_check.sh: unknown argument $arg (only --smoke, --help)" >&2
        exit 2
        ;;
    esac
done
[ "$SMOKE" = 1 ] || SMOKE=0

PY="${PYTHON:-python3}"
OUT="${OUT:-}"
[ -n "$OUT" ] || OUT="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.gpu_wheels}"
if [ "$SMOKE" = 1 ]; then BUDGET="${GPU_CHECK_BUDGET:-120}"; else BUDGET="${GPU_CHECK_BUDGET:-540}"; fi
TAIL="${GPU_CHECK_TAIL:-6}"
SKIP_STEPS="${GPU_CHECK_SKIP:-}"
MIN_STEP_S=15
export PY OUT ROOT SMOKE WHEELS
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export MPLBACKEND=Agg
# Smoke mode shares a small CPU: one thread per process (a busy neighbour stalls multi-threaded
# small matmuls).
[ "$SMOKE" = 1 ] && export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

# ---------------------------------------------------------------- steps

NAMES=()
RCS=()
SECS=()
START_NS=$(date +%s%N)

now_ms() { echo $((($(date +%s%N) - START_NS) / 1000000)); }

# step NAME CAP_SECONDS COMMAND [ARGS...]: runs COMMAND under timeout, its output in $OUT/logs.
step() {
    local name=$1 cap=$2
    shift 2
    if [[ " $SKIP_STEPS " == *" $name "* ]]; then
        skip "$name" "GPU_CHECK_SKIP"
        return
    fi
    local n=$((${#NAMES[@]} + 1))
    local log
    log=$(printf '%s/logs/%02d_%s.log' "$OUT" "$n" "$name")
    local left=$((BUDGET - $(now_ms) / 1000))
    ((left < cap)) && cap=$left
    if ((cap < MIN_STEP_S)); then
        echo "== [$n] $name: skipped, ${left}s of the ${BUDGET}s budget left" | tee "$log"
        NAMES+=("$name")
        RCS+=("budget")
        SECS+=("0.0")
        return
    fi
    echo "== [$n] $name (cap ${cap}s): $*"
    echo "\$ $*" >"$log"
    local t0 t1 rc
    t0=$(now_ms)
    timeout -k 10 "$cap" "$@" >>"$log" 2>&1 </dev/null
    rc=$?
    t1=$(now_ms)
    tail -n "$TAIL" "$log" | sed 's/^/    /'
    NAMES+=("$name")
    RCS+=("$rc")
    SECS+=("$(printf '%d.%d' $(((t1 - t0) / 1000)) $((((t1 - t0) % 1000) / 100)))")
}

# skip NAME REASON: a step that does not apply here (rc "skip", not a failure).
skip() {
    local n=$((${#NAMES[@]} + 1))
    echo "== [$n] $1: skipped ($2)" | tee "$(printf '%s/logs/%02d_%s.log' "$OUT" "$n" "$1")"
    NAMES+=("$1")
    RCS+=("skip")
    SECS+=("0.0")
}

# The machine: nvidia-smi (read only), the packages the steps need, torch and the GPU's name
# (last, so the echoed tail of the log shows them).
env_info() {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ); host: $(hostname); smoke: $SMOKE; out: $OUT"
    uname -a
    echo "git: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')," \
        "$(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l) changed file(s)"
    echo "nproc: $(nproc); load: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi
        nvidia-smi --format=csv \
            --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit,mig.mode.current
    else
        echo "nvidia-smi: not found"
    fi
    "$PY" - <<'EOF'
import importlib.metadata as md
import os
import sys

import torch

names = ["lightning", "torchmetrics", "transformers", "pytest", "hypothesis", "jsonargparse", "docstring-parser",
         "typeshed-client", "schedulefree", "litgpt", "psutil", "pyyaml", "matplotlib", "scikit-learn", "tensorboard",
         "rich", "heavyball", "setuptools", "numpy"]
for name in names:
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        version = "missing"
    print(f"  {name:<18} {version}")
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| cudnn", torch.backends.cudnn.version())
print("torch.cuda.is_available():", torch.cuda.is_available())
if torch.cuda.is_available():
    print("torch.cuda.get_device_name():", torch.cuda.get_device_name())
    props = torch.cuda.get_device_properties(0)
    print(f"capability {props.major}.{props.minor}, {props.total_memory / 2**30:.1f} GiB,", end=" ")
    print(f"{props.multi_processor_count} SMs")
    print("device_count", torch.cuda.device_count(), "| bf16", torch.cuda.is_bf16_supported())
    print("allow_tf32 (matmul)", torch.backends.cuda.matmul.allow_tf32)
print("cpu capability", torch.backends.cpu.get_cpu_capability(), "| threads", torch.get_num_threads())
sys.exit(0 if torch.cuda.is_available() or os.environ["SMOKE"] == "1" else 1)
EOF
}

# Carried wheels (only the distributions missing here), then the project itself. Smoke mode
# installs nothing: it names what it would install.
install() {
    local fail=0 name
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        for name in $(for w in "$WHEELS"/*.whl; do basename "$w" | cut -d- -f1; done | sort -u); do
            if "$PY" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$name" 2>/dev/null; then
                echo "have $name: not reinstalled"
                continue
            fi
            if [ "$SMOKE" = 1 ]; then # never change the developer's environment
                echo "smoke: would install $name from $WHEELS"
                continue
            fi
            echo "installing $name from $WHEELS"
            PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" "$name" ||
                fail=$((fail + 1))
        done
    else
        echo "no wheels in $WHEELS: carried-wheel install skipped"
    fi
    local here
    # Where lightning_muon comes from without PYTHONPATH or the working directory (found, not imported).
    here=$(cd / && "$PY" -I -c "import importlib.util as u, pathlib
print(pathlib.Path(u.find_spec('lightning_muon').origin).resolve().parents[1])" 2>/dev/null)
    if [ "$here" = "$ROOT" ]; then
        echo "lightning_muon is already installed from $ROOT: not reinstalled"
    elif [ "$SMOKE" = 1 ]; then
        echo "smoke: project install skipped (installed from ${here:-nowhere});" \
            "the steps import it through PYTHONPATH=$ROOT"
    elif ! PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation \
        -e "$ROOT"; then
        echo "pip install -e . failed: the steps import the project through PYTHONPATH=$ROOT"
    fi
    "$PY" - <<'EOF' || fail=$((fail + 1))
import importlib.util
import sys

need = ["lightning_muon", "jsonargparse", "docstring_parser", "typeshed_client", "schedulefree", "litgpt", "psutil",
        "yaml"]
missing = [name for name in need if importlib.util.find_spec(name) is None]
optional = [name for name in ("matplotlib",) if importlib.util.find_spec(name) is None]
print("missing (needed):", missing or "none", "| missing (optional, PNGs):", optional or "none")
sys.exit(1 if missing else 0)
EOF
    return $((fail > 0))
}
export -f env_info install

# ---------------------------------------------------------------- the run

XDIST=""
"$PY" -c "import xdist" 2>/dev/null && XDIST="-n 8"

echo "gpu_check.sh: $([ "$SMOKE" = 1 ] && echo "smoke (cpu)" || echo "gpu"), budget ${BUDGET}s, out $OUT"

step env 60 bash -c env_info
step install 120 bash -c install

if [ "$SMOKE" = 1 ]; then
    # The same structure, each step shrunk: the cuda tests collect and skip without a GPU.
    step pytest_cuda 60 "$PY" -m pytest -q -x -p no:cacheprovider -m cuda tests/test_cuda.py
    step bench_optimizer 60 "$PY" benchmarks/bench_optimizer.py --device cpu --quick --threads 1 \
        --sections roofline step --out "$OUT/bench_optimizer.json"
    step scale_model 60 "$PY" studies/scale_model.py --device cpu --profile this-cpu --preset gpt2-small \
        --worlds 8 --tp-degrees 2 --out "$OUT/scale_model.json"
    step memory 60 "$PY" benchmarks/bench_optimizer.py --device cpu --quick --threads 1 --sections memory \
        --out "$OUT/memory.json"
    step train_step 60 "$PY" benchmarks/bench_train_step.py --device cpu --quick --out "$OUT/bench_train_step.json"
    step main_job 60 "$PY" examples/muon_vs_adamw/main.py --steps 2 --eval-every 1 --out "$OUT/muon_vs_adamw"
    step cli_fit 60 "$PY" -m lightning_muon fit --config configs/muon.yaml --trainer.accelerator=cpu \
        --trainer.devices=1 --trainer.max_steps=3 --trainer.val_check_interval=3 --trainer.limit_val_batches=1 \
        --trainer.num_sanity_val_steps=0 \
        --trainer.enable_progress_bar=false --trainer.default_root_dir="$OUT/cli_fit"
    step pytest_numerics_distributed 60 "$PY" -m pytest -q -x -p no:cacheprovider -m "numerics or distributed" \
        tests/test_symmetric.py
    step bench_optimizer_rest 60 "$PY" benchmarks/bench_optimizer.py --device cpu --quick --threads 1 \
        --sections accuracy --out "$OUT/bench_optimizer_rest.json"
else
    # The cuda-marked tests (bf16 Newton-Schulz, a sync-free step, 1-GPU fits under both strategies).
    step pytest_cuda 150 "$PY" -m pytest -q -p no:cacheprovider --continue-on-collection-errors -m cuda \
        --durations=10 tests/
    # Newton-Schulz TFLOP/s against the bare matmuls in fp32 and bf16 (roofline, d up to 4096), and the
    # whole optimizer step against torch.optim.Muon + AdamW (step).
    step bench_optimizer 200 "$PY" benchmarks/bench_optimizer.py --device cuda --sections roofline step batching \
        --out "$OUT/bench_optimizer.json"
    # GEMM, Newton-Schulz and copy rates measured on this GPU, then the predicted optimizer +
    # exposed-communication time as "% of step" for GPT-2 small (d=768 x 12) and 1.3B (d=2048 x 24).
    step scale_model 120 "$PY" studies/scale_model.py --device cuda --preset gpt2-small 1.3b \
        --out "$OUT/scale_model.json"
    # torch.cuda.max_memory_allocated per step, ours against torch.optim.Muon and AdamW, then with the
    # post-step callbacks (one GPU: the multi-rank memory measurements need a GPU per rank).
    step memory 90 "$PY" benchmarks/bench_optimizer.py --device cuda --sections memory --out "$OUT/memory.json"
    step memory_callbacks 60 "$PY" benchmarks/bench_spectra.py --device cuda --memory \
        --out "$OUT/memory_callbacks.json"
    # Muon's share of a GPT-2-small training step (forward + backward + step), ours and torch.optim.Muon's.
    step train_step 120 "$PY" benchmarks/bench_train_step.py --device cuda --out "$OUT/bench_train_step.json"
    # The README's main job on the GPU, short.
    step main_job 120 "$PY" examples/muon_vs_adamw/main.py --device cuda --steps 100 --eval-every 50 \
        --out "$OUT/muon_vs_adamw"
    # The demo GPT of configs/muon.yaml on the GPU through the CLI, short.
    step cli_fit 120 "$PY" -m lightning_muon fit --config configs/muon.yaml --trainer.accelerator=gpu \
        --trainer.devices=1 --trainer.max_steps=200 --trainer.val_check_interval=100 \
        --trainer.enable_progress_bar=false --trainer.default_root_dir="$OUT/cli_fit"
    # pytest-xdist, where installed, spreads them over the machine's cores.
    # -v: each test's verdict is a log line as it ends, so a run cut short by its cap still names its failures.
    step pytest_numerics_distributed 300 "$PY" -m pytest -v -p no:cacheprovider --continue-on-collection-errors $XDIST \
        -m "numerics or distributed" \
        --durations=15 tests/
    step bench_optimizer_rest 150 "$PY" benchmarks/bench_optimizer.py --device cuda \
        --sections accuracy gram symmetric --out "$OUT/bench_optimizer_rest.json"
fi

# Whatever the steps wrote to benchmarks/results/ (their default output folder) during this run.
if [ -d benchmarks/results ]; then
    mkdir -p "$OUT/results"
    find benchmarks/results -type f -newer "$OUT/logs/01_env.log" -exec cp -p {} "$OUT/results/" \;
fi

# ---------------------------------------------------------------- summary

failed=0
skipped=0
{
    echo
    echo "== gpu_check summary ($([ "$SMOKE" = 1 ] && echo smoke || echo gpu); out: $OUT) =="
    printf '%-28s %-12s %8s\n' step rc seconds
    for i in "${!NAMES[@]}"; do
        rc=${RCS[$i]}
        note=""
        case "$rc" in
        skip | budget) skipped=$((skipped + 1)) ;;
        0) ;;
        124 | 137) note=" timeout" failed=$((failed + 1)) ;;
        *) failed=$((failed + 1)) ;;
        esac
        printf '%-28s %-12s %8s\n' "${NAMES[$i]}" "$rc$note" "${SECS[$i]}"
    done
    total=$(now_ms)
    printf 'total %d.%d s; %d failed, %d skipped\n' $((total / 1000)) $(((total % 1000) / 100)) "$failed" "$skipped"
} >"$OUT/summary.txt" # braces, not a pipe: the counts stay in this shell
cat "$OUT/summary.txt"
# One archive of everything else (the device tool returns at most 8 files), then only it and the summary.
(cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name gpu_check.tgz -print0 |
    xargs -0 tar czf gpu_check.tgz && find . -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name gpu_check.tgz \
    -exec rm -rf {} +)
echo "packed: $OUT/gpu_check.tgz ($(du -h "$OUT/gpu_check.tgz" | cut -f1))"
exit $((failed > 0))
