"""The client bench's server streams as vLLM and SGLang do (one `data:` event per token, usage last, [DONE]), and
every client it compares reads whole answers from it."""

from __future__ import annotations

import json

import pytest

from bench import client


@pytest.fixture(scope="module")
def url():
    proc, url = client.start_server()
    yield url
    proc.terminate()
    proc.wait()


def stream(url: str, tokens: int, include_usage: bool = True) -> list[bytes]:
    import urllib.request

    body = {"model": client.MODEL, "prompt": client.PROMPT, "max_tokens": tokens, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return [line for line in resp.read().split(b"\n") if line]


def test_one_event_per_token_then_usage_then_done(url):
    lines = stream(url, client.SHORT)
    assert lines[-1] == b"data: [DONE]"
    events = [json.loads(line.removeprefix(b"data: ")) for line in lines[:-1]]
    tokens, usage = events[:-1], events[-1]
    assert len(tokens) == client.SHORT
    assert all(len(e["choices"]) == 1 and e["choices"][0]["text"].count(" t") == 1 for e in tokens)
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None] * (client.SHORT - 1) + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == client.SHORT
    assert len(stream(url, client.LONG, include_usage=False)) == client.LONG + 1  # no usage event when not asked


@pytest.mark.parametrize("name", list(client.CLIENTS))
def test_every_client_reads_whole_answers(url, name):
    """Each client asserts what it got (token count, finish, text) and returns its wall time."""
    assert client.CLIENTS[name](url, 20, 8, client.SHORT) > 0
