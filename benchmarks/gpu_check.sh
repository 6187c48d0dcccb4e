#!/usr/bin/env bash
# The GPU acceptance run (issue 38): the one script to run whenever a GPU machine is available.
# Run from the repository root; results go to $OUT (default /tmp/gpu-check):
#
#     OUT=/some/dir bash benchmarks/gpu_check.sh           # on the GPU machine, ~7 minutes
#     OUT=/tmp/gc bash benchmarks/gpu_check.sh --cpu       # the same end to end on CPU, small
#     bash benchmarks/gpu_check.sh quickstart probe        # only these parts
#
# Parts, run in parallel (each under its own time limit; a failing part keeps the others):
#   quickstart   the README's quick start, nothing set: `pytest -m convergence` (three verdicts)
#   experiments  every shipped quick/ci-tier experiment (experiments/*.toml), placed as the
#                plugin places them on this machine (one GPU per rank, ranks sharing a GPU, CPU)
#   torchtitan   experiments/torchtitan/debug_1gpu.toml (nightly tier): runs where the torch
#                and torchtitan allow it, else a clean skip naming why
#   sweep        benchmarks/gpu_sweep.py: bf16 correct layouts at two seeds (false alarms) and
#                planted bugs (detection) on the envelope config b, probe off
#   probe        benchmarks/gloo_cuda_probe.py: which collectives gloo runs on CUDA tensors
#                (2 and 4 ranks sharing the GPU), each in its own subprocess
#   fixedcost    benchmarks/job_fixed_cost.py (each job's fixed cost per phase), when present
#   float8       experiments/precision/gpu.toml (nightly tier): bf16 vs float8 tensorwise,
#                rowwise and all-gather with precision.kernels = "hardware" (the GPU's own
#                float8 matmuls, never emulated), judged by the margin regime. Needs torchao:
#                where it is not installed, a torchao wheel carried in .gpu-deps/ (made here by
#                `pip download --no-deps -d .gpu-deps "torchao>=0.18,<0.19"`) is unpacked
#                into the work folder and put on PYTHONPATH for this part (nothing installed);
#                without either the pairs skip naming the install
#
# $OUT gets: results.md (the table, also printed), gloo_probe.json, sweep.json, reports of the
# pytest parts (quickstart.json, experiments.json) and logs.tar.gz (every part's log, the
# reports' markdown, the failed jobs' rank logs).
# --cpu (alias --dry-run): GPUs hidden, a few steps, a few cases: checks the script itself on a
# machine without a GPU, so a GPU's minutes go to results.
# (no set -u: empty arrays such as STEPS=() expand to nothing on every bash, 4.3 included)
CPU=0
parts=()
for arg in "$@"; do
  case $arg in
    --cpu | --dry-run) CPU=1 ;;
    *) parts+=("$arg") ;;
  esac
done
PARTS=${parts[*]:-quickstart experiments torchtitan sweep probe fixedcost float8}
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
LOGS=$WORK/logs
mkdir -p "$LOGS" "$WORK/status"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
START=$(date +%s)

if [ "$CPU" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""
  STEPS=(--convergence-steps 3)
  SEEDS=(7)
  SWEEP=(--steps 4)
  SWEEP_CHUNKS=("fsdp2-cp2 fsdp-dp-rank-dropped")
  PROBE=(--device cpu --worlds 2 --only all_reduce send_recv --parallel 2 --timeout 280)
  TITAN=(--collect-only -q)
  FIXED=(--device cpu --rounds 1)
  EXPERIMENTS=(experiments/dp_vs_tp.toml)
  LIMIT=900
else
  STEPS=()
  SEEDS=(7 8)
  SWEEP=()
  # A few cases per process, the processes in parallel (16 cores; the pairs share the GPU).
  SWEEP_CHUNKS=("fsdp2-cp2 fsdp-dp-rank-dropped" "hsdp2x2 hsdp-sum-not-average"
    "fsdp4 dp-ranks-read-same-shard" "fsdp2-accum2 grad-accum-not-divided"
    "cp-rope-ignores-offset cp-mask-ignores-offset")
  PROBE=(--device cuda --worlds 2 4 --parallel 6)
  TITAN=()
  FIXED=(--rounds 2)
  EXPERIMENTS=(-n 3 experiments/*.toml)
  LIMIT=400
fi

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | head -3
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
  git log --oneline -1 2>/dev/null
} | tee "$LOGS/machine.txt"

# The project from this checkout, on PYTHONPATH (ahead of any installed copy; never installed by
# this script: no network there, and nothing to undo), its train configs where the installed
# package would have them, and the pytest plugin by -p where no installed copy registers it.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -e convergence/configs ] || ln -sfn ../train_configs convergence/configs
PLUGIN=()
$PY -c "from importlib.metadata import entry_points as e; import sys; sys.exit(any(p.name == 'convergence' for p in e(group='pytest11')))" \
  && PLUGIN=(-p pytest_convergence.plugin)
$PY -c "import convergence.preflight, convergence.trainer.train" >>"$LOGS/machine.txt" 2>&1 \
  || echo "WARNING: the package does not import here (machine.txt)" | tee -a "$LOGS/machine.txt"

# One part: its command under a time limit, its log, its status line (name, rc, seconds).
part() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout -k 20 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name $rc $((SECONDS - t0))" >"$WORK/status/$name"
}

pytest_part() {  # name, limit, pytest args...
  local name=$1 limit=$2
  shift 2
  # --continue-on-collection-errors: a test module of tests/ that cannot import here (a test
  # extra not installed) must not stop the pairs; -v: the lines of the pairs that ended survive
  # a part cut off by its time limit.
  part "$name" "$limit" $PY -m pytest -p no:cacheprovider "${PLUGIN[@]}" -rA -v \
    --continue-on-collection-errors \
    --convergence-workdir "$WORK/$name-work" --convergence-report "$WORK/$name-report" \
    --junitxml "$WORK/$name-junit.xml" "${STEPS[@]}" "$@"
}

for p in $PARTS; do
  case $p in
    quickstart) pytest_part quickstart "$LIMIT" -m convergence & ;;
    experiments)
      pytest_part experiments "$LIMIT" -m convergence --convergence-tier ci "${EXPERIMENTS[@]}" & ;;
    torchtitan)
      pytest_part torchtitan 240 -m convergence --convergence-tier nightly "${TITAN[@]}" \
        experiments/torchtitan/debug_1gpu.toml & ;;
    sweep)  # one process per seed (each its own pool: they share the GPU), then one table
      (
        for seed in "${SEEDS[@]}"; do
          for chunk in "${!SWEEP_CHUNKS[@]}"; do
            # shellcheck disable=SC2086  # a chunk is a list of case names
            part "sweep-$seed-$chunk" "$LIMIT" $PY benchmarks/gpu_sweep.py --seeds "$seed" \
              "${SWEEP[@]}" ${SWEEP_CHUNKS[$chunk]:+--cases ${SWEEP_CHUNKS[$chunk]}} \
              --json "$WORK/sweep-$seed-$chunk.json" &
          done
        done
        wait
        $PY benchmarks/gpu_sweep.py --merge "$WORK"/sweep-*.json --json "$OUT/sweep.json" \
          >"$LOGS/sweep.log" 2>&1
      ) & ;;
    probe) part probe 320 $PY benchmarks/gloo_cuda_probe.py "${PROBE[@]}" --json "$OUT/gloo_probe.json" & ;;
    float8)
      (
        if ! $PY -c "import torchao" >/dev/null 2>&1; then
          wheel=$(ls .gpu-deps/torchao-*.whl 2>/dev/null | head -1)
          if [ -n "$wheel" ]; then
            $PY -m zipfile -e "$wheel" "$WORK/pydeps" && export PYTHONPATH=$WORK/pydeps:$PYTHONPATH
          fi
        fi
        pytest_part float8 "$LIMIT" -m convergence --convergence-tier nightly \
          experiments/precision/gpu.toml
      ) & ;;
    fixedcost)
      if [ -f benchmarks/job_fixed_cost.py ]; then
        (cd benchmarks && part fixedcost 300 $PY job_fixed_cost.py "${FIXED[@]}" --no-append) &
      else
        echo "fixedcost - 0" >"$WORK/status/fixedcost"
        echo "benchmarks/job_fixed_cost.py is not in this checkout: skipped" >"$LOGS/fixedcost.log"
      fi ;;
    *) echo "unknown part: $p" >&2 ;;
  esac
done
wait

# The summary: one row per part, then each part's own lines that say what happened.
signals() {  # jobs killed by a signal, in every rank log and part log
  grep -rlE "SIGABRT|SIGSEGV|Signal [0-9]+|died with <Signals|exitcode *: *-[0-9]" \
    "$WORK" --include=*.log 2>/dev/null | grep -v '/logs/probe.log' | wc -l
}
pairs() {  # each pair of a pytest part's report: its verdict and where it ran
  [ -f "$1" ] || { echo "(no report)"; return; }
  $PY - "$1" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
print("| pair | verdict | wall s | where it ran |\n|---|---|---:|---|")
for p in report["pairs"]:
    wall = p["wall_s"]["pair"]
    print(f"| {p['id']} | {p['status']} | {wall or 0:.0f} | {p.get('placement') or '-'} |")
PY
}
summary() {  # the last line pytest or a benchmark prints about its outcome
  local log=$LOGS/$1.log
  case $1 in
    quickstart | experiments | torchtitan | float8) grep -E "^=+ .* in [0-9.]+s" "$log" | tail -1 | tr -d '=' ;;
    sweep-*) grep -E "^false alarms" "$log" | tail -1 ;;
    probe) echo "OK cells: $(grep -o '| OK' "$log" | wc -l); FAIL cells: $(grep -o 'FAIL' "$log" | wc -l)" ;;
    fixedcost) tail -1 "$log" ;;
  esac
}
{
  echo "# GPU acceptance run ($(date -u +%F' '%H:%M) UTC, $(($(date +%s) - START)) s)"
  echo
  sed 's/^/    /' "$LOGS/machine.txt"
  echo
  echo "| part | exit | seconds | summary |"
  echo "|---|---:|---:|---|"
  for f in "$WORK"/status/*; do
    read -r name rc secs <"$f"
    echo "| $name | $rc | $secs | $(summary "$name" | tr '|' '/' | head -c 300) |"
  done
  echo
  echo "logs naming a signal (SIGABRT/SIGSEGV/...; probe excluded): $(signals)"
  for name in quickstart experiments torchtitan float8; do
    [ -f "$LOGS/$name.log" ] || continue
    echo
    echo "## $name: each item (pytest -rA) and where its pair ran"
    echo
    pairs "$WORK/$name-report/report.json"
    grep -E "^(SKIPPED|ERROR|FAILED)" "$LOGS/$name.log" | sed 's/^/    /' | head -20
  done
  for name in sweep probe; do
    [ -f "$LOGS/$name.log" ] || continue
    echo
    echo "## $name"
    echo
    grep -E "^\||^gloo on|^false alarms" "$LOGS/$name.log"
  done
  if [ -f "$LOGS/fixedcost.log" ]; then
    echo
    echo "## fixedcost"
    echo
    grep -E "^\|" "$LOGS/fixedcost.log" || tail -5 "$LOGS/fixedcost.log"
  fi
} >"$OUT/results.md"

# Reports and the rank logs of failed jobs, into one tarball (the device returns few files).
for name in quickstart experiments torchtitan float8; do
  [ -f "$WORK/$name-report/report.json" ] && cp "$WORK/$name-report/report.json" "$OUT/$name.json"
  [ -f "$WORK/$name-report/report.md" ] && cp "$WORK/$name-report/report.md" "$LOGS/$name-report.md"
  [ -f "$WORK/$name-junit.xml" ] && cp "$WORK/$name-junit.xml" "$LOGS/"
done
mkdir -p "$LOGS/failed-ranks"
grep -rlE "Error|Traceback|SIG[A-Z]+" "$WORK" --include=stderr.log 2>/dev/null | head -30 \
  | while read -r f; do cp "$f" "$LOGS/failed-ranks/$(echo "${f#"$WORK"/}" | tr / _)"; done
tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs
cat "$OUT/results.md"
echo "results in $OUT (work folder $WORK)"
