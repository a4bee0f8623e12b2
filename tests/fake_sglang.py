"""A fake SGLang server for tests: SGLang's native HTTP protocol, field by field, on aiohttp.web in a thread.

What it mirrors (python/sglang/srt/entrypoints/http_server.py, python/sglang/srt/managers/io_struct.py):
- `GET /health`: 503 while "starting", then 200 with an empty body;
- `GET /model_info` (newer) and `GET /get_model_info` (older): `{model_path, tokenizer_path, is_generation, ...}`;
- `POST /generate` with `GenerateReqInput` fields (`rid`, `input_ids`, `sampling_params`, `stream`); an unknown
  sampling param is a 400 as in SGLang (`SamplingParams(**sampling_params)`), and so is an unknown top-level field
  (SGLang would ignore it; here a misspelt field must fail the test). A duplicate running `rid` is a 400.
  The answer is `{text, output_ids, meta_info: {id, finish_reason: {type, ...}, prompt_tokens,
  completion_tokens, cached_tokens}}`; a stream is `data: {json}` lines, one per token, ending with `data: [DONE]`.
  `output_ids`/`text` are cumulative, or only the new ones with `incremental=True` (the server's
  `--incremental-streaming-output`);
- `POST /abort_request` `{rid, abort_all}`: the running request stops and finishes with `finish_reason.type ==
  "abort"` (a stream sends that as its last chunk, then [DONE]);
- the OpenAI-compatible `GET /v1/models` and `POST /v1/completions` (see `_completions`).

Tokens are deterministic (`fake_output_ids`, a function of the input ids: a continuation sent as prompt + partial
ids gets its own) and come `token_delay_s` apart, slowly enough to abort. With `knee` set the server is
compute-bound: each request's token delay grows with the number running above the knee (aggregate throughput flat),
and `noise` makes every delay vary by that relative standard deviation, as real throughput does. `faults` injects
failures into the next generation calls. Everything the server saw is recorded for the tests to check.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from aiohttp import web

# SGLang's SamplingParams and GenerateReqInput fields, listed once
from bench.reliability.fault_server import GENERATE_FIELDS as REQUEST_FIELDS
from bench.reliability.fault_server import SAMPLING_PARAMS

EOS_ID = 2


def fake_output_ids(input_ids: list[int], n: int) -> list[int]:
    """The tokens this server generates for a prompt: a function of the prompt only, never EOS_ID."""
    seed = sum(input_ids) * 31 + len(input_ids)
    return [3 + (seed + 7 * k) % 997 for k in range(n)]


def fake_text(ids: list[int]) -> str:
    return "".join(f" t{t}" for t in ids)


@dataclass
class Faults:
    """Failures for the next /generate calls, taken in this order: status, reset, hang, malformed, stream_error."""

    status: int = 0  # answer with this HTTP status ...
    status_times: int = 0  # ... this many times
    retry_after: Optional[str] = None  # the Retry-After header sent with `status`
    reset_times: int = 0  # drop the connection without an answer
    hang_times: int = 0  # never answer
    malformed_times: int = 0  # 200 with a body that is not JSON
    stream_error_times: int = 0  # a stream that reports {"error": ...} (as SGLang does for a ValueError)
    empty_times: int = 0  # a 200 answer that finished ("stop") without a single token

    def take(self) -> Optional[str]:
        for name in ("status", "reset", "hang", "malformed", "stream_error", "empty"):
            if getattr(self, f"{name}_times") > 0:
                setattr(self, f"{name}_times", getattr(self, f"{name}_times") - 1)
                return name
        return None


@dataclass
class FakeSGLang:
    model_path: str = "models/tiny-llama"
    token_delay_s: float = 0.002
    stop_after: Optional[int] = None  # emit EOS after this many tokens (finish "stop"); None: run to max_new_tokens
    incremental: bool = False  # like --incremental-streaming-output
    knee: Optional[int] = None  # compute-bound: the token delay scales with running / knee above the knee
    noise: float = 0.0  # relative standard deviation of every token delay
    stream_interval: int = 1  # like --stream-interval: a stream chunk every this many tokens (and at the end)
    starting_s: float = 0.0  # /health answers 503 for this long after start
    has_model_info: bool = True  # False: an older server with /get_model_info only
    faults: Faults = field(default_factory=Faults)
    # what the server saw
    generate_calls: list = field(default_factory=list)  # request bodies, in order
    generate_times: list = field(default_factory=list)  # time.monotonic() of each /generate arrival
    authorizations: list = field(default_factory=list)  # the Authorization header of each /generate (None: none)
    aborts: list = field(default_factory=list)  # rids named by /abort_request
    disconnects: list = field(default_factory=list)  # rids whose client went away mid-request
    finished: dict = field(default_factory=dict)  # rid -> finish_reason.type it ended with
    health_calls: int = 0
    port: int = 0

    def __post_init__(self):
        self._running: dict[str, asyncio.Event] = {}  # rid -> set by /abort_request
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._rng = random.Random(0)

    # ---- lifecycle: a thread with its own event loop ---------------------------------------------------------- #

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FakeSGLang":
        """Listen (again, on the same port after `stop`)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._call(self._serve())
        return self

    def stop(self) -> None:
        """The server dies: the listener and every open connection close."""
        if self._loop is None:
            return
        self._call(self._runner.cleanup())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
        self._loop = None

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        # handler_cancellation: a client that goes away cancels its handler, as uvicorn/SGLang notice disconnects
        self._runner = web.AppRunner(app, shutdown_timeout=0.1, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()
        self.port = self._runner.addresses[0][1]
        self._started = time.monotonic()

    # ---- endpoints --------------------------------------------------------------------------------------------- #

    async def _health(self, request: web.Request) -> web.Response:
        self.health_calls += 1
        starting = time.monotonic() - self._started < self.starting_s
        return web.Response(status=503 if starting else 200)

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

    async def _abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.aborts.append(body.get("rid"))
        targets = list(self._running) if body.get("abort_all") else [body.get("rid")]
        for rid in targets:
            if rid in self._running:
                self._running[rid].set()
        return web.Response(status=200)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.generate_calls.append(body)
        self.authorizations.append(request.headers.get("Authorization"))  # SGLang's --api-key checks this header
        self.generate_times.append(time.monotonic())
        problem = _invalid(body)
        if problem:
            return _error(400, problem)
        fault = self.faults.take()
        if fault in ("status", "reset", "hang", "malformed"):
            return await self._fail(request, fault)
        if fault == "empty":
            return web.json_response(
                {"text": "", "output_ids": [], "meta_info": self._meta(body.get("rid") or "empty", body, 0, "stop")}
            )
        rid = body.get("rid") or f"fake-{len(self.generate_calls)}"
        if rid in self._running:
            return _error(400, f"Duplicate request ID {rid}")
        self._running[rid] = asyncio.Event()
        try:
            if body.get("stream"):
                return await self._stream(request, rid, body, fault == "stream_error")
            return await self._complete(rid, body)
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects.append(rid)
            raise
        finally:
            self._running.pop(rid, None)

    async def _fail(self, request: web.Request, fault: str) -> web.Response:
        if fault == "status":
            headers = {"Retry-After": self.faults.retry_after} if self.faults.retry_after else None
            return _error(self.faults.status, "injected failure", headers)
        if fault == "reset":
            request.transport.abort()  # no answer at all: the client sees the connection drop
            return web.Response()
        if fault == "hang":
            await asyncio.sleep(3600)
        return web.Response(text='{"text": "unterminated', content_type="application/json")  # malformed

    # ---- SGLang's OpenAI-compatible API (python/sglang/srt/entrypoints/openai/) ---------------------------------- #
    # /v1/models lists the served model (`root`: its path, as vLLM and SGLang report it); /v1/completions takes a
    # token-id or text prompt. `return_token_ids: true` adds vLLM's fields: `prompt_token_ids` and `token_ids` per
    # choice (all of them in a plain answer, the new ones in each stream chunk). Faults apply here too.

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_path,
                        "object": "model",
                        "created": 0,
                        "owned_by": "sglang",
                        "root": self.model_path,
                        "max_model_len": 4096,
                    }
                ],
            }
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.generate_calls.append(body)
        self.generate_times.append(time.monotonic())
        if body.get("model") != self.model_path:
            return _error(404, f"The model '{body.get('model')}' does not exist")
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt = [3 + ord(c) % 997 for c in prompt]  # a stand-in tokenizer: one id per character
        fault = self.faults.take()
        if fault in ("status", "reset", "hang", "malformed"):
            return await self._fail(request, fault)
        rid = f"cmpl-{len(self.generate_calls)}"
        native = {"input_ids": prompt, "sampling_params": {"max_new_tokens": body.get("max_tokens", 16)}}
        self._running[rid] = asyncio.Event()
        try:
            if body.get("stream"):
                return await self._completions_stream(request, rid, body, native)
            planned, finish = self._plan(native)
            out = [t async for t in self._tokens(rid, planned)]
            choice = {
                "index": 0,
                "text": fake_text([t for t in out if t != EOS_ID]),
                "logprobs": None,
                "finish_reason": finish if len(out) == len(planned) else "abort",
            }
            if body.get("return_token_ids"):
                choice.update(prompt_token_ids=prompt, token_ids=out)
            return web.json_response(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": 0,
                    "model": self.model_path,
                    "choices": [choice],
                    "usage": _usage(prompt, out),
                }
            )
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects.append(rid)
            raise
        finally:
            self._running.pop(rid, None)

    async def _completions_stream(self, request: web.Request, rid: str, body: dict, native: dict):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        planned, finish = self._plan(native)
        out: list[int] = []
        async for token in self._tokens(rid, planned):
            out.append(token)
            choice = {
                "index": 0,
                "text": fake_text([token] if token != EOS_ID else []),
                "logprobs": None,
                "finish_reason": finish if len(out) == len(planned) else None,
            }
            if body.get("return_token_ids"):
                choice["token_ids"] = [token]
                if len(out) == 1:
                    choice["prompt_token_ids"] = native["input_ids"]
            await _sse(
                resp,
                {"id": rid, "object": "text_completion", "created": 0, "model": self.model_path, "choices": [choice]},
            )
        if (body.get("stream_options") or {}).get("include_usage"):
            await _sse(
                resp,
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": 0,
                    "model": self.model_path,
                    "choices": [],
                    "usage": _usage(native["input_ids"], out),
                },
            )
        await resp.write(b"data: [DONE]\n\n")
        return resp

    # ---- generation ---------------------------------------------------------------------------------------------- #

    def _plan(self, body: dict) -> tuple[list[int], str]:
        """All the tokens this request would produce and how it would end, if not aborted."""
        max_new = body.get("sampling_params", {}).get("max_new_tokens", 128)
        if self.stop_after is not None and self.stop_after < max_new:
            return fake_output_ids(body["input_ids"], self.stop_after) + [EOS_ID], "stop"
        return fake_output_ids(body["input_ids"], max_new), "length"

    async def _tokens(self, rid: str, planned: list[int]):
        """Yield the tokens one by one, a token delay apart, until done or aborted."""
        for token in planned:
            await asyncio.sleep(self._delay())
            if self._running[rid].is_set():
                return
            yield token

    def _delay(self) -> float:
        delay = self.token_delay_s
        if self.knee is not None:
            delay *= max(1.0, len(self._running) / self.knee)
        if self.noise:
            delay *= max(0.0, 1.0 + self._rng.gauss(0.0, self.noise))
        return delay

    def _meta(self, rid: str, body: dict, n: int, finish: Optional[str]) -> dict:
        reason = None
        if finish == "stop":
            reason = {"type": "stop", "matched": EOS_ID}
        elif finish == "length":
            reason = {"type": "length", "length": n}
        elif finish == "abort":
            reason = {"type": "abort", "message": "Abort in the middle of decoding."}
        if finish:
            self.finished[rid] = finish
        return {
            "id": rid,
            "finish_reason": reason,
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": n,
            "cached_tokens": 0,
        }

    async def _complete(self, rid: str, body: dict) -> web.Response:
        planned, finish = self._plan(body)
        out = [t async for t in self._tokens(rid, planned)]
        if len(out) < len(planned):
            finish = "abort"
        visible = [t for t in out if t != EOS_ID]  # SGLang's text leaves out the stop token, its ids keep it
        return web.json_response(
            {"text": fake_text(visible), "output_ids": out, "meta_info": self._meta(rid, body, len(out), finish)}
        )

    async def _stream(self, request: web.Request, rid: str, body: dict, fail: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        planned, finish = self._plan(body)
        out: list[int] = []
        sent = 0
        async for token in self._tokens(rid, planned):
            out.append(token)
            if fail and len(out) == 2:
                await _sse(resp, {"error": {"message": "injected engine failure"}})
                break
            done = len(out) == len(planned)
            if done or len(out) % self.stream_interval == 0:
                await _sse(resp, self._chunk(rid, body, out, sent, finish if done else None))
                sent = len(out)
        else:
            if len(out) < len(planned):  # aborted: the last chunk says so
                await _sse(resp, self._chunk(rid, body, out, sent, "abort"))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def _chunk(self, rid: str, body: dict, out: list[int], sent: int, finish: Optional[str]) -> dict:
        ids = out[sent:] if self.incremental else list(out)
        return {
            "text": fake_text([t for t in ids if t != EOS_ID]),
            "output_ids": ids,
            "meta_info": self._meta(rid, body, len(out), finish),
        }


def _invalid(body: dict) -> Optional[str]:
    unknown = set(body) - REQUEST_FIELDS
    if unknown:
        return f"unknown fields {sorted(unknown)}"
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        return "input_ids must be a list of ints"
    unknown = set(body.get("sampling_params") or {}) - SAMPLING_PARAMS
    if unknown:
        return f"unknown sampling params {sorted(unknown)}"
    return None


def _usage(prompt: list[int], out: list[int]) -> dict:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(out), "total_tokens": len(prompt) + len(out)}


def _error(status: int, message: str, headers: Optional[dict] = None) -> web.Response:
    # SGLang's error body (ORJSONResponse of ErrorResponse): {"object": "error", "message", "type", "code"}
    return web.json_response(
        {"object": "error", "message": message, "type": str(status), "code": status}, status=status, headers=headers
    )


async def _sse(resp: web.StreamResponse, payload: dict) -> None:
    await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
