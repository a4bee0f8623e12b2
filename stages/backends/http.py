"""What the HTTP backends share: a pool of servers and one request loop with narrow retries.

- Balancing: each attempt goes to the live server with the fewest requests in flight (ties rotate).
- Failover: a connection error marks the server dead. It leaves the rotation, the requests in flight on it are
  retried elsewhere, and a background task probes it every `backend.probe_interval_s` and puts it back once it is
  healthy and still serves the configured model. When every server is marked dead, attempts go to all of them
  anyway (Envoy's "panic mode"): one dropped connection to a single server must cost a retry, not the run.
- Retries only where another try can succeed: 408/409/429/5xx, connection errors and timeouts, at most
  `backend.max_retries` times, after a capped exponential backoff with full jitter or the server's `Retry-After`,
  whichever is longer. Other 4xx, malformed answers and engine errors fail at once: repeating them only costs time.
- One `aiohttp.ClientSession` whose connector is sized to the dataset's concurrency.

A subclass supplies the protocol: `_attempt` (one try on one server), `_served_models` (what a server serves) and
`_abort` (tell a server to stop one request), plus `health_path`.
"""

from __future__ import annotations

import asyncio
import json
import os
import itertools
import random
import secrets
import time
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Iterator, Optional

import aiohttp

from stages.artifacts import log
from stages.backends import GenRequest, GenResult
from stages.config import Config, DatasetConfig, UserError

RETRY_STATUSES = frozenset({408, 409, 429})
# SGLang's /health runs a one-token generation and gives it 20 s (SGLANG_HEALTH_CHECK_TIMEOUT): leave room for it.
PROBE_TIMEOUT_S = 30.0
STARTUP_POLL_S = 1.0  # how often start() asks a loading server (503) again
ABORT_TIMEOUT_S = 5.0  # an abort is best effort: it must not hold up the caller's cancellation for long
CONNECTION_HEADROOM = 8  # connections beyond the concurrency: health probes and aborts must not queue behind work


class Failure(Exception):
    """One failed attempt. `code` becomes `GenResult.error`; `retry`: another attempt may succeed; `dead`: the
    server looks gone; `abort`: the server may still be working on the request; `retry_after`: the server's wish."""

    def __init__(
        self,
        code: str,
        detail: str,
        retry: bool = False,
        dead: bool = False,
        abort: bool = False,
        retry_after: Optional[float] = None,
    ):
        super().__init__(f"{code}: {detail}")
        self.code, self.detail = code, detail
        self.retry, self.dead, self.abort, self.retry_after = retry, dead, abort, retry_after


def status_failure(status: int, body: str, retry_after_header: Optional[str]) -> Failure:
    retry = status in RETRY_STATUSES or status >= 500
    return Failure(
        f"http_{status}",
        f"HTTP {status}: {body.strip()[:300]}",
        retry=retry,
        retry_after=parse_retry_after(retry_after_header) if retry else None,
    )


def parse_retry_after(value: Optional[str]) -> Optional[float]:
    """`Retry-After` in seconds (the form inference servers send); anything else is ignored."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and seconds >= 0 else None


def backoff_delay(retry: int, base_s: float, max_s: float, retry_after: Optional[float], ceiling_s: float) -> float:
    """Full jitter (uniform over [0, capped exponential]) spreads the retries of many requests that failed together;
    a `Retry-After` is a floor, itself capped so a bogus header cannot stall the run longer than a request may take."""
    delay = random.uniform(0.0, min(max_s, base_s * 2 ** (retry - 1)))
    if retry_after is not None:
        delay = max(delay, min(retry_after, ceiling_s))
    return delay


def model_matches(expected: str, served: str) -> bool:
    """`models/Qwen3-8B` matches `/data/Qwen3-8B` and `Qwen/Qwen3-8B`: servers report paths or hub ids."""
    return expected == served or _basename(expected) == _basename(served)


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


@dataclass(eq=False)
class Server:
    url: str
    outstanding: int = 0
    picks: int = 0
    alive: bool = True
    # Attempts in flight here; when the server is marked dead they are cancelled and listed in `doomed`, which
    # tells their awaiting request to fail over rather than take it for its caller's cancellation.
    inflight: set = field(default_factory=set)
    doomed: set = field(default_factory=set)


class ServerPool:
    """Least outstanding requests over the live servers; dead ones are probed in the background until healthy."""

    def __init__(self, urls: list[str], probe: Callable[[str], Awaitable[Optional[str]]], probe_interval_s: float):
        self.servers = [Server(url.rstrip("/")) for url in urls]
        self._probe = probe  # url -> None when healthy and serving the right model, else what is wrong
        self._interval = probe_interval_s
        self._revivers: set[asyncio.Task] = set()

    def pick(self) -> Server:
        live = [s for s in self.servers if s.alive] or self.servers
        server = min(live, key=lambda s: (s.outstanding, s.picks))
        server.picks += 1
        return server

    @contextmanager
    def track(self, server: Server) -> Iterator[None]:
        server.outstanding += 1
        try:
            yield
        finally:
            server.outstanding -= 1

    def mark_dead(self, server: Server, why: str) -> None:
        if not server.alive:
            return
        server.alive = False
        for attempt in server.inflight:
            server.doomed.add(attempt)
            attempt.cancel()
        log("backend", event="server_dead", url=server.url, reason=why)
        task = asyncio.create_task(self._revive(server))
        self._revivers.add(task)
        task.add_done_callback(self._revivers.discard)

    async def _revive(self, server: Server) -> None:
        while True:
            await asyncio.sleep(self._interval)
            problem = await self._probe(server.url)
            if problem is None:
                server.alive = True
                log("backend", event="server_back", url=server.url)
                return
            log("backend", event="server_still_down", url=server.url, reason=problem)

    async def close(self) -> None:
        for task in list(self._revivers):
            task.cancel()
        await asyncio.gather(*self._revivers, return_exceptions=True)


class HttpBackend:
    """The request loop of every HTTP backend; see the module docstring."""

    name = "http"
    health_path = "/health"
    takes_token_ids = True
    # How long a cancelled request reads on for the answer's end (`_graceful`). A server that is told to abort ends
    # the stream with what it produced; without an abort endpoint only what is already on its way can come.
    grace_s = 0.05

    def __init__(self, cfg: Config, tokenizer):
        self.cfg = cfg
        self.bcfg = cfg.backend
        self.tokenizer = tokenizer
        self.expected_model = self.bcfg.served_model_name or cfg.model.path
        self.session: Optional[aiohttp.ClientSession] = None
        self.pool = ServerPool(self.bcfg.urls, self._problem, self.bcfg.probe_interval_s)
        self._aborted: set[str] = set()  # attempt rids already told to stop: one abort each

    # ---- protocol hooks -------------------------------------------------------------------------------------- #

    async def _attempt(self, server: Server, req: GenRequest, rid: str) -> GenResult:
        raise NotImplementedError

    async def _served_models(self, url: str) -> list[str]:
        raise NotImplementedError

    async def _abort(self, server: Server, rid: str) -> None:
        """Tell the server to stop `rid`. Default: nothing, because closing the connection was the abort."""

    # ---- lifecycle ------------------------------------------------------------------------------------------- #

    async def start(self) -> None:
        """Before any prompt: every server probed, the served model checked; unhealthy servers join later."""
        self.session = self._new_session()
        try:
            await self._check_servers()
        except BaseException:
            await self.close()  # the caller only closes a backend that started
            raise

    async def _check_servers(self) -> None:
        problems = await asyncio.gather(*(self._startup_problem(s.url) for s in self.pool.servers))
        found = list(zip(self.pool.servers, problems))
        wrong = [f"{s.url} serves {p[1]}" for s, p in found if p and p[0] == "model"]
        if wrong:
            raise UserError(
                f"backend: wrong model: {'; '.join(wrong)}; expected {self.expected_model!r} "
                "(model.path, or backend.served_model_name if the server uses another name)"
            )
        if all(p for _, p in found):
            raise UserError("backend: no healthy server: " + "; ".join(f"{s.url}: {p[1]}" for s, p in found))
        for server, problem in found:
            if problem:
                self.pool.mark_dead(server, problem[1])
        log("backend", kind=self.name, servers=len(found) - sum(bool(p) for _, p in found), of=len(found))

    async def close(self) -> None:
        await self.pool.close()
        if self.session is not None:
            await self.session.close()
            self.session = None

    def _new_session(self) -> aiohttp.ClientSession:
        concurrency = self.cfg.ds.concurrency if self.cfg.dataset else DatasetConfig().concurrency
        connector = aiohttp.TCPConnector(limit=concurrency + len(self.pool.servers) + CONNECTION_HEADROOM)
        timeout = aiohttp.ClientTimeout(total=self.bcfg.request_timeout_s, sock_connect=self.bcfg.connect_timeout_s)
        return aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self._auth_headers())

    def _auth_headers(self) -> dict:
        key = os.environ.get(self.bcfg.api_key_env) if self.bcfg.api_key_env else None
        return {"Authorization": f"Bearer {key}"} if key else {}

    # ---- health and model checks ----------------------------------------------------------------------------- #

    async def _startup_problem(self, url: str) -> Optional[tuple[str, str]]:
        """None, ("health", what) or ("model", what). A 503 means "still loading": wait for it, bounded."""
        deadline = time.monotonic() + self.bcfg.startup_timeout_s
        while True:
            status, why = await self._health(url)
            if status == 200:
                return await self._model_problem(url)
            left = deadline - time.monotonic()
            if status != 503 or left <= 0:
                waited = f" (still starting after {self.bcfg.startup_timeout_s:g}s)" if status == 503 else ""
                return ("health", why + waited)
            await asyncio.sleep(min(STARTUP_POLL_S, left))

    async def _problem(self, url: str) -> Optional[str]:
        """The background probe of a dead server: healthy now, and still the right model?"""
        status, why = await self._health(url)
        if status != 200:
            return why
        problem = await self._model_problem(url)
        return problem[1] if problem else None

    async def _health(self, url: str) -> tuple[int, str]:
        """The health endpoint's status (0: unreachable) and, when it is not 200, what was found."""
        try:
            async with self.session.get(url + self.health_path, timeout=self._probe_timeout()) as resp:
                await resp.read()
                return resp.status, f"{self.health_path} answered {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return 0, f"unreachable ({type(e).__name__}: {e})"

    async def _model_problem(self, url: str) -> Optional[tuple[str, str]]:
        try:
            served = await self._served_models(url)
        except Failure as f:
            return ("health", f"{url}: cannot tell which model it serves: {f.detail}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return ("health", f"{url}: cannot tell which model it serves: {type(e).__name__}: {e}")
        if not any(model_matches(self.expected_model, name) for name in served):
            return ("model", ", ".join(repr(n) for n in served) or "no model")
        return None

    def _probe_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S, sock_connect=self.bcfg.connect_timeout_s)

    async def _get_json(self, url: str) -> tuple[int, object]:
        """GET a small JSON document (health, model info): (status, parsed body or None)."""
        async with self.session.get(url, timeout=self._probe_timeout()) as resp:
            if resp.status != 200:
                await resp.read()
                return resp.status, None
            return resp.status, parse_json(await resp.text())

    # ---- the request loop ------------------------------------------------------------------------------------ #

    async def generate(self, req: GenRequest) -> GenResult:
        t0 = time.perf_counter()
        last: Optional[Failure] = None
        server = self.pool.servers[0]
        for n in range(self.bcfg.max_retries + 1):
            if last is not None:
                await asyncio.sleep(
                    backoff_delay(
                        n,
                        self.bcfg.backoff_base_s,
                        self.bcfg.backoff_max_s,
                        last.retry_after,
                        self.bcfg.request_timeout_s,
                    )
                )
            self._resume_or_restart(req)
            if req.partial.completion_tokens >= req.max_tokens:  # parked at max_tokens: nothing left to generate
                return self._complete(req, req.partial.completion_tokens, 0, "length", len(req.prompt_ids), True)
            server = self.pool.pick()
            rid = attempt_rid(req.rid)  # unique per attempt: a server may still hold an earlier attempt's rid
            try:
                res = await self._attempt_on(server, req, rid)
            except Failure as f:
                if req.cancelled:  # never retry what the caller cancelled
                    raise asyncio.CancelledError() from None
                req.attempt_errors.append(f.code)
                if f.abort:
                    await self._abort_quietly(server, rid)
                if f.dead:
                    self.pool.mark_dead(server, f.detail)
                if not f.retry:
                    return self._failed(req, f.code, f.detail, server.url, t0)
                last = f
                continue
            res.server, res.latency_s = server.url, time.perf_counter() - t0
            return res
        assert last is not None  # the loop ran (max_retries >= 0) and only a failure gets here
        code = "retries_exhausted" if self.bcfg.max_retries else last.code
        detail = f"{last.code}: {last.detail}" if self.bcfg.max_retries else last.detail
        return self._failed(req, code, detail, server.url, t0)

    def _failed(self, req: GenRequest, code: str, detail: str, server: str, t0: float) -> GenResult:
        return GenResult(req.rid, error=code, detail=detail, server=server, latency_s=time.perf_counter() - t0)

    def _resume_or_restart(self, req: GenRequest) -> None:
        """Before an attempt: go on from what earlier attempts (or the store) produced when the protocol can send
        token ids; otherwise start over, and count the streamed tokens thrown away."""
        if self.takes_token_ids and req.prompt_ids is not None and req.partial.continuable():
            return
        req.discarded_tokens += req.partial.completion_tokens
        req.partial.clear()

    def _input_ids(self, req: GenRequest) -> list[int]:
        """The prompt, then the output produced so far: a continuation is a longer prompt."""
        return list(req.prompt_ids) + list(req.partial.output_ids)

    @staticmethod
    def _take_answer(req: GenRequest, ids: Optional[list], text: str) -> None:
        """A plain (non-streamed) answer into the partial, which holds just what the attempt started from."""
        if ids is not None:
            req.partial.output_ids = req.partial.output_ids + [int(t) for t in ids]
        req.partial.text += text

    def _complete(
        self,
        req: GenRequest,
        base: int,
        new_tokens: int,
        finish: str,
        server_prompt_tokens: Optional[int],
        has_ids: bool,
        prompt_ids: Optional[list] = None,
    ) -> GenResult:
        """The partial now holds the attempt's whole answer after the `base` tokens it started from: the response.
        An abort or an answer without a single token is a failure to retry, never a response; the partial keeps
        the aborted tokens for the next attempt or the store."""
        p = req.partial
        p.completion_tokens = base + new_tokens
        if finish == "abort":
            raise Failure("aborted", f"the server aborted the request after {p.completion_tokens} tokens", retry=True)
        if p.completion_tokens == 0:
            raise Failure("empty", "the answer has no tokens", retry=True)
        prompt_tokens = len(req.prompt_ids) if base and req.prompt_ids is not None else server_prompt_tokens
        return GenResult(
            req.rid,
            output_ids=list(p.output_ids) if has_ids else None,
            text=p.text,
            prompt_tokens=int(prompt_tokens or 0),
            completion_tokens=p.completion_tokens,
            finish_reason=finish,
            prompt_ids=None if base else prompt_ids,
            continued_from=base,
        )

    async def _attempt_on(self, server: Server, req: GenRequest, rid: str) -> GenResult:
        """One attempt that also ends when the server is marked dead by another request, and that aborts the
        request on the server when the caller cancels it. An answer the server finished while the cancel was under
        way is returned (see `_graceful`)."""
        with self.pool.track(server):
            if len(self.pool.servers) == 1:  # nothing to fail over to: no separate task needed to watch for death
                try:
                    return await self._classified(server, req, rid)
                except asyncio.CancelledError:  # `post` has closed the connection on its way out
                    await self._abort_quietly(server, rid)
                    raise
            work = asyncio.ensure_future(self._classified(server, req, rid))
            if server.alive:  # in panic mode (every server dead) nothing is left to fail over to
                server.inflight.add(work)
            try:
                return await work
            except asyncio.CancelledError:
                if work in server.doomed:  # the server was marked dead by another request: fail over
                    raise Failure(
                        "connection", f"{server.url} was marked dead while the request was in flight", retry=True
                    ) from None
                await _stop(work)  # closes the connection first, which frees it for the abort
                if work.done() and not work.cancelled() and work.exception() is None:
                    return work.result()  # it finished during the cancel's grace: a response, keep it
                await self._abort_quietly(server, rid)
                raise
            finally:
                server.inflight.discard(work)
                server.doomed.discard(work)

    # ---- the caller's cancel: a grace to collect what the server finished or produced --------------------------- #
    # When the caller cancels an attempt (the budget is met, Ctrl-C), the answer may be on its way: the server may
    # have finished it already, or (told to abort) end it with every token it produced. So a cancelled attempt
    # tells the server to stop (`_abort`) and reads on for `grace_s`: a complete answer is returned as the
    # response, an aborted one leaves its tokens in the partial and the cancel goes on. Not for a server marked
    # dead (its attempts are cancelled to fail over): nothing more will come from it.

    async def _graceful(self, server: Server, req: GenRequest, rid: str, read: Callable[[], Awaitable[GenResult]]):
        """Run `read` (resumable: it keeps its place when cancelled); on the caller's cancel, finish it in grace."""
        if req.cancelled:  # the cancel came before the answer's headers (see `post`)
            return await self._within_grace(read)
        try:
            return await read()
        except asyncio.CancelledError:
            if not await self._enter_grace(server, req, rid):
                raise
            return await self._within_grace(read)

    async def _enter_grace(self, server: Server, req: GenRequest, rid: str) -> bool:
        if not server.alive:
            return False
        req.cancelled = True
        await self._abort_quietly(server, rid)
        return True

    async def _within_grace(self, read: Callable[[], Awaitable[GenResult]]) -> GenResult:
        try:
            return await asyncio.wait_for(read(), self.grace_s)
        except (Failure, aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            raise asyncio.CancelledError() from None  # aborted, cut or silent: the cancel stands

    async def _classified(self, server: Server, req: GenRequest, rid: str) -> GenResult:
        """Transport errors as `Failure`s: the one place that decides what is retried."""
        try:
            return await self._attempt(server, req, rid)
        except aiohttp.ConnectionTimeoutError as e:  # before TimeoutError: no connection at all is a dead server
            raise Failure("connection", f"connect timeout to {server.url}: {e}", retry=True, dead=True) from e
        except asyncio.TimeoutError as e:
            raise Failure(
                "timeout",
                f"no complete answer within {self.bcfg.request_timeout_s:g}s from {server.url}",
                retry=True,
                abort=True,
            ) from e
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            raise Failure("connection", f"{type(e).__name__} from {server.url}: {e}", retry=True, dead=True) from e
        except aiohttp.ClientError as e:  # the rest: an answer that is not valid HTTP
            raise Failure("bad_response", f"{type(e).__name__} from {server.url}: {e}") from e

    async def _abort_quietly(self, server: Server, rid: str) -> None:
        if rid in self._aborted:
            return
        self._aborted.add(rid)
        try:
            await asyncio.wait_for(self._abort(server, rid), ABORT_TIMEOUT_S)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log("backend", event="abort_failed", url=server.url, rid=rid, reason=f"{type(e).__name__}: {e}")

    @asynccontextmanager
    async def post(
        self, server: Server, path: str, body: dict, req: GenRequest, rid: str
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST that raises a `Failure` for a non-200 status and drops the connection when the reader stops early
        (cancelled, failed): a half-read answer cannot go back to the pool, and for OpenAI-style servers closing
        the connection is how a request is aborted. A server sends a plain answer's headers only with the answer,
        so a plain request is shielded from the caller's cancel until the grace has had its chance (a stream's
        headers come before its first token: cancelled before them, it has produced nothing to collect)."""
        if req.stream:
            resp = await self.session.post(server.url + path, json=body)
        else:
            sending = asyncio.ensure_future(self.session.post(server.url + path, json=body))
            try:
                resp = await asyncio.shield(sending)
            except asyncio.CancelledError:
                resp = await self._headers_in_grace(server, req, rid, sending)
        try:
            if resp.status != 200:
                raise status_failure(resp.status, await resp.text(errors="replace"), resp.headers.get("Retry-After"))
            yield resp
        except BaseException:
            resp.close()
            raise
        finally:
            resp.release()

    async def _headers_in_grace(self, server: Server, req: GenRequest, rid: str, sending: asyncio.Future):
        try:
            if await self._enter_grace(server, req, rid):
                return await asyncio.wait_for(asyncio.shield(sending), self.grace_s)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        finally:
            if not sending.done():
                sending.cancel()  # closes the connection: the abort of an OpenAI-style server
        raise asyncio.CancelledError()


_RUN_TAG = secrets.token_hex(4)  # this process's: attempt ids of different runs never meet on a server
_attempts = itertools.count()


def attempt_rid(rid: str) -> str:
    """A request id for one attempt: the logical id (for the server's logs), then a suffix unique to the attempt."""
    return f"{rid}-{_RUN_TAG}{next(_attempts):x}"


async def _stop(task: asyncio.Future) -> None:
    """Cancel an attempt and wait until it has closed its connection, without mistaking its CancelledError for
    our own (asyncio.wait never raises the awaited task's exception)."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved


def parse_json(text: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise Failure("bad_response", f"not JSON ({e}): {text[:200]!r}") from e


class Body:
    """A plain answer read whole; a read cancelled half-way keeps what it has and can go on (the grace)."""

    def __init__(self, resp: aiohttp.ClientResponse):
        self.resp = resp
        self.chunks: list[bytes] = []

    async def json(self):
        while chunk := await self.resp.content.readany():
            self.chunks.append(chunk)
        return parse_json(b"".join(self.chunks).decode(errors="replace"))


class EventStream:
    """The JSON payloads of a `data: {...}` server-sent-event stream, until `data: [DONE]` or the end of the body
    (`transformers serve` sends no [DONE]). Whether the answer is complete is the caller's call: a finish reason
    must have come. Lines are split here rather than by aiohttp's readline, which refuses a line over twice its read
    buffer (128 KiB in aiohttp 3.9, 512 KiB in 3.14): SGLang's cumulative chunks of a long answer can be longer.

    The reader keeps its state between iterations, so a reading cancelled half-way can go on where it stopped (the
    grace read after a cancel, `HttpBackend._graceful`)."""

    def __init__(self, resp: aiohttp.ClientResponse):
        self.resp = resp
        self.pending = b""
        self.ended = False

    async def events(self) -> AsyncIterator[dict]:
        while not self.ended:
            chunk = await self.resp.content.readany()
            if not chunk:  # the end of the body
                self.ended = True
                event, self.pending = _sse_data(self.pending), b""
                if event is not None and event is not _DONE:
                    yield event
                return
            *lines, self.pending = (self.pending + chunk).split(b"\n")
            for line in lines:
                event = _sse_data(line)
                if event is _DONE:
                    self.ended = True
                    return
                if event is not None:
                    yield event


_DONE = object()


def _sse_data(raw: bytes):
    """One SSE line: its JSON object, _DONE for `data: [DONE]`, None for anything else (blank, comment, event:).
    Works on bytes (json.loads takes UTF-8 bytes): no decode of a line that is not data."""
    line = raw.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return _DONE
    try:
        event = json.loads(data)
    except ValueError as e:
        raise Failure("bad_response", f"not JSON ({e}): {data[:200]!r}") from e
    if not isinstance(event, dict):
        raise Failure("bad_response", f"stream event is not an object: {data[:200]!r}")
    return event


def engine_error(answer: dict) -> Failure:
    """`{"error": {"message": ...}}` (or a bare string) inside a 200 answer or a stream: the server gave up."""
    err = answer["error"]
    message = err.get("message", err) if isinstance(err, dict) else err
    return Failure("engine_error", str(message)[:500])


def stream_cut(url: str) -> Failure:
    """A stream that ended before its finish reason: the answer is incomplete, try again."""
    return Failure("connection", f"the stream from {url} ended before a finish reason", retry=True)


@contextmanager
def response_shape(what: str) -> Iterator[None]:
    """A missing or mistyped field in a server's answer is `bad_response`, not a crash of the run."""
    try:
        yield
    except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
        raise Failure("bad_response", f"{what}: {type(e).__name__}: {e}") from e
