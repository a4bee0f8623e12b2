#!/usr/bin/env bash
# bench/hidden_states.py on one GPU, with a target the size of the ones drafters are trained for: a random-weight
# Llama built from Llama-3-8B's shape (hidden 4096, 32 layers, 32 query heads of 128 and 8 KV heads, MLP 14336,
# vocab 128,256; 16 GB of bf16 weights), so the naive path pays a real LM head (a [tokens, 128k] logits tensor)
# and ours pays real device-to-host copies, which the plain forward beside it (the same engine and batches, nothing
# captured) does not: capture_vs_forward and the time split show what they cost. Writes
# bench/results/hidden_states_gpu.json with every figure the CPU run prints; stops in one line without a GPU.
#
#   bench/hidden_states_gpu.sh [extra flags for bench.hidden_states, e.g. --samples 200]
#
# Sizing, for one 80-140 GB GPU:
# - GPU memory: ours, the plain forward and naive each hold the weights while they take turns (3 x 16 GB), plus
#   naive's 33 hidden states and logits for one padded batch (about 9 GB at 16k tokens); the fp8 run comes after
#   they have exited;
# - disk: a token costs 32 KB in bf16, so 400 samples of mean 1,000 tokens put about 13 GB in ours' store, 6.5 GB
#   in the fp8 one, up to a third of 13 GB of naive's files at a time (removed after each round) and 16 GB of
#   weights under $TMPDIR (default /tmp): about 40 GB. Point TMPDIR at a bigger disk for more samples;
# - batch_tokens 16384: the stage's default of 4,096 leaves a GPU this size mostly idle; naive's batch size is
#   chosen by the benchmark to match ours' average padded batch.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
exec "$PYTHON" -m bench.hidden_states --device cuda \
    --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --intermediate 14336 --vocab 128256 \
    --samples "${SAMPLES:-400}" --batch-tokens "${BATCH_TOKENS:-16384}" --threads "${THREADS:-$(nproc)}" \
    --out bench/results/hidden_states_gpu.json "$@"
