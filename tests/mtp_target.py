"""A tiny random target that carries native MTP weights (`mtp.*`), for training speculators' MTP draft in the tests.

The tiny target's tokenizer and sizes (hidden 64, 4 heads), as a Qwen3ForCausalLM (model_type `qwen3`, which
speculators 0.9.0's MTP supports: speculators/models/mtp/model_definitions.py), with one MTP head appended to
model.safetensors in the Qwen3-Next / Qwen3.5 checkpoint layout that speculators' MTPConverter reads
(speculators/convert/mtp/converter.py):

    mtp.fc.weight                       [H, 2H]   its input: cat[embedding, hidden state]
    mtp.pre_fc_norm_embedding.weight    [H]
    mtp.pre_fc_norm_hidden.weight       [H]
    mtp.norm.weight                     [H]
    mtp.layers.0.<a Qwen3 decoder layer>

transformers ignores the mtp.* keys when it loads the model (it reports them as unexpected): the capture runs the plain
Qwen3, and the draft trainer reads the head from the same file.
"""

from __future__ import annotations

from pathlib import Path

from draftdata.config.schema import TinyModelConfig
from draftdata.model.tiny import build_model, build_tokenizer, iter_demo_texts


def mtp_weights(config, seed: int) -> dict:
    """One MTP head, random as the rest is: a Qwen3 decoder layer's weights under mtp.layers.0, the fc and norms."""
    import torch
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    torch.manual_seed(seed + 1)
    layer = Qwen3DecoderLayer(config, layer_idx=0)
    with torch.no_grad():
        for p in layer.parameters():  # as transformers initialises: normal(0, 0.02), norms ones
            p.copy_(torch.ones_like(p) if p.ndim == 1 else torch.randn_like(p) * config.initializer_range)
    h = config.hidden_size
    out = {f"mtp.layers.0.{k}": v.detach().clone().contiguous() for k, v in layer.state_dict().items()}
    out["mtp.fc.weight"] = torch.randn(h, 2 * h) * config.initializer_range
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = torch.ones(h)
    return out


def build_mtp_target(out: Path, corpus_dir: Path, num_layers: int = 4, seed: int = 0) -> Path:
    from safetensors.torch import load_file, save_file

    tm = TinyModelConfig(corpus_dir=str(corpus_dir), num_layers=num_layers, seed=seed, mean_response_tokens=24)
    tok = build_tokenizer(iter_demo_texts(corpus_dir), tm.vocab_size)
    eos_id, pad_id = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    model = build_model(tm, len(tok), eos_id, pad_id, arch="qwen3")
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    model.save_pretrained(out)
    path = out / "model.safetensors"  # the MTP head beside the model, as a Qwen3-Next / Qwen3.5 checkpoint ships it
    weights = load_file(str(path))
    weights.update(mtp_weights(model.config, tm.seed))
    save_file(weights, str(path), metadata={"format": "pt"})
    return out
