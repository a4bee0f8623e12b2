"""Slot batching: the embedded backend's continuous batching on a CPU, its loop.

transformers' continuous batching is built for a GPU. On a CPU its decode step runs one attention call over the
whole batch's keys under a block-diagonal mask (every query against every sequence's keys: batch² work), gathers the
paged cache into a new tensor in every layer, and sorts the whole vocabulary for top-p: on the demo's prompts it ran
at a fraction of what this CPU can do (docs/benchmarks.md). Here the model is the same transformers model, its
weights as loaded, computed in the engine's compute dtype (`model.compute_dtype`, model/compute.py) at every step,
whatever the number of requests in it. The wing's parts:

- the loop (`SlotBatching`, here, a thread): new requests are prefilled packed, several prompts in one forward (up
  to `prefill_tokens`), each attending to its own keys, a prompt's prefix that a request in flight has cached
  (a chat template's system prompt, a dataset's shared instructions) taken from its row rather than computed again;
  then every request in flight decodes one token per forward; every request ends with its tokens or an error, a
  fault in a step or a stop included;
- the cache (`cache.py`): keys and values kept by request in rows of capacity classes, 16-bit, and the attention
  over them, one call per class (its decode kernel in `attention.py`: float32 scores);
- the sampler (`sampling.py`): top-p and top-k cut on the few hundred most likely tokens (exact), and a seeded
  request's token at sequence position p drawn with noise keyed by (seed + p) and each token's id: the draw depends
  neither on the batch nor on restarts;
- the forward (`forward.py`): for a Llama-family model (Llama, Qwen2) a lean one on the model's own weights, its
  matmuls on weights packed once where that pays (`packed.py`); for any other model transformers' own forward with
  the cache's attention.

`probe` checks the whole against the model's plain forward before any request: a model whose forward this does not
compute the same (a sliding window, soft-capped logits, attention sinks) is refused there, and so is one the engine
cannot set up at all (a config without Llama's fields: `Unsupported` either way); the embedded backend then uses
transformers' continuous batching. A lean forward the probe refuses gives way to the model's own first. The
interface is the part of transformers' manager that the embedded backend uses: add_request,
register_result_handler, cancel_request, start, stop.
"""

from __future__ import annotations

import asyncio
import operator
import queue
import threading
from dataclasses import dataclass, field

from draftdata.generate.embedded import attention
from draftdata.generate.embedded.cache import KVCache
from draftdata.generate.embedded.forward import ATTN_NAME, LeanForward, ModelForward, Unsupported, register_attention
from draftdata.generate.embedded.sampling import Sampling, sample

__all__ = ["Sampling", "SlotBatching", "SlotOutput", "Unsupported"]

STOPPED = "the engine stopped"  # the error of a request still in flight, or sent, when the engine's loop ends
MIN_SHARED = 16  # a prompt's prefix shared with a request in flight is taken from its row from this many tokens up


def _common_prefix(a: list[int], b: list[int], most: int) -> int:
    """How many leading tokens `a` and `b` share, up to `most`."""
    n = 0
    for x, y in zip(a[:most], b):
        if x != y:
            break
        n += 1
    return n


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


# How far the probe lets this engine's logits be from the model's own forward, relative to the largest. In float32
# both compute the same sums in another order (1e-5). In 16 bits each is its own rounding of the float32 result: on
# SmolLM2-135M in bf16 on a CPU with AMX, the model's forward is 1.0 to 1.2 % from float32 and this engine's 1.4 %,
# and the two 2.7 % from each other (on a CPU without AMX, under 2 %). 5 % leaves that room and still refuses a
# forward computed otherwise by a margin: tests/test_slots.py's injected fault, the hidden states scaled by 1.5, is
# off by half the largest logit.
PROBE_TOLERANCE = {"float32": 0.02, "16-bit": 0.05}


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
        self.model = self.cache = self.device = self.forward = self.compute_dtype = None
        self.attention = "reference"  # the decode attention: "kernel" where its C++ kernel builds here (attention.py)
        self._previous_impl = None
        self._inbox: queue.Queue = queue.Queue()
        self._handlers: dict[str, tuple] = {}
        self._lock = threading.Lock()
        self._closed = False  # the loop is over: a request sent now gets its error at once
        self._waiting: list[_Request] = []
        self._active: dict[str, _Request] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None

    def _prepare(self, model) -> None:
        """Compute the loaded model in the compute dtype, set up the cache and the forward, and check it all
        (`probe`). Run in the engine's own thread, before any other torch work there: once a process's main thread
        has run a parallel region, torch's OpenMP work in any other thread runs slower (docs/benchmarks.md); the
        thread that ran the process's first parallel region runs at full speed."""
        import torch

        own = next(model.parameters()).dtype
        self.compute_dtype = getattr(torch, self._dtype_name)
        self.model = model.to(self.compute_dtype)
        config = model.config.get_text_config()
        shape = (config.num_hidden_layers, config.num_key_value_heads)  # a config without them fails here, first
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.device = next(model.parameters()).device
        kernel = attention.kernel()
        self.attention = "reference" if kernel is None else "kernel"
        # 16-bit keys and values even where the arithmetic is float32: half the bytes a decode step reads
        self.cache = KVCache(*shape, head_dim, own, self.slots, kernel or attention.reference)
        register_attention()
        self._previous_impl = model.config._attn_implementation
        model.set_attn_implementation(ATTN_NAME)
        if LeanForward.unsupported_reason(model) is None:
            self.forward = LeanForward(model, rows=self.slots)
            try:
                self.probe()
                return
            except Unsupported:
                pass  # transformers' own forward over the same cache, checked in turn
        self.forward = ModelForward(model)
        self.probe()

    def probe(self, tolerance: float | None = None) -> float:
        """Check this engine against the model's plain forward on two sequences, prefilled packed then decoded two
        steps (teacher-forced): the largest logit difference relative to the largest logit, which must stay under
        `tolerance` (PROBE_TOLERANCE for the compute dtype). A model whose forward this does not compute the same
        raises Unsupported here, before any request."""
        import torch

        if tolerance is None:
            tolerance = PROBE_TOLERANCE["float32" if self.compute_dtype == torch.float32 else "16-bit"]

        vocab = self.model.config.get_text_config().vocab_size
        seqs = [[(7 * i + 3) % vocab for i in range(9)], [(11 * i + 5) % vocab for i in range(70)]]
        self.model.set_attn_implementation(self._previous_impl)
        try:
            with torch.inference_mode():
                ref = [self.model(torch.tensor([s], device=self.device)).logits[0, -3:].float() for s in seqs]
        finally:
            self.model.set_attn_implementation(ATTN_NAME)
        try:
            with torch.inference_mode():
                ours = self._probe_steps(seqs)
        finally:
            self.cache.clear()
        error = max(float((torch.stack(o) - r).abs().max() / r.abs().max()) for o, r in zip(ours, ref))
        if not error < tolerance:
            raise Unsupported(f"its logits differ from the model's own forward by {error:.3g} of the largest")
        return error

    def _probe_steps(self, seqs: list[list[int]]) -> list[list]:
        """The probe's sequences but their last two tokens prefilled packed, then decoded a token at a time; each
        sequence's logits at its last three positions."""
        import torch

        heads = [s[:-2] for s in seqs]
        ours: list[list] = [[] for _ in seqs]
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
        return ours

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
        request = _Request(request_id, prompt, max_new_tokens, streaming, seed)
        with self._lock:
            closed = self._closed
            if not closed:
                self._inbox.put(("add", request))
        if closed:  # nothing will run it: its error now, not a wait forever
            self._deliver(request, True, STOPPED)

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
        """Block until the engine serves; raise what stopped it from starting: the model loader's own error, or
        Unsupported for anything after the model loaded (a model this engine does not compute the same as its own
        forward, or one it cannot set up at all; its cause chained)."""
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def stop(self, block: bool = True) -> None:
        """End the loop; every request not finished by then gets the error `STOPPED`."""
        self._stopping = True
        self._inbox.put(("stop", None))
        if block and self._thread is not None:
            self._thread.join()

    def _main(self) -> None:
        import torch

        try:
            torch.set_grad_enabled(False)
            self._start()
        finally:
            self._ready.set()
        try:
            if self._startup_error is None:
                self._run()
        finally:
            self._close()

    def _start(self) -> None:
        """Load and prepare; what fails is kept for `wait_ready`."""
        try:
            model = self._load()
        except BaseException as e:  # noqa: BLE001 - the loader's own error (model.path, ...) reaches the caller
            self._startup_error = e
            return
        try:
            self._prepare(model)
        except Unsupported as e:
            self._startup_error = e
        except Exception as e:  # noqa: BLE001 - any other failure to set up: a model this engine cannot run
            error = Unsupported(f"{type(e).__name__}: {e}")
            error.__cause__ = e
            self._startup_error = error

    def _close(self) -> None:
        """The loop is over (stopped, failed to start, or broken): every request it holds or was sent gets an
        error, and the model its own attention back."""
        with self._lock:
            self._closed = True
        while True:
            try:
                kind, value = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._waiting.append(value)
        self._fail_all(STOPPED)
        if self.model is not None and self._previous_impl is not None:
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
        token. A request taken from the waiting list is active from then on, before its row is placed, so that a
        fault anywhere in the step reaches it (`_fail_all`)."""
        import torch

        batch, tokens = [], 0
        while self._waiting and len(self._active) < self.slots:
            n = len(self._waiting[0].prompt)
            if batch and tokens + n > self.prefill_tokens:
                break
            r = self._waiting.pop(0)
            self._active[r.rid] = r
            batch.append(r)
            tokens += n
        donors = [rid for rid in self._active if rid in self.cache.where and self.cache.filled(rid)]
        ids, positions, last, segments = [], [], [], []
        for r in batch:
            self.cache.place(r.rid, len(r.prompt) + 1)  # the prompt, and the first token's key at the next step
            start = self._share_prefix(r, donors)
            ids.extend(r.prompt[start:])
            positions.extend(range(start, len(r.prompt)))
            last.append(len(ids) - 1)
            segments.append((r.rid, len(r.prompt) - start))
        self.cache.begin_prefill(segments)
        hidden = self._forward(torch.tensor([ids]), torch.tensor([positions]))
        self._emit(batch, self._logits(hidden[0, last]))

    def _share_prefix(self, r: _Request, donors: list[str]) -> int:
        """Where `r`'s prefill starts: past the longest prefix its prompt shares with the tokens cached for a
        request in flight (`donors`), whose keys and values it takes (`KVCache.share`), where that prefix is at
        least `MIN_SHARED` tokens (prompts under one chat template and system prompt share theirs); 0 otherwise.
        At least the prompt's last token is computed: its logits give the first token."""
        best, shared = None, 0
        for rid in donors:
            other = self._active[rid]
            cached = (other.prompt + other.generated)[: self.cache.filled(rid)]
            n = _common_prefix(cached, r.prompt, len(r.prompt) - 1)
            if n > shared:
                best, shared = rid, n
        if best is None or shared < MIN_SHARED:
            return 0
        self.cache.share(best, r.rid, shared)
        return shared

    def _decode(self) -> None:
        import torch

        reqs = [self._active[rid] for rid in self.cache.begin_decode()]
        ids = torch.tensor([[r.generated[-1]] for r in reqs])
        positions = torch.tensor([[r.length - 1] for r in reqs])
        hidden = self._forward(ids, positions)
        self._emit(reqs, self._logits(hidden[:, -1]))

    def _forward(self, ids, positions):
        return self.forward.hidden(ids.to(self.device), positions.to(self.device), self.cache)

    def _logits(self, hidden):
        return self.forward.logits(hidden).float()

    def _sample(self, logits, reqs: list[_Request]) -> list[int]:
        return sample(logits, self.sampling, [r.seed for r in reqs], [r.length for r in reqs])

    def _emit(self, reqs: list[_Request], logits) -> None:
        """Sample each request's next token, deliver what they produced, free the finished ones' rows."""
        for r, token in zip(reqs, self._sample(logits, reqs)):
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
        """Every request active or waiting ends with `error`; the cache is emptied (a fault may have left it half
        way through a step)."""
        for r in list(self._active.values()) + self._waiting:
            self._deliver(r, True, error)
        self._active, self._waiting = {}, []
        if self.cache is not None:
            self.cache.clear()
