"""The `embedded` backend: the target run in-process by transformers' continuous batching.

Token ids in and out, no server, no GPU needed: it serves the demo and small models. `add_request` queues work on
the manager's background thread; results come back on the event loop through `register_result_handler`; a stop
(`req.stop`) calls `cancel_request`, which frees the request's KV cache, and returns what the request produced. With
`req.stream` the request is added with `streaming=True`: every step's output reaches the handler, which keeps
`req.partial` current.

A partial answer (parked by an earlier run) is continued: prompt + its ids in, the remaining max_tokens. Sampling is
seeded per request (`SeededSampling`), so what a request draws does not depend on which others share its batch.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from draftdata.config.schema import Config
from draftdata.errors import ConfigError
from draftdata.generate.backends.protocol import GenRequest, GenResult, cancel_as_stop, stopped_result
from draftdata.generate.embedded import varlen_attention
from draftdata.generate.embedded.forward import LeanForward
from draftdata.generate.embedded.loop import Sampling, SlotBatching, Unsupported
from draftdata.model.compute import torch_dtype
from draftdata.model.load import load_model
from draftdata.model.target import Target
from draftdata.util.log import log


class EmbeddedBackend:
    name = "embedded"
    takes_token_ids = True

    def __init__(self, cfg: Config, target: Target):
        self.cfg = cfg
        self.tokenizer = target.tok
        # the arithmetic every answer is computed in (as the request keys were made), recorded on its row; `slots`
        # computes on the CPU even where a GPU is. A quantized checkpoint was refused with the target (load_target)
        self.compute_dtype = target.compute_dtype
        self.on_gpu = target.on_gpu
        # the turn ends where a server's would: on the tokenizer's eos and every id of the generation config's
        # eos_token_id (gpt-oss: <|return|>, <|call|>; never <|end|>, which closes its reasoning)
        self.stop_ids = target.stop_ids
        self.manager = None
        self.attention: str | None = None  # the decode-attention path answers are computed by, once started
        self.seeded = False
        self.varlen = False
        self._attempts = itertools.count()

    async def start(self) -> None:
        self.manager = await self._slots()  # started: its thread loaded the model and checked it
        if self.manager is None:
            # computed in the dtype the run's keys name (model/compute.py), as slot batching would
            self.manager = self._transformers(load_model(self.cfg.model).to(torch_dtype(self.compute_dtype)))
            self.manager.start()
            self.attention = "transformers"
        else:
            self.attention = self.manager.attention

    async def _slots(self) -> SlotBatching | None:
        """Slot batching where `backend.embedded_batching` asks for it (auto: on a CPU) and the model passes its
        check, started; None: transformers' continuous batching is to run instead."""
        choice = self.cfg.backend.embedded_batching
        if choice == "transformers" or self.on_gpu:
            return None
        s = self.cfg.ds.sampling
        engine = SlotBatching(
            lambda: load_model(self.cfg.model, device="cpu"),  # its cache and its kernels are a CPU's
            Sampling(s.temperature, s.top_p, s.top_k),
            self.stop_ids,
            slots=self.cfg.concurrency,
            prefill_tokens=self.cfg.backend.max_batch_tokens,
            compute_dtype=self.compute_dtype,
        )
        engine.start()
        try:
            await asyncio.to_thread(engine.wait_ready)
        except Unsupported as e:  # anything after the model loaded; the loader's own errors (model.path) go up as is
            engine.stop()
            if choice == "slots":
                raise ConfigError("backend.embedded_batching", f"slots cannot run {self.cfg.model.path}: {e}") from None
            log("backend", kind="embedded", batching="transformers", why=f"slots cannot run this model: {e}")
            return None
        self.seeded = True  # slot batching draws each seeded request's tokens from its own seed
        dtype = str(engine.compute_dtype).removeprefix("torch.")
        forward = "lean" if isinstance(engine.forward, LeanForward) else "transformers"
        log(
            "backend",
            kind="embedded",
            batching="slots",
            slots=engine.slots,
            compute_dtype=dtype,
            forward=forward,
            attention=engine.attention,
        )
        return engine

    def _transformers(self, model):
        """transformers' continuous batching (a GPU's, and the fallback)."""
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        sampling = self.cfg.ds.sampling
        eos = self.tokenizer.eos_token_id
        gen = GenerationConfig(
            max_new_tokens=self.cfg.ds.max_tokens,
            eos_token_id=sorted(self.stop_ids),
            pad_token_id=self.tokenizer.pad_token_id or eos,
            do_sample=sampling.temperature > 0,
            temperature=sampling.temperature or None,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else None,
        )
        cb = ContinuousBatchingConfig(
            num_blocks=self.cfg.backend.num_blocks, max_batch_tokens=self.cfg.backend.max_batch_tokens, page_size=32
        )
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        # on a CPU each sequence attends to its own keys only (see the module); on a GPU its per-sequence calls and
        # their host syncs cost more than the masked call they replace (128 in flight made the H200 prefill at ~20
        # tok/s, docs/benchmarks.md), so transformers' own attention stays there
        self.varlen = model.device.type == "cpu" and varlen_attention.install()
        if gen.do_sample:
            self.seeded = install_seeded_sampling(manager)
        return manager

    async def generate(self, req: GenRequest) -> GenResult:
        return await cancel_as_stop(req, self._generate(req))

    async def _generate(self, req: GenRequest) -> GenResult:
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        t0 = time.perf_counter()
        base = req.partial.completion_tokens if req.partial.continuable() else 0
        if not base:
            req.partial.clear()
        if base >= req.max_tokens:  # parked at max_tokens: nothing left to generate
            return self._result(req, base, [], "length", t0)
        follow = _PartialFollower(req.partial, self.tokenizer, base) if req.stream else None

        def on_result(out) -> None:
            if done.done():  # finished, or stopped: the partial stays what the caller was given
                return
            if follow is not None:
                follow.update(out.generated_tokens)
            if out.is_finished():
                done.set_result(out)

        rid = f"{req.rid}-{next(self._attempts)}"  # unique per attempt: the manager keys its state by it
        kwargs = {"seed": req.seed} if self.seeded and req.seed is not None else {}  # positions carry the offset
        self.manager.register_result_handler(rid, on_result)
        self.manager.add_request(
            list(req.prompt_ids) + req.partial.output_ids[:base],
            request_id=rid,
            max_new_tokens=req.max_tokens - base,
            streaming=req.stream,
            **kwargs,
        )
        try:
            await asyncio.wait({done, req.stop_signal()}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not done.done():  # stopped (or its caller is gone): free its KV cache, take no more of its output
                self.manager.cancel_request(rid)
                done.cancel()
        if follow is not None:  # decoded whole, as a response is: the stream holds back a character cut mid-way
            follow.decode_whole()
        if done.cancelled():  # what it streamed is in the partial; one that finished meanwhile is a response
            return stopped_result(req, self.name, time.perf_counter() - t0)
        out = done.result()
        if out.error is not None:
            return GenResult(
                req.rid,
                error="engine_error",
                detail=str(out.error),
                server=self.name,
                latency_s=time.perf_counter() - t0,
            )
        ids = list(out.generated_tokens)
        finish = "stop" if ids and ids[-1] in self.stop_ids else "length"
        return self._result(req, base, ids, finish, t0)

    def _result(self, req: GenRequest, base: int, new_ids: list[int], finish: str, t0: float) -> GenResult:
        ids = req.partial.output_ids[:base] + new_ids
        return GenResult(
            req.rid,
            output_ids=ids,
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(ids),
            finish_reason=finish,
            server=self.name,
            latency_s=time.perf_counter() - t0,
            continued_from=base,
        )

    async def close(self) -> None:
        if self.manager is not None:
            await asyncio.to_thread(self.manager.stop, True)
            self.manager = None
        if self.varlen:
            varlen_attention.uninstall()
            self.varlen = False


class _PartialFollower:
    """Keeps a `Partial` current from streamed outputs, whose `generated_tokens` hold every token of this attempt so
    far: only the new ones are decoded, by a `DecodeStream` (O(1) per token, where re-decoding everything would be
    O(n²)). The partial starts with the `base` tokens the attempt continues from."""

    def __init__(self, partial, tokenizer, base: int):
        from tokenizers.decoders import DecodeStream

        self.partial = partial
        self.base = base
        self.tokenizer = tokenizer
        self.backend = tokenizer._tokenizer  # the Rust tokenizer behind the fast one
        self.decoder = DecodeStream(skip_special_tokens=True)  # as the final text: decode(skip_special_tokens=True)
        if base:  # the decoder needs the tokens before the first new one to place spaces and split characters
            for token in partial.output_ids[:base]:
                self.decoder.step(self.backend, token)

    def update(self, generated: list[int]) -> None:
        p = self.partial
        for token in generated[len(p.output_ids) - self.base :]:
            p.output_ids.append(token)
            piece = self.decoder.step(self.backend, token)
            if piece is not None:  # None: the token ends inside a multi-byte character
                p.text += piece
        p.completion_tokens = len(p.output_ids)

    def decode_whole(self) -> None:
        """The attempt is over (finished or stopped): the text decoded whole, as the response's is, so that a last token
        ending inside a multi-byte character shows as the response shows it (the stream held it back)."""
        self.partial.text = self.tokenizer.decode(self.partial.output_ids, skip_special_tokens=True)


def install_seeded_sampling(manager) -> bool:
    """Sample every request from its own seed: transformers' continuous batching draws all requests of a step from
    one global generator, so what a request gets depends on its batch-mates and timing. Our processor, last in the
    chain, draws the request's token by Gumbel-max from a generator seeded with (request seed + position) and leaves
    the sampler a one-hot distribution. It relies on the manager's logits-processor list (transformers 5.x); where
    that differs, sampling stays unseeded and a line says so."""
    try:
        from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

        procs = manager.logit_processor
        procs.logits_processor.append(_seeded_processor(ContinuousBatchingLogitsProcessor)())
        procs.tensors_required += 1
        procs.supported_keys["seed"] = int
        procs.do_processing = True
        return True
    except (ImportError, AttributeError, TypeError) as e:
        log(
            "backend",
            kind="embedded",
            warning=f"per-request seeds unavailable ({type(e).__name__}: {e}); sampling is not reproducible",
        )
        return False


def _seeded_processor(base):
    import torch

    class SeededSampling(base):
        supported_kwargs = {"seed": int}
        ignored_kwargs = ()

        def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
            int32_tensor.fill_(0)

        def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
            # the token at sequence position p is drawn with seed + p: the same draw whatever its batch-mates, however
            # often the manager evicted and re-prefilled its request, and whether it continues a parked partial
            seeds = [
                (r.state.logit_processor_kwargs.get("seed", 0) + r.state.position_offset) & 0x7FFFFFFF
                for r in requests_with_new_token
            ]
            return torch.tensor(seeds, dtype=torch.int32, device="cpu")

        def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
            seeds = tensor_arg[: scores.size(0)].tolist()
            gen = torch.Generator(device=scores.device)
            uniform = torch.stack(
                [torch.rand(scores.size(-1), generator=gen.manual_seed(s), device=scores.device) for s in seeds]
            )
            gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-20)))
            choice = (scores + gumbel).argmax(dim=-1, keepdim=True)  # Gumbel-max: a draw from softmax(scores)
            return torch.full_like(scores, float("-inf")).scatter_(-1, choice, 0.0)

    return SeededSampling
