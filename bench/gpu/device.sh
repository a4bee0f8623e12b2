#!/usr/bin/env bash
# The GPU run's entry on the GPU machine, one call per chunk of the bundle (docs/benchmarks.md, "On a GPU"):
#
#   bash bench/gpu/device.sh stash          every call but the last: keeps the chunk it carries in $GPU_HOME
#   bash bench/gpu/device.sh run [ARGS]     the last: joins and checks the chunks, installs the wheels, runs
#                                           python -m bench.gpu.run ARGS into $OUT (the same command again goes on
#                                           from where a cut run stopped, while the machine keeps $GPU_HOME)
#
# Each call carries .gpu/chunks/part-NN and .gpu/chunks/manifest.json (python -m bench.gpu.bundle prints the calls).
# The machine keeps files between two calls only while it stays warm: make them one after the other.
set -euo pipefail
cd "$(dirname "$0")/../.."
GPU_HOME=${GPU_HOME:-/tmp/draftdata-gpu}
PYTHON=${PYTHON:-python3}
mkdir -p "$GPU_HOME/chunks"
if compgen -G ".gpu/chunks/*" >/dev/null; then cp .gpu/chunks/* "$GPU_HOME/chunks/"; fi
what=${1:?stash or run}
shift
if [ "$what" = stash ]; then
    ls -l "$GPU_HOME/chunks"
    exit 0
fi
"$PYTHON" -m bench.gpu.bundle unpack "$GPU_HOME"
export PYTHONPATH=$GPU_HOME/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export DRAFTDATA_TRAINERS_PYTHON=$GPU_HOME/tv/bin/python
OUT=${OUT:-$GPU_HOME/out}
mkdir -p "$OUT"
# the trainers' Python imports what bench/drafter_train.py does, before any GPU time goes to the data it would train on
"$DRAFTDATA_TRAINERS_PYTHON" -I -c "import speculators.models.eagle3, speculators.train.data, speculators.train.cli, \
speculators.train.optimizers, speculators.train.trainer, speculators.models.metrics, torch, transformers; \
from importlib.metadata import version; print('trainers: speculators', version('speculators'), 'transformers', \
transformers.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tail -3 \
    | tee "$OUT/trainers.txt" || true  # a failure here is the proof's alone: the other parts still run
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$OUT/nvidia-smi.txt" 2>&1 || true
set -o pipefail
"$PYTHON" -m bench.gpu.run --bundle "$GPU_HOME/bundle" --work "$GPU_HOME/work" --out "$OUT" "$@" 2>&1 | tee -a "$OUT/run.log"
