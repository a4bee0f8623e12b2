"""A logging reverse proxy on loopback, in front of a real OpenAI-compatible server.

The kill suite needs to know which responses the server finished and handed to the client before the client was
killed: only the wire can tell. Every request is forwarded unchanged and its answer streamed back unchanged; per
request the proxy records the sampling seed it carried (the generate stage derives it from the store key, so the
seed names the response) and the moment the whole answer had been written to the client's socket, if it ever was.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass

# Not forwarded: they describe one hop's connection, and aiohttp sets its own.
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}


@dataclass
class Exchange:
    """One request through the proxy."""

    path: str
    seed: int | None
    started: float
    status: int = 0
    # time.time() when the whole answer (a 200; when streamed, up to its event with a finish reason or `[DONE]`) had
    # been written to the client's socket; None: never (the client went away first, or the answer was an error or
    # cut short)
    delivered: float | None = None

    @property
    def complete(self) -> bool:
        return self.delivered is not None


class LoggingProxy:
    """Start with `start()` (returns its URL), read `exchanges()` at any time, `stop()` at the end. Runs its own event
    loop on a background thread, so the caller can block on subprocesses meanwhile."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self._log: list[Exchange] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kill-proxy", daemon=True)
        self._runner = None
        self._session = None

    def start(self) -> str:
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def exchanges(self) -> list[Exchange]:
        with self._lock:
            return list(self._log)

    def clear(self) -> None:
        with self._lock:
            self._log.clear()

    async def _start(self) -> str:
        import aiohttp
        from aiohttp import web

        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0)
        )
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # a free port, held from the start
        await web.SockSite(self._runner, sock).start()
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def _stop(self) -> None:
        await self._runner.cleanup()
        await self._session.close()

    async def _handle(self, request):
        from aiohttp import web

        body = await request.read()
        ex = Exchange(request.path, _seed(body), time.time())
        with self._lock:
            self._log.append(ex)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=body, headers=headers
        ) as up:
            ex.status = up.status
            resp = web.StreamResponse(
                status=up.status, headers={k: v for k, v in up.headers.items() if k.lower() not in HOP_HEADERS}
            )
            await resp.prepare(request)
            streamed = up.headers.get("content-type", "").startswith("text/event-stream")
            events = _Finish()
            try:
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                    events.feed(chunk)
                await resp.write_eof()
            except ConnectionError:
                # the client went away (a cancel, a kill): not delivered; leaving this block closes the upstream
                # request too, as the client's own disconnect would have
                return resp
            if up.status == 200 and (not streamed or events.finished):
                ex.delivered = time.time()
        return resp


def _seed(body: bytes) -> int | None:
    try:
        doc = json.loads(body) if body else None
    except ValueError:
        return None
    return doc.get("seed") if isinstance(doc, dict) else None


class _Finish:
    """Reads a server-sent-event stream as it passes: `finished` once an event carries a finish reason or `[DONE]`
    (`transformers serve` sends no `[DONE]`; vLLM sends both)."""

    def __init__(self):
        self.finished = False
        self._pending = b""

    def feed(self, chunk: bytes) -> None:
        *lines, self._pending = (self._pending + chunk).split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.finished = True
                continue
            try:
                event = json.loads(payload)
            except ValueError:
                continue
            if any(c.get("finish_reason") for c in event.get("choices") or []):
                self.finished = True
