"""The engines that compute hidden states: transformers in-process (hf) and vLLM (vllm, in its own Python)."""
