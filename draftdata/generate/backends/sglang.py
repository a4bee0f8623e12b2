"""The `sglang` backend: SGLang's native `POST /generate`, token ids in and out.

The chat template is applied locally, so `input_ids` are exactly the training prompt tokens. Field names are
SGLang's own:
- request: `GenerateReqInput` in python/sglang/srt/managers/io_struct.py (`rid`, `input_ids`, `sampling_params`
  with `max_new_tokens`, every sampling field and `sampling.extra`, `stream`);
- answer and stream chunks: `{text, output_ids, meta_info: {id, finish_reason: {type: stop|length|abort, ...},
  prompt_tokens, completion_tokens, ...}}`, streamed by `generate_request` in
  python/sglang/srt/entrypoints/http_server.py as `data: {json}` lines ending with `data: [DONE]`; an error inside
  a stream comes as `data: {"error": {"message": ...}}`;
- `POST /abort_request` takes `AbortReq` `{rid, abort_all}`; `GET /health` is 503 while the server starts;
  `GET /model_info` (older servers: `/get_model_info`) answers `{model_path, tokenizer_path, ...}`.

Streamed `output_ids` (and `text`) are CUMULATIVE by default, and only the new ones when the server runs with
`--incremental-streaming-output` (`OutputProcessor.handle_batch_output`,
python/sglang/srt/managers/tokenizer_manager_components/output_processor.py: `incremental =
incremental_streaming_output and is_stream`). `meta_info.completion_tokens` is the running total in both, so each
chunk says which form it is in (`is_increment`). Cumulative chunks make a long stream cost O(n²) to parse: prefer
`--incremental-streaming-output` on servers used with `on_budget: keep_partial`.
"""

from __future__ import annotations

import aiohttp

from draftdata.config.schema import sent
from draftdata.generate.backends.http import (
    ABORT_TIMEOUT_S,
    Body,
    EventStream,
    Failure,
    HttpBackend,
    Server,
    engine_error,
    finish_or_discard,
    response_shape,
    stream_cut,
)
from draftdata.generate.backends.protocol import GenRequest, GenResult
from draftdata.model.tokenizer import render_prompt_ids

SGLANG_ENDS = ("stop", "length", "abort")  # FINISH_MATCHED_TOKEN/_STR/_REGEX, FINISH_LENGTH, FINISH_ABORT


def finish_reason(value) -> str:
    """`meta_info.finish_reason` is `{"type": "stop"|"length"|"abort", ...}` (a bare string on some versions).
    Anything else (null in a plain answer, an unknown type) says nothing of how the answer ended: a `bad_response`,
    not retried, rather than a response stored as complete."""
    kind = value.get("type") if isinstance(value, dict) else value
    if kind in SGLANG_ENDS:
        return kind
    raise Failure("bad_response", f"finish_reason {value!r} does not say how the answer ended (stop, length, abort)")


def is_increment(have: int, chunk: int, total: int) -> bool:
    """A cumulative chunk carries all `total` ids so far; an incremental one the `total - have` new ones."""
    return have + chunk == total and chunk < total


class SGLangBackend(HttpBackend):
    name = "sglang"
    health_path = "/health"
    grace_s = 1.0  # after /abort_request the scheduler ends the stream within a step or two

    async def _served_models(self, url: str) -> list[str]:
        for path in ("/model_info", "/get_model_info"):
            status, info = await self._get_json(url + path)
            if status == 404:
                continue  # an older server: try the older name
            if status != 200:
                raise Failure(f"http_{status}", f"{path} answered {status}")
            with response_shape(path):
                return [str(info["model_path"])]
        raise Failure("http_404", "neither /model_info nor /get_model_info exists")

    async def _abort(self, server: Server, rid: str) -> None:
        async with self.session.post(
            server.url + "/abort_request", json={"rid": rid}, timeout=aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)
        ) as resp:
            await resp.read()

    def _body(self, req: GenRequest, rid: str) -> dict:
        if req.prompt_ids is None:
            kwargs = self.cfg.template_kwargs
            req.prompt_ids = render_prompt_ids(self.tokenizer, req.messages, req.tools, kwargs)
        done = req.partial.completion_tokens
        s = req.sampling
        # every field, neutral ones included (a server may fill an omitted one from the model's generation config);
        # SGLang's top_k=-1 is "off", like ours
        sampling = {"max_new_tokens": req.max_tokens - done, **sent(s), **s.get("extra", {})}
        seed = req.attempt_seed(done)
        if seed is not None:  # honoured by servers started with --enable-deterministic-inference
            sampling["sampling_seed"] = seed
        return {"rid": rid, "input_ids": self._input_ids(req), "sampling_params": sampling, "stream": req.stream}

    async def _attempt(self, server: Server, req: GenRequest, rid: str) -> GenResult:
        base = req.partial.completion_tokens
        async with self.post(server, "/generate", req, self._body(req, rid)) as resp:
            if req.stream:
                return await self._follow(server, req, EventStream(resp), base)
            return self._answer(req, await Body(resp).json(), base)

    def _answer(self, req: GenRequest, out, base: int) -> GenResult:
        if isinstance(out, dict) and "error" in out:
            raise engine_error(out)
        with response_shape("/generate answer"):
            meta = out["meta_info"]
            new = int(meta["completion_tokens"])
            # before the answer enters the partial: one that is no response is not parked, its tokens lost
            finish = finish_or_discard(req, finish_reason, meta["finish_reason"], new)
            self._take_answer(req, out["output_ids"], out.get("text") or "")
            return self._complete(req, base, new, finish, int(meta["prompt_tokens"]) - base, has_ids=True)

    async def _follow(self, server: Server, req: GenRequest, stream: EventStream, base: int) -> GenResult:
        """Read the stream into `req.partial` (after the `base` tokens it held when the attempt began)."""
        partial = req.partial
        base_ids, base_text = partial.output_ids[:base], partial.text if base else ""
        meta: dict | None = None
        async for event in stream.events():
            if "error" in event:
                raise engine_error(event)
            with response_shape("/generate stream chunk"):
                meta = event["meta_info"]
                chunk, total = event["output_ids"], meta["completion_tokens"]
                if is_increment(len(partial.output_ids) - base, len(chunk), total):
                    partial.output_ids.extend(chunk)
                    partial.text += event.get("text") or ""
                else:
                    partial.output_ids = base_ids + list(chunk)
                    partial.text = base_text + (event.get("text") or "")
                partial.completion_tokens = base + total
        if meta is None or meta.get("finish_reason") is None:
            raise stream_cut(server.url)
        with response_shape("/generate stream end"):
            new = int(meta["completion_tokens"])
            try:
                finish = finish_or_discard(req, finish_reason, meta["finish_reason"], new)
            except Failure:  # the streamed answer is no response: back to what the attempt started from
                partial.output_ids, partial.text, partial.completion_tokens = base_ids, base_text, base
                raise
            return self._complete(req, base, new, finish, int(meta["prompt_tokens"]) - base, has_ids=True)
