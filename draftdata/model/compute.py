"""The dtype an in-process engine computes the target in (`model.compute_dtype`): the embedded generation engine and
the hf hidden-states engine.

A 16-bit model runs in its own dtype where the hardware multiplies it natively (a GPU; a CPU with AMX or AVX-512
BF16 for bf16, AMX-FP16 for fp16), and in float32 elsewhere: a CPU without those units runs bf16 matmuls no faster
than float32, some far slower (docs/benchmarks.md). Computing a 16-bit model in float32 computes the same
model, more precisely, but not the same tokens: the dtype is part of what a stored answer or state was computed by.

So the choice is made from the setting, the weights' dtype and the device alone, never from a timing (a timing can
flip on a busy machine), and a dtype other than the weights' own is part of the target's fingerprint
(`computed_fingerprint`): one key never holds results of two kinds of arithmetic.
"""

from __future__ import annotations

from draftdata.config.schema import ModelConfig
from draftdata.errors import ConfigError
from draftdata.model.load import model_dir, read_config
from draftdata.util.hashing import content_hash

AUTO = "auto"
DTYPES = ("float32", "bfloat16", "float16")


def weights_dtype(model: ModelConfig) -> str:
    """The dtype of the target's weights as its config.json states it (float32 when it says nothing, as transformers
    loads such a model)."""
    return config_dtype(read_config(model_dir(model)))


def quantization_method(model: ModelConfig) -> str | None:
    """The quantization of the target's checkpoint as its config.json names it: fp8, gptq, awq, ...; None for plain
    weights."""
    return config_quantization(read_config(model_dir(model)))


def config_dtype(conf: dict | None) -> str:
    """The weights' dtype a config.json (`conf`; None: none) states, its text config's for a multimodal wrapper."""
    conf = conf or {}
    text = conf.get("text_config") or {}
    name = conf.get("dtype") or conf.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    return name if name in DTYPES else "float32"


def config_quantization(conf: dict | None) -> str | None:
    """The quantization a config.json names (`quantization_config`, or `compression_config` for
    compressed-tensors; the text config's too)."""
    conf = conf or {}
    for holder in (conf, conf.get("text_config") or {}):
        for key in ("quantization_config", "compression_config"):
            if isinstance(q := holder.get(key), dict):
                return str(q.get("quant_method") or q.get("format") or key)
    return None


def check_embedded_target(model: ModelConfig) -> None:
    """`refuse_quantized` of the target as its config.json names its quantization (check_params' form of generate's
    refusal)."""
    refuse_quantized(model, quantization_method(model))


def refuse_quantized(model: ModelConfig, method: str | None) -> None:
    """The embedded backend casts the whole model to its compute dtype and packs the linear layers' weights itself:
    a quantized checkpoint (`method`, its config's quantization; None: plain weights) would lose its scales (FP8) or
    be refused by transformers (GPTQ)."""
    if method is not None:
        raise ConfigError(
            "backend.kind",
            f"embedded cannot run {model.path}: its weights are quantized ({method}) and the embedded engine casts "
            "them without their scales; serve it (backend.kind: sglang or openai) and generate from the server",
        )


def check_hf_cast(model: ModelConfig, computed: str) -> None:
    """The hf engine casts the loaded model where it computes in another dtype than the weights': a quantized
    checkpoint's weights would lose their scales (FP8, with no error) or be refused (GPTQ)."""
    method, weights = quantization_method(model), weights_dtype(model)
    if method is not None and computed != weights:
        raise ConfigError(
            "model.compute_dtype",
            f"{model.path} is quantized ({method}): computing it in {computed}, not its own {weights}, casts its "
            f"weights without their scales; set model.compute_dtype: {weights}, or auto and capture on a GPU",
        )


def native_16bit(dtype: str) -> bool:
    """Whether this CPU multiplies `dtype` in hardware (bf16: AMX or AVX-512 BF16; fp16: AMX-FP16)."""
    import torch

    cpu = torch.cpu
    if dtype == "bfloat16":
        return bool(cpu._is_amx_tile_supported() or cpu._is_avx512_bf16_supported())
    if dtype == "float16":
        return bool(cpu._is_amx_fp16_supported())
    return True


def resolve(setting: str, weights: str, on_gpu: bool) -> str:
    """The dtype to compute in: `setting` unless it is auto; auto is the weights' own dtype on a GPU or where this
    CPU multiplies it natively, else float32."""
    if setting != AUTO:
        return setting
    if on_gpu or weights == "float32" or native_16bit(weights):
        return weights
    return "float32"


def compute_dtype(model: ModelConfig, on_gpu: bool | None = None) -> str:
    """`model.compute_dtype` resolved for this machine (`on_gpu`: where the engine runs; default: a GPU if there
    is one, as the engines place the model)."""
    if on_gpu is None:
        import torch

        on_gpu = torch.cuda.is_available()
    return resolve(model.compute_dtype, weights_dtype(model), on_gpu)


def embedded_on_gpu(cfg) -> bool:
    """Whether the embedded backend computes on a GPU: transformers' batching does where one is; `slots` runs on
    the CPU, a GPU or not (`backend.embedded_batching`)."""
    import torch

    return cfg.backend.embedded_batching != "slots" and torch.cuda.is_available()


def computed_fingerprint(model_fp: str, computed_in: str | None, weights: str | None) -> str:
    """The fingerprint of a target as an engine computed it: the weights' own where it computed in their dtype (or
    where the engine is a server's, `computed_in` None: its arithmetic is the server's), else a new one naming the
    dtype."""
    if computed_in is None or computed_in == weights:
        return model_fp
    return content_hash({"model": model_fp, "compute_dtype": computed_in})


# vllm.LLM options that change the arithmetic of what it computes (hidden_states.vllm_kwargs); "auto" or absent is
# vLLM's own default
VLLM_NUMERICS = ("dtype", "quantization", "kv_cache_dtype")


def vllm_dtype(vllm_kwargs: dict) -> str | None:
    """The `dtype` vLLM is asked to compute in, by torch's name (None: auto, vLLM's choice from the weights)."""
    option = str(vllm_kwargs.get("dtype", AUTO)).removeprefix("torch.")
    option = {"half": "float16", "float": "float32"}.get(option, option)
    return None if option == AUTO else option


def vllm_fingerprint(model_fp: str, weights: str, vllm_kwargs: dict) -> str:
    """The fingerprint of a target as vLLM computes it: the weights' own under vLLM's defaults, else one that names
    the dtype asked (as `computed_fingerprint`), the quantization and the KV cache's dtype. States computed with
    `quantization: fp8` are another model's and are never reused as the bf16 ones, nor mixed with them."""
    fp = computed_fingerprint(model_fp, vllm_dtype(vllm_kwargs), weights)
    numerics = {k: str(vllm_kwargs[k]) for k in VLLM_NUMERICS[1:] if vllm_kwargs.get(k) not in (None, AUTO)}
    return content_hash({"model": fp, **numerics}) if numerics else fp


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)
