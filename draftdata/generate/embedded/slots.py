"""Slot batching: the embedded backend's continuous batching on a CPU.

transformers' continuous batching is built for a GPU. On a CPU its decode step runs one attention call over the
whole batch's keys under a block-diagonal mask (every query against every sequence's keys: batch² work), gathers the
paged cache into a new tensor in every layer, and sorts the whole vocabulary for top-p: on the demo's prompts it ran
at a fraction of what this CPU can do (docs/benchmarks.md). Here the model is the same transformers model, its
weights and modules as loaded; what is ours:

- for a Llama-family model (Llama, Qwen2), the forward itself (`lean.py`): the same arithmetic on the model's own
  weights, q/k/v and gate/up each one matmul, without transformers' per-layer Python, and for a 16-bit model on a
  CPU with oneDNN's bf16 kernels, decode's few rows multiplied on weights packed once; any other model runs its
  own forward, with the parts below;

- the attention function (registered with transformers' AttentionInterface), over keys and values kept by request
  in rows of capacity classes (`cache.py`): one attention call per class, no copy of the cache;
- the loop (`SlotBatching`, a thread): new requests are prefilled packed, several prompts in one forward (up to
  `prefill_tokens`), each attending to its own keys; then every request in flight decodes one token per forward;
- sampling (`sampling.py`): top-p and top-k cut on the few hundred most likely tokens (exact), and a seeded
  request's token at sequence position p drawn with noise keyed by (seed + p) and each token's id, as the embedded
  backend's always was by (seed + p): the draw depends neither on the batch nor on restarts;
- the dtype of the arithmetic (`faster_dtype`): float32 where this CPU multiplies faster in it than in the model's
  16-bit dtype (the keys and values stay 16-bit), and then, for forwards of a few rows, bf16 on weights packed once
  where that is faster (`linear.py`).

`probe` checks the whole against the model's plain forward before any request: a model whose forward this does not
compute the same (a sliding window, soft-capped logits, attention sinks) is refused there, and the embedded backend
then uses transformers' continuous batching; a lean forward the probe refuses gives way to the model's own first.
The interface is the part of transformers' manager that the embedded backend uses: add_request,
register_result_handler, cancel_request, start, stop.
"""

from __future__ import annotations

import asyncio
import operator
import queue
import threading
import time
from dataclasses import dataclass, field

from draftdata.generate.embedded.cache import KVCache
from draftdata.generate.embedded.lean import LeanDecoder
from draftdata.generate.embedded.linear import SMALL_ROWS, hybridize, packing_pays
from draftdata.generate.embedded.sampling import Sampling, sample

__all__ = ["Sampling", "SlotBatching", "SlotOutput", "Unsupported"]

ATTN_NAME = "draftdata_slots"
_UNSUPPORTED_KWARGS = ("sliding_window", "softcap", "s_aux", "sinks")


class Unsupported(RuntimeError):
    """The model's forward is not what slot batching computes."""


@dataclass
class SlotOutput:
    """What a result handler receives, as transformers' GenerationOutput gives it."""

    request_id: str
    generated_tokens: list[int]
    finished: bool = False
    error: str | None = None

    def is_finished(self) -> bool:
        return self.finished


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    max_new: int
    stream: bool
    seed: int | None
    generated: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:  # its tokens; all but the last are in the cache
        return len(self.prompt) + len(self.generated)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, _attention)
    AttentionMaskInterface.register(ATTN_NAME, lambda *args, **kwargs: None)  # the cache makes each step's masks


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature; the step's `KVCache` arrives as `slot_cache`."""
    cache = kwargs.get("slot_cache")
    if cache is None:
        raise Unsupported("slot attention called outside a slot batch")
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise Unsupported(f"the model's attention uses {name}")
    if dropout:
        raise Unsupported("attention dropout")
    return cache.attend(module.layer_idx, query, key, value, scaling), None


class SlotBatching:
    """The engine: a thread that runs forwards while requests are in flight. See the module docstring."""

    def __init__(
        self,
        load,
        sampling: Sampling,
        stop_ids: set[int],
        slots: int = 64,
        prefill_tokens: int = 2048,
        compute_dtype: str = "float32",
    ):
        """`load()` gives the model; it is called in the engine's thread (see `_prepare`). `compute_dtype`: the
        arithmetic's (model/compute.py)."""
        self._load = load
        self._dtype_name = compute_dtype
        self.sampling = sampling
        self.stop_ids = set(stop_ids)
        self.slots = slots
        self.prefill_tokens = prefill_tokens
        self.model = self.cache = self.device = self.lean = None
        self.compute_dtype = None
        self.small_rows = 0  # forwards of at most this many rows multiply in bf16 on packed weights (linear.py)
        self._inbox: queue.Queue = queue.Queue()
        self._handlers: dict[str, tuple] = {}
        self._lock = threading.Lock()
        self._waiting: list[_Request] = []
        self._active: dict[str, _Request] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self.timers = {"prefill_s": 0.0, "decode_s": 0.0, "sample_s": 0.0, "steps": 0, "decoded": 0, "prefilled": 0}

    def _prepare(self) -> None:
        """Load the model, choose the arithmetic's dtype, set up the cache and check it all (`probe`). Run in the
        engine's own thread, before any other torch work there: once a process's main thread has run a parallel
        region, torch's OpenMP work in any other thread runs up to half as fast (measured here: a [32, 576] x
        [576, 1536] matmul 390 us in the main thread, 560-640 us in a thread started after it); the thread that
        ran the process's first parallel region runs at full speed."""
        import torch

        torch.set_grad_enabled(False)
        _register()
        model = self._load()
        own = next(model.parameters()).dtype
        self.compute_dtype = getattr(torch, self._dtype_name)
        self.model = model.to(self.compute_dtype)
        config = model.config.get_text_config()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.device = next(model.parameters()).device
        # 16-bit keys and values even where the arithmetic is float32: half the bytes a decode step reads
        self.cache = KVCache(config.num_hidden_layers, config.num_key_value_heads, head_dim, own, self.slots)
        # a bf16 model computed in float32: its weights, exact in bf16, multiply few rows faster packed (linear.py)
        if self.compute_dtype == torch.float32 and own == torch.bfloat16 and packing_pays(model):
            self.small_rows = SMALL_ROWS if hybridize(model) else 0
        self._previous_impl = model.config._attn_implementation
        model.set_attn_implementation(ATTN_NAME)
        if not self.small_rows and LeanDecoder.describes(model) is None:
            self.lean = LeanDecoder(model, rows=self.slots)
        try:
            self.probe()
        except Unsupported:
            if self.lean is None:
                raise
            self.lean = None  # transformers' own forward over the same cache, checked in turn
            self.probe()

    def probe(self, tolerance: float = 0.02) -> float:
        """Check this engine against the model's plain forward on two sequences, prefilled packed then decoded two
        steps (teacher-forced): the largest logit difference relative to the largest logit, which must stay under
        `tolerance` (16-bit rounding is well under it). A model whose forward this does not compute the same
        raises Unsupported here, before any request."""
        import torch

        vocab = self.model.config.get_text_config().vocab_size
        seqs = [[(7 * i + 3) % vocab for i in range(9)], [(11 * i + 5) % vocab for i in range(70)]]
        self.model.set_attn_implementation(self._previous_impl)
        try:
            with torch.inference_mode():
                ref = [self.model(torch.tensor([s], device=self.device)).logits[0, -3:].float() for s in seqs]
        finally:
            self.model.set_attn_implementation(ATTN_NAME)
        heads = [s[:-2] for s in seqs]
        ours: list[list] = [[], []]
        with torch.inference_mode():
            for i, h in enumerate(heads):
                self.cache.place(f"probe-{i}", len(h))  # the second row outgrows its class while decoding
            self.cache.begin_prefill([(f"probe-{i}", len(h)) for i, h in enumerate(heads)])
            packed = heads[0] + heads[1]
            positions = list(range(len(heads[0]))) + list(range(len(heads[1])))
            hidden = self._forward(torch.tensor([packed]), torch.tensor([positions]))
            for i, row in enumerate(self._logits(hidden[0, [len(heads[0]) - 1, len(packed) - 1]])):
                ours[i].append(row)
            for back in (2, 1):
                order = self.cache.begin_decode()
                index = [int(rid.split("-")[1]) for rid in order]
                ids = torch.tensor([[seqs[i][len(seqs[i]) - back]] for i in index])
                hidden = self._forward(ids, torch.tensor([[len(seqs[i]) - back] for i in index]))
                for i, row in zip(index, self._logits(hidden[:, -1])):
                    ours[i].append(row)
            for i in range(len(seqs)):
                self.cache.free(f"probe-{i}")
        error = max(float((torch.stack(o) - r).abs().max() / r.abs().max()) for o, r in zip(ours, ref))
        if not error < tolerance:
            raise Unsupported(f"its logits differ from the model's own forward by {error:.3g} of the largest")
        return error

    # --- the manager interface the embedded backend uses ---------------------------------------------------------
    def register_result_handler(self, rid: str, callback) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            self._handlers[rid] = (callback, loop)

    def add_request(self, ids, request_id: str, max_new_tokens: int, streaming: bool = False, seed=None) -> None:
        try:  # a prompt of anything but token ids fails its own request here, not every request of its batch
            prompt = [operator.index(t) for t in ids]
        except TypeError:
            with self._lock:
                self._handlers.pop(request_id, None)
            raise
        self._inbox.put(("add", _Request(request_id, prompt, max_new_tokens, streaming, seed)))

    def cancel_request(self, rid: str) -> None:
        with self._lock:
            self._handlers.pop(rid, None)  # nothing more reaches its handler from now on
        self._inbox.put(("cancel", rid))

    def start(self) -> None:
        """Start the engine's thread: it loads the model and checks it, then serves; `wait_ready` says how that
        went."""
        self._thread = threading.Thread(target=self._main, name="draftdata-slots", daemon=True)
        self._thread.start()

    def wait_ready(self) -> None:
        """Block until the engine serves; raise what stopped it from starting (Unsupported: the model is not one
        this engine computes the same as its own forward)."""
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def stop(self, block: bool = True) -> None:
        self._stopping = True
        self._inbox.put(("stop", None))
        if block and self._thread is not None:
            self._thread.join()

    def _main(self) -> None:
        try:
            self._prepare()
        except BaseException as e:  # noqa: BLE001 - handed to wait_ready, in the caller's thread
            self._startup_error = e
            if self.model is not None and hasattr(self, "_previous_impl"):
                self.model.set_attn_implementation(self._previous_impl)
            return
        finally:
            self._ready.set()
        try:
            self._run()
        finally:
            self.model.set_attn_implementation(self._previous_impl)

    # --- the loop -------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        import torch

        with torch.inference_mode():
            while not self._stopping:
                self._take_inbox(block=not (self._active or self._waiting))
                if self._stopping:
                    break
                try:
                    if self._waiting and len(self._active) < self.slots:
                        self._prefill()
                    if self._active:
                        self._decode()
                except Exception as e:  # noqa: BLE001 - every request in flight hears of it; the loop goes on
                    self._fail_all(f"{type(e).__name__}: {e}")

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block)
        except queue.Empty:
            return
        while True:
            kind, value = item
            if kind == "add":
                self._waiting.append(value)
            elif kind == "cancel":
                self._cancel(value)
            elif kind == "stop":
                self._stopping = True
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _cancel(self, rid: str) -> None:
        self._waiting = [r for r in self._waiting if r.rid != rid]
        if self._active.pop(rid, None) is not None:
            self.cache.free(rid)

    def _prefill(self) -> None:
        """Prompts of waiting requests, packed into one forward of up to `prefill_tokens`; each gets its first
        token."""
        import torch

        t0 = time.perf_counter()
        batch, tokens = [], 0
        while self._waiting and len(self._active) + len(batch) < self.slots:
            n = len(self._waiting[0].prompt)
            if batch and tokens + n > self.prefill_tokens:
                break
            batch.append(self._waiting.pop(0))
            tokens += n
        ids, positions, last = [], [], []
        for r in batch:
            self.cache.place(r.rid, len(r.prompt) + 1)  # the prompt, and the first token's key at the next step
            self._active[r.rid] = r
            ids.extend(r.prompt)
            positions.extend(range(len(r.prompt)))
            last.append(len(ids) - 1)
        self.cache.begin_prefill([(r.rid, len(r.prompt)) for r in batch])
        hidden = self._forward(torch.tensor([ids]), torch.tensor([positions]))
        logits = self._logits(hidden[0, last])
        self.timers["prefill_s"] += time.perf_counter() - t0
        self.timers["prefilled"] += tokens
        self._emit(batch, logits)

    def _decode(self) -> None:
        import torch

        t0 = time.perf_counter()
        reqs = [self._active[rid] for rid in self.cache.begin_decode()]
        ids = torch.tensor([[r.generated[-1]] for r in reqs])
        positions = torch.tensor([[r.length - 1] for r in reqs])
        hidden = self._forward(ids, positions)
        logits = self._logits(hidden[:, -1])
        self.timers["decode_s"] += time.perf_counter() - t0
        self.timers["steps"] += 1
        self.timers["decoded"] += len(reqs)
        self._emit(reqs, logits)

    def _forward(self, ids, positions):
        if self.lean is not None:
            return self.lean.forward(ids.to(self.device), positions.to(self.device), self.cache)
        out = self.model.base_model(
            input_ids=ids.to(self.device),
            position_ids=positions.to(self.device),
            use_cache=False,
            slot_cache=self.cache,
        )
        return out.last_hidden_state

    def _logits(self, hidden):
        if self.lean is not None:
            return self.lean.logits(hidden).float()
        return self.model.get_output_embeddings()(hidden).float()

    def _emit(self, reqs: list[_Request], logits) -> None:
        """Sample each request's next token, deliver what they produced, free the finished ones' rows."""
        t0 = time.perf_counter()
        tokens = sample(logits, self.sampling, [r.seed for r in reqs], [r.length for r in reqs])
        self.timers["sample_s"] += time.perf_counter() - t0
        for r, token in zip(reqs, tokens):
            r.generated.append(token)
            finished = token in self.stop_ids or len(r.generated) >= r.max_new
            if finished or r.stream:
                self._deliver(r, finished)
            if finished:
                del self._active[r.rid]
                self.cache.free(r.rid)

    def _deliver(self, r: _Request, finished: bool, error: str | None = None) -> None:
        with self._lock:
            handler = self._handlers.pop(r.rid, None) if finished else self._handlers.get(r.rid)
        if handler is None:
            return
        callback, loop = handler
        out = SlotOutput(r.rid, list(r.generated), finished, error)
        try:
            loop.call_soon_threadsafe(callback, out)
        except RuntimeError:  # its event loop is closed: nobody is waiting
            pass

    def _fail_all(self, error: str) -> None:
        for r in list(self._active.values()) + self._waiting:
            self._deliver(r, True, error)
        for rid in list(self._active):
            self.cache.free(rid)
        self._active, self._waiting = {}, []
