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
- Stopping (`req.stop`, see draftdata/generate/backends/protocol.py): every attempt runs as a task of its own, beside
  the request's stop signal and its server's death. On a stop the server is told once (`_abort`), the answer is read
  on for `grace_s` and what came is returned: the complete answer, or the partial as a stopped result. A server's
  death ends the reading at once and the attempt fails over.

A subclass supplies the protocol: `_attempt` (one try on one server), `_served_models` (what a server serves) and
`_abort` (tell a server to stop one request), plus `health_path`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import aiohttp

from draftdata.config.schema import Config
from draftdata.errors import UserError
from draftdata.generate.backends.protocol import DEAD_ENGINE_HINT, GenRequest, GenResult, cancel_as_stop, stopped_result
from draftdata.model.target import Target
from draftdata.util.log import log

RETRY_STATUSES = frozenset({408, 409, 429})
# SGLang's /health runs a one-token generation and gives it 20 s (SGLANG_HEALTH_CHECK_TIMEOUT): leave room for it.
PROBE_TIMEOUT_S = 30.0
STARTUP_POLL_S = 1.0  # how often start() asks a loading server (503) again
ABORT_TIMEOUT_S = 5.0  # an abort is best effort: it must not hold up the caller's stop for long
CONNECTION_HEADROOM = 8  # connections beyond the concurrency: health probes and aborts must not queue behind work
# What is read past an answer's end marker (`data: [DONE]`) so that its connection is reused: the chunked body's
# last chunk, a few bytes that come at once. A server that sends more, or takes longer, costs its connection.
TAIL_LIMIT_BYTES = 64 * 1024
TAIL_TIMEOUT_S = 1.0


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
        retry_after: float | None = None,
    ):
        super().__init__(f"{code}: {detail}")
        self.code, self.detail = code, detail
        self.retry, self.dead, self.abort, self.retry_after = retry, dead, abort, retry_after


# What a server says when its engine has died (vLLM: the API server answers every request so, then exits): no retry
# on it can succeed until it is restarted, and the cause is in its own log.
DEAD_ENGINE_MARKS = ("EngineCore encountered an issue", "EngineDeadError", "Engine loop has died")


def dead_engine(message: str) -> Failure | None:
    """A failure that says the server's engine is dead: the server leaves the rotation (it is probed until it
    serves again), and the detail says what to do."""
    if not any(mark in message for mark in DEAD_ENGINE_MARKS):
        return None
    return Failure("engine_dead", f"{error_message(message)[:200]} ({DEAD_ENGINE_HINT})", retry=True, dead=True)


def error_message(body: str) -> str:
    """The message of an OpenAI-style error body (`{"error": {"message": ...}}`, as vLLM and SGLang answer), else
    the body itself."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, TypeError, KeyError):
        return body.strip()
    return message.strip() if isinstance(message, str) else body.strip()


def status_failure(status: int, body: str, retry_after_header: str | None) -> Failure:
    if status >= 500 and (dead := dead_engine(body)) is not None:
        return dead
    retry = status in RETRY_STATUSES or status >= 500
    return Failure(
        f"http_{status}",
        f"HTTP {status}: {body.strip()[:300]}",
        retry=retry,
        retry_after=parse_retry_after(retry_after_header) if retry else None,
    )


def parse_retry_after(value: str | None) -> float | None:
    """`Retry-After` in seconds (the form inference servers send); anything else is ignored."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and seconds >= 0 else None


def backoff_delay(retry: int, base_s: float, max_s: float, retry_after: float | None, ceiling_s: float) -> float:
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
    # Completed when the server is marked dead: the attempts in flight here wait on it beside their work, to stop
    # reading and fail over. Made on first use (a pool is built before its event loop runs), anew for each life.
    _death: asyncio.Future | None = field(default=None, repr=False)

    def death(self) -> asyncio.Future:
        if self._death is None:
            self._death = asyncio.get_running_loop().create_future()
        return self._death


class ServerPool:
    """Least outstanding requests over the live servers; dead ones are probed in the background until healthy."""

    def __init__(self, urls: list[str], probe: Callable[[str], Awaitable[str | None]], probe_interval_s: float):
        self.servers = [Server(url.rstrip("/")) for url in urls]
        self._probe = probe  # url -> None when healthy and serving the right model, else what is wrong
        self._interval = probe_interval_s
        self._revivers: set[asyncio.Task] = set()

    def pick(self, prefer: str | None = None, slack: int = 0) -> Server:
        """`prefer`: the server that answered a conversation's previous turn, taken while it is alive and holds at
        most `slack` requests more than the least busy one (it has the conversation's KV in its prefix cache)."""
        live = [s for s in self.servers if s.alive] or self.servers
        server = min(live, key=lambda s: (s.outstanding, s.picks))
        if prefer is not None:
            server = next((s for s in live if s.url == prefer and s.outstanding <= server.outstanding + slack), server)
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
        if server._death is not None:
            server._death.set_result(why)  # the attempts in flight there fail over
        log("backend", event="server_dead", url=server.url, reason=why)
        task = asyncio.create_task(self._revive(server))
        self._revivers.add(task)
        task.add_done_callback(self._revivers.discard)

    async def _revive(self, server: Server) -> None:
        while True:
            await asyncio.sleep(self._interval)
            problem = await self._probe(server.url)
            if problem is None:
                server.alive, server._death = True, None
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
    # How long a stopped request reads on for the answer's end (`_stop_attempt`). A server that is told to abort
    # ends the stream with what it produced; without an abort endpoint only what is already on its way can come.
    grace_s = 0.05

    def __init__(self, cfg: Config, target: Target):
        self.cfg = cfg
        self.bcfg = cfg.backend
        self.tokenizer = target.tok
        self.expected_model = self.bcfg.served_model_name or cfg.model.path
        self.session: aiohttp.ClientSession | None = None
        self.pool = ServerPool(self.bcfg.urls, self._problem, self.bcfg.probe_interval_s)
        self._aborted: set[str] = set()  # attempt rids already told to stop: one abort each
        # How much busier than the least busy server a conversation's previous server may be and still take its
        # next turn: a quarter of each server's share of the requests in flight (re-reading a conversation's
        # history costs less than waiting behind a queue much longer than the others')
        concurrency = cfg.concurrency
        self._affinity_slack = concurrency // len(self.pool.servers) // 4

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
        concurrency = self.cfg.concurrency
        connector = aiohttp.TCPConnector(limit=concurrency + len(self.pool.servers) + CONNECTION_HEADROOM)
        timeout = aiohttp.ClientTimeout(total=self.bcfg.request_timeout_s, sock_connect=self.bcfg.connect_timeout_s)
        return aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self._auth_headers())

    def _auth_headers(self) -> dict:
        key = os.environ.get(self.bcfg.api_key_env) if self.bcfg.api_key_env else None
        return {"Authorization": f"Bearer {key}"} if key else {}

    # ---- health and model checks ----------------------------------------------------------------------------- #

    async def _startup_problem(self, url: str) -> tuple[str, str] | None:
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

    async def _problem(self, url: str) -> str | None:
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

    async def _model_problem(self, url: str) -> tuple[str, str] | None:
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
        return await cancel_as_stop(req, self._generate(req))

    async def _generate(self, req: GenRequest) -> GenResult:
        t0 = time.perf_counter()
        last: Failure | None = None
        server = self.pool.servers[0]
        for n in range(self.bcfg.max_retries + 1):
            if last is not None:
                await self._backoff(req, n, last)
            if req.stopping:  # before the restart below, which would throw a text-only partial away
                return self._stopped(req, server, t0)
            self._resume_or_restart(req)
            if req.partial.completion_tokens >= req.max_tokens:  # parked at max_tokens: nothing left to generate
                return self._complete(req, req.partial.completion_tokens, 0, "length", len(req.prompt_ids), True)
            server = self.pool.pick(req.prefer, self._affinity_slack)
            rid = attempt_rid(req.rid)  # unique per attempt: a server may still hold an earlier attempt's rid
            try:
                res = await self._attempt_on(server, req, rid)
            except Failure as f:
                if req.stopping:  # never retry what the caller stopped
                    return self._stopped(req, server, t0)
                req.attempt_errors.append(f.code)
                if f.abort:
                    await self._abort_quietly(server, rid)
                if f.dead:
                    self.pool.mark_dead(server, f.detail)
                if not f.retry:
                    return self._failed(req, f.code, f.detail, server.url, t0)
                last = f
                continue
            if res is None:  # stopped by the caller
                return self._stopped(req, server, t0)
            res.server, res.latency_s = server.url, time.perf_counter() - t0
            return res
        assert last is not None  # the loop ran (max_retries >= 0) and only a failure gets here
        code = "retries_exhausted" if self.bcfg.max_retries else last.code
        detail = f"{last.code}: {last.detail}" if self.bcfg.max_retries else last.detail
        return self._failed(req, code, detail, server.url, t0)

    def _failed(self, req: GenRequest, code: str, detail: str, server: str, t0: float) -> GenResult:
        return GenResult(req.rid, error=code, detail=detail, server=server, latency_s=time.perf_counter() - t0)

    def _stopped(self, req: GenRequest, server: Server, t0: float) -> GenResult:
        return stopped_result(req, server.url, time.perf_counter() - t0)

    async def _backoff(self, req: GenRequest, retry: int, last: Failure) -> None:
        """The pause before a retry, which a stop ends early."""
        b = self.bcfg
        delay = backoff_delay(retry, b.backoff_base_s, b.backoff_max_s, last.retry_after, b.request_timeout_s)
        await asyncio.wait({req.stop_signal()}, timeout=delay)

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
    def _take_answer(req: GenRequest, ids: list | None, text: str) -> None:
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
        server_prompt_tokens: int | None,
        has_ids: bool,
        prompt_ids: list | None = None,
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
            reasoning=p.reasoning,
            tool_calls=list(p.tool_calls),
        )

    async def _attempt_on(self, server: Server, req: GenRequest, rid: str) -> GenResult | None:
        """One attempt, a task of its own beside two signals: the caller's stop (`_stop_attempt`; None: stopped)
        and, when there are other servers to fail over to, this server's death (stop reading, retry elsewhere)."""
        with self.pool.track(server):
            work = asyncio.ensure_future(self._classified(server, req, rid))
            try:
                signals = {req.stop_signal()}
                if len(self.pool.servers) > 1 and server.alive:  # in panic mode nothing is left to fail over to
                    signals.add(server.death())
                await asyncio.wait({work, *signals}, return_when=asyncio.FIRST_COMPLETED)
                if work.done():
                    return work.result()
                if not req.stopping:  # marked dead by another request: nothing more will come from it
                    raise Failure(
                        "connection", f"{server.url} was marked dead while the request was in flight", retry=True
                    )
                return await self._stop_attempt(server, req, rid, work)
            finally:
                await _halt(work)

    async def _stop_attempt(self, server: Server, req: GenRequest, rid: str, work: asyncio.Future) -> GenResult | None:
        """The caller's stop. The answer may be on its way: the server may have finished it already, or (told to
        abort) end it with every token it produced. So tell the server (`_abort`; for an OpenAI-style server,
        closing the connection is the abort, which `_halt` does), read on for `grace_s`, and return the complete
        answer if it came; None when the attempt ended otherwise (aborted, cut or silent), its tokens in the
        partial. A server marked dead gets the abort (in panic mode it may still be working) but no grace."""
        await self._abort_quietly(server, rid)
        if server.alive:
            await asyncio.wait({work}, timeout=self.grace_s)
        await _halt(work)
        if work.cancelled() or isinstance(work.exception(), GRACE_ENDINGS):
            return None
        return work.result()

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
        self, server: Server, path: str, req: GenRequest, body: dict
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST `req`'s `body`, with its conversation's id in `backend.session_header` where one is named. Raises a
        `Failure` for a non-200 status and drops the connection when the reader stops early (halted, failed): a
        half-read answer cannot go back to the pool, and for OpenAI-style servers closing the connection is how a
        request is aborted."""
        name = self.bcfg.session_header
        headers = {name: req.session} if name and req.session else None
        resp = await self.session.post(server.url + path, json=body, headers=headers)
        try:
            if resp.status != 200:
                raise status_failure(resp.status, await resp.text(errors="replace"), resp.headers.get("Retry-After"))
            yield resp
            await _read_tail(resp)
        except BaseException:
            resp.close()
            raise
        finally:
            resp.release()


async def _read_tail(resp: aiohttp.ClientResponse) -> None:
    """Read what is left of a body whose reader stopped at the answer's end marker, so that the connection goes back
    to the pool: aiohttp closes a connection released before its body's end, and where that end comes apart from
    the marker (a proxy, a server that flushes it later) every answer would cost the next request a new connection
    (tests/test_backends.py). A tail that does not end soon closes the connection, as before."""
    content, left = resp.content, TAIL_LIMIT_BYTES
    try:
        while left > 0 and not content.at_eof():
            left -= len(await asyncio.wait_for(content.readany(), TAIL_TIMEOUT_S))
    except (aiohttp.ClientError, asyncio.TimeoutError):
        pass
    if not content.at_eof():
        resp.close()


_RUN_TAG = secrets.token_hex(4)  # this process's: attempt ids of different runs never meet on a server
_attempts = itertools.count()


def attempt_rid(rid: str) -> str:
    """A request id for one attempt: the logical id (for the server's logs), then a suffix unique to the attempt."""
    return f"{rid}-{_RUN_TAG}{next(_attempts):x}"


# How an attempt that was stopped can end besides its answer: the abort's answer (a retryable Failure), a cut
# connection, silence, a malformed end. None of them is an error of the request: the stop stands.
GRACE_ENDINGS = (Failure, aiohttp.ClientError, asyncio.TimeoutError, ValueError)


async def _halt(work: asyncio.Future) -> None:
    """End an attempt that is still reading (its grace is over, its server died, its caller is gone) and wait
    until it has closed its connection. Cancelling our own task is how a read is interrupted; the CancelledError
    ends that task and goes no further."""
    if not work.done():
        work.cancel()
        await asyncio.wait({work})
    if not work.cancelled():
        work.exception()  # retrieved, so asyncio does not log it as never retrieved


def parse_json(text: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise Failure("bad_response", f"not JSON ({e}): {text[:200]!r}") from e


class Body:
    """A plain answer read whole."""

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
    buffer (128 KiB in aiohttp 3.9, 512 KiB in 3.14): SGLang's cumulative chunks of a long answer can be longer."""

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


_JSON = json.JSONDecoder()


def _sse_data(raw: bytes):
    """One SSE line: its JSON object, _DONE for `data: [DONE]`, None for anything else (blank, comment, event:).
    Works on bytes: no decode of a line that is not data. A stream sends a line per token, so the parse is the
    client's main cost per token: the decoder's own `raw_decode` on the UTF-8 text (SSE is UTF-8) costs less than
    `json.loads(bytes)`, which first guesses the encoding and matches whitespace around the object."""
    line = raw.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return _DONE
    try:
        text = data.decode()
        event, end = _JSON.raw_decode(text)
        if end != len(text):
            raise ValueError(f"extra data at char {end}")
    except ValueError as e:
        raise Failure("bad_response", f"not JSON ({e}): {data[:200]!r}") from e
    if not isinstance(event, dict):
        raise Failure("bad_response", f"stream event is not an object: {data[:200]!r}")
    return event


def engine_error(answer: dict) -> Failure:
    """`{"error": {"message": ...}}` (or a bare string) inside a 200 answer or a stream: the server gave up."""
    err = answer["error"]
    message = str(err.get("message", err) if isinstance(err, dict) else err)
    return dead_engine(message) or Failure("engine_error", message[:500])


def finish_or_discard(req: GenRequest, parse: Callable[[object], str], value, new_tokens: int) -> str:
    """`parse(value)` (a finish reason), counting the answer's `new_tokens` as thrown away when it is no response
    (neither parked nor continued: a filtered or unexplained answer is not a prefix to go on from)."""
    try:
        return parse(value)
    except Failure:
        req.discarded_tokens += int(new_tokens)
        raise


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
