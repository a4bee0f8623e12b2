"""A loopback OpenAI-compatible server for the `inputs` suite: it answers like vLLM and counts what it is asked.

The count is the point: a bad input must be refused before any generation request reaches the server, so every
POST is counted (GETs apart: the health and model checks a stage may rightly make before refusing). It answers
`/v1/models` with the configured model id and `max_model_len` (as vLLM does), refuses a prompt that does not fit
the context with vLLM's 400, and otherwise returns a fixed answer with its token ids.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class CountingServer:
    def __init__(self, model_id: str, output_ids: list[int], text: str, max_model_len: int):
        self.model_id, self.output_ids, self.text, self.max_model_len = model_id, output_ids, text, max_model_len
        self.posts = 0
        self.gets = 0
        self._lock = threading.Lock()
        self._httpd = _QuietServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def start(self) -> CountingServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def reset(self) -> None:
        with self._lock:
            self.posts = self.gets = 0

    def count(self, method: str) -> None:
        with self._lock:
            if method == "POST":
                self.posts += 1
            else:
                self.gets += 1

    def answer(self, path: str, body: dict) -> tuple[int, dict | list[dict]]:
        """(status, JSON document), or (200, the events of a stream) when the request asks to stream."""
        prompt = body.get("prompt")
        n_prompt = len(prompt) if isinstance(prompt, list) else len(json.dumps(body.get("messages", "")))
        max_tokens = int(body.get("max_tokens") or 16)
        if n_prompt + max_tokens > self.max_model_len:  # vLLM's words for it
            return 400, {
                "error": {
                    "message": f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, you requested {n_prompt + max_tokens} tokens.",
                    "type": "BadRequestError",
                    "code": 400,
                }
            }
        ids = self.output_ids[:max_tokens]
        finish = "stop" if len(ids) == len(self.output_ids) else "length"
        usage = {"prompt_tokens": n_prompt, "completion_tokens": len(ids), "total_tokens": n_prompt + len(ids)}
        if path.endswith("/chat/completions"):
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text}, "finish_reason": finish}
            delta = {"index": 0, "delta": {"content": self.text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": self.text, "finish_reason": finish}
            delta = dict(choice)
        if body.get("return_token_ids"):
            choice["token_ids"] = delta["token_ids"] = ids
        if body.get("stream"):
            return 200, [{"choices": [delta]}, {"choices": [], "usage": usage}]
        return 200, {"id": "cmpl-0", "model": self.model_id, "choices": [choice], "usage": usage}


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A client that hangs up mid-answer (a stage that stopped) is no news: only the stage's output counts."""


def _handler(server: CountingServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: the suite prints its own table
            pass

        def _send(self, status: int, doc) -> None:
            data = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            server.count("GET")
            if self.path == "/v1/models":
                self._send(
                    200,
                    {
                        "object": "list",
                        "data": [{"id": server.model_id, "object": "model", "max_model_len": server.max_model_len}],
                    },
                )
            elif self.path == "/health":
                self._send(200, {})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            server.count("POST")
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                return self._send(400, {"error": {"message": "body is not JSON"}})
            status, doc = server.answer(self.path, body)
            if not isinstance(doc, list):
                return self._send(status, doc)
            events = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in doc) + b"data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(events)))
            self.end_headers()
            self.wfile.write(events)

    return Handler
