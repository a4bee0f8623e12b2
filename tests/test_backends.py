"""The HTTP backends against real servers on 127.0.0.1: a protocol-faithful fake SGLang (bench/fake_server.py, in a
thread) for the protocol, faults, retries and failover, and a real `transformers serve` process for the
OpenAI-compatible backend. The embedded backend's streaming runs the tiny model in-process.

`transformers serve` (transformers 5.x), as found here and exercised below: /v1/completions takes a text prompt only
(a token-id list is a 400 "prompt must be a string"), fields outside OpenAI's schema are a 422 (so no
`return_token_ids`, no `top_k`), no token ids come back, `stream_options` is accepted and ignored (usage always comes
in the last chunk), a stream ends without `data: [DONE]`, and only a streamed request stops when the client
disconnects. Hence `prompt_format: text|chat` and `return_token_ids: false` for it.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from conftest import ROOT, bare_target, free_port, target_for, transformers_serve

from bench.fake_server import EOS_ID, VLLM_ENGINE_DEAD, FakeServer, Fault, Faults, fake_output_ids, fake_text
from draftdata.config.schema import (
    BackendConfig,
    BackendKind,
    Config,
    DatasetConfig,
    ModelConfig,
    SamplingConfig,
)
from draftdata.errors import ConfigError, UserError
from draftdata.generate.backends.protocol import GenRequest, Partial
from draftdata.generate.request import key_sampling, request_key
from draftdata.generate.run.connect import make_backend
from draftdata.model.tokenizer import load_tokenizer, render_prompt_ids

pytestmark = pytest.mark.timeout(90)

IDS = [5, 6, 7]
SAMPLING = {"temperature": 0.7, "top_p": 1.0, "top_k": -1}
# what goes on the wire for SAMPLING: every sampling field, the neutral value for those it leaves out
SENT = dict(SAMPLING, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]


# ---- helpers ------------------------------------------------------------------------------------------------------- #


def run(coro, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def config(kind: BackendKind, urls: list[str], model_path: str = "models/tiny-llama", **backend) -> Config:
    opts = dict(
        kind=kind,
        urls=urls,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        probe_interval_s=0.1,
        request_timeout_s=10.0,
        startup_timeout_s=5.0,
    )
    opts.update(backend)
    return Config(
        model=ModelConfig(path=model_path),
        datasets={"d": DatasetConfig(concurrency=8)},
        dataset="d",
        backend=BackendConfig(**opts),
    )


def sglang(*urls: str, **backend) -> Config:
    return config(BackendKind.sglang, list(urls), **backend)


def request(rid: str = "r1", ids=IDS, max_tokens: int = 16, stream: bool = False, messages=MESSAGES) -> GenRequest:
    return GenRequest(
        rid, list(ids) if ids is not None else None, messages, None, max_tokens, dict(SAMPLING), stream=stream
    )


@asynccontextmanager
async def started(cfg: Config, target=None):
    """The configured backend, started, for `target` (as generate loads it: `target_for`; None: a client that knows
    no tokenizer)."""
    backend = make_backend(cfg, target or bare_target())
    await backend.start()
    try:
        yield backend
    finally:
        await backend.close()


async def generate(cfg: Config, req: GenRequest, target=None):
    async with started(cfg, target) as backend:
        return await backend.generate(req)


@pytest.fixture
def fake():
    servers: list[FakeServer] = []

    def make(**kw) -> FakeServer:
        servers.append(FakeServer(**kw).start())
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


# ---- sglang: protocol ---------------------------------------------------------------------------------------------- #


def test_sglang_sends_native_fields_and_round_trips_ids(fake):
    srv = fake(stop_after=5)
    stop, length = run(_two(sglang(srv.url)))
    first = srv.generate_calls[0]
    assert first.pop("rid").startswith("r1-")  # the logical id plus a per-attempt suffix
    assert first == {
        "input_ids": IDS,
        "stream": False,
        "sampling_params": {"max_new_tokens": 16, **SENT},
    }
    assert stop.ok and stop.finish_reason == "stop" and stop.server == srv.url
    assert stop.output_ids == fake_output_ids(IDS, 5) + [EOS_ID] and stop.text == fake_text(fake_output_ids(IDS, 5))
    assert (stop.prompt_tokens, stop.completion_tokens) == (3, 6)
    assert length.ok and length.finish_reason == "length" and length.output_ids == fake_output_ids(IDS, 4)


async def _two(cfg):
    async with started(cfg) as backend:
        return await backend.generate(request()), await backend.generate(request("r2", max_tokens=4))


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_sglang_stream_updates_the_partial_token_by_token(fake, incremental):
    srv = fake(token_delay_s=0.01, incremental=incremental)

    async def go():
        async with started(sglang(srv.url)) as backend:
            req = request(max_tokens=12, stream=True)
            task = asyncio.create_task(backend.generate(req))
            seen = []
            while not task.done():
                seen.append(list(req.partial.output_ids))
                await asyncio.sleep(0.002)
            return req, task.result(), seen

    req, res, seen = run(go())
    expected = fake_output_ids(IDS, 12)
    assert res.ok and res.output_ids == expected and res.text == fake_text(expected) and res.completion_tokens == 12
    assert all(s == expected[: len(s)] for s in seen)  # always a prefix of the answer ...
    assert len({len(s) for s in seen}) >= 6  # ... that grew while the stream ran
    assert (req.partial.output_ids, req.partial.text, req.partial.completion_tokens) == (expected, res.text, 12)


def test_streamed_answers_one_after_another_reuse_one_connection(fake):
    """A streamed answer's reader stops at `data: [DONE]`; what follows (the chunked body's end) is read before the
    connection is released, or aiohttp closes it and the next request opens another (here the body's end comes
    apart, later, as through a proxy)."""
    srv = fake(token_delay_s=0, tail_delay_s=0.05)

    async def go():
        async with started(sglang(srv.url)) as backend:
            return [await backend.generate(request(f"r{i}", max_tokens=6, stream=True)) for i in range(5)]

    assert all(r.ok and r.completion_tokens == 6 for r in run(go()))
    assert len(srv.log) == 5 and len({a.peer for a in srv.log}) == 1 and srv.log[0].peer


def test_stream_lines_longer_than_aiohttp_readline_accepts(fake):
    """SGLang's cumulative chunks of a long answer are longer than aiohttp's readline accepts (512 KiB)."""
    srv = fake(token_delay_s=0, stream_interval=40000)
    res = run(generate(sglang(srv.url), request(max_tokens=80000, stream=True)))
    assert res.ok, res.detail
    assert res.output_ids == fake_output_ids(IDS, 80000)
    assert len(json.dumps({"text": res.text, "output_ids": res.output_ids})) > 512 * 1024  # the last line's size


def test_a_stream_line_is_one_json_object_or_a_bad_response():
    """The SSE line parser (the client's main cost per token) stays as strict as json.loads: one object and nothing
    after it, in UTF-8."""
    from draftdata.generate.backends.http import _DONE, Failure, _sse_data

    assert _sse_data(b'data: {"choices": [{"text": " \xc3\xa9"}]}\r') == {"choices": [{"text": " \u00e9"}]}
    assert _sse_data(b"data: [DONE]") is _DONE
    assert _sse_data(b"") is None and _sse_data(b": keep-alive") is None
    for bad in (b'data: {"a": 1} {"b": 2}', b'data: {"a": 1}x', b'data: {"a": "\xff"}', b"data: [1]", b"data: {"):
        with pytest.raises(Failure) as e:
            _sse_data(bad)
        assert e.value.code == "bad_response", bad


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_cancel_aborts_on_the_server_and_keeps_the_partial(fake, stream):
    """A cancelled request is aborted on the server, whose answer (the abort's last chunk, or the plain answer)
    brings every token it produced into the partial: nothing generated is lost, streamed or not."""
    srv = fake(token_delay_s=0.01)

    async def go():
        async with started(sglang(srv.url)) as backend:
            req = request(max_tokens=1000, stream=stream)
            task = asyncio.create_task(backend.generate(req))
            await until(lambda: req.partial.completion_tokens >= 5 if stream else len(srv.generate_calls) == 1)
            await asyncio.sleep(0 if stream else 0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            rid = srv.generate_calls[0]["rid"]
            assert srv.aborts == [rid]  # told before generate() re-raised, once
            assert srv.finished[rid] == "abort"  # and the server ended it
            return req

    req = run(go())
    n = len(req.partial.output_ids)
    assert 5 <= n < 1000 and req.partial.output_ids == fake_output_ids(IDS, n) and req.partial.completion_tokens == n
    assert req.partial.text == fake_text(req.partial.output_ids)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_response_finished_during_the_cancel_is_returned(fake, stream):
    """The server finished while the cancel was on its way (the answer sits unread in the socket): the task ends
    with the complete response instead of a cancellation, so the caller commits it."""
    srv = fake(token_delay_s=0.001)

    async def go():
        async with started(sglang(srv.url)) as backend:
            req = request(max_tokens=40, stream=stream)
            task = asyncio.create_task(backend.generate(req))
            await until(lambda: len(srv.generate_calls) == 1)
            deadline = time.monotonic() + 5
            while not srv.finished and time.monotonic() < deadline:
                time.sleep(0.01)  # blocks this event loop: the answer arrives but is not read
            task.cancel()
            return await task

    res = run(go())
    assert res.ok and res.finish_reason == "length" and res.output_ids == fake_output_ids(IDS, 40)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_abort_by_the_server_is_retried_from_its_partial(fake, stream):
    """An operator's abort (or a server restart's abort_all) is never a response: the next attempt continues from
    the tokens the aborted one produced, so the answer is as long as one that was never interrupted."""
    srv = fake(token_delay_s=0.01)

    async def go():
        async with started(sglang(srv.url)) as backend:
            req = request(max_tokens=60, stream=stream)
            task = asyncio.create_task(backend.generate(req))
            await until(lambda: len(srv.generate_calls) == 1)
            await asyncio.sleep(0.1)
            async with aiohttp.ClientSession() as s:  # someone else aborts everything
                async with s.post(srv.url + "/abort_request", json={"abort_all": True}) as resp:
                    assert resp.status == 200
            return req, await task

    req, res = run(go())
    first, second = srv.generate_calls
    assert srv.finished[first["rid"]] == "abort" and req.attempt_errors == ["aborted"]
    n = len(second["input_ids"]) - len(IDS)  # what the aborted attempt had produced
    assert 0 < n < 60 and second["input_ids"] == IDS + fake_output_ids(IDS, n)
    assert second["sampling_params"]["max_new_tokens"] == 60 - n
    assert res.ok and res.finish_reason == "length" and res.continued_from == n and res.completion_tokens == 60
    assert res.output_ids == fake_output_ids(IDS, n) + fake_output_ids(IDS + fake_output_ids(IDS, n), 60 - n)
    assert res.prompt_tokens == len(IDS)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_a_parked_partial_is_continued(fake, stream):
    """A request that starts with a partial answer (parked by an earlier run) sends prompt + partial ids with the
    rest of max_tokens, and returns the whole response."""
    srv = fake()
    parked = fake_output_ids([9, 9], 7)
    req = request(max_tokens=20, stream=stream)
    req.partial = Partial(list(parked), "parked text", len(parked))
    res = run(generate(sglang(srv.url), req))
    body = srv.generate_calls[0]
    assert body["input_ids"] == IDS + parked and body["sampling_params"]["max_new_tokens"] == 13
    assert res.ok and res.completion_tokens == 20 and res.continued_from == 7
    assert res.output_ids == parked + fake_output_ids(IDS + parked, 13)
    assert res.text.startswith("parked text") and res.prompt_tokens == len(IDS)


def test_seed_goes_with_every_attempt(fake):
    """The sampling seed is derived from the request and where an attempt resumes: SGLang's sampling_seed."""
    srv = fake()
    srv.faults = Faults(status=503, status_times=1)
    req = request()
    req.seed = 1234
    assert run(generate(sglang(srv.url), req)).ok
    assert [c["sampling_params"]["sampling_seed"] for c in srv.generate_calls] == [1234, 1234]
    req = request(max_tokens=10)
    req.seed, req.partial = 1234, Partial([5, 6, 7], "", 3)
    assert run(generate(sglang(srv.url), req)).ok
    assert srv.generate_calls[-1]["sampling_params"]["sampling_seed"] == 1237


def test_an_answer_without_tokens_is_retried(fake):
    srv = fake()
    srv.faults = Faults(empty_times=1)
    req = request()
    res = run(generate(sglang(srv.url), req))
    assert res.ok and res.completion_tokens == 16 and req.attempt_errors == ["empty"]
    srv.faults = Faults(empty_times=100)
    res = run(generate(sglang(srv.url, max_retries=1), request()))
    assert res.error == "retries_exhausted" and res.detail.startswith("empty")


# ---- sglang: faults and retries ------------------------------------------------------------------------------------ #


@pytest.mark.parametrize(
    "faults, attempts",
    [
        (Faults(status=500, status_times=2), 3),
        (Faults(status=503, status_times=1), 2),
        (Faults(status=408, status_times=1), 2),
        (Faults(status=429, status_times=1), 2),
        (Faults(reset_times=2), 3),
        (Faults(hang_times=1), 2),
    ],
    ids=["500x2", "503", "408", "429", "reset", "hang"],
)
def test_retryable_faults_are_retried_then_succeed(fake, faults, attempts):
    srv = fake()
    srv.faults = faults
    hang = faults.hang_times > 0
    res = run(generate(sglang(srv.url, request_timeout_s=0.5 if hang else 10.0), request()))
    assert res.ok, res.detail
    assert res.output_ids == fake_output_ids(IDS, 16)
    rids = [c["rid"] for c in srv.generate_calls]
    assert len(rids) == attempts and len(set(rids)) == attempts  # every attempt has its own rid
    if hang:
        assert srv.aborts == [rids[0]]  # the attempt that timed out was stopped on the server


@pytest.mark.parametrize(
    "faults, code",
    [
        (Faults(status=400, status_times=1), "http_400"),
        (Faults(status=404, status_times=1), "http_404"),
        (Faults(malformed_times=1), "bad_response"),
    ],
    ids=["400", "404", "malformed"],
)
def test_other_failures_are_not_retried(fake, faults, code):
    srv = fake()
    srv.faults = faults
    res = run(generate(sglang(srv.url), request()))
    assert res.error == code and len(srv.generate_calls) == 1 and res.detail


def test_engine_error_inside_a_stream(fake):
    srv = fake()
    srv.faults = Faults(stream_error_times=1)
    res = run(generate(sglang(srv.url), request(stream=True)))
    assert res.error == "engine_error" and "injected engine failure" in res.detail
    assert len(srv.generate_calls) == 1


def test_a_dead_engine_leaves_the_rotation_with_what_to_do(fake):
    """vLLM's engine died (its CPU build's seeded chunked-prefill crash, say): every answer is its 500, /health says
    503. One line says so, and what to do, instead of a bare 500."""
    srv = fake(openai_flavour="vllm")
    srv.engine_dead = True
    cfg = config(BackendKind.openai, [srv.url], return_token_ids=True, max_retries=1)

    async def go():
        async with started(cfg) as backend:
            srv.engine_dead = True  # after start(): dead while serving
            return await backend.generate(request(stream=True))

    srv.engine_dead = False
    res = run(go())
    assert res.error == "retries_exhausted" and res.detail.startswith("engine_dead: EngineCore encountered an issue")
    assert "--max-num-batched-tokens" in res.detail and "restart it" in res.detail and "\n" not in res.detail


def test_an_engine_that_dies_mid_stream_is_retried_once_it_serves_again(fake):
    srv = fake(openai_flavour="vllm")
    srv.faults = Faults(stream_error_times=1, stream_error_message=VLLM_ENGINE_DEAD)
    req = request(stream=True)
    res = run(generate(config(BackendKind.openai, [srv.url], return_token_ids=True), req))
    assert res.ok and req.attempt_errors == ["engine_dead"] and len(srv.generate_calls) == 2


def test_retries_exhausted_names_the_last_cause(fake):
    srv = fake()
    srv.faults = Faults(status=503, status_times=100)
    res = run(generate(sglang(srv.url, max_retries=2), request()))
    assert res.error == "retries_exhausted" and res.detail.startswith("http_503") and len(srv.generate_calls) == 3
    res = run(generate(sglang(srv.url, max_retries=0), request()))
    assert res.error == "http_503" and len(srv.generate_calls) == 4  # no retries: the cause itself


def test_retry_after_is_honoured(fake):
    srv = fake()
    srv.faults = Faults(status=429, status_times=1, retry_after="1")
    res = run(generate(sglang(srv.url), request()))  # backoff alone would wait at most 0.05 s
    assert res.ok
    assert srv.generate_times[1] - srv.generate_times[0] >= 1.0


# ---- sglang: several servers --------------------------------------------------------------------------------------- #


def test_dead_server_is_taken_out_and_probed_back(fake):
    a, b = fake(), fake()

    async def go():
        async with started(sglang(a.url, b.url)) as backend:
            b.stop()  # dies after start-up
            first = await asyncio.gather(*(backend.generate(request(f"r{i}", ids=[i, 1])) for i in range(8)))
            server_b = backend.pool.servers[1]
            assert not server_b.alive
            probes = b.health_calls
            b.start()  # back, on the same port
            await until(lambda: server_b.alive)
            assert b.health_calls > probes  # re-probed in the background
            second = await asyncio.gather(*(backend.generate(request(f"s{i}", ids=[i, 2])) for i in range(8)))
            return first, second

    first, second = run(go())
    assert all(r.ok and r.server == a.url for r in first)
    assert all(r.ok for r in second) and {r.server for r in second} == {a.url, b.url}


def test_request_in_flight_on_a_dead_server_is_retried_elsewhere(fake):
    b, a = fake(), fake(token_delay_s=0.02)
    b.faults = Faults(hang_times=1)

    async def go():
        async with started(sglang(b.url, a.url, request_timeout_s=30.0)) as backend:
            hung = asyncio.create_task(backend.generate(request("hung")))  # b is first in line: it hangs there
            await until(lambda: len(b.generate_calls) == 1)
            b.faults.reset_times = 1
            other = asyncio.create_task(backend.generate(request("other")))  # fewer in flight: to a
            reset = asyncio.create_task(backend.generate(request("reset")))  # a tie: to b, which drops it
            t0 = time.monotonic()
            results = await asyncio.gather(hung, other, reset)
            return results, time.monotonic() - t0

    results, elapsed = run(go())
    assert all(r.ok and r.server == a.url for r in results), [(r.rid, r.server, r.detail) for r in results]
    assert elapsed < 5  # "hung" moved when b was marked dead, long before its 30 s timeout
    assert [c["rid"].rsplit("-", 1)[0] for c in b.generate_calls] == ["hung", "reset"]


# ---- sglang: start-up checks --------------------------------------------------------------------------------------- #


def test_wrong_model_stops_before_any_request(fake):
    srv = fake(model_path="/models/Other-Model-7B")
    with pytest.raises(UserError) as err:
        run(generate(sglang(srv.url), request()))
    message = str(err.value)
    assert srv.url in message and "Other-Model-7B" in message and "tiny-llama" in message and "\n" not in message
    assert srv.generate_calls == []


def test_model_is_matched_by_basename_or_served_name(fake):
    old = fake(model_path="/data/ckpt/tiny-llama", has_model_info=False)  # an older server: /get_model_info only
    named = fake(model_path="org/custom-name")
    assert run(generate(sglang(old.url), request())).ok
    assert run(generate(sglang(named.url, served_model_name="custom-name"), request())).ok


def test_start_waits_for_a_server_that_is_loading(fake):
    srv = fake(starting_s=1.2)
    t0 = time.monotonic()
    assert run(generate(sglang(srv.url), request())).ok
    assert time.monotonic() - t0 >= 1.2


def test_start_fails_clearly_when_no_server_is_healthy(fake):
    srv = fake(starting_s=60)
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UserError) as err:
        run(generate(sglang(srv.url, nobody, startup_timeout_s=0.5), request()))
    message = str(err.value)
    assert "no healthy server" in message and "\n" not in message
    assert f"{srv.url}: /health answered 503 (still starting" in message
    assert f"{nobody}: unreachable" in message


def test_unhealthy_server_at_start_joins_later(fake):
    a, b = fake(), fake(starting_s=60)

    async def go():
        async with started(sglang(a.url, b.url, startup_timeout_s=0.3)) as backend:
            assert [s.alive for s in backend.pool.servers] == [True, False]
            b.starting_s = 0
            await until(lambda: backend.pool.servers[1].alive)

    run(go())


# ---- openai: token ids, against the fake's OpenAI-compatible API --------------------------------------------------- #


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_sends_the_token_id_prompt_and_reads_token_ids(fake, stream):
    srv = fake(stop_after=5)
    req = request(max_tokens=16, stream=stream)
    res = run(generate(config(BackendKind.openai, [srv.url], return_token_ids=True), req))
    body = srv.generate_calls[0]
    assert body["prompt"] == IDS and body["model"] == "models/tiny-llama" and body["max_tokens"] == 16
    assert body["return_token_ids"] is True and {k: body[k] for k in SENT} == SENT  # every field, neutral ones too
    assert body.get("stream_options") == ({"include_usage": True} if stream else None)
    expected = fake_output_ids(IDS, 5) + [EOS_ID]
    assert res.ok and res.output_ids == expected and res.prompt_ids == IDS and res.finish_reason == "stop"
    assert (res.prompt_tokens, res.completion_tokens) == (3, 6) and res.text == fake_text(expected[:-1])
    if stream:
        assert (req.partial.output_ids, req.partial.completion_tokens) == (expected, 6)


def test_openai_retries_and_cancel_closes_the_connection(fake):
    srv = fake(token_delay_s=0.01)
    srv.faults = Faults(status=503, status_times=1, reset_times=1)
    cfg = config(BackendKind.openai, [srv.url], return_token_ids=True)

    async def go():
        async with started(cfg) as backend:
            assert (await backend.generate(request(max_tokens=4))).ok
            assert len(srv.generate_calls) == 3
            req = request("r2", max_tokens=1000, stream=True)
            task = asyncio.create_task(backend.generate(req))
            await until(lambda: req.partial.completion_tokens >= 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: srv.disconnects == ["cmpl-4"])
            return req

    req = run(go())
    assert srv.aborts == []  # no /abort_request: closing the connection is the abort
    n = len(req.partial.output_ids)
    assert 5 <= n < 1000 and req.partial.output_ids == fake_output_ids(IDS, n)


# ---- embedded: streaming ------------------------------------------------------------------------------------------- #


def test_embedded_streams_the_partial_and_keeps_it_on_cancel(endless_model):
    cfg = Config(model=ModelConfig(path=str(endless_model)), datasets={"d": DatasetConfig()}, dataset="d")
    tok = load_tokenizer(cfg.model)
    ids = render_prompt_ids(tok, MESSAGES, None, {})

    async def go():
        async with started(cfg, target_for(cfg, tok)) as backend:
            done = request(ids=ids, max_tokens=24, stream=True)
            res = await backend.generate(done)
            cut = request("r2", ids=ids, max_tokens=2000, stream=True)
            task = asyncio.create_task(backend.generate(cut))
            await until(lambda: cut.partial.completion_tokens >= 5, timeout=30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return done, res, cut

    done, res, cut = run(go(), timeout=60)
    assert res.ok and res.completion_tokens == 24 and res.finish_reason == "length"
    assert (done.partial.output_ids, done.partial.text) == (res.output_ids, res.text)
    n = cut.partial.completion_tokens
    assert 5 <= n < 2000 and len(cut.partial.output_ids) == n
    assert cut.partial.text == tok.decode(cut.partial.output_ids, skip_special_tokens=True)


def test_embedded_partial_ends_as_the_response_when_its_last_token_splits_a_character(endless_model):
    """The stream holds back a character until its last byte comes; an answer whose last token ends inside one must
    still leave the partial equal to the response (it once kept the text without the held-back character). Seeded
    sampling draws each position alike whatever max_tokens is, so a long answer shows where to cut."""
    cfg = Config(model=ModelConfig(path=str(endless_model)), datasets={"d": DatasetConfig()}, dataset="d")
    tok = load_tokenizer(cfg.model)
    ids = render_prompt_ids(tok, MESSAGES, None, {})

    def splits(prefix: list[int]) -> bool:  # a stream decoding these ids ends holding part of a character back
        return tok.decode(prefix, skip_special_tokens=True).endswith("\ufffd")

    async def answer(max_tokens: int, seed: int):
        req = request(ids=ids, max_tokens=max_tokens, stream=True)
        req.seed = seed
        async with started(cfg, target_for(cfg, tok)) as backend:
            return req, await backend.generate(req)

    cut_at = None
    for seed in range(20):
        _, long = run(answer(256, seed), timeout=60)
        cut_at = next((k for k in range(1, len(long.output_ids) + 1) if splits(long.output_ids[:k])), None)
        if cut_at is not None:
            break
    assert cut_at is not None, "no answer of 20 seeds ends a token inside a character"
    req, res = run(answer(cut_at, seed), timeout=60)
    assert res.output_ids == long.output_ids[:cut_at] and res.text.endswith("\ufffd")
    assert (req.partial.output_ids, req.partial.text) == (res.output_ids, res.text)


def test_embedded_stops_on_every_end_of_turn_of_the_generation_config(endless_model, tmp_path):
    """A target whose generation config lists several end-of-turn ids (Llama 3.1: <|eot_id|> and <|eom_id|>) must
    stop on each, and call it a stop: the same request, with the token it first produced made an end of turn."""
    import json
    import shutil

    def first_answer(model: Path):
        cfg = Config(model=ModelConfig(path=str(model)), datasets={"d": DatasetConfig()}, dataset="d")
        tok = load_tokenizer(cfg.model)

        async def go():
            async with started(cfg, target_for(cfg, tok)) as backend:
                req = request(ids=render_prompt_ids(tok, MESSAGES, None, {}), max_tokens=8)
                req.seed = 7
                return await backend.generate(req)

        return run(go(), timeout=60), tok

    plain, tok = first_answer(endless_model)
    assert plain.ok and plain.finish_reason == "length" and len(plain.output_ids) == 8
    first = plain.output_ids[0]
    assert first != tok.eos_token_id
    model = tmp_path / endless_model.name
    shutil.copytree(endless_model, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, first]}))
    ended, _ = first_answer(model)
    assert ended.ok and ended.output_ids == [first] and ended.finish_reason == "stop"


def test_embedded_goes_on_past_gpt_oss_end_of_message(harmony_model):
    """gpt-oss's <|end|> closes its reasoning, not its turn: a target whose every greedy token is <|end|> is not
    stopped by it; it runs to max_tokens, as a server stopping on <|return|> and <|call|> would let it."""
    sampling = SamplingConfig(temperature=0.0)
    cfg = Config(
        model=ModelConfig(path=str(harmony_model)), datasets={"d": DatasetConfig(sampling=sampling)}, dataset="d"
    )
    tok = load_tokenizer(cfg.model)
    end, ret, call = tok.convert_tokens_to_ids(["<|end|>", "<|return|>", "<|call|>"])

    async def go():
        async with started(cfg, target_for(cfg, tok)) as backend:
            res = await backend.generate(request(ids=render_prompt_ids(tok, MESSAGES, None, {}), max_tokens=6))
            return backend.stop_ids, res

    stop_ids, res = run(go(), timeout=60)
    assert stop_ids == {ret, call}
    assert res.ok and res.output_ids == [end] * 6 and res.finish_reason == "length"


# ---- openai: a real `transformers serve` --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def serve(endless_model, tmp_path_factory):
    """`transformers serve` on a free port, pinned to the endless tiny model (sequential generation, CPU)."""
    with transformers_serve(endless_model, tmp_path_factory.mktemp("serve") / "serve.log") as url:
        yield url


def openai(url: str, model: Path, **backend) -> Config:
    backend.setdefault("openai_fields_only", True)  # it refuses top_k, min_p and repetition_penalty (422)
    return config(BackendKind.openai, [url], model_path=str(model), **backend)


@pytest.mark.parametrize("prompt_format", ["text", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_transformers_serve_completions_and_chat(serve, endless_model, prompt_format, stream):
    tok = load_tokenizer(ModelConfig(path=str(endless_model)))
    ids = render_prompt_ids(tok, MESSAGES, None, {})
    req = request(ids=ids, max_tokens=8, stream=stream)
    cfg = openai(serve, endless_model, prompt_format=prompt_format)
    res = run(generate(cfg, req, target_for(cfg, tok)))
    assert res.ok, res.detail
    assert res.finish_reason == "length" and res.completion_tokens == 8 and res.text
    assert res.output_ids is None  # transformers serve returns text only
    # the decoded ChatML prompt re-tokenizes to our ids, and the server's template renders like ours
    assert res.prompt_tokens == len(ids) and "prompt_tokens_drift" not in res.extra
    if stream:
        assert req.partial.text == res.text and 1 <= req.partial.completion_tokens <= 8


def test_transformers_serve_limits_are_reported_not_retried(serve, endless_model):
    ids_prompt = run(generate(openai(serve, endless_model, prompt_format="ids"), request()))
    assert ids_prompt.error == "http_400" and "prompt must be a string" in ids_prompt.detail
    tok = load_tokenizer(ModelConfig(path=str(endless_model)))
    cfg = openai(serve, endless_model, prompt_format="chat", return_token_ids=True)
    token_ids = run(generate(cfg, request(), target_for(cfg, tok)))
    assert token_ids.error == "http_422" and "return_token_ids" in token_ids.detail


def test_transformers_serve_wrong_model_stops_at_start(serve, endless_model):
    with pytest.raises(UserError) as err:
        run(generate(openai(serve, endless_model, served_model_name="someone-else"), request()))
    assert serve in str(err.value) and "someone-else" in str(err.value)


def test_transformers_serve_disconnect_stops_generation(serve, endless_model):
    """Cancelling closes the connection; the server stops generating (its next request is not queued behind the
    cancelled one: generation is sequential there) and the partial text is kept."""
    tok = load_tokenizer(ModelConfig(path=str(endless_model)))
    ids = render_prompt_ids(tok, MESSAGES, None, {})
    cfg = openai(serve, endless_model, prompt_format="text", request_timeout_s=60.0)

    async def go():
        async with started(cfg, target_for(cfg, tok)) as backend:
            long = request("long", ids=ids, max_tokens=4000, stream=True)
            task = asyncio.create_task(backend.generate(long))
            await until(lambda: long.partial.completion_tokens >= 1, timeout=20)
            t0, n0 = time.monotonic(), long.partial.completion_tokens
            await until(lambda: long.partial.completion_tokens >= n0 + 20, timeout=20)
            rate = (long.partial.completion_tokens - n0) / (time.monotonic() - t0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            t1 = time.monotonic()
            short = await backend.generate(request("short", ids=ids, max_tokens=4))
            return long, short, time.monotonic() - t1, (4000 - long.partial.completion_tokens) / rate

    long, short, latency, remaining = run(go(), timeout=80)
    assert long.partial.text and long.partial.completion_tokens >= 21
    assert short.ok and short.completion_tokens == 4
    assert latency < remaining / 2, f"next request took {latency:.1f}s; the cancelled one had {remaining:.1f}s left"


# ---- stopping by signal (GenRequest.stop) -------------------------------------------------------------------------- #
# The caller signals a request to stop: the backend aborts on the server once (SGLang) or closes the connection
# (OpenAI-style), reads on for its grace and RETURNS the complete answer or a stopped result with the partial. No
# CancelledError is involved, so the caller's task is not left cancelling: an asyncio.timeout around the call, or
# after it, works as it should.


async def not_left_cancelling() -> None:
    """The current task carries no cancellation request: the next asyncio.timeout fires as a TimeoutError."""
    assert asyncio.current_task().cancelling() == 0
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await asyncio.sleep(1)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_sglang_stop_aborts_once_and_returns_the_partial_inside_a_timeout(fake, stream):
    srv = fake(token_delay_s=0.01)

    async def go():
        async with started(sglang(srv.url)) as backend:
            req = request(max_tokens=1000, stream=stream)
            if stream:
                waiter = asyncio.create_task(until(lambda: req.partial.completion_tokens >= 5))
                waiter.add_done_callback(lambda _: req.stop("budget_cut"))
            else:
                asyncio.get_running_loop().call_later(0.1, req.stop, "budget_cut")
            async with asyncio.timeout(20):  # it must fire only at its deadline, never because of the stop
                res = await backend.generate(req)
            await not_left_cancelling()
            return req, res

    req, res = run(go())
    rid = srv.generate_calls[0]["rid"]
    assert srv.aborts == [rid] and srv.finished[rid] == "abort"  # told once, and the server ended it
    assert res.stopped and not res.ok and res.error is None and res.server == srv.url
    n = res.completion_tokens
    assert 5 <= n < 1000 and res.output_ids == fake_output_ids(IDS, n) == req.partial.output_ids
    assert res.text == fake_text(res.output_ids) and req.attempt_errors == []  # the abort's answer is no failure


def test_openai_stop_closes_the_connection_and_sends_no_abort(fake):
    srv = fake(token_delay_s=0.01)

    async def go():
        async with started(config(BackendKind.openai, [srv.url], return_token_ids=True)) as backend:
            req = request(max_tokens=1000, stream=True)
            task = asyncio.create_task(backend.generate(req))
            await until(lambda: req.partial.completion_tokens >= 5)
            req.stop("budget_cut")
            res = await task
            await until(lambda: len(srv.disconnects) == 1)
            return res

    res = run(go())
    assert srv.aborts == [] and res.stopped and res.completion_tokens >= 5
    assert res.output_ids == fake_output_ids(IDS, res.completion_tokens)


def block_until_finished(srv) -> None:
    """Block the event loop until the server has finished the answer: it sits unread in the socket."""
    deadline = time.monotonic() + 5
    while not srv.finished and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("how", ["stop", "cancel"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_an_answer_finished_before_the_stop_took_effect_is_returned(fake, stream, how):
    """The stop (or a caller's cancel, taken as one) finds the finished answer and returns it; a cancel is then
    withdrawn, so the caller's task is not left cancelling."""
    srv = fake(token_delay_s=0.001)

    async def go():
        async with started(sglang(srv.url)) as backend:
            req = request(max_tokens=40, stream=stream)

            async def caller():
                res = await backend.generate(req)
                await not_left_cancelling()
                return res

            task = asyncio.create_task(caller())
            await until(lambda: len(srv.generate_calls) == 1)
            block_until_finished(srv)
            if how == "stop":
                req.stop("budget_cut")
            else:
                task.cancel()
            return await task

    res = run(go())
    assert res.ok and not res.stopped and res.output_ids == fake_output_ids(IDS, 40)


def test_a_request_stopped_before_it_is_sent_sends_nothing(fake):
    srv = fake()
    req = request()
    req.partial = Partial([1, 2], "ab", 2)
    req.stop("interrupted")
    res = run(generate(sglang(srv.url), req))
    assert res.stopped and srv.generate_calls == [] and (res.output_ids, res.completion_tokens) == ([1, 2], 2)


def test_a_stop_ends_the_wait_before_a_retry(fake):
    srv = fake()
    srv.faults = Faults(status=503, status_times=1, retry_after="8")  # the retry would wait 8 s

    async def go():
        async with started(sglang(srv.url)) as backend:
            req = request()
            asyncio.get_running_loop().call_later(0.3, req.stop, "budget_cut")
            t0 = time.monotonic()
            res = await backend.generate(req)
            return req, res, time.monotonic() - t0

    req, res, elapsed = run(go())
    assert res.stopped and elapsed < 3 and len(srv.generate_calls) == 1 and req.attempt_errors == ["http_503"]


def test_embedded_stop_cancels_in_the_manager_and_returns_the_streamed_partial(endless_model):
    cfg = Config(model=ModelConfig(path=str(endless_model)), datasets={"d": DatasetConfig()}, dataset="d")
    tok = load_tokenizer(cfg.model)

    async def go():
        async with started(cfg, target_for(cfg, tok)) as backend:
            req = request(ids=render_prompt_ids(tok, MESSAGES, None, {}), max_tokens=2000, stream=True)
            task = asyncio.create_task(backend.generate(req))
            await until(lambda: req.partial.completion_tokens >= 5, timeout=30)
            async with asyncio.timeout(30):
                req.stop("budget_cut")
                res = await task
            await not_left_cancelling()
            return req, res

    req, res = run(go(), timeout=60)
    assert res.stopped and 5 <= res.completion_tokens < 2000
    assert res.output_ids == req.partial.output_ids and len(res.output_ids) == res.completion_tokens
    assert res.text == tok.decode(res.output_ids, skip_special_tokens=True)


# ---- finish reasons that do not say the model ended its turn ----------------------------------------------------- #


@pytest.mark.parametrize(
    "kind, reason, code, stream",
    [
        ("openai", "content_filter", "content_filter", False),
        ("openai", "content_filter", "content_filter", True),
        ("openai", None, "bad_response", False),  # a stream without one is cut: see the next test
        ("openai", "gremlins", "bad_response", False),
        ("openai", "gremlins", "bad_response", True),
        ("sglang", None, "bad_response", False),
        ("sglang", "gremlins", "bad_response", False),
        ("sglang", "gremlins", "bad_response", True),
    ],
    ids=[
        "openai-content_filter-plain",
        "openai-content_filter-stream",
        "openai-null-plain",
        "openai-unknown-plain",
        "openai-unknown-stream",
        "sglang-null-plain",
        "sglang-unknown-plain",
        "sglang-unknown-stream",
    ],
)
def test_answer_that_did_not_end_its_turn_fails_unretried(fake, kind, reason, code, stream):
    """A filtered answer, or one whose finish reason is missing or outside the protocol, is no response: a failure
    that is not retried (the same prompt meets the same filter), its tokens thrown away, so that nothing of it is
    parked or stored."""
    srv = fake(stop_after=5, every=Fault("finish", reason=reason))
    req = request(max_tokens=16, stream=stream)
    extra = {"return_token_ids": True} if kind == "openai" else {}
    res = run(generate(config(BackendKind(kind), [srv.url], **extra), req))
    assert [a.finish for a in srv.log] == [reason] and [a.outcome for a in srv.log] == ["finish"]
    assert not res.ok and res.error == code and res.detail and req.attempt_errors == [code]
    assert len(srv.generate_calls) == 1  # not retried
    # nothing left in the partial for the caller to park or store, and the answer's tokens counted as thrown away
    assert (req.partial.output_ids, req.partial.text, req.partial.completion_tokens) == ([], "", 0)
    assert req.discarded_tokens == 6


@pytest.mark.parametrize("kind", ["openai", "sglang"])
def test_stream_without_a_finish_reason_is_a_cut_stream_retried(fake, kind):
    srv = fake(stop_after=5, every=Fault("finish", reason=None))
    extra = {"return_token_ids": True} if kind == "openai" else {}
    cfg = config(BackendKind(kind), [srv.url], max_retries=2, **extra)
    res = run(generate(cfg, request(stream=True)))
    assert res.error == "retries_exhausted" and res.detail.startswith("connection") and len(srv.generate_calls) == 3


# ---- sampling: what the store key says is what the server samples with ------------------------------------------- #

# Qwen3's generation_config.json plus a repetition penalty: vLLM (`--generation-config auto`) and SGLang fill an
# omitted sampling field from it
QWEN3_LIKE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
SAMPLED_LIKE = [("sglang", "ids"), ("openai", "ids"), ("openai", "chat")]


def _sampling_config(kind: str, fmt: str, url: str, sampling: SamplingConfig, **backend) -> Config:
    if kind == "openai":
        backend.update(prompt_format=fmt, return_token_ids=True)
    cfg = config(BackendKind(kind), [url], **backend)
    cfg.ds.sampling = sampling
    return cfg


@pytest.mark.parametrize("kind,fmt", SAMPLED_LIKE, ids=["sglang", "openai-completions", "openai-chat"])
@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(temperature=0.7), SamplingConfig(temperature=0.9, top_k=5, min_p=0.1, repetition_penalty=1.05)],
    ids=["defaults", "set"],
)
def test_request_leaves_no_sampling_field_to_the_servers_generation_config(fake, kind, fmt, sampling):
    """The fake fills what a request leaves out from the model's generation_config, as vLLM and SGLang do: the
    sampling it runs with must be exactly what the store key says, neutral values included."""
    srv = fake(stop_after=3, generation_config=QWEN3_LIKE)
    key = key_sampling(sampling)
    req = GenRequest("r1", list(IDS), MESSAGES, None, 8, dict(key))
    res = run(generate(_sampling_config(kind, fmt, srv.url, sampling), req))
    assert res.ok, res.detail
    said = dict(temperature=0.7, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0)
    said = dict(said, frequency_penalty=0.0, **key)
    assert srv.log[0].sampling == said


@pytest.mark.parametrize("kind,fmt", SAMPLED_LIKE[:2], ids=["sglang", "openai"])
def test_sampling_extra_is_sent_where_the_protocol_takes_it(fake, kind, fmt):
    name = "min_new_tokens" if kind == "sglang" else "min_tokens"  # SGLang's and vLLM's names
    sampling = SamplingConfig(extra={name: 2})
    srv = fake(stop_after=3)
    req = GenRequest("r1", list(IDS), MESSAGES, None, 8, key_sampling(sampling))
    assert run(generate(_sampling_config(kind, fmt, srv.url, sampling), req)).ok
    body = srv.generate_calls[0]
    assert (body["sampling_params"] if kind == "sglang" else body)[name] == 2


def test_a_datasets_template_kwargs_win_over_the_models_in_what_is_sent(fake, tiny_model):
    """Chat format: the server's template is asked for the merged kwargs, the dataset's keys winning. sglang: a
    request without ids is rendered here under the same kwargs (a thinking template: "off" writes an empty block)."""
    srv = fake(stop_after=3)
    chat = config(BackendKind.openai, [srv.url], prompt_format="chat")
    chat.model.template_kwargs = {"enable_thinking": True, "tools_in_user_message": False}
    chat.ds.template_kwargs = {"enable_thinking": False}
    assert run(generate(chat, request(ids=None))).ok
    assert srv.generate_calls[0]["chat_template_kwargs"] == {"enable_thinking": False, "tools_in_user_message": False}

    model = ModelConfig(path=str(tiny_model), chat_template=str(ROOT / "conf" / "templates" / "qwen3_thinking.jinja"))
    tok = load_tokenizer(model)
    native = sglang(srv.url)
    native.model.template_kwargs, native.ds.template_kwargs = {"enable_thinking": True}, {"enable_thinking": False}
    assert run(generate(native, request(ids=None), bare_target(tok))).ok  # a fake server's: only the tokenizer
    assert srv.generate_calls[1]["input_ids"] == render_prompt_ids(tok, MESSAGES, None, {"enable_thinking": False})
    assert tok.decode(srv.generate_calls[1]["input_ids"]).endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("name", ["model", "prompt", "max_tokens", "stream", "n", "seed", "top_k"])
def test_colliding_extra_body_is_refused_before_any_request(fake, name):
    srv = fake()
    cfg = config(BackendKind.openai, [srv.url], extra_body={name: 1})
    with pytest.raises(ConfigError) as err:
        run(generate(cfg, request()))
    assert err.value.key == f"backend.extra_body.{name}" and "\n" not in str(err.value)
    assert srv.log == [] and srv.health_calls == 0  # refused before any connection
    with pytest.raises(ConfigError) as err:
        cfg.backend.check("backend")  # what config validation runs
    assert err.value.key == f"backend.extra_body.{name}"


def test_sglang_refuses_extra_body_instead_of_dropping_it(fake):
    srv = fake()
    with pytest.raises(ConfigError) as err:
        run(generate(sglang(srv.url, extra_body={"min_new_tokens": 4}), request()))
    assert err.value.key == "backend.extra_body" and "sampling.extra" in str(err.value) and srv.log == []


def test_sampling_extra_naming_a_field_we_set_is_refused():
    with pytest.raises(ConfigError) as err:
        SamplingConfig(extra={"top_k": 20}).check("datasets.D.sampling")
    assert err.value.key == "datasets.D.sampling.extra.top_k" and "datasets.D.sampling.top_k" in str(err.value)


def test_what_changes_the_data_changes_the_store_key():
    key = lambda s: request_key("fp", IDS, key_sampling(s), 16)  # noqa: E731
    base = key(SamplingConfig())
    # the neutral values leave the key as it was before those fields existed
    assert key_sampling(SamplingConfig()) == {"temperature": 0.7, "top_p": 1.0, "top_k": -1}
    changed = [
        SamplingConfig(extra={"min_tokens": 4}),
        SamplingConfig(extra={"min_tokens": 5}),
        SamplingConfig(min_p=0.05),
        SamplingConfig(repetition_penalty=1.1),
        SamplingConfig(presence_penalty=0.5),
        SamplingConfig(frequency_penalty=0.5),
    ]
    keys = {key(s) for s in changed}
    assert len(keys) == len(changed) and base not in keys
