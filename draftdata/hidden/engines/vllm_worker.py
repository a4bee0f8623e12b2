"""The vLLM side of the `vllm` hidden-states engine; draftdata/hidden/engines/vllm.py starts it in a Python that has
vLLM.

Run as `python -m draftdata.hidden.engines.vllm_worker SETTINGS_JSON` with the project root on PYTHONPATH. vLLM
imports this module again, by name, in the process that owns the model (its engine core, or each tensor-parallel
worker), where `CaptureExtension` is mixed into vLLM's worker class (`worker_extension_cls`): the capture runs next
to the model, and the rank that owns the result writes it to a file, since tensors do not travel back over vLLM's
RPC.

Two paths (settings `path`: auto, extract or hook). `extract` is vLLM's own hidden-state extraction (the
`extract_hidden_states` speculative method and a hidden-states KV connector, as speculators uses it): nothing of the
model is patched. `hook` captures inside the decoder's forward (vLLM's EAGLE-3 aux outputs, or forward hooks), for a
vLLM or a model without the extraction. `auto` starts the extraction where vLLM's own connector runs (CUDA) and
falls back to the hooks if it cannot start, saying why on stderr and in the start-up answer.

Only the standard library, torch, safetensors, vLLM and the project's dependency-free draftdata.errors and
draftdata.hidden.engines.base are imported: the vLLM venv has none of the project's dependencies.

Protocol, one JSON object per line. The worker answers once at start-up and once per command, on its original
stdout; everything else that writes to stdout (vLLM's logs, its child processes) is sent to stderr instead.
  start-up   <- {"ok": true, "n_layers", "hidden_size", "vocab_size", "max_len", "path" (extract or hook),
                "fallback" (why not extract, or null), "mode", "norm": {kind, eps, weight_offset, class},
                "norm_file"}: the norm file holds its weight (and bias) and a probe
  forward    -> {"cmd": "forward", "input": PATH, "output": PATH}: the input is a safetensors file with `ids`
                (the samples' token ids, concatenated) and `lengths`; command lines stay short, so writing one
                never blocks on a full pipe
             <- {"ok": true, "output": PATH}: safetensors with `aux` [sum T, k, H] and `final` [sum T, H], the
                samples concatenated in batch order, in the model's dtype
  close      -> {"cmd": "close"}   (or end of stdin)
  any error  <- {"ok": false, "error": ONE LINE, "fatal": bool}; after a fatal one the worker exits
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from typing import Any

from draftdata.model.load import find_decoder

# Where the capture lives on vLLM's worker object, between the RPC calls that install, start and finish it.
_HOOKED = "_draftdata_capture"


def describe_norm(norm) -> dict:
    """Kind, eps and weight offset of the final norm; the engine checks them against a probe of the module."""
    name = type(norm).__name__
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    if "LayerNorm" in name and "RMS" not in name:
        return {"kind": "layer", "eps": eps, "weight_offset": 0.0, "class": name}
    return {"kind": "rms", "eps": eps, "weight_offset": 1.0 if "Gemma" in name else 0.0, "class": name}


def residual_sum(output) -> Any:
    """A vLLM decoder layer often returns (hidden, residual) with the residual added only by the next layer's norm:
    the layer's true output is their sum. Summed at once, because the next norm updates both in place."""
    if isinstance(output, tuple):
        hidden, residual = output[0], output[1] if len(output) > 1 else None
        return hidden if residual is None else hidden + residual
    return output


class Capture:
    """Per-forward capture on the rank that owns the model's output. `mode` is `aux` (vLLM's own EAGLE-3
    aux-hidden-state outputs, which know the model's sequence-parallel and residual quirks) or `hooks` (forward
    hooks on the decoder layers, for models without them). Captured rows are mapped back to samples later, by the
    token ids and positions vLLM ran (`assemble`); an incomplete forward is an error, never rows to guess."""

    def __init__(self, model, layers: list[int], mode: str, writer: bool):
        self.decoder = find_decoder(model)
        self.n_layers = len(self.decoder.layers)
        self.layers = layers
        self.mode = mode
        self.writer = writer
        self.active = False
        self.records: list[dict] = []
        self.problem: str | None = None
        self._cur: dict = {}
        # The last layer's output is the final norm's input: taken there, whatever the mode.
        self._inner = sorted({i for i in layers if i != self.n_layers - 1})
        self._install(model)

    def _install(self, model) -> None:
        d = self.decoder
        if self.mode == "aux":
            # vLLM's key L+1 is the input to layer L+1 = the output of layer L; returned in layer order.
            model.set_aux_hidden_state_layers(tuple(i + 1 for i in self._inner))
        else:
            for i in self._inner:
                d.layers[i].register_forward_hook(self._keep_layer(i))
        d.norm.register_forward_pre_hook(self._keep_final, with_kwargs=True)
        if hasattr(d, "embed_tokens"):
            d.embed_tokens.register_forward_pre_hook(self._keep_embed_ids)
        # vLLM's compile decorator calls `self.forward` directly, bypassing module hooks on the decoder itself; an
        # instance attribute is what that call finds.
        inner_forward = d.forward
        signature = inspect.signature(inner_forward)

        def forward(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            self._begin(bound.get("input_ids"), bound.get("positions"))
            out = inner_forward(*args, **kwargs)
            aux = None
            if self.mode == "aux" and isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list):
                out, aux = out  # the runner expects the hidden states alone, as without EAGLE-3
            self._end(aux)
            return out

        d.forward = forward

    def _begin(self, input_ids, positions) -> None:
        self._cur = {"ids": input_ids, "positions": positions, "layers": {}} if self.active else {}

    def _keep_embed_ids(self, _module, args) -> None:
        if self.active and self._cur and self._cur["ids"] is None:
            self._cur["ids"] = args[0]

    def _keep_layer(self, layer: int):
        def hook(_module, _args, output):
            if self.active and self.writer and self._cur:
                self._cur["layers"][layer] = residual_sum(output)

        return hook

    def _keep_final(self, _module, args, kwargs) -> None:
        if self.active and self.writer and self._cur:
            residual = args[1] if len(args) > 1 else kwargs.get("residual")
            self._cur["final"] = args[0] if residual is None else args[0] + residual

    def _end(self, aux: list | None) -> None:
        cur, self._cur = self._cur, {}
        if not (self.active and self.writer and cur):
            return
        try:
            self.records.append(self._record(cur, aux))
        except RuntimeError as e:
            # Raised from draftdata_finish instead: an exception inside the forward would kill vLLM's engine.
            self.problem = self.problem or str(e)

    def _record(self, cur: dict, aux: list | None) -> dict:
        import torch

        if self.mode == "aux":
            if aux is None or len(aux) != len(self._inner):
                raise RuntimeError(
                    f"{type(self.decoder).__name__} returned {0 if aux is None else len(aux)} aux "
                    f"hidden states for {len(self._inner)} requested layers"
                )
            cur["layers"] = dict(zip(self._inner, aux))
        missing = [i for i in self._inner if i not in cur["layers"]] + ([] if "final" in cur else ["final norm"])
        if missing or cur["ids"] is None or cur["positions"] is None:
            raise RuntimeError(
                f"the capture saw an incomplete forward (missing: {missing or 'token ids'}); is the "
                "model compiled despite enforce_eager?"
            )
        final = cur["final"]
        n = final.shape[0]
        positions = cur["positions"]
        if positions.dim() == 2:  # M-RoPE: [3, N], equal rows for text tokens
            positions = positions[0]
        parts = [final if i == self.n_layers - 1 else cur["layers"][i] for i in self.layers]
        if any(p.shape[0] != n for p in parts) or positions.shape[0] < n or cur["ids"].shape[0] < n:
            raise RuntimeError("captured tensors disagree in length (sequence-parallel layer outputs?)")
        # Copies, never views: vLLM reuses its input and activation buffers in the next step (on the CPU, `.to`
        # would return the very same tensor).
        return {
            "ids": cur["ids"][:n].to("cpu", torch.int64, copy=True),
            "positions": positions[:n].to("cpu", torch.int64, copy=True),
            "bounds": query_bounds(n),
            # stack makes a new tensor; MTP alone reads the last state only: no aux layer, an empty axis
            "aux": torch.stack(parts, dim=1).to("cpu")
            if parts
            else torch.empty((n, 0, final.shape[-1]), dtype=final.dtype),
            "final": final.to("cpu", copy=True),
        }


def query_bounds(n: int) -> list[int]:
    """Request boundaries in this forward's token axis, from the attention metadata when it has them."""
    try:
        from vllm.forward_context import get_forward_context

        metadata = get_forward_context().attn_metadata
    except Exception:  # no context outside a model runner's forward
        return []
    if not isinstance(metadata, dict):
        return []
    for m in metadata.values():
        loc = getattr(m, "query_start_loc", None)
        if loc is not None:
            return [int(x) for x in loc.tolist() if 0 < int(x) < n]
    return []


def segments(record: dict) -> list[tuple[int, int]]:
    """Split a forward's rows into per-request runs: at attention boundaries and wherever positions do not step
    by one. A run that does not start at position 0 is not a whole prefill (a chunk or a decode step)."""
    pos = record["positions"]
    cuts = set(record["bounds"])
    if len(pos) > 1:
        cuts.update((1 + (pos[1:] != pos[:-1] + 1).nonzero().flatten()).tolist())
    edges = [0] + sorted(cuts) + [len(pos)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def assemble(records: list[dict], batch: list[list[int]]) -> tuple[Any, Any]:
    """The rows of each sample, in batch order. A run counts only if it starts at position 0 and its ids equal a
    whole sample: then it is a complete prefill of exactly those tokens, whichever request computed it."""
    import torch

    wanted: dict[tuple, list[int]] = {}
    for i, ids in enumerate(batch):
        wanted.setdefault(tuple(ids), []).append(i)
    found: dict[int, tuple] = {}
    for r in records:
        for a, b in segments(r):
            if int(r["positions"][a]) != 0:
                continue
            for i in wanted.get(tuple(r["ids"][a:b].tolist()), []):
                found.setdefault(i, (r["aux"][a:b], r["final"][a:b]))
    lost = [i for i in range(len(batch)) if i not in found]
    if lost:
        raise RuntimeError(
            f"{len(lost)} of {len(batch)} samples were not computed in one piece (first: #{lost[0]}, "
            f"{len(batch[lost[0]])} tokens); was the prefill chunked?"
        )
    aux = torch.cat([found[i][0] for i in range(len(batch))])
    final = torch.cat([found[i][1] for i in range(len(batch))])
    return aux, final


class CaptureExtension:
    """Mixed into vLLM's worker class; methods are called on every rank through `LLM.collective_rpc`."""

    def draftdata_describe(self, norm_file: str) -> dict:
        """The target's sizes and final norm; the rank that owns the output writes the norm's file."""
        from vllm.distributed import get_tensor_model_parallel_rank

        decoder = find_decoder(self.model_runner.get_model())
        norm = decoder.norm
        if get_tensor_model_parallel_rank() == 0:
            write_norm(norm, norm_file)
        return {
            "n_layers": len(decoder.layers),
            "hidden_size": int(norm.weight.shape[0]),
            "vocab_size": int(self.model_config.get_vocab_size()),
            "norm": describe_norm(norm),
        }

    def draftdata_install(self, layers: list[int], mode: str, norm_file: str) -> dict:
        """The hook path: install the capture on this rank."""
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.model_executor.models.interfaces import supports_eagle3

        if self.parallel_config.pipeline_parallel_size > 1:
            raise RuntimeError(
                "pipeline parallelism is not supported here (the final norm and the first layers "
                "would live on different ranks); use tensor parallelism"
            )
        model = self.model_runner.get_model()
        if mode == "auto":
            mode = "aux" if supports_eagle3(model) else "hooks"
        if mode not in ("aux", "hooks") or (mode == "aux" and not supports_eagle3(model)):
            raise RuntimeError(
                f"capture mode {mode!r} is not available for {type(model).__name__}; use "
                "'hooks' (or 'aux' on a model that supports EAGLE-3)"
            )
        writer = get_tensor_model_parallel_rank() == 0  # every TP rank holds the full hidden states
        setattr(self, _HOOKED, Capture(model, layers, mode, writer))
        return dict(self.draftdata_describe(norm_file), mode=mode)

    def draftdata_start(self) -> None:
        capture = getattr(self, _HOOKED)
        capture.records, capture.problem = [], None
        capture.active = True

    def draftdata_finish(self, batch: list[list[int]], path: str) -> str | None:
        capture = getattr(self, _HOOKED)
        capture.active = False
        records, capture.records = capture.records, []
        if capture.problem:
            raise RuntimeError(capture.problem)
        if not capture.writer:
            return None
        aux, final = assemble(records, batch)
        save(path, {"aux": aux, "final": final})
        return path


def write_norm(norm, path: str) -> None:
    """The final norm's parameters and a probe (input and the module's own output) for the engine to check."""
    import torch

    weight = norm.weight.detach()
    x = torch.randn(4, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    with torch.inference_mode():
        y = norm(x)
    tensors = {"weight": weight.float(), "probe_in": x, "probe_out": y[0] if isinstance(y, tuple) else y}
    if getattr(norm, "bias", None) is not None:
        tensors["bias"] = norm.bias.detach().float()
    save(path, tensors)


def save(path: str, tensors: dict) -> None:
    """Write under a temp name and rename, so the engine never reads a torn file."""
    from safetensors.torch import save_file

    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, path + ".tmp")
    os.replace(path + ".tmp", path)


def target_config(settings: dict):
    """vLLM's view of the target (its context length, its layer count), read without loading it."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=settings["model"], skip_tokenizer_init=True, **settings.get("llm_kwargs", {}))
    return args.create_model_config()


def max_model_len(settings: dict, target) -> int:
    """The longest sequence: the model's own limit, capped by the per-step token budget, since every prompt must
    fit one step (chunked prefill off, so no prefill is ever split across forwards)."""
    return min(int(target.max_model_len), int(settings["max_batch_tokens"]))


def llm_kwargs(settings: dict, target) -> dict:
    """`vllm.LLM`'s arguments for plain prefill of exact token ids, the user's `llm_kwargs` last."""
    kwargs = dict(
        model=settings["model"],
        skip_tokenizer_init=True,  # prompts arrive as token ids; nothing is decoded
        tensor_parallel_size=int(settings["tensor_parallel_size"]),
        enable_prefix_caching=False,  # every position must be computed, none taken from a cache
        enable_chunked_prefill=False,  # a prompt is one forward, never pieces to reassemble
        max_num_batched_tokens=int(settings["max_batch_tokens"]),
        max_model_len=max_model_len(settings, target),
        enforce_eager=True,  # module hooks need eager execution; prefill-only work gains little from graphs
        worker_extension_cls="draftdata.hidden.engines.vllm_worker.CaptureExtension",
        seed=0,
    )
    return dict(kwargs, **settings.get("llm_kwargs", {}))


def extract_layer_ids(layers: list[int], n_layers: int) -> list[int]:
    """The layers vLLM's extraction collects, in its numbering: id L + 1 is the output of layer L (the input of layer
    L + 1, residual added), collected in ascending order; id N, the last layer's output, is the final norm's input,
    so it is always asked for: the pre-norm final state."""
    return sorted({i + 1 for i in layers} | {n_layers})


def extract_kwargs(settings: dict, n_layers: int) -> dict:
    """vLLM's own hidden-state extraction (the path speculators drives): the `extract_hidden_states` speculative
    method caches the chosen layers' states in a cache-only KV layer, and a hidden-states connector writes each
    finished request's to a safetensors file in `states_dir`."""
    from vllm.platforms import current_platform

    ids = extract_layer_ids(settings["layers"], n_layers)
    return extraction_config(ids, settings["states_dir"], current_platform.is_cuda_alike())


def extraction_config(layer_ids: list[int], states_dir: str, cuda: bool) -> dict:
    """`speculative_config` and `kv_transfer_config` of vLLM's extraction of layers `layer_ids` (vLLM's numbering)
    into files in `states_dir`: `vllm.LLM`'s arguments here, and, as JSON, `vllm serve`'s flags for speculators'
    online training (its scripts/launch_vllm.py passes the same). vLLM's connector on a GPU (`cuda`); on the CPU
    build, the same connector copying from host memory (draftdata/hidden/engines/vllm_connector.py)."""
    connector = (
        {"kv_connector": "ExampleHiddenStatesConnector"}
        if cuda
        else {
            "kv_connector": "HostHiddenStatesConnector",
            "kv_connector_module_path": "draftdata.hidden.engines.vllm_connector",
        }
    )
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        "kv_transfer_config": {
            **connector,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": states_dir},
        },
    }


def extract_unavailable(forced: bool = False) -> str | None:
    """Why this vLLM does not run its own extraction here, or None. `auto` takes it only where vLLM's own connector
    runs (CUDA): on the CPU build the extraction needs draftdata's connector, which reaches into vLLM's internals
    (it overrides a private method of vLLM's connector: what the extraction is meant to avoid), so only a forced
    `extract` runs it there. Speed does not decide it: on the CPU build the two paths' costs outside the forward are
    memory copies, and their order changed from one run of bench.hidden_states_vllm to the next."""
    import importlib.util

    from vllm.platforms import current_platform

    if importlib.util.find_spec("vllm.model_executor.models.extract_hidden_states") is None:
        return "this vLLM has no extract_hidden_states method"
    if current_platform.is_cuda_alike() or (forced and current_platform.is_cpu()):
        return None
    if current_platform.is_cpu():
        return (
            "vLLM's hidden-states connector copies through CUDA; on the CPU build the extraction runs through "
            "draftdata's own connector, which overrides a private vLLM method "
            "(hidden_states.vllm_path: extract runs it)"
        )
    return f"vLLM's hidden-states connector copies through CUDA, and the platform is {current_platform.device_name}"


def generate(llm, batch: list[list[int]]) -> list:
    """One forward of each sample's exact ids (and one generated token, which nothing keeps)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
    for ids, out in zip(batch, outputs):
        if list(out.prompt_token_ids) != ids:
            raise RuntimeError("vLLM ran other prompt tokens than the sample's")
    return outputs


class HookRun:
    """The hook path: draftdata's capture inside vLLM's forward (draftdata_install), rows mapped back to samples by
    their ids and positions."""

    name = "hook"

    def __init__(self, llm):
        self.llm = llm

    def __call__(self, batch: list[list[int]], path: str) -> str:
        self.llm.collective_rpc("draftdata_start")
        generate(self.llm, batch)
        if path not in self.llm.collective_rpc("draftdata_finish", args=(batch, path)):
            raise RuntimeError("no rank wrote the captured states")
        return path


class ExtractRun:
    """The extract path: vLLM's own files, one per request, read back in batch order (the file's token ids checked
    against the sample's) and split into the chosen layers and the pre-norm final state."""

    name = "extract"

    def __init__(self, llm, layers: list[int], n_layers: int):
        self.llm = llm
        ids = extract_layer_ids(layers, n_layers)
        self.picks = [ids.index(i + 1) for i in layers]

    def __call__(self, batch: list[list[int]], path: str) -> str:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        aux, final = [], []
        for ids, out in zip(batch, generate(self.llm, batch)):
            file = (out.kv_transfer_params or {}).get("hidden_states_path")
            if file is None:
                raise RuntimeError("vLLM returned no hidden-states file for a sample")
            t = load_hidden_states(file)  # waits for the connector's write to finish
            cleanup_hidden_states(file)
            if t["token_ids"].tolist() != ids:
                raise RuntimeError("vLLM's hidden-states file holds other tokens than the sample's")
            states = t["hidden_states"]  # [T, len(extract_layer_ids), H]
            aux.append(states[:, self.picks])
            final.append(states[:, -1])
        save(path, {"aux": torch.cat(aux), "final": torch.cat(final)})
        return path


def start(settings: dict) -> tuple[object, dict]:
    """vLLM loaded for the path `settings["path"]` asks for (`auto`: extract where this vLLM runs it, else hook):
    the batch runner and the start-up answer (sizes, norm, the path that runs and why extract does not)."""
    target = target_config(settings)
    n_layers = target.get_total_num_hidden_layers()
    bad = [i for i in settings["layers"] if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"hidden_states.layers: layer ids {bad} out of range for a {n_layers}-layer model")
    want, why = settings.get("path", "auto"), None
    if want in ("auto", "extract"):
        why = extract_unavailable(forced=want == "extract")
        if why is None:
            try:
                return start_extract(settings, target, n_layers)
            except Exception as e:  # noqa: BLE001 (auto: any failure of the extraction falls back to the hooks)
                if want == "extract":
                    raise
                why = one_line(e)
        if want == "extract":
            raise RuntimeError(f"hidden_states.vllm_path is extract, but {why}")
        print(f"draftdata: vLLM's own extraction is not used ({why}); the hook path runs", file=sys.stderr)
    from vllm import LLM

    kwargs = llm_kwargs(settings, target)
    llm = LLM(**kwargs)
    args = (settings["layers"], settings.get("mode", "auto"), settings["norm_file"])
    infos = llm.collective_rpc("draftdata_install", args=args)
    return HookRun(llm), dict(infos[0], max_len=kwargs["max_model_len"], path="hook", fallback=why)


def start_extract(settings: dict, target, n_layers: int) -> tuple[object, dict]:
    from vllm import LLM

    kwargs = llm_kwargs(settings, target)
    llm = LLM(**dict(kwargs, **extract_kwargs(settings, n_layers)))
    infos = llm.collective_rpc("draftdata_describe", args=(settings["norm_file"],))
    return ExtractRun(llm, settings["layers"], n_layers), dict(
        infos[0], max_len=kwargs["max_model_len"], path="extract", mode="extract", fallback=None
    )


def read_batch(path: str) -> list[list[int]]:
    from safetensors.torch import load_file

    t = load_file(path)
    ids, out, start = t["ids"].tolist(), [], 0
    for n in t["lengths"].tolist():
        out.append(ids[start : start + n])
        start += n
    return out


def one_line(e: BaseException) -> str:
    """An exception as one line. pydantic's (vLLM's config validation) starts with a count of errors; its first
    error's own message is the useful part."""
    text = str(e)
    if callable(getattr(e, "errors", None)):
        try:
            text = str(e.errors()[0]["msg"]).removeprefix("Value error, ")
        except Exception:  # not pydantic after all
            pass
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else 'no message'}"[:1000]


def protocol_stream():
    """Keep the real stdout for the protocol and send everything else written to fd 1 to stderr, including what
    vLLM's child processes print; the duplicate is not inherited, so the engine sees EOF when this process dies."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def send(proto, **msg) -> None:
    proto.write(json.dumps(msg) + "\n")
    proto.flush()


def is_fatal(e: BaseException) -> bool:
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:
        return True
    return isinstance(e, (EngineDeadError, MemoryError)) or "dead" in type(e).__name__.lower()


def serve(run, proto) -> None:
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("cmd") == "close":
            return
        try:
            send(proto, ok=True, output=run(read_batch(cmd["input"]), cmd["output"]))
        except Exception as e:  # reported to the engine as one line; the worker stays up unless vLLM died
            fatal = is_fatal(e)
            send(proto, ok=False, error=one_line(e), fatal=fatal)
            if fatal:
                return


def shutdown(llm) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def main() -> int:
    proto = protocol_stream()
    settings = json.loads(sys.argv[1])
    try:
        run, info = start(settings)
    except BaseException as e:  # start-up failures (bad path, out of memory) end here as one line
        send(proto, ok=False, error=f"cannot start vLLM on {settings['model']!r}: {one_line(e)}", fatal=True)
        return 1
    send(proto, ok=True, norm_file=settings["norm_file"], **info)
    try:
        serve(run, proto)
    finally:
        shutdown(run.llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
