"""Running the target over samples and capturing what an EAGLE-3 drafter trains on.

An engine takes batches of token-id lists and returns, per sample, the outputs of the chosen decoder layers
(`aux`, [T, k, H], physical 0-based layer ids) and the final state BEFORE the final norm (`final`, [T, H]), both on
the CPU in float32 or the model's own dtype. The final norm's parameters come with the engine (`FinalNorm`), so the
post-norm state that SpecForge trains on is computed exactly from the stored pre-norm one, and speculators' pre-norm
state is stored as is.

Engines: `HFEngine` (transformers, in-process, `device_map` for a target bigger than one GPU) here, and
`VLLMEngine` (draftdata/hidden/engines/vllm.py: vLLM with tensor/data parallelism, in a Python that has vLLM).
"""

from __future__ import annotations

from draftdata.config.schema import ModelConfig
from draftdata.errors import UserError
from draftdata.hidden.engines.base import find_decoder
from draftdata.hidden.norm import FinalNorm
from draftdata.util.timing import Timers


def final_norm_of(norm) -> FinalNorm:
    """Read a final-norm module's parameters, and check that `FinalNorm.apply` reproduces it on random input: a norm
    of another formula stops here, before any GPU time is spent, rather than silently converting wrongly."""
    import torch

    name = type(norm).__name__
    weight = norm.weight.detach().float().cpu()
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    if isinstance(norm, torch.nn.LayerNorm):
        spec = FinalNorm("layer", eps, weight, None if norm.bias is None else norm.bias.detach().float().cpu())
    else:
        spec = FinalNorm("rms", eps, weight, weight_offset=1.0 if "Gemma" in name else 0.0)
    x = torch.randn(4, weight.shape[0], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = norm(x.to(norm.weight.device, norm.weight.dtype)).float().cpu()
    if not torch.allclose(spec.apply(x.to(norm.weight.dtype)), own, rtol=1e-2, atol=1e-2):
        raise UserError(
            f"model.path: the final norm ({name}) is neither RMSNorm nor LayerNorm as known here; the "
            "post-norm state could not be derived from the stored pre-norm one"
        )
    return spec


class HFEngine:
    """transformers in-process. Hooks capture the chosen layers' outputs and the final norm's input; the decoder runs
    without the LM head (no logits). Batches are padded on the right and run WITHOUT an attention mask: under causal
    attention a real token only sees the positions before it, all real, so its states are exact, and attention keeps
    its fast mask-free path (a padding mask costs ~1.8× in attention on a CPU and rules out flash kernels on a GPU).
    The pad positions' own states are computed and dropped; `pad_tokens` counts them."""

    def __init__(self, model_cfg: ModelConfig, layers: list[int], device_map: str | None = None):
        import torch

        from draftdata.model.compute import compute_dtype, torch_dtype
        from draftdata.model.load import load_model

        model = load_model(model_cfg, device_map=device_map)
        # `model.compute_dtype`: a 16-bit model on a CPU that does not multiply it in hardware runs in float32 under
        # auto (the same states, more precise, stored in hidden_states.dtype all the same); a model on GPUs,
        # dispatched by device_map, is left as it is
        on_gpu = bool(device_map) or torch.cuda.is_available()
        dtype = torch_dtype(compute_dtype(model_cfg, on_gpu=on_gpu))
        self.model = model if device_map or dtype == next(model.parameters()).dtype else model.to(dtype)
        self.decoder = find_decoder(self.model)
        self.n_layers = len(self.decoder.layers)
        self.hidden_size = self.model.config.get_text_config().hidden_size
        self.final_norm = final_norm_of(self.decoder.norm)
        self.layers = layers
        self.pad_tokens = 0
        self.timers = Timers()  # padding, decoder, copies to host: where a batch's time goes
        self._capture = True
        self._out: dict = {}
        self._handles = [self.decoder.layers[i].register_forward_hook(self._keep(i)) for i in layers]
        self._handles.append(self.decoder.norm.register_forward_pre_hook(self._keep_input))

    def _keep(self, layer: int):
        def hook(_module, _inputs, output):
            if self._capture:
                self._out[layer] = output[0] if isinstance(output, tuple) else output

        return hook

    def _keep_input(self, _module, inputs):
        if self._capture:
            self._out["final"] = inputs[0]

    def forward(self, batch: list[list[int]]) -> list[tuple[object, object]]:
        import torch

        self.pad_tokens += self._run(batch, self.timers)
        # under a device_map the layers' outputs sit on their layers' GPUs: gathered on the first one's, then one
        # copy to the host per batch, not one per sample (each is a device sync); in the model's own dtype: a bf16
        # target's states stored as bf16 need no float32 round trip
        with self.timers("copies to host"):
            outs = [self._out[i] for i in self.layers]
            aux = torch.stack([o.to(outs[0].device) for o in outs], dim=2).cpu()  # [B, W, k, H]
            final = self._out["final"].cpu()
            self._out.clear()
        return [(aux[i, : len(x)], final[i, : len(x)]) for i, x in enumerate(batch)]

    def prefill(self, batch: list[list[int]]) -> int:
        """The same padded batch through the same decoder with nothing kept or copied: the plain prefill that the
        benchmark holds the capture against (its hooks stay registered and return at once). Its time is the
        caller's to measure: the engine's timers and `pad_tokens` keep the capture's alone. Returns the batch's pad
        tokens."""
        self._capture = False
        try:
            return self._run(batch, Timers())
        finally:
            self._capture = True

    def _run(self, batch: list[list[int]], timers: Timers) -> int:
        """The batch padded on the right, through the decoder (no LM head); the hooks see the layers' outputs.
        Returns the batch's pad tokens."""
        import torch

        with timers("padding"):
            width = max(len(x) for x in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            for i, x in enumerate(batch):
                ids[i, : len(x)] = torch.tensor(x)
            device = self.decoder.layers[0].parameters().__next__().device
            ids = ids.to(device)
        with timers("decoder"), torch.inference_mode():
            self.decoder(input_ids=ids, use_cache=False)
            last = self.decoder.norm.weight.device  # under a device_map, the last GPU the batch runs on
            if last.type == "cuda":  # the kernels are queued: the time is theirs once they have run
                torch.cuda.synchronize(last)
        return len(batch) * width - sum(len(x) for x in batch)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
