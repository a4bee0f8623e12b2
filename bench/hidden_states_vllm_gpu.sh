#!/usr/bin/env bash
# The vllm hidden-states engine on one GPU, where vLLM's own extraction runs through vLLM's ExampleHiddenStatesConnector
# unchanged (on the CPU build, draftdata/hidden/engines/vllm_connector.py stands in for its CUDA-only copy). Checks,
# in this order, and stops at the first that fails:
# 1. both paths (extract, hook) equal transformers per layer and token, and auto picks extract with no fallback:
#    tests/test_vllm.py -m vllm -k vllm_engine (float32 weights, 1e-3);
# 2. the stage end to end on both paths, bf16 states against the hf backend's within bf16 tolerance:
#    -k hidden_states_stage;
# 3. capture_vs_forward for both paths: bench.hidden_states_vllm with the three vLLM processes sharing the GPU,
#    writing bench/results/hidden_states_vllm_gpu.json.
#
#   VLLM_PYTHON=.vllm/bin/python bench/hidden_states_vllm_gpu.sh [extra flags for bench.hidden_states_vllm]
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
export DRAFTDATA_VLLM_PYTHON=${VLLM_PYTHON:?VLLM_PYTHON: a Python with vLLM for CUDA}
"$PYTHON" -m pytest -q -m vllm tests/test_vllm.py -k "vllm_engine or hidden_states_stage"
exec "$PYTHON" -m bench.hidden_states_vllm --vllm-python "$DRAFTDATA_VLLM_PYTHON" --threads "${THREADS:-4}" \
    --samples "${SAMPLES:-256}" --llm-kwargs '{"gpu_memory_utilization": 0.25}' \
    --out bench/results/hidden_states_vllm_gpu.json "$@"
