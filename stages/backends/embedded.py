"""The `embedded` backend: the target run in-process by transformers' continuous batching.

Token ids in and out, no server, no GPU needed: it serves the demo and small models. `add_request` queues work on
the manager's background thread; results come back on the event loop through `register_result_handler`;
cancelling the awaiting task calls `cancel_request`, which frees the request's KV cache. With `req.stream` the
request is added with `streaming=True`: every step's output reaches the handler, which keeps `req.partial` current.
"""

from __future__ import annotations

import asyncio
import time

from stages.backends import GenRequest, GenResult, Partial
from stages.config import Config
from stages.target import load_model


class EmbeddedBackend:
    name = "embedded"

    def __init__(self, cfg: Config, tokenizer):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.manager = None

    async def start(self) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        ds = self.cfg.ds
        model = load_model(self.cfg.model)
        eos = self.tokenizer.eos_token_id
        sampling = ds.sampling
        gen = GenerationConfig(
            max_new_tokens=ds.max_tokens, eos_token_id=eos, pad_token_id=self.tokenizer.pad_token_id or eos,
            do_sample=sampling.temperature > 0, temperature=sampling.temperature or None,
            top_p=sampling.top_p, top_k=sampling.top_k if sampling.top_k > 0 else None,
        )
        cb = ContinuousBatchingConfig(
            num_blocks=self.cfg.backend.num_blocks, max_batch_tokens=self.cfg.backend.max_batch_tokens, page_size=32,
        )
        self.manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        self.manager.start()

    async def generate(self, req: GenRequest) -> GenResult:
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        t0 = time.perf_counter()

        follow = _PartialFollower(req.partial, self.tokenizer) if req.stream else None

        def on_result(out) -> None:
            if follow is not None:
                follow.update(out.generated_tokens)
            if out.is_finished() and not done.done():
                done.set_result(out)

        self.manager.register_result_handler(req.rid, on_result)
        self.manager.add_request(req.prompt_ids, request_id=req.rid, max_new_tokens=req.max_tokens,
                                 streaming=req.stream)
        try:
            out = await done
        except asyncio.CancelledError:
            self.manager.cancel_request(req.rid)
            raise
        latency = time.perf_counter() - t0
        if out.error is not None:
            return GenResult(req.rid, error="engine_error", detail=str(out.error), server=self.name, latency_s=latency)
        ids = list(out.generated_tokens)
        eos = self.tokenizer.eos_token_id
        finish = "stop" if ids and ids[-1] == eos else "length"
        return GenResult(
            req.rid, output_ids=ids, text=self.tokenizer.decode(ids, skip_special_tokens=True),
            prompt_tokens=len(req.prompt_ids), completion_tokens=len(ids), finish_reason=finish,
            server=self.name, latency_s=latency,
        )

    async def close(self) -> None:
        if self.manager is not None:
            await asyncio.to_thread(self.manager.stop, True)
            self.manager = None


class _PartialFollower:
    """Keeps a `Partial` current from streamed outputs, whose `generated_tokens` hold every token so far: only the
    new ones are decoded, by a `DecodeStream` (O(1) per token, where re-decoding everything would be O(n²))."""

    def __init__(self, partial: Partial, tokenizer):
        from tokenizers.decoders import DecodeStream

        self.partial = partial
        self.backend = tokenizer._tokenizer  # the Rust tokenizer behind the fast one
        self.decoder = DecodeStream(skip_special_tokens=True)  # as the final text: decode(skip_special_tokens=True)

    def update(self, generated: list[int]) -> None:
        p = self.partial
        for token in generated[len(p.output_ids):]:
            p.output_ids.append(token)
            piece = self.decoder.step(self.backend, token)
            if piece is not None:  # None: the token ends inside a multi-byte character
                p.text += piece
        p.completion_tokens = len(p.output_ids)
