#!/usr/bin/env bash
# The GPU checks of issue 28, as one script for a machine with one GPU (run from the repository
# root; OUT is where the figures go; arguments pick the parts, default all):
#   rounding  benchmarks/gpu_rounding.py: a TP shard's matmul rounding per shape, CPU and GPU
#   single    convergence calibrate with a one-device control and the one-device layout accum2
#   shared    convergence calibrate with the default layouts (2 and 4 ranks) on one GPU, its ranks
#             sharing it through gloo (CONVERGENCE_RANKS_PER_GPU=4; NCCL refuses two ranks per GPU);
#             no TP: DTensor's functional collectives over gloo on CUDA crash (SIGSEGV, torch 2.11)
#   cp        the same for FSDP+CP in bf16 (its own file: a failure there keeps the others)
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PARTS=${*:-rounding single shared cp}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
python3 -c "import convergence" 2>/dev/null \
  || python3 -m pip install -q --no-deps --no-build-isolation --no-index . 2>&1 | tail -3
python3 -c "import convergence.configs" 2>/dev/null || {
  echo "not installed: running from the checkout"
  ln -sfn ../train_configs convergence/configs
  export PYTHONPATH=$PWD
}
logs() {  # the end of each rank's stderr of the jobs that failed
  grep -l "Error\|Traceback" -r "$1" --include=stderr.log 2>/dev/null | head -3 | while read -r f; do
    echo "== $f"; tail -8 "$f"; done
}
for part in $PARTS; do
  echo "=== $part"
  case $part in
    rounding) time python3 benchmarks/gpu_rounding.py --json "$OUT/gpu_rounding.json" ;;
    single)
      time timeout 240 python3 -m convergence.cli calibrate debug --control single \
        --fp32-layouts accum2 --bf16-layouts --steps 30 --workdir /tmp/cal-single \
        --out "$OUT/calibration-gpu-single.json" || logs /tmp/cal-single ;;
    shared)
      time CONVERGENCE_RANKS_PER_GPU=4 timeout 400 python3 -m convergence.cli calibrate debug \
        --fp32-layouts single ddp2 fsdp4 hsdp2x2 --bf16-layouts hsdp2x2 --steps 30 \
        --workdir /tmp/cal-shared --out "$OUT/calibration-gpu-shared.json" || logs /tmp/cal-shared ;;
    cp)
      time CONVERGENCE_RANKS_PER_GPU=4 timeout 200 python3 -m convergence.cli calibrate debug \
        --fp32-layouts --bf16-layouts fsdp2-cp2 --steps 30 \
        --workdir /tmp/cal-shared --out "$OUT/calibration-gpu-cp.json" || logs /tmp/cal-shared ;;
  esac
done
