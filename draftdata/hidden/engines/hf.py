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

from contextlib import contextmanager

from draftdata.config.schema import ModelConfig
from draftdata.errors import UserError
from draftdata.hidden.norm import FinalNorm
from draftdata.hidden.policy import PolicySpec, policy_of
from draftdata.model.load import find_decoder


def final_norm_of(norm) -> FinalNorm:
    """Read a final-norm module's parameters, and check that `FinalNorm.apply` reproduces it on random input: a norm
    of another formula stops here, before any GPU time is spent, rather than silently converting wrongly."""
    import torch

    name = type(norm).__name__
    weight = norm.weight.detach().float().cpu()
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    if isinstance(norm, torch.nn.LayerNorm):
        specs = [FinalNorm("layer", eps, weight, None if norm.bias is None else norm.bias.detach().float().cpu())]
    else:  # a scale of `weight` (Llama, Qwen3) or of 1 + `weight` (Gemma, Qwen3-Next, Qwen3.5): the module says which
        specs = [FinalNorm("rms", eps, weight, weight_offset=offset) for offset in (0.0, 1.0)]
    x = torch.randn(4, weight.shape[0], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = norm(x.to(norm.weight.device, norm.weight.dtype)).float().cpu()
    for spec in specs:
        if torch.allclose(spec.apply(x.to(norm.weight.dtype)), own, rtol=1e-2, atol=1e-2):
            return spec
    raise UserError(
        f"model.path: the final norm ({name}) is neither RMSNorm nor LayerNorm as known here; the "
        "post-norm state could not be derived from the stored pre-norm one"
    )


class HFEngine:
    """transformers in-process. Hooks capture the chosen layers' outputs and the final norm's input; the decoder runs
    without the LM head (no logits). Batches are padded on the right and run WITHOUT an attention mask: under causal
    attention a real token only sees the positions before it, all real, so its states are exact, and attention keeps
    its fast mask-free path (a padding mask costs ~1.8× in attention on a CPU and rules out flash kernels on a GPU).
    The pad positions' own states are computed and dropped; `pad_tokens` counts them. The hooks are on the decoder only
    while a batch runs through it: outside `forward` the model is transformers' own, and a forward of anyone else's
    through it keeps nothing."""

    def __init__(
        self, model_cfg: ModelConfig, layers: list[int], device_map: str | None = None, policy: PolicySpec | None = None
    ):
        import torch

        from draftdata.model.compute import check_hf_cast, compute_dtype, torch_dtype
        from draftdata.model.load import load_model

        # `model.compute_dtype`: a 16-bit model on a CPU that does not multiply it in hardware runs in float32 under
        # auto (the same states, more precise, stored in hidden_states.dtype all the same); a model on GPUs,
        # dispatched by device_map, is left as it is
        on_gpu = bool(device_map) or torch.cuda.is_available()
        self.compute_dtype = compute_dtype(model_cfg, on_gpu=on_gpu)  # recorded with every shard it computes
        check_hf_cast(model_cfg, self.compute_dtype)  # before the weights are read
        model = load_model(model_cfg, device_map=device_map)
        dtype = torch_dtype(self.compute_dtype)
        self.model = model if device_map or dtype == next(model.parameters()).dtype else model.to(dtype)
        self.decoder = find_decoder(self.model)
        self.n_layers = len(self.decoder.layers)
        self.hidden_size = self.model.config.get_text_config().hidden_size
        self.final_norm = final_norm_of(self.decoder.norm)
        self.layers = layers
        self.pad_tokens = 0
        self.input_device = next(self.decoder.layers[0].parameters()).device  # under a device_map, the first GPU's
        self.policy = policy
        self.lm_head = self.model.get_output_embeddings() if policy else None
        self.softcap = getattr(self.model.config.get_text_config(), "final_logit_softcapping", None)
        if policy:
            self._check_head()
        self._out: dict = {}

    def forward(self, batch: list[list[int]]) -> list[tuple[object, object]]:
        import torch

        ids = pad_right(batch, self.input_device)
        with self._hooked(), torch.inference_mode():
            last = self.decoder(input_ids=ids, use_cache=False).last_hidden_state  # no LM head over the whole batch
            # the policy from the post-norm state the decoder returns, a sample's real rows at a time
            policies = [self._policy(last[i, : len(x)]) for i, x in enumerate(batch)] if self.policy else None
        del last
        self.pad_tokens += ids.numel() - sum(len(x) for x in batch)
        out, self._out = self._out, {}
        # under a device_map the layers' outputs sit on their layers' GPUs: gathered on the first one's, then one
        # copy to the host per batch, not one per sample (each is a device sync); in the model's own dtype: a bf16
        # target's states stored as bf16 need no float32 round trip
        outs = [out[i] for i in self.layers]
        final = out["final"].cpu()
        if outs:
            aux = torch.stack([o.to(outs[0].device) for o in outs], dim=2).cpu()  # [B, W, k, H]
        else:  # MTP alone reads the last state only: no aux layer, an empty axis
            aux = final.new_empty((*final.shape[:2], 0, final.shape[-1]))
        got = [(aux[i, : len(x)], final[i, : len(x)]) for i, x in enumerate(batch)]
        return [(*g, p) for g, p in zip(got, policies)] if policies else got

    def _policy(self, post_norm):
        return policy_of(post_norm, self.lm_head, self.policy, self.softcap)

    def _check_head(self) -> None:
        """The policy as computed here (the decoder's post-norm state through the LM head, Gemma's soft cap after)
        against the model's own logits on a few tokens: a model that scales its logits another way stops here,
        before any sample, rather than storing a wrong policy."""
        import torch

        ids = torch.arange(1, 9, device=self.input_device).unsqueeze(0)
        with torch.inference_mode():
            own = self.model(input_ids=ids, use_cache=False).logits[0].float()
            last = self.decoder(input_ids=ids, use_cache=False).last_hidden_state[0]
            ours = self.lm_head(last).float()
            if self.softcap:
                ours = torch.tanh(ours / self.softcap) * self.softcap
        if not torch.allclose(ours.cpu(), own.cpu(), rtol=1e-3, atol=1e-3):
            raise UserError(
                f"hidden_states.policy_top_k: {type(self.model).__name__}'s logits are not its LM head over the final "
                "state as computed here (a logit scale of its own?); the policy cannot be kept for this model"
            )

    @contextmanager
    def _hooked(self):
        """The chosen layers' outputs and the final norm's input kept in `_out` while the block runs."""
        handles = [self.decoder.layers[i].register_forward_hook(self._keep(i)) for i in self.layers]
        handles.append(self.decoder.norm.register_forward_pre_hook(self._keep_input))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _keep(self, layer: int):
        def hook(_module, _inputs, output):
            self._out[layer] = output[0] if isinstance(output, tuple) else output

        return hook

    def _keep_input(self, _module, inputs):
        self._out["final"] = inputs[0]

    def close(self) -> None:
        """Nothing to release: the hooks are removed after every batch."""


def pad_right(batch: list[list[int]], device):
    """A batch's token ids in one [B, W] tensor on `device`, padded on the right (the pad positions' states are
    dropped: under causal attention no real token sees them)."""
    import torch

    width = max(len(x) for x in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
    return ids.to(device)
