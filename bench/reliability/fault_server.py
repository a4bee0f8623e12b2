"""A fault server on loopback: the real protocols field by field, a deterministic model, injected faults, a log.

Protocols (the ones the `openai` and `sglang` backends speak):
- OpenAI-compatible, as vLLM serves it: `GET /v1/models` (`id` and `root`: the model path), `POST /v1/completions`
  (a token-id or text `prompt`) and `POST /v1/chat/completions` (`messages`, rendered with the model's chat template),
  plain or streamed (`data: {json}` lines, one chunk per decode step, `usage` in a last chunk with `choices: []`
  when `stream_options.include_usage`, then `data: [DONE]`); `return_token_ids: true` adds `token_ids` per choice
  and `prompt_token_ids`; errors are `{"error": {message, type, param, code}}`;
- SGLang's native `POST /generate` (`rid`, `input_ids`, `sampling_params`, `stream`; `{text, output_ids, meta_info:
  {id, finish_reason: {type}, prompt_tokens, completion_tokens, cached_tokens}}`, cumulative stream chunks),
  `POST /abort_request`, `GET /health`, `GET /model_info` and `GET /get_model_info`; errors are SGLang's
  `{"object": "error", message, type, code}`. tests/fake_sglang.py documents where each field comes from.

The model is greedy and deterministic: each next token is a function of the whole context, so an answer continued
from a cut (prompt + the partial ids) is token for token the answer that was never cut, as with a real model under
greedy decoding. Every answer ends by itself (the end-of-turn token) or at `max_tokens`, and its text is the
tokenizer's decode of its ids, so a checker can recompute every correct answer from its prompt alone.

Faults are planned per server by arrival order of generation requests (`Fault`); `stop()` kills the server (its
listener and every open connection close) and `start()` brings it back on the same port. Every generation request
is logged as an `Attempt`: what it asked for, which fault it met, which tokens left the server and how it ended.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from aiohttp import web

M64 = (1 << 64) - 1
SAMPLING_PARAMS = {  # SGLang's SamplingParams fields (python/sglang/srt/sampling/sampling_params.py)
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "custom_params",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
}
GENERATE_FIELDS = {  # the GenerateReqInput fields a text-generation client may send
    "rid",
    "text",
    "input_ids",
    "sampling_params",
    "stream",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "log_metrics",
    "lora_path",
    "session_params",
    "priority",
    "extra_key",
    "custom_labels",
    "return_hidden_states",
    "input_embeds",
    "image_data",
}
# Before a reset: what was written has reached the client and been read (a reset makes the client drop what it
# received but had not read yet, so without the pause the tokens it saw would depend on its scheduling).
RESET_PAUSE_S = 0.2


def _mix(h: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit function of the state."""
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & M64
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB & M64
    return h ^ (h >> 31)


class GreedyModel:
    """The served model: a deterministic next-token function of the context, over the target's own tokenizer."""

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

    @staticmethod
    def _state(ids: list[int]) -> int:
        h = 0
        for t in ids:
            h = _mix(h ^ (t + 0x9E3779B97F4A7C15) & M64)
        return h

    def answer(self, context: list[int], max_new: int) -> tuple[list[int], str]:
        """The tokens that follow `context` and how the answer ends: `stop` (its last id is the end-of-turn
        token) or `length`. The end-of-turn token only follows a word, so an answer is never empty."""
        h, last, out = self._state(context), (context[-1] if context else -1), []
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

    def render(self, messages: list[dict], tools: Optional[list[dict]] = None, **template_kwargs) -> list[int]:
        """The chat template, as a server applies it to /v1/chat/completions messages."""
        return list(
            self.tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False, **template_kwargs
            )
        )


@dataclass
class Fault:
    """What one generation request meets instead of a clean answer.

    kind: `status` (an HTTP error with `status`, and `retry_after` as Retry-After), `reset` (the connection is reset
    after `after` tokens: mid-stream, or half-way through a plain answer's body), `stall` (silence after `after`
    tokens, until the client gives up), `malformed` (a plain body, or a stream line after `after` tokens, that is
    not JSON), `no_usage` (an OpenAI answer without `usage`)."""

    kind: str
    status: int = 0
    retry_after: Optional[str] = None
    after: int = 0


@dataclass
class Attempt:
    """One generation request as the server saw it."""

    server: str
    index: int  # arrival order on this server, from 1
    endpoint: str
    stream: bool
    rid: Optional[str]
    context: list[int]  # the ids the answer follows: the prompt, or the prompt and a partial answer
    max_new: int
    fault: Optional[str] = None
    status: int = 0
    retry_after: Optional[float] = None
    sent: list[int] = field(default_factory=list)  # token ids a client could read (whole stream chunks or body)
    finish: Optional[str] = None  # the finish reason sent; None: the answer never finished
    # complete | status | reset | stall | malformed | no_usage (a faulty answer) | killed (the server died under
    # it) | disconnected (the client went away) | aborted (an /abort_request ended it)
    outcome: str = ""
    t_start: float = 0.0
    t_end: float = 0.0


class FaultServer:
    """One server on 127.0.0.1, in a thread with its own event loop."""

    def __init__(
        self,
        model: GreedyModel,
        model_path: str,
        faults: Optional[dict[int, Fault]] = None,
        every: Optional[Fault] = None,
        token_delay_s: float = 0.01,
    ):
        self.model, self.model_path = model, model_path
        self.faults = dict(faults or {})  # arrival index -> fault
        self.every = every  # a fault every request meets (unless `faults` names another)
        self.token_delay_s = token_delay_s
        self.log: list[Attempt] = []
        self.aborts: list[str] = []  # rids named by /abort_request
        self.port = 0
        self.up = False
        self._arrivals = 0
        self._running: dict[str, asyncio.Event] = {}  # rid -> set by /abort_request
        self._active: set = set()  # transports of requests in flight: a dying server drops them
        self._stopping = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- lifecycle ------------------------------------------------------------------------------------------ #

    def start(self) -> "FaultServer":
        """Listen (again, on the same port after `stop`)."""
        self._call(self._serve())
        return self

    def stop(self) -> None:
        """The server dies: the listener closes, every request in flight is cut, no answer is finished."""
        if self.up:
            self._call(self._die())

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _serve(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._openai)
        app.router.add_post("/v1/chat/completions", self._openai)
        # handler_cancellation: a client that goes away cancels its handler, as uvicorn notices disconnects
        self._runner = web.AppRunner(app, shutdown_timeout=0.1, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()
        self.port = self._runner.addresses[0][1]
        self._stopping, self.up = False, True

    async def _die(self) -> None:
        self._stopping = True
        for transport in list(self._active):
            transport.abort()  # the process is gone: its connections close mid-answer
        await self._runner.cleanup()
        self.up = False

    # ---- endpoints that are not generation ------------------------------------------------------------------ #

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _model_info(self, request: web.Request) -> web.Response:
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
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_path,
                        "object": "model",
                        "created": 0,
                        "owned_by": "vllm",
                        "root": self.model_path,
                        "parent": None,
                        "max_model_len": 4096,
                        "permission": [],
                    }
                ],
            }
        )

    async def _abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.aborts.append(body.get("rid"))
        for rid in list(self._running) if body.get("abort_all") else [body.get("rid")]:
            if rid in self._running:
                self._running[rid].set()
        return web.Response(status=200)

    # ---- generation: one path for both protocols ------------------------------------------------------------ #

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        problem = _sglang_invalid(body)
        if problem:
            return _sglang_error(400, problem)
        sp = body.get("sampling_params") or {}
        rid = body.get("rid") or f"gen-{self._arrivals + 1}"
        if rid in self._running:
            return _sglang_error(400, f"Duplicate request ID {rid}")
        proto = SGLang(self.model, rid, body["input_ids"])
        return await self._serve_attempt(request, proto, sp.get("max_new_tokens", 128), bool(body.get("stream")), rid)

    async def _openai(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path == "/v1/chat/completions"
        if body.get("model") != self.model_path:
            return _openai_error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        if chat:
            context = self.model.render(body["messages"], body.get("tools"), **(body.get("chat_template_kwargs") or {}))
        elif isinstance(body.get("prompt"), str):
            context = list(self.model.tok(body["prompt"], add_special_tokens=False).input_ids)
        elif isinstance(body.get("prompt"), list) and all(isinstance(t, int) for t in body["prompt"]):
            context = body["prompt"]
        else:
            return _openai_error(400, "prompt must be a string or a list of token ids", "BadRequestError")
        proto = OpenAI(self.model, f"{'chatcmpl' if chat else 'cmpl'}-{self._arrivals + 1}", list(context), body, chat)
        return await self._serve_attempt(
            request, proto, int(body.get("max_tokens") or 16), bool(body.get("stream")), None
        )

    async def _serve_attempt(
        self, request: web.Request, proto, max_new: int, stream: bool, rid: Optional[str]
    ) -> web.StreamResponse:
        self._arrivals += 1
        fault = self.faults.get(self._arrivals, self.every)
        a = Attempt(
            self.url,
            self._arrivals,
            request.path,
            stream,
            rid,
            list(proto.context),
            max_new,
            fault=fault.kind if fault else None,
            t_start=time.monotonic(),
        )
        self.log.append(a)
        key = proto.rid
        self._running[key] = asyncio.Event()
        self._active.add(request.transport)
        planned, finish = self.model.answer(proto.context, max_new)
        try:
            if fault is not None and fault.kind == "status":
                a.status, a.outcome = fault.status, "status"
                a.retry_after = float(fault.retry_after) if fault.retry_after else None
                headers = {"Retry-After": fault.retry_after} if fault.retry_after else None
                return proto.error(fault.status, "injected failure", headers)
            if stream:
                return await self._stream(request, proto, a, fault, planned, finish)
            return await self._plain(request, proto, a, fault, planned, finish)
        except ConnectionResetError:  # the connection is gone (the client left, or this server died)
            self._cut(a)
            return web.Response()  # aiohttp drops it quietly: there is nobody to answer
        except asyncio.CancelledError:
            self._cut(a)
            raise
        finally:
            a.t_end = time.monotonic()
            self._running.pop(key, None)
            self._active.discard(request.transport)

    def _cut(self, a: Attempt) -> None:
        if not a.outcome:  # a fault's own outcome stands; otherwise the answer was cut from outside
            a.outcome = "killed" if self._stopping else "disconnected"

    async def _tokens(self, key: str, planned: list[int]):
        """The planned tokens one decode step apart, until done or aborted."""
        for token in planned:
            await asyncio.sleep(self.token_delay_s)
            if self._running[key].is_set():
                return
            yield token

    async def _plain(self, request, proto, a: Attempt, fault: Optional[Fault], planned, finish):
        out = [t async for t in self._tokens(proto.rid, planned)]
        if len(out) < len(planned):
            finish = "abort"
        if fault is not None and fault.kind == "malformed":
            a.outcome = "malformed"
            return web.Response(text=json.dumps(proto.answer(out, finish))[:40], content_type="application/json")
        doc = proto.answer(out, finish, usage=not (fault and fault.kind == "no_usage"))
        data = json.dumps(doc).encode()
        if fault is not None and fault.kind == "reset":
            a.outcome = "reset"
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = len(data)
            await resp.prepare(request)
            await resp.write(data[: len(data) // 2])
            await _reset(request)
            return resp
        if fault is not None and fault.kind == "stall":
            a.outcome = "stall"
            await self._running[proto.rid].wait()  # the client's timeout closes the connection first
            return web.Response(status=200)
        a.sent, a.finish = out, finish
        a.outcome = (
            "no_usage"
            if fault is not None and fault.kind == "no_usage"
            else ("complete" if finish != "abort" else "aborted")
        )
        return web.Response(body=data, content_type="application/json")

    async def _stream(self, request, proto, a: Attempt, fault: Optional[Fault], planned, finish):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        mid = fault.kind in ("reset", "stall", "malformed") if fault else False
        cut = min(fault.after, len(planned) - 1) if mid else None  # a fault mid-answer comes before its end
        out: list[int] = []
        for chunk in proto.stream_start():
            await _sse(resp, chunk)
        if cut == 0:
            planned = []
        async for token in self._tokens(proto.rid, planned):
            out.append(token)
            done = len(out) == len(planned)
            await _sse(resp, proto.chunk(out, finish if done and cut is None else None))
            a.sent = list(out)
            if cut is not None and len(out) == cut:
                break
        if cut is not None:
            a.outcome = fault.kind
            if fault.kind == "reset":
                await _reset(request)
                return resp
            if fault.kind == "stall":
                await self._running[proto.rid].wait()  # silence; an /abort_request ends it as SGLang does
                await _sse(resp, proto.chunk(out, "abort"))
                await resp.write(b"data: [DONE]\n\n")
                return resp
            await resp.write(b'data: {"id": "' + proto.rid.encode() + b'", "choices": [{"text\n\n')  # malformed
            await resp.write(b"data: [DONE]\n\n")
            return resp
        if len(out) < len(planned):  # aborted: SGLang's last chunk says so
            a.outcome = "aborted"
            await _sse(resp, proto.chunk(out, "abort"))
        else:
            a.finish = finish
            a.outcome = "complete"
        if proto.wants_usage() and not (fault is not None and fault.kind == "no_usage"):
            await _sse(resp, proto.usage_chunk(out))
        await resp.write(b"data: [DONE]\n\n")
        return resp


# ---- the two wire formats ------------------------------------------------------------------------------------- #


class SGLang:
    """SGLang's /generate answer and stream chunks (cumulative `text` and `output_ids`)."""

    def __init__(self, model: GreedyModel, rid: str, context: list[int]):
        self.model, self.rid, self.context = model, rid, context

    def error(self, status: int, message: str, headers=None) -> web.Response:
        return _sglang_error(status, message, headers)

    def _meta(self, out: list[int], finish: Optional[str]) -> dict:
        reason = None
        if finish == "stop":
            reason = {"type": "stop", "matched": out[-1]}
        elif finish == "length":
            reason = {"type": "length", "length": len(out)}
        elif finish == "abort":
            reason = {"type": "abort", "message": "Abort in the middle of decoding."}
        return {
            "id": self.rid,
            "finish_reason": reason,
            "prompt_tokens": len(self.context),
            "completion_tokens": len(out),
            "cached_tokens": 0,
        }

    def answer(self, out: list[int], finish: Optional[str], usage: bool = True) -> dict:
        return {"text": self.model.text(out), "output_ids": list(out), "meta_info": self._meta(out, finish)}

    def stream_start(self) -> list[dict]:
        return []

    def chunk(self, out: list[int], finish: Optional[str]) -> dict:
        return self.answer(out, finish)

    def wants_usage(self) -> bool:
        return False


class OpenAI:
    """vLLM's /v1/completions and /v1/chat/completions answers and stream chunks."""

    def __init__(self, model: GreedyModel, rid: str, context: list[int], body: dict, chat: bool):
        self.model, self.rid, self.context, self.body, self.chat = model, rid, context, body, chat
        self.ids = bool(body.get("return_token_ids"))
        self.head = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model"),
        }
        self.chunk_head = dict(self.head, object="chat.completion.chunk" if chat else "text_completion")

    def error(self, status: int, message: str, headers=None) -> web.Response:
        kind = {429: "RateLimitError", 503: "ServiceUnavailableError"}.get(status, "InternalServerError")
        return _openai_error(status, message, kind, headers)

    def _usage(self, out: list[int]) -> dict:
        return {
            "prompt_tokens": len(self.context),
            "total_tokens": len(self.context) + len(out),
            "completion_tokens": len(out),
            "prompt_tokens_details": None,
        }

    def answer(self, out: list[int], finish: Optional[str], usage: bool = True) -> dict:
        text = self.model.text(out)
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": [], "reasoning_content": None},
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
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
        return [
            dict(
                self.chunk_head,
                choices=[
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                ],
            )
        ]

    def chunk(self, out: list[int], finish: Optional[str]) -> dict:
        """The decode step that produced `out[-1]` (the end-of-turn token's text is empty, as vLLM sends it)."""
        piece = self.model.text(out[-1:])
        if self.chat:
            choice = {"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        if self.ids:
            choice["token_ids"] = list(out[-1:])
            if len(out) == 1:
                choice["prompt_token_ids"] = list(self.context)
        return dict(self.chunk_head, choices=[choice])

    def usage_chunk(self, out: list[int]) -> dict:
        return dict(self.chunk_head, choices=[], usage=self._usage(out))

    def wants_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))


def _sglang_invalid(body: dict) -> Optional[str]:
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


def _sglang_error(status: int, message: str, headers: Optional[dict] = None) -> web.Response:
    return web.json_response(
        {"object": "error", "message": message, "type": str(status), "code": status}, status=status, headers=headers
    )


def _openai_error(status: int, message: str, kind: str, headers: Optional[dict] = None) -> web.Response:
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
