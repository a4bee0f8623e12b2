"""A fake inference server on loopback for the tests and the benches: the real protocols field by field, a
deterministic model, injected faults, and a log of every generation request. aiohttp.web, in a thread of its own.

Protocols (the ones the `sglang` and `openai` backends speak):
- SGLang's native API (python/sglang/srt/entrypoints/http_server.py, python/sglang/srt/managers/io_struct.py):
  `GET /health` (503 while "starting", then 200 with an empty body); `GET /model_info` (newer) and
  `GET /get_model_info` (older): `{model_path, tokenizer_path, is_generation, ...}`; `POST /generate` with
  `GenerateReqInput` fields (`rid`, `input_ids`, `sampling_params`, `stream`). An unknown sampling param is a 400 as
  in SGLang (`SamplingParams(**sampling_params)`), and so is an unknown top-level field (SGLang would ignore it; here
  a misspelt field must fail the test); a duplicate running `rid` is a 400. The answer is `{text, output_ids,
  meta_info: {id, finish_reason: {type, ...}, prompt_tokens, completion_tokens, cached_tokens}}`; a stream is
  `data: {json}` lines ending with `data: [DONE]`, a chunk every `stream_interval` tokens (`--stream-interval`),
  `output_ids`/`text` cumulative or, with `incremental` (`--incremental-streaming-output`), only the new ones; with
  `skip_tokenizer_init` (`--skip-tokenizer-init`) answers and chunks carry no `text`.
  `POST /abort_request` `{rid, abort_all}` stops the running request, which finishes with `finish_reason.type ==
  "abort"` (a stream sends that as its last chunk, then [DONE]). Errors are `{"object": "error", message, type, code}`.
- The OpenAI-compatible API, as SGLang (python/sglang/srt/entrypoints/openai/) or vLLM serves it (`openai_flavour`):
  `GET /v1/models` (`id` and `root`: the model path); `POST /v1/completions` (a token-id or text `prompt`) and
  `POST /v1/chat/completions` (`messages`, rendered by the model's chat template), plain or streamed (one chunk per
  decode step; the chat stream's first chunk carries the role; `usage` in a last chunk with `choices: []` when
  `stream_options.include_usage`; then `data: [DONE]`). `return_token_ids: true` adds vLLM's `prompt_token_ids` and
  `token_ids` per choice (all of them in a plain answer, the new ones in each chunk). vLLM adds `stop_reason`,
  `prompt_logprobs`, `usage.prompt_tokens_details` and the model card's `parent` and `permission`, and its errors
  are `{"error": {message, type, param, code}}`; SGLang's are its own error body above. With `parsed`, chat answers
  come as from a server running a reasoning and a tool-call parser (vLLM's and SGLang's protocol files: the message's
  `tool_calls` and `reasoning`/`reasoning_content`; streamed, `delta.tool_calls` pieces keyed by `index`).

Models: `FakeModel` (the tests': no tokenizer, tokens a function of the prompt, see `fake_output_ids`),
`GreedyModel` (the benches': greedy and deterministic over a real tokenizer) or `DrawnLengthModel` (the budget
bench's: answer lengths drawn from a length family, one per prompt). Whichever it is, an answer continued from a cut
(prompt + the partial ids) is what a real model would continue with, and a checker can recompute every answer.
Tokens come `token_delay_s` apart (on a schedule, so a late wake-up of a busy loop does not slow them), slowly enough
to abort; each attempt counts the tokens the server `produced`, those an abort left unsent included. With `knee` set
the server is compute-bound: the token delay grows with the number running above the knee (aggregate throughput
flat), and `noise` makes every delay vary by that relative standard deviation, as real throughput does.

Sampling: with `generation_config` set, a sampling field a request leaves out takes the model's default from it, as
vLLM (`--generation-config auto`) and SGLang do; each `Attempt` records the sampling it ran with.

Faults: `faults` is a `Faults` (what the next requests meet, in order: the tests' way) or a dict from arrival index
to `Fault` (planned: the benches' way), and `every` a fault every other request meets. `stop()` kills the server (its
listener and every open connection close) and `start()` brings it back on the same port. Every generation request
is logged as an `Attempt`: what it asked for, which fault it met, which tokens left the server and how it ended.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field

from aiohttp import web

from bench.budget import episode_at

# SGLang's SamplingParams fields (python/sglang/srt/sampling/sampling_params.py)
SAMPLING_PARAMS = set(
    "max_new_tokens stop stop_token_ids temperature top_p top_k min_p frequency_penalty presence_penalty"
    " repetition_penalty min_new_tokens n json_schema regex ebnf structural_tag ignore_eos skip_special_tokens"
    " spaces_between_special_tokens no_stop_trim custom_params stream_interval logit_bias sampling_seed".split()
)
# the GenerateReqInput fields a text-generation client may send (python/sglang/srt/managers/io_struct.py)
GENERATE_FIELDS = set(
    "rid text input_ids sampling_params stream return_logprob logprob_start_len top_logprobs_num"
    " return_text_in_logprobs log_metrics lora_path session_params priority extra_key custom_labels"
    " return_hidden_states input_embeds image_data".split()
)
# Before a reset: what was written has reached the client and been read (a reset makes the client drop what it
# received but had not read yet, so without the pause the tokens it saw would depend on its scheduling).
RESET_PAUSE_S = 0.2
VLLM_ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."  # EngineDeadError
MID_STREAM = ("reset", "stall", "malformed", "stream_error")  # the faults that cut a stream after `after` tokens
# The sampling fields a request may leave out and what each is then, unless `generation_config` says otherwise: the
# protocols' own defaults (SGLang's SamplingParams, vLLM's SamplingParams).
SAMPLING_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
# what vLLM (`--generation-config auto`) and SGLang take from the model's generation_config.json for an omitted field
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
VLLM_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError", 503: "ServiceUnavailableError"}


# ---- the models ------------------------------------------------------------------------------------------------- #

EOS_ID = 2
M64 = (1 << 64) - 1


def fake_output_ids(input_ids: list[int], n: int) -> list[int]:
    """The tokens FakeModel generates for a prompt: a function of the prompt only, never EOS_ID."""
    seed = sum(input_ids) * 31 + len(input_ids)
    return [3 + (seed + 7 * k) % 997 for k in range(n)]


def fake_text(ids: list[int]) -> str:
    return "".join(f" t{t}" for t in ids)


class FakeModel:
    """The tests' model, without a tokenizer: `fake_output_ids` up to max_new_tokens (finish "length"), or with
    `stop_after` that many and then EOS_ID (finish "stop")."""

    eos = EOS_ID

    def __init__(self, stop_after: int | None = None):
        self.stop_after = stop_after

    def answer(self, context: list[int], max_new: int) -> tuple[list[int], str]:
        if self.stop_after is not None and self.stop_after < max_new:
            return fake_output_ids(context, self.stop_after) + [EOS_ID], "stop"
        return fake_output_ids(context, max_new), "length"

    def text(self, ids: list[int]) -> str:
        return fake_text([t for t in ids if t != EOS_ID])  # SGLang's text leaves out the stop token, its ids keep it

    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % 997 for c in text]  # a stand-in tokenizer: one id per character

    def render(self, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> list[int]:
        return self.encode("".join(str(m.get("content") or "") for m in messages))


def _mix(h: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit function of the state."""
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & M64
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB & M64
    return h ^ (h >> 31)


def _hash_ids(ids: list[int]) -> int:
    h = 0
    for t in ids:
        h = _mix(h ^ (t + 0x9E3779B97F4A7C15) & M64)
    return h


class GreedyModel:
    """The benches' model: a deterministic next-token function of the whole context, over the target's own
    tokenizer, as a real model under greedy decoding. Every answer ends by itself (the end-of-turn token) or at
    max_new_tokens, and its text is the tokenizer's decode of its ids."""

    def __init__(self, tokenizer, mean_tokens: int = 12):
        self.tok = tokenizer
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        specials = set(tokenizer.all_special_ids)
        # Plain word tokens: each decodes to visible ASCII on its own, so a stream's text pieces (one per token)
        # add up to the decode of the whole answer, as a real server's incremental detokenizer makes them.
        self.pool = [
            t
            for t in range(len(tokenizer))
            if t not in specials and (s := tokenizer.decode([t])).isascii() and s.strip().isalnum()
        ]
        self.words = set(self.pool)
        self.mean_tokens = mean_tokens

    def answer(self, context: list[int], max_new: int) -> tuple[list[int], str]:
        """The tokens that follow `context` and how the answer ends: `stop` (its last id is the end-of-turn
        token) or `length`. The end-of-turn token only follows a word, so an answer is never empty."""
        h, last, out = _hash_ids(context), (context[-1] if context else -1), []
        while len(out) < max_new:
            r = _mix(h)
            ends = last in self.words and r % self.mean_tokens == 0
            token = self.eos if ends else self.pool[(r >> 16) % len(self.pool)]
            out.append(token)
            if token == self.eos:
                return out, "stop"
            h, last = _mix(h ^ (token + 0x9E3779B97F4A7C15) & M64), token
        return out, "length"

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False).input_ids)

    def render(self, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> list[int]:
        """The chat template, as a server applies it to /v1/chat/completions messages."""
        return list(
            self.tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False, **template_kwargs
            )
        )


ANSWER_BASE = 1000  # DrawnLengthModel's answer tokens are ANSWER_BASE + their position; its prompts' ids are below


class DrawnLengthModel(FakeModel):
    """The budget bench's model (FakeModel's text and encoding): each prompt's answer length is a draw of
    `draw(rng)`, the rng seeded by the prompt's ids and `seed`, so clients that send the same prompts get the same
    lengths. An answer of n tokens is ANSWER_BASE + 1, ..., ANSWER_BASE + n - 1, then EOS_ID (finish "stop";
    "length" when max_new cuts it). A context that ends in answer tokens says how far its answer got, so a continued
    answer is the rest of the uncut one."""

    def __init__(self, draw: Callable[[random.Random], float], seed: int = 0):
        self.draw, self.seed = draw, seed

    def length(self, prompt: list[int]) -> int:
        return max(1, round(self.draw(random.Random(_hash_ids(prompt) ^ self.seed))))

    def answer(self, context: list[int], max_new: int) -> tuple[list[int], str]:
        done = context[-1] - ANSWER_BASE if context and context[-1] > ANSWER_BASE else 0
        n = self.length(context[: len(context) - done])
        out = [ANSWER_BASE + k for k in range(done + 1, n)] + [EOS_ID]
        return (out, "stop") if len(out) <= max_new else (out[:max_new], "length")


# ---- faults and the log ----------------------------------------------------------------------------------------- #


@dataclass
class Fault:
    """What one generation request meets instead of a clean answer.

    Before any answer: `status` (an HTTP error with `status`, and `retry_after` as Retry-After), `drop` (the
    connection closes without a byte of answer), `hang` (no answer at all, until the client gives up).
    Mid-answer: `reset` (the connection is reset after `after` tokens: mid-stream, or half-way through a plain
    answer's body), `stall` (silence after `after` tokens, until the client gives up or aborts), `malformed` (a plain
    body, or a stream line after `after` tokens, that is not JSON), `stream_error` (a stream reports `{"error": ...}`
    after `after` tokens, as SGLang does for a ValueError; a plain answer is clean).
    A faulty answer: `no_usage` (an OpenAI answer without `usage`), `empty` (finished, "stop", without a token),
    `finish` (an answer with every token but `reason` as its `finish_reason`: `content_filter`, None for null, or a
    value outside the protocol, SGLang's as `{"type": reason}`; a stream sends it in its last chunk)."""

    kind: str
    status: int = 0
    retry_after: str | None = None
    after: int = 0
    reason: str | None = None  # the finish_reason of a `finish` fault
    message: str = "injected engine failure"  # what a `stream_error` reports


@dataclass
class Faults:
    """The tests' faults: the next generation requests meet these, taken in this order: status, reset (a `drop`:
    no answer at all), hang, malformed, stream_error (after the first token), empty."""

    status: int = 0  # answer with this HTTP status ...
    status_times: int = 0  # ... this many times
    retry_after: str | None = None  # the Retry-After header sent with `status`
    reset_times: int = 0  # drop the connection without an answer
    hang_times: int = 0  # never answer
    malformed_times: int = 0  # 200 with a body that is not JSON
    stream_error_times: int = 0  # a stream that reports {"error": ...} (as SGLang does for a ValueError)
    stream_error_message: str = "injected engine failure"  # what it reports (VLLM_ENGINE_DEAD: vLLM's engine died)
    empty_times: int = 0  # a 200 answer that finished ("stop") without a single token

    def take(self) -> Fault | None:
        for name in ("status", "reset", "hang", "malformed", "stream_error", "empty"):
            if getattr(self, f"{name}_times") > 0:
                setattr(self, f"{name}_times", getattr(self, f"{name}_times") - 1)
                if name == "status":
                    return Fault("status", self.status, self.retry_after)
                if name == "stream_error":
                    return Fault("stream_error", after=1, message=self.stream_error_message)  # once it has begun
                return Fault("drop" if name == "reset" else name)
        return None


@dataclass
class Attempt:
    """One generation request as the server saw it."""

    server: str
    index: int  # arrival order on this server, from 1
    endpoint: str
    body: dict  # the request body, as sent
    authorization: str | None  # its Authorization header (SGLang's --api-key checks it)
    t_start: float  # time.monotonic() at arrival
    headers: dict = field(default_factory=dict)  # every header it came with
    rid: str = ""  # the id the server runs it under: SGLang's rid, or the OpenAI answer's id (cmpl-N, chatcmpl-N)
    stream: bool = False
    context: list[int] = field(default_factory=list)  # the ids the answer follows: the prompt, or it + a partial
    max_new: int = 0
    sampling: dict = field(default_factory=dict)  # the effective sampling: what it sent, the server's defaults else
    fault: str | None = None
    status: int = 0  # the HTTP error status it was answered with (a fault, or a refused request)
    retry_after: float | None = None
    sent: list[int] = field(default_factory=list)  # token ids a client could read (whole stream chunks or body)
    produced: int = 0  # tokens the server generated for it, those no chunk carried included (an abort's last ones)
    finish: str | None = None  # the finish reason sent; None: the answer never finished
    # complete | status | drop | hang | reset | stall | malformed | stream_error | no_usage | empty | finish (a
    # faulty answer) | killed (the server died under it) | disconnected (the client went away) | aborted (by
    # /abort_request)
    outcome: str = ""
    t_end: float = 0.0
    peer: int = 0  # the client's port: one per TCP connection, so requests that share it reused a connection


# ---- the server ------------------------------------------------------------------------------------------------- #


@dataclass(eq=False)
class FakeServer:
    """One server on 127.0.0.1, in a thread with its own event loop."""

    model: FakeModel | GreedyModel | None = None  # None: a FakeModel that stops after `stop_after` tokens
    model_path: str = "models/tiny-llama"
    openai_flavour: str = "sglang"  # whose OpenAI-compatible API: "sglang" or "vllm" (fields and error bodies)
    token_delay_s: float = 0.002
    stop_after: InitVar[int | None] = None
    incremental: bool = False  # like --incremental-streaming-output
    # like --skip-tokenizer-init: /generate answers and chunks carry `output_ids` and no `text` (no detokenizer runs)
    skip_tokenizer_init: bool = False
    knee: int | None = None  # compute-bound: the token delay scales with running / knee above the knee
    noise: float = 0.0  # relative standard deviation of every token delay
    # A noisy neighbour: (start, end) episodes in time.monotonic() seconds, in order, during which the server runs at
    # `slow_factor` of its rate (another job on its machine or GPU)
    slow: list[tuple[float, float]] = field(default_factory=list)
    slow_factor: float = 1.0
    stream_interval: int = 1  # like --stream-interval: a stream chunk every this many tokens (and at the end)
    # a stream's body ends this long after its `data: [DONE]` (its last chunk written apart, as through a proxy)
    tail_delay_s: float = 0.0
    starting_s: float = 0.0  # /health answers 503 for this long after start
    has_model_info: bool = True  # False: an older server with /get_model_info only
    # vLLM's engine has died (EngineDeadError): /health answers 503 and every generation request HTTP 500 with
    # vLLM's message, until the server is restarted (vLLM's API server exits soon after)
    engine_dead: bool = False
    # The model's generation_config.json, as vLLM (`--generation-config auto`, its default) and SGLang read it: a
    # sampling field a request leaves out takes its value from here (GENERATION_CONFIG_FIELDS); None: no file.
    generation_config: dict | None = None
    # The parts a server's parsers take out of every chat answer: {"reasoning": str} as with `--reasoning-parser`,
    # {"tool_calls": [{"name", "arguments"}]} as with a tool-call parser (for a request that offers tools). They
    # come as the parsers send them (see `OpenAI`); the answer's token ids and usage count the model's text only.
    parsed: dict | None = None
    faults: Faults | dict[int, Fault] = field(default_factory=Faults)
    every: Fault | None = None  # a fault every request meets (unless `faults` names another)
    port: int = 0
    # what the server saw
    log: list[Attempt] = field(default_factory=list)  # every generation request, in arrival order
    aborts: list = field(default_factory=list)  # rids named by /abort_request
    health_calls: int = 0

    def __post_init__(self, stop_after: int | None):
        self.model = self.model or FakeModel(stop_after)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._rng = random.Random(0)
        self._running: dict[str, asyncio.Event] = {}  # rid -> set by /abort_request
        self._active: set = set()  # transports of requests in flight: a dying server drops them
        self._stopping = False

    # ---- what the tests read --------------------------------------------------------------------------------- #

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def up(self) -> bool:
        return self._loop is not None

    @property
    def generate_calls(self) -> list[dict]:
        return [a.body for a in self.log]

    @property
    def generate_times(self) -> list[float]:
        return [a.t_start for a in self.log]

    @property
    def authorizations(self) -> list[str | None]:
        return [a.authorization for a in self.log]

    @property
    def disconnects(self) -> list[str]:
        """Requests whose client went away mid-answer."""
        return [a.rid for a in self.log if a.outcome == "disconnected"]

    @property
    def finished(self) -> dict[str, str]:
        """rid -> the finish reason it was sent with."""
        return {a.rid: a.finish for a in self.log if a.finish}

    # ---- lifecycle: a thread with its own event loop, per start ---------------------------------------------- #

    def start(self) -> FakeServer:
        """Listen (again, on the same port after `stop`)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._call(self._serve())
        return self

    def stop(self) -> None:
        """The server dies: the listener closes, every request in flight is cut, no answer is finished."""
        if self._loop is None:
            return
        self._call(self._die())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
        self._loop = None

    close = stop  # the benches' name: nothing outlives a stopped server

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _serve(self) -> None:
        app = web.Application(client_max_size=64 << 20)  # long prompts, as a real server takes them
        app.router.add_get("/health", self._health)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._openai)
        app.router.add_post("/v1/chat/completions", self._openai)
        # handler_cancellation: a client that goes away cancels its handler, as uvicorn/SGLang notice disconnects
        self._runner = web.AppRunner(app, shutdown_timeout=0.1, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()
        self.port = self._runner.addresses[0][1]
        self._running, self._active = {}, set()  # a server that starts knows of no request
        self._stopping, self._started = False, time.monotonic()

    async def _die(self) -> None:
        self._stopping = True
        for transport in list(self._active):
            transport.abort()  # the process is gone: its connections close mid-answer
        await self._runner.cleanup()
        for _ in range(100):  # the cut handlers log how they ended before the loop goes
            if not self._running:
                break
            await asyncio.sleep(0.01)

    # ---- endpoints that are not generation ------------------------------------------------------------------- #

    async def _health(self, request: web.Request) -> web.Response:
        self.health_calls += 1
        starting = time.monotonic() - self._started < self.starting_s
        return web.Response(status=503 if starting or self.engine_dead else 200)

    async def _model_info(self, request: web.Request) -> web.Response:
        if request.path == "/model_info" and not self.has_model_info:
            raise web.HTTPNotFound()
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
            }
        )

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model_path,
            "object": "model",
            "created": 0,
            "owned_by": self.openai_flavour,
            "root": self.model_path,
            "max_model_len": 4096,
        }
        if self.openai_flavour == "vllm":
            card.update(parent=None, permission=[])
        return web.json_response({"object": "list", "data": [card]})

    async def _abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.aborts.append(body.get("rid"))
        for rid in list(self._running) if body.get("abort_all") else [body.get("rid")]:
            if rid in self._running:
                self._running[rid].set()
        return web.Response(status=200)

    # ---- generation: each protocol's request, then one path for both ------------------------------------------ #

    def _arrive(self, request: web.Request, body: dict) -> Attempt:
        auth = request.headers.get("Authorization")
        a = Attempt(self.url, len(self.log) + 1, request.path, body, auth, time.monotonic(), dict(request.headers))
        a.peer = (request.transport.get_extra_info("peername") or ("", 0))[1] if request.transport else 0
        self.log.append(a)
        return a

    def _sampling(self, a: Attempt, sent: dict) -> None:
        """The sampling the request runs with: the fields it sent, the generation_config's for those it left out,
        the protocol's defaults for the rest."""
        filled = {k: v for k, v in (self.generation_config or {}).items() if k in GENERATION_CONFIG_FIELDS}
        a.sampling = {k: sent.get(k, filled.get(k, default)) for k, default in SAMPLING_DEFAULTS.items()}

    @staticmethod
    def _refuse(a: Attempt, response: web.Response) -> web.Response:
        a.status, a.outcome, a.t_end = response.status, "status", time.monotonic()
        return response

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        a = self._arrive(request, body)
        problem = _sglang_invalid(body)
        if problem:
            return self._refuse(a, _sglang_error(400, problem))
        self._sampling(a, body.get("sampling_params") or {})
        rid = body.get("rid") or f"gen-{a.index}"
        if rid in self._running:
            return self._refuse(a, _sglang_error(400, f"Duplicate request ID {rid}"))
        max_new = (body.get("sampling_params") or {}).get("max_new_tokens", 128)
        return await self._answer(request, a, SGLang(self, rid, body["input_ids"]), max_new)

    async def _openai(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        a = self._arrive(request, body)
        chat = request.path == "/v1/chat/completions"
        vllm = self.openai_flavour == "vllm"
        if self.engine_dead:  # vLLM's engine_error_handler: a 500 with the engine's dead message
            return self._refuse(a, _openai_error(vllm, 500, VLLM_ENGINE_DEAD))
        if body.get("model") != self.model_path:
            name = body.get("model")
            message = f"The model `{name}` does not exist." if vllm else f"The model '{name}' does not exist"
            return self._refuse(a, _openai_error(vllm, 404, message))
        if chat and body.get("tool_choice") is not None and body.get("tools") is None:
            # as vLLM's ChatCompletionRequest validator does
            return self._refuse(a, _openai_error(vllm, 400, "When using `tool_choice`, `tools` must be set."))
        prompt = body.get("prompt")
        if chat and isinstance(body.get("messages"), list):
            context = self.model.render(body["messages"], body.get("tools"), **(body.get("chat_template_kwargs") or {}))
        elif not chat and isinstance(prompt, str):
            context = self.model.encode(prompt)
        elif not chat and isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            context = prompt
        else:
            what = "messages must be a list" if chat else "prompt must be a string or a list of token ids"
            return self._refuse(a, _openai_error(vllm, 400, what))
        self._sampling(a, body)
        wire = OpenAI(self, f"{'chatcmpl' if chat else 'cmpl'}-{a.index}", list(context), body, chat)
        return await self._answer(request, a, wire, int(body.get("max_tokens") or 16))

    async def _answer(self, request: web.Request, a: Attempt, wire, max_new: int) -> web.StreamResponse:
        """A request both protocols accept: its fault, its tokens, its answer, and how it ended, in the log."""
        fault = self._fault_for(a.index)
        a.rid, a.stream, a.context, a.max_new = wire.rid, bool(a.body.get("stream")), list(wire.context), max_new
        a.fault = fault.kind if fault else None
        self._running[wire.rid] = asyncio.Event()
        transport = request.transport  # None once the connection is lost: keep it to forget it below
        self._active.add(transport)
        planned, finish = self.model.answer(wire.context, max_new)
        if a.fault == "empty":
            planned, finish, a.outcome = [], "stop", "empty"
        elif a.fault == "finish":
            finish, a.outcome = fault.reason, "finish"
        try:
            if a.fault in ("status", "drop", "hang"):
                return await self._fail_at_once(request, a, wire, fault)
            if a.stream:
                return await self._stream(request, a, wire, fault, planned, finish)
            return await self._plain(request, a, wire, planned, finish)
        except ConnectionResetError:  # the connection is gone (the client left, or this server died)
            self._cut(a)
            return web.Response()  # aiohttp drops it quietly: there is nobody to answer
        except asyncio.CancelledError:
            self._cut(a)
            raise
        finally:
            a.t_end = time.monotonic()
            self._running.pop(wire.rid, None)
            self._active.discard(transport)

    def _fault_for(self, index: int) -> Fault | None:
        if isinstance(self.faults, Faults):
            return self.faults.take() or self.every
        return self.faults.get(index, self.every)

    def _cut(self, a: Attempt) -> None:
        if not a.outcome:  # a fault's own outcome stands; otherwise the answer was cut from outside
            a.outcome = "killed" if self._stopping else "disconnected"

    @staticmethod
    def _ended(a: Attempt, out: list[int], finish: str) -> None:
        """An answer that finished (or was aborted): all its tokens reached the client."""
        a.sent, a.finish = list(out), finish
        if not a.outcome:  # a faulty answer's outcome stands
            a.outcome = "aborted" if finish == "abort" else "complete"

    async def _tokens(self, a: Attempt, rid: str, planned: list[int]):
        """Yield the planned tokens one by one, a token delay apart, until done or aborted. The delays run on a
        schedule, not from each wake-up: a busy event loop wakes a sleeper late, and that lateness, the same at any
        batch, would otherwise slow a small batch's short delays most and bend the throughput curve `knee` sets."""
        due = time.monotonic()
        for token in planned:
            due += self._delay()
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if self._running[rid].is_set():
                return
            a.produced += 1
            yield token

    def _delay(self) -> float:
        delay = self.token_delay_s
        if self.knee is not None:
            delay *= max(1.0, len(self._running) / self.knee)
        if self.noise:
            delay *= max(0.0, 1.0 + self._rng.gauss(0.0, self.noise))
        if self.slow:
            delay /= episode_at(self.slow, self.slow_factor, time.monotonic())[0]
        return delay

    async def _fail_at_once(self, request: web.Request, a: Attempt, wire, fault: Fault) -> web.Response:
        a.outcome = fault.kind
        if fault.kind == "status":
            a.status = fault.status
            a.retry_after = float(fault.retry_after) if fault.retry_after else None
            headers = {"Retry-After": fault.retry_after} if fault.retry_after else None
            return wire.error(fault.status, "injected failure", headers)
        if fault.kind == "drop":
            request.transport.abort()  # no answer at all: the client sees the connection drop
            return web.Response()
        await asyncio.sleep(3600)  # hang: the client gives up first
        return web.Response()

    async def _plain(self, request: web.Request, a: Attempt, wire, planned: list[int], finish: str):
        out = [t async for t in self._tokens(a, wire.rid, planned)]
        if len(out) < len(planned):
            finish = "abort"
        kind = a.fault
        if kind == "malformed":
            a.outcome = "malformed"
            return web.Response(text=json.dumps(wire.answer(out, finish))[:40], content_type="application/json")
        data = json.dumps(wire.answer(out, finish, usage=kind != "no_usage")).encode()
        if kind == "reset":
            a.outcome = "reset"
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = len(data)
            await resp.prepare(request)
            await resp.write(data[: len(data) // 2])
            await _reset(request)
            return resp
        if kind == "stall":
            a.outcome = "stall"
            await self._running[wire.rid].wait()  # the client's timeout closes the connection first
            return web.Response(status=200)
        if kind == "no_usage":
            a.outcome = "no_usage"
        self._ended(a, out, finish)
        return web.Response(body=data, content_type="application/json")

    async def _stream(self, request: web.Request, a: Attempt, wire, fault: Fault | None, planned, finish):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for chunk in wire.stream_start():
            await _sse(resp, chunk)
        mid = fault is not None and fault.kind in MID_STREAM
        cut = max(0, min(fault.after, len(planned) - 1)) if mid else None  # a fault mid-answer comes before its end
        out: list[int] = []
        sent = 0  # how many tokens the chunks so far carried
        async for token in self._tokens(a, wire.rid, planned[:cut]):
            out.append(token)
            if len(out) < len(planned) and (len(out) == cut or len(out) % self.stream_interval == 0):
                await _sse(resp, wire.chunk(out, sent, None))
                sent, a.sent = len(out), list(out)
        if cut is not None:
            return await self._fail_mid_stream(request, resp, a, wire, fault, out, sent)
        finish = finish if len(out) == len(planned) else "abort"  # aborted: the last chunk says so
        for chunk in wire.stream_tail():
            await _sse(resp, chunk)
        await _sse(resp, wire.chunk(out, sent, finish))
        self._ended(a, out, finish)  # a stream without usage still delivered every token: complete
        if wire.wants_usage() and a.fault != "no_usage":
            await _sse(resp, wire.usage_chunk(out))
        await resp.write(b"data: [DONE]\n\n")
        if self.tail_delay_s:
            await asyncio.sleep(self.tail_delay_s)
        return resp

    async def _fail_mid_stream(self, request: web.Request, resp, a: Attempt, wire, fault: Fault, out, sent: int):
        a.outcome = fault.kind
        if fault.kind == "reset":
            await _reset(request)
            return resp
        if fault.kind == "stall":
            await self._running[wire.rid].wait()  # silence; an /abort_request ends it as SGLang does
            await _sse(resp, wire.chunk(out, sent, "abort"))
        elif fault.kind == "malformed":
            await resp.write(b'data: {"id": "' + wire.rid.encode() + b'", "choices": [{"text\n\n')
        else:  # stream_error: the engine gave up mid-answer
            await _sse(resp, {"error": {"message": fault.message}})
        await resp.write(b"data: [DONE]\n\n")
        return resp


# ---- the two wire formats ------------------------------------------------------------------------------------- #


class SGLang:
    """SGLang's /generate answer and stream chunks."""

    def __init__(self, server: FakeServer, rid: str, context: list[int]):
        self.model, self.incremental = server.model, server.incremental
        self.rid, self.context = rid, context
        self.texts = not server.skip_tokenizer_init

    def error(self, status: int, message: str, headers: dict | None = None) -> web.Response:
        return _sglang_error(status, message, headers)

    def _meta(self, out: list[int], finish: str | None) -> dict:
        reason = None
        if finish == "stop":
            reason = {"type": "stop", "matched": self.model.eos}
        elif finish == "length":
            reason = {"type": "length", "length": len(out)}
        elif finish == "abort":
            reason = {"type": "abort", "message": "Abort in the middle of decoding."}
        elif finish is not None:  # a `finish` fault's type outside the protocol
            reason = {"type": finish}
        return {
            "id": self.rid,
            "finish_reason": reason,
            "prompt_tokens": len(self.context),
            "completion_tokens": len(out),
            "cached_tokens": 0,
        }

    def answer(self, out: list[int], finish: str | None, usage: bool = True) -> dict:
        return self._body(out, finish)

    def stream_start(self) -> list[dict]:
        return []

    def stream_tail(self) -> list[dict]:
        return []

    def chunk(self, out: list[int], sent: int, finish: str | None) -> dict:
        """Cumulative `text` and `output_ids`, or only those since the last chunk (`incremental`)."""
        return self._body(out, finish, out[sent:] if self.incremental else out)

    def _body(self, out: list[int], finish: str | None, ids: list[int] | None = None) -> dict:
        ids = out if ids is None else ids
        text = {"text": self.model.text(ids)} if self.texts else {}
        return {**text, "output_ids": list(ids), "meta_info": self._meta(out, finish)}

    def wants_usage(self) -> bool:
        return False


class OpenAI:
    """/v1/completions and /v1/chat/completions answers and stream chunks, as SGLang or vLLM sends them."""

    def __init__(self, server: FakeServer, rid: str, context: list[int], body: dict, chat: bool):
        self.model, self.vllm = server.model, server.openai_flavour == "vllm"
        self.rid, self.context, self.body, self.chat = rid, context, body, chat
        self.ids = bool(body.get("return_token_ids"))
        self.head = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model"),
        }
        self.chunk_head = dict(self.head, object="chat.completion.chunk" if chat else "text_completion")
        parsed = (server.parsed or {}) if chat else {}
        self.reasoning = parsed.get("reasoning")
        # a tool-call parser runs for a request that offers tools (vLLM: tool_choice auto, its default then)
        self.tool_calls = parsed.get("tool_calls") if body.get("tools") else None
        # where the thinking goes: SGLang's and vLLM < 0.11's `reasoning_content`; vLLM's `reasoning` now
        self.reasoning_key = "reasoning" if self.vllm else "reasoning_content"

    def error(self, status: int, message: str, headers: dict | None = None) -> web.Response:
        return _openai_error(self.vllm, status, message, headers)

    def _usage(self, out: list[int]) -> dict:
        usage = {
            "prompt_tokens": len(self.context),
            "total_tokens": len(self.context) + len(out),
            "completion_tokens": len(out),
        }
        if self.vllm:
            usage["prompt_tokens_details"] = None
        return usage

    def _choice(self, text: str, finish: str | None, delta: bool) -> dict:
        if not self.chat:
            content = {"text": text}
        elif delta:
            content = {"delta": {"content": text}}
        else:
            message = {"role": "assistant", "content": text, "tool_calls": self._calls()}
            content = {"message": dict(message, **{self.reasoning_key: self.reasoning})}
        if finish == "stop" and self.tool_calls:  # a parsed call ends the turn as `tool_calls`
            finish = "tool_calls"
        choice = {"index": 0, **content, "logprobs": None, "finish_reason": finish}
        if self.vllm and not (self.chat and delta):
            choice["stop_reason"] = None
        if self.vllm and not (self.chat or delta):
            choice["prompt_logprobs"] = None
        return choice

    def answer(self, out: list[int], finish: str | None, usage: bool = True) -> dict:
        choice = self._choice(self.model.text(out), finish, delta=False)
        if self.ids:
            choice.update(token_ids=list(out), prompt_token_ids=list(self.context))
        doc = dict(self.head, choices=[choice])
        if usage:
            doc["usage"] = self._usage(out)
        return doc

    def stream_start(self) -> list[dict]:
        """The chat stream's first chunk carries the role only."""
        if not self.chat:
            return []
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        # the thinking comes first, a decode step (here: a word) per delta, under the reasoning parser's key
        words = re.findall(r"\s*\S+", self.reasoning or "")
        return [dict(self.chunk_head, choices=[role])] + [self._delta({self.reasoning_key: w}) for w in words]

    def stream_tail(self) -> list[dict]:
        """A parsed tool call's deltas, keyed by `index`: the id, type and function name first, then the arguments
        string in pieces (vLLM's hermes parser streams them as the model writes them)."""
        out = []
        for i, call in enumerate(self._calls()):
            fn = call["function"]
            out.append(
                self._delta(
                    {"tool_calls": [dict(index=i, id=call["id"], type="function", function={"name": fn["name"]})]}
                )
            )
            half = len(fn["arguments"]) // 2
            for piece in (fn["arguments"][:half], fn["arguments"][half:]):
                out.append(self._delta({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}))
        return out

    def _delta(self, delta: dict) -> dict:
        return dict(self.chunk_head, choices=[{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])

    def _calls(self) -> list[dict]:
        """The tool calls as a message carries them: an id, type `function`, the arguments a JSON string."""
        return [
            {
                "id": f"chatcmpl-tool-{self.rid}-{i}",
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for i, c in enumerate(self.tool_calls or [])
        ]

    def chunk(self, out: list[int], sent: int, finish: str | None) -> dict:
        """The tokens since the last chunk (the end-of-turn token's text is empty, as vLLM sends it)."""
        new = out[sent:]
        choice = self._choice(self.model.text(new), finish, delta=True)
        if self.ids:
            choice["token_ids"] = list(new)
            if sent == 0:
                choice["prompt_token_ids"] = list(self.context)
        return dict(self.chunk_head, choices=[choice])

    def usage_chunk(self, out: list[int]) -> dict:
        return dict(self.chunk_head, choices=[], usage=self._usage(out))

    def wants_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))


def _sglang_invalid(body: dict) -> str | None:
    unknown = set(body) - GENERATE_FIELDS
    if unknown:
        return f"unknown fields {sorted(unknown)}"
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        return "input_ids must be a list of ints"
    unknown = set(body.get("sampling_params") or {}) - SAMPLING_PARAMS
    if unknown:
        return f"unknown sampling params {sorted(unknown)}"
    return None


def _sglang_error(status: int, message: str, headers: dict | None = None) -> web.Response:
    # SGLang's error body (ORJSONResponse of ErrorResponse), on its native and its OpenAI-compatible routes
    return web.json_response(
        {"object": "error", "message": message, "type": str(status), "code": status}, status=status, headers=headers
    )


def _openai_error(vllm: bool, status: int, message: str, headers: dict | None = None) -> web.Response:
    if not vllm:
        return _sglang_error(status, message, headers)
    kind = VLLM_ERROR_TYPES.get(status, "InternalServerError")
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status, headers=headers
    )


async def _sse(resp: web.StreamResponse, payload: dict) -> None:
    await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


async def _reset(request: web.Request) -> None:
    """A TCP reset (SO_LINGER 0, then close), once what was written has had time to reach the client."""
    await asyncio.sleep(RESET_PAUSE_S)
    sock = request.transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    request.transport.abort()
