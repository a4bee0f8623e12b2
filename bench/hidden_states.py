"""Throughput, padding, bytes and memory of the hidden_states stage against the loop most pipelines write.

    python -m bench.hidden_states [--quick] [--samples 300] [--rounds 3] [--naive-batch N] [--threads N]
        [--device cpu|cuda] [--hidden 256] [--layers 8] [--heads] [--kv-heads] [--intermediate] [--vocab 8192]
    python -m bench.hidden_states --llama8b [--depths 2,4] [--samples 4] [--rounds 2]

The target is a random-weight Llama built from a config here (default: hidden 256, 8 layers, 4 heads of 64, MLP 688,
vocab 8,192, bf16 weights) and saved with `save_pretrained` into a temp dir: the cost of a forward depends on the
shapes, not on the weights. Samples are random token ids with lognormal lengths (mean 1,000, sigma 0.8, capped at
4,096; seeded). Kept per token: the outputs of EAGLE-3's default layers ([1, 3, 4] for 8 layers) and the final
state. Side by side, in one run:

- ours: the stage's own path, `draftdata.hidden.compute.Computer` (length-sorted batches of at most `batch_tokens`
  padded tokens from `length_batches`; `draftdata.hidden.engines.hf.HFEngine`: hooks on the decoder, no LM head) writing
  bf16 shards into a `StateStore` in a temp dir, the sample keys hashed as the stage hashes them;
- naive: fixed-size padded batches in dataset order through the full CausalLM with `output_hidden_states=True`
  (logits computed), the three layers and the last hidden state picked, one `torch.save` per sample of a dict of
  the unpadded tensors in bf16. Its batch size is the one whose padded batches (batch size x longest sample in the
  batch, averaged over batches) come closest to ours' average padded batch, so both run batches of about the same
  size and differ in what they compute and pad (`--naive-batch` sets it instead: 1 is a loop that pads nothing);
- forward: the plain prefill, ours' floor: the same engine (`prefill`: its decoder on the same right-padded batches
  without an attention mask, every layer and the final norm, no LM head, as ours) on the same batches
  (`stage_batches`, checked by their padding), with nothing captured, copied, packed, written or stored
  (`plain_forward`). Ours needs the last layer's output, so it runs every layer too: the
  two run the same layers. A serving engine's prefill computes the LM head for the last token of each sample only,
  a negligible share, so no LM head here either;
- ours again with dtype fp8, for its bytes and its error against the bf16 states (both stores read back with
  `ShardReader`; relative L2 over every sample, aux and final together).

Each path lives in its own spawned process (the same `--threads` torch threads in each) that loads the model once,
except the plain forward, which ours' process runs on ours' engine: run in a process of its own, the same forward took
longer than ours' whole capture in every round of a quiet run (the process's state, not the capture); its RSS is ours'.
The parent cuts the samples into `rounds` consecutive slices and has ours and naive take turns on each (ours first in
even rounds, naive in odd ones), so a slow spell of the machine hits both. The plain forward is paired with ours batch
by batch (`Paired`): each batch of ours' round also runs through `prefill`, before its capture in one batch and after it
in the next, timed apart and taken out of ours' round, so the two meet the same machine a fraction of a second apart
(rounds of whole passes, a few seconds each, drifted by more than the few percent being measured on a shared 2-core
machine, up to a quarter between the rounds of one run). With a background writer (on a GPU) the prefill would share the
machine with ours' writes, so there it runs the round's batches as a turn of its own, next to ours'. A round's time runs
from the token ids to the files on disk (ours flushes its shard at the end of each round); the process's CPU time is
kept beside the wall time, as a check on a shared machine. A slice is ours' window (`window_samples`): the stage sorts
within a window, so ours pads a little more than it would over the whole set. tok/s count real tokens; `ratio` is
ours_tok_s / naive_tok_s over all rounds (`ratio_median_of_rounds` the median of the paired rounds' ratios, as a check
on the machine's noise; `ratio_cpu` by CPU time). `capture_vs_forward` is ours' tok/s / the plain forward's, the median
of the rounds (each round's value beside it, and by CPU time), and `time_split` says where ours' time went, measured
from outside the stage's code (`Split`: the calls it makes for each step wrapped in ours' worker process, hooks on the
decoder): the engine's padding, decoder and copies to host, the checks, shard packing, writes, the state store's index,
the keys, and `other` (no step: the batching, the loop); with a background writer (on a GPU) packing and writes
overlap the compute.
Peak RSS is each process's own `ru_maxrss`, so the naive run cannot inflate ours'; `rss_after_load_mb` is the
same reading before the first timed round (imports, weights, a warm-up forward). The fp8 run comes after the
comparison, alone.

Writes bench/results/hidden_states.json (with `--device cuda`, as bench/hidden_states_gpu.sh runs it:
hidden_states_gpu.json; without a GPU it stops in one line). Goals: ratio >= 2; capture_vs_forward >= 0.95;
bytes_per_token within 1 % of 2 * 4 * H (bf16, 3 aux layers + the final state; ids, offsets and keys are the rest);
fp8 bytes_per_token <= 0.55 of bf16's.

The small default shape flatters ours: the LM head that naive computes and ours skips is a far bigger share of the
work at hidden 256 / vocab 8,192 than on a real target. `--llama8b` runs the same comparison (no fp8) on
Llama-3.1-8B's shape (hidden 4096, 32 heads of 128, 8 KV heads, MLP 14336, vocab 128,256), cut to `--depths` layers
so that it fits a small machine (the checkpoint is memory-mapped, so both paths share one copy of the weights), and
keeps the real target's three aux layers (each at most the last layer there is). Cutting layers inflates the LM
head's share in turn, so per path seconds per token = fixed + per_layer x layers is fitted over the depths (least
squares, by wall and by CPU time) and read at 32 layers (capture_vs_forward too, from ours' and forward's lines). The
FLOPs of every path and depth are counted over the batches that ran (`flops_per_token`): their ratio is what the time
ratio should be if both ran at one rate, and the GFLOP per CPU second each fitted term implies checks the fit against
the count. Writes bench/results/hidden_states_llama8b.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing as mp
import os
import random
import resource
import statistics
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
MEAN_LEN, SIGMA, MAX_LEN = 1000.0, 0.8, 4096
HEAD_DIM = 64
WARMUP_TOKENS = 256  # per sample of the untimed warm-up batch (one-time kernel and allocator setup)


@dataclass(frozen=True)
class Spec:
    """Everything a worker process needs; it rebuilds the samples from the seed rather than receive them."""

    model_dir: str
    out_dir: str
    device: str
    threads: int
    samples: int
    seed: int
    mean_len: float
    max_len: int
    vocab: int
    rounds: int
    batch_tokens: int
    shard_max_tokens: int
    naive_batch: int
    layers: tuple


# ---- the data ----------------------------------------------------------------------------------------------------- #


def lengths(n: int, seed: int, mean: float, max_len: int) -> list[int]:
    rng = random.Random(seed)
    mu = math.log(mean) - SIGMA**2 / 2
    return [max(1, min(max_len, round(rng.lognormvariate(mu, SIGMA)))) for _ in range(n)]


def make_samples(spec: Spec) -> list[list[int]]:
    """Random token ids: the forward's cost does not depend on which ids."""
    rng = random.Random(f"ids/{spec.seed}")
    return [
        [rng.randrange(spec.vocab) for _ in range(n)]
        for n in lengths(spec.samples, spec.seed, spec.mean_len, spec.max_len)
    ]


def round_slices(n: int, rounds: int) -> list[tuple[int, int]]:
    bounds = [round(i * n / rounds) for i in range(rounds + 1)]
    return list(zip(bounds, bounds[1:]))


def fixed_batches(lens: list[int], size: int) -> list[list[int]]:
    return [lens[i : i + size] for i in range(0, len(lens), size)]


def mean_padded(batches: list[list[int]]) -> float:
    return statistics.fmean(len(b) * max(b) for b in batches)


def choose_naive_batch(lens: list[int], rounds: int, batch_tokens: int, given: int | None = None):
    """(naive batch size, ours' and naive's average padded batch in tokens): the size whose padded batches come
    closest to ours on average, unless one is given. Both are cut per round, as they run."""
    target = mean_padded(ours_batches(lens, rounds, batch_tokens))

    def naive(size: int) -> float:
        return mean_padded(naive_batches(lens, rounds, size))

    size = given or min(range(1, 65), key=lambda s: abs(naive(s) - target))
    return size, target, naive(size)


def ours_batches(lens: list[int], rounds: int, batch_tokens: int) -> list[list[int]]:
    """The lengths in each of ours' batches, as the stage cuts them within each round's window."""
    from draftdata.hidden.compute import length_batches

    return [
        [len(ids) for _, ids in batch]
        for a, b in round_slices(len(lens), rounds)
        for batch in length_batches([(str(i), range(n)) for i, n in enumerate(lens[a:b])], batch_tokens)
    ]


def naive_batches(lens: list[int], rounds: int, size: int) -> list[list[int]]:
    return [batch for a, b in round_slices(len(lens), rounds) for batch in fixed_batches(lens[a:b], size)]


# ---- the model ---------------------------------------------------------------------------------------------------- #


def model_config(args) -> dict:
    heads = args.heads or max(1, args.hidden // HEAD_DIM)
    # Llama's MLP width: 8/3 of the hidden size, rounded up to a multiple of 16 (688 for 256)
    intermediate = args.intermediate or 16 * math.ceil(8 * args.hidden / 3 / 16)
    return {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": args.kv_heads or heads,
        "head_dim": args.hidden // heads,
        "intermediate_size": intermediate,
        "vocab_size": args.vocab,
        "max_position_embeddings": max(4096, args.max_len),
        "tie_word_embeddings": False,
    }


def build_model(config: dict, path: str, device: str, tiled: bool = False) -> None:
    """Random bf16 weights, saved as a checkpoint. Run in its own process: on a GPU it is built there (initialising
    billions of weights on the CPU takes minutes) and the parent never holds a CUDA context. `tiled`: the matrices
    repeat one random block instead (seconds rather than minutes for an 8B-wide model on a CPU; the cost of a
    forward does not depend on the values)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(0)
    with torch.device("meta" if tiled else device):
        model = LlamaForCausalLM._from_config(LlamaConfig(**config), dtype=torch.bfloat16)
    if tiled:
        model = model.to_empty(device=device)  # buffers such as the rotary table are rebuilt when it is loaded
        fill_tiled(model)
    model.save_pretrained(path)


def fill_tiled(model, block: int = 1 << 22) -> None:
    """Norm weights 1, every matrix the same random block (std 0.02, as HF's init) repeated."""
    import torch

    values = (torch.randn(block) * 0.02).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            if p.dim() == 1:
                flat.fill_(1.0)
                continue
            for i in range(0, flat.numel(), block):
                n = min(block, flat.numel() - i)
                flat[i : i + n] = values[:n]


# ---- the two paths, each in its own process ----------------------------------------------------------------------- #


class Clock:
    """Wall time, and the process's CPU time: on a shared machine another job's burst stretches the wall time of
    whichever path runs then, while the CPU time the path itself needs stays put (on a GPU it means little)."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> dict:
        return {"seconds": time.perf_counter() - self.wall, "cpu_seconds": time.process_time() - self.cpu}


def state_settings(spec: Spec, dtype: str) -> dict:
    """What the stage hashes into every sample's key; the model is named, not fingerprinted (it is random)."""
    from draftdata.hidden.shards import FORMAT_VERSION

    return {"version": FORMAT_VERSION, "layers": list(spec.layers), "dtype": dtype, "model": "bench-random-llama"}


class Started:
    """The stage's Computer takes its engine from a holder (the stage's own starts the model on first use); this
    one hands over a model already loaded and warmed up, so loading stays out of the timed rounds."""

    name = "hf"  # what the state store records for each shard (the stage's LazyEngine.name): the bench's HFEngine

    def __init__(self, engine):
        self.engine = engine

    def get(self):
        return self.engine

    @property
    def pad_tokens(self) -> int:
        return self.engine.pad_tokens


def prefill(engine, batch: list[list[int]]) -> int:
    """The plain prefill that ours is held against: the batch padded as the engine pads it, through the engine's own
    decoder (every layer and the final norm, no LM head), with nothing captured (the engine's hooks are on only inside
    its forward), copied, packed or stored, and nothing counted in the engine's `pad_tokens`. Returns the batch's pad
    tokens."""
    import torch

    from draftdata.hidden.engines.hf import pad_right

    ids = pad_right(batch, engine.input_device)
    with torch.inference_mode():
        engine.decoder(input_ids=ids, use_cache=False)
    finish_kernels(engine.decoder)
    return ids.numel() - sum(map(len, batch))


def finish_kernels(decoder) -> None:
    """On a GPU the kernels are queued when the decoder returns: its time is theirs once they have run (under a
    device_map, on the last GPU the batch runs on)."""
    import torch

    last = decoder.norm.weight.device
    if last.type == "cuda":
        torch.cuda.synchronize(last)


class Split:
    """Where ours' wall time goes, step by step, measured from outside the stage's code: `instrument` wraps, in this
    worker process, the calls the stage makes for each step, and hooks on the decoder mark where it starts and ends
    within the engine's forward. A step's seconds leave out the steps timed inside it (the state store's index
    inside the wait for the writer), so one thread's steps add up to the time they cover; each thread has its own
    (with a background writer, packing and writes run beside the compute)."""

    def __init__(self):
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._local = threading.local()
        self._wrapped: list[tuple] = []
        self._hooks: list = []

    def _stack(self) -> list:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def _charge(self) -> float:
        """The time since the last mark to the step running now; the new mark."""
        now, stack = time.perf_counter(), self._stack()
        if stack:
            self.seconds[stack[-1][0]] += now - stack[-1][1]
            stack[-1][1] = now
        return now

    def enter(self, step: str) -> None:
        self._stack().append([step, self._charge()])

    def leave(self) -> None:
        now, stack = self._charge(), self._stack()
        stack.pop()
        if stack:  # the step it ran inside goes on from here
            stack[-1][1] = now

    def switch(self, step: str) -> None:
        """The running step goes on as another (the forward's padding, once the decoder is done, as its copies)."""
        self._charge()
        self._stack()[-1][0] = step

    def running(self) -> str | None:
        stack = self._stack()
        return stack[-1][0] if stack else None

    @contextmanager
    def step(self, name: str):
        self.enter(name)
        try:
            yield
        finally:
            self.leave()

    def wrap(self, owner, name: str, step: str) -> None:
        """`owner.name` (a module's function, a class's method, an object's) timed as `step` until `restore`."""
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            with self.step(step):
                return inner(*args, **kwargs)

        self._wrapped.append((owner, name, vars(owner).get(name)))  # None: an object's method, its class's
        setattr(owner, name, timed)

    def instrument(self, engine) -> None:
        """The stage's steps: the engine's (`time_engine`), the checks and the fp8 error of the compute loop, and
        the shard writer's packing, writes, waits and index."""
        from draftdata.hidden import compute, shards, writer
        from draftdata.hidden.state_store import StateStore

        self.time_engine(engine)
        self.wrap(compute, "check", "checks")
        self.wrap(compute.Computer, "_fp8_error", "fp8 error")
        self.wrap(writer, "write", "writes")
        self.wrap(shards.ShardImage, "__init__", "shard packing")
        self.wrap(writer.ShardWriter, "wait", "waiting for the writer")
        self.wrap(StateStore, "add_shard", "state store")

    def time_engine(self, engine) -> None:
        """The engine's forward: its padding, then the decoder (from its hooks), then the copies to the host."""
        self.wrap(engine, "forward", "padding")
        self._hooks += [engine.decoder.register_forward_pre_hook(self._decoder_starts)]
        self._hooks += [engine.decoder.register_forward_hook(self._decoder_ends)]

    def _decoder_starts(self, decoder, _args) -> None:
        if self.running() == "padding":  # inside the capture's forward (the plain prefill runs the decoder too)
            self.enter("decoder")

    def _decoder_ends(self, decoder, _args, _out) -> None:
        if self.running() == "decoder":
            finish_kernels(decoder)
            self.leave()
            self.switch("copies to host")

    def restore(self) -> None:
        for hook in self._hooks:
            hook.remove()
        while self._wrapped:
            owner, name, own = self._wrapped.pop()
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)


class Paired:
    """Ours' engine with the plain prefill of each batch run beside its capture, before it in one batch and after it
    in the next, timed apart: on a shared 2-core machine the speed drifts by more than the few percent being
    measured over the seconds a round takes, while two forwards of the same batch a fraction of a second apart meet
    the same machine. `take()` hands over the prefills' time since the last call, for the round to subtract."""

    def __init__(self, engine):
        self.engine, self.batches = engine, 0
        self._plain = {"seconds": 0.0, "cpu_seconds": 0.0, "tokens": 0, "padded": 0}

    def forward(self, batch: list[list[int]]):
        before = self.batches % 2 == 0
        self.batches += 1
        if before:
            self._prefill(batch)
        out = self.engine.forward(batch)
        if not before:
            self._prefill(batch)
        return out

    def _prefill(self, batch: list[list[int]]) -> None:
        clock = Clock()
        padded = prefill(self.engine, batch)
        for k, v in clock.read().items():
            self._plain[k] += v
        self._plain["tokens"] += sum(map(len, batch))
        self._plain["padded"] += padded

    @property
    def pad_tokens(self) -> int:
        return self.engine.pad_tokens

    def take(self) -> dict:
        out, self._plain = self._plain, {k: type(v)() for k, v in self._plain.items()}
        return out


def background_writes(spec: Spec) -> bool:
    """As the stage chooses: a writer thread where the target computes off the CPU."""
    return spec.device != "cpu"


def overlapped(spec: Spec) -> tuple:
    """The steps that ran on the writer thread, beside the compute."""
    return ("shard packing", "writes") if background_writes(spec) else ()


class Ours:
    """The stage's compute pass, one window per round. With `paired` (the bf16 run, writes in line) the plain
    prefill runs beside each batch (`Paired`); with a background writer (on a GPU) it would share the machine with
    the writes, so there it runs the round's batches as a turn of its own (`forward`), next to ours'."""

    def __init__(self, spec: Spec, dtype: str, paired: bool = False):
        from draftdata.config.schema import ModelConfig
        from draftdata.hidden.compute import Computer
        from draftdata.hidden.engines.hf import HFEngine
        from draftdata.hidden.state_store import StateStore
        from draftdata.hidden.tally import HiddenTally

        self.spec, self.samples = spec, make_samples(spec)
        self.root = Path(spec.out_dir) / f"ours-{dtype}"
        self.engine = HFEngine(ModelConfig(path=spec.model_dir), list(spec.layers))
        self.store = StateStore(self.root)
        self.paired = Paired(self.engine) if paired and not background_writes(spec) else None
        self.split = Split()
        self.split.instrument(self.engine)
        self.computer = Computer(
            Started(self.paired or self.engine),
            self.store,
            state_settings(spec, dtype),
            dtype,
            spec.batch_tokens,
            spec.shard_max_tokens,
            HiddenTally(),
            background_writes=background_writes(spec),
        )

    def warm_up(self) -> None:
        self.engine.forward([[1] * WARMUP_TOKENS] * 2)
        self.engine.pad_tokens = 0

    def forward(self, rnd: int) -> dict:
        """The plain prefill of this round's slice as a turn of its own (unpaired: see the class): this engine,
        these batches, nothing captured (`plain_forward`). Run in this process, beside the capture, so both meet the
        same allocator, threads and caches: in separate processes the same forward ran at different speeds, which
        is the processes' state, not the capture."""
        a, b = round_slices(len(self.samples), self.spec.rounds)[rnd]
        return plain_forward(self.engine, stage_batches(self.samples[a:b], self.spec.batch_tokens))

    def run(self, rnd: int) -> dict:
        from draftdata.hidden.state_store import state_key

        a, b = round_slices(len(self.samples), self.spec.rounds)[rnd]
        pad0, before, clock = self.engine.pad_tokens, self.split.snapshot(), Clock()
        sh = self.computer.settings_hash
        with self.split.step("keys"):  # the stage hashes every sample's ids to look it up in the store
            missing = [(state_key(sh, ids), ids) for ids in self.samples[a:b]]
        self.computer.run(missing)
        self.computer.sync()  # the window's states on disk, as naive's are
        times = clock.read()
        split = {k: v - before.get(k, 0.0) for k, v in self.split.snapshot().items()}
        out = {"tokens": sum(map(len, self.samples[a:b])), "padded": self.engine.pad_tokens - pad0, "split": split}
        if self.paired is None:
            return {**times, **out}
        plain = self.paired.take()
        return {**{k: v - plain[k] for k, v in times.items()}, **out, "forward": plain}

    def finish(self) -> dict:
        self.computer.close()
        self.split.restore()
        tally = self.computer.tally
        shards = list(self.root.rglob("*.safetensors"))
        out = {"bytes": sum(p.stat().st_size for p in shards), "files": len(shards)}
        if tally.fp8_err_den:
            out["fp8_rel_err_stage"] = (tally.fp8_err_num / tally.fp8_err_den) ** 0.5
        self.engine.close()
        self.store.close()
        return out


def stage_batches(samples: list[list[int]], batch_tokens: int) -> list[list[list[int]]]:
    """The samples' ids in the batches the stage cuts from them (a fresh store: every sample missing)."""
    from draftdata.hidden.compute import length_batches

    return [[ids for _, ids in batch] for batch in length_batches(list(enumerate(samples)), batch_tokens)]


def plain_forward(engine, batches: list[list[list[int]]]) -> dict:
    """The batches through `prefill`: the engine's own decoder on the same padded batches, nothing captured, copied,
    packed, written or stored. The floor that ours (the same engine, the same batches, plus the capture) is held
    against."""
    clock, padded = Clock(), 0
    for batch in batches:
        padded += prefill(engine, batch)
    return {**clock.read(), "tokens": sum(len(x) for b in batches for x in b), "padded": padded}


class Naive:
    """The loop as commonly written: padded batches in dataset order, the CausalLM's own hidden_states tuple."""

    def __init__(self, spec: Spec):
        from transformers import AutoModelForCausalLM

        self.spec, self.samples = spec, make_samples(spec)
        self.model = AutoModelForCausalLM.from_pretrained(spec.model_dir, dtype="auto").to(spec.device).eval()
        self.dir = Path(spec.out_dir) / "naive"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bytes = 0

    def warm_up(self) -> None:
        self.forward([[1] * WARMUP_TOKENS] * 2)

    def forward(self, batch: list[list[int]]):
        import torch

        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, x in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
            mask[i, : len(x)] = 1
        with torch.inference_mode():
            out = self.model(
                input_ids=ids.to(self.spec.device), attention_mask=mask.to(self.spec.device), output_hidden_states=True
            )
        return ids, out.hidden_states

    def run(self, rnd: int) -> dict:
        import torch

        a, b = round_slices(len(self.samples), self.spec.rounds)[rnd]
        tokens = padded = 0
        clock = Clock()
        for start in range(a, b, self.spec.naive_batch):
            batch = self.samples[start : min(start + self.spec.naive_batch, b)]
            ids, hs = self.forward(batch)
            padded += ids.numel() - sum(map(len, batch))
            for i, x in enumerate(batch):
                n = len(x)
                # hidden_states[L + 1] is the output of layer L; the last entry is after the final norm in HF
                # (the stage keeps the pre-norm state and the norm's weights instead: the same bytes).
                # torch.cat and the explicit copy give each file its own storage: saving a view of the batch
                # would write the whole padded batch into every file.
                torch.save(
                    {
                        "input_ids": ids[i, :n].clone(),
                        "aux_hidden_states": torch.cat([hs[layer + 1][i, :n] for layer in self.spec.layers], dim=-1).to(
                            "cpu", torch.bfloat16
                        ),
                        "hidden_state": hs[-1][i, :n].to("cpu", torch.bfloat16, copy=True),
                    },
                    self.dir / f"{start + i}.pt",
                )
                tokens += n
        times = clock.read()
        self._count_and_clear()
        return {**times, "tokens": tokens, "padded": padded}

    def _count_and_clear(self) -> None:
        """Untimed: the round's files are measured and removed, so a big model's run fits on the disk."""
        for p in self.dir.iterdir():
            self.bytes += p.stat().st_size
            p.unlink()

    def finish(self) -> dict:
        return {"bytes": self.bytes, "files": len(self.samples)}


def peak_memory(device: str) -> dict:
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux
    if device == "cuda":
        import torch

        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def make_path(kind: str, spec: Spec):
    if kind == "naive":
        return Naive(spec)
    return Ours(spec, "fp8" if kind == "fp8" else "bfloat16", paired=kind == "ours")


def serve(conn, kind: str, spec: Spec) -> None:
    """A worker's loop: build the path, then answer ("run", round) and ("finish",) until finished."""
    if spec.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the stage's loader would otherwise take a GPU if there is one
    try:
        import torch
        from transformers.utils import logging

        logging.disable_progress_bar()  # one bar per process and checkpoint would bury the table
        torch.set_num_threads(spec.threads)
        path = make_path(kind, spec)
        path.warm_up()
        conn.send(("ok", {"rss_after_load_mb": peak_memory(spec.device)["peak_rss_mb"]}))
        while (msg := conn.recv())[0] in ("run", "forward"):
            conn.send(("ok", getattr(path, msg[0])(msg[1])))
        conn.send(("ok", {**path.finish(), **peak_memory(spec.device)}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class Worker:
    def __init__(self, kind: str, spec: Spec):
        ctx = mp.get_context("spawn")  # a fresh interpreter: its RSS is this path's alone
        self.kind = kind
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, kind, spec), daemon=True)
        self.proc.start()
        child.close()

    def answer(self) -> dict:
        try:
            status, value = self.conn.recv()
        except EOFError:  # killed without a word: out of memory, most likely
            self.proc.join()
            raise RuntimeError(f"{self.kind} worker died (exit code {self.proc.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"{self.kind} worker failed:\n{value}")
        return value

    def call(self, *msg) -> dict:
        self.conn.send(msg)
        return self.answer()

    def close(self) -> None:
        self.proc.join()


# ---- the comparison ----------------------------------------------------------------------------------------------- #


def interleaved(spec: Spec, fp8: bool = True) -> dict:
    """ours and naive take turns on each round's slice, the plain forward paired with ours' batches (or, with a
    background writer, a turn of its own on ours' worker and engine, always next to ours, whose floor it is); then
    fp8 alone."""
    ours, naive = Worker("ours", spec), Worker("naive", spec)
    loaded = {w.kind: w.answer() for w in (ours, naive)}
    turns = (("ours", ours, "run"), ("naive", naive, "run"))
    if background_writes(spec):  # the forward can't run paired (see Ours): a turn of its own, next to ours'
        turns = (turns[0], ("forward", ours, "forward"), turns[1])
    rounds: dict = {"ours": [], "forward": [], "naive": []}
    for r in range(spec.rounds):
        for kind, w, what in turns if r % 2 == 0 else turns[::-1]:
            rounds[kind].append(w.call(what, r))
            if "forward" in rounds[kind][-1]:  # paired: ours' round holds the forward's
                rounds["forward"].append(rounds[kind][-1].pop("forward"))
    final = {w.kind: {**loaded[w.kind], **w.call("finish")} for w in (ours, naive)}
    final["forward"] = {**final["ours"], "bytes": 0, "files": 0}  # its process is ours'
    for w in (ours, naive):
        w.close()
    if not fp8:
        return {"rounds": rounds, "final": final}
    fp8 = Worker("fp8", spec)
    loaded["fp8"] = fp8.answer()
    rounds["fp8"] = [fp8.call("run", r) for r in range(spec.rounds)]
    final["fp8"] = {**loaded["fp8"], **fp8.call("finish")}
    fp8.close()
    return {"rounds": rounds, "final": final}


def fp8_rel_err(spec: Spec) -> float:
    """Relative L2 error of the fp8 states against the bf16 ones, both read back from their stores."""
    from draftdata.hidden.state_store import StateStore, state_key
    from draftdata.util.hashing import content_hash

    stores = {d: StateStore(Path(spec.out_dir) / f"ours-{d}") for d in ("bfloat16", "fp8")}
    hashes = {d: content_hash(state_settings(spec, d)) for d in stores}
    readers: dict = {}
    num = den = 0.0
    for ids in make_samples(spec):
        (ref_ids, *ref), (q_ids, *q) = (_read(stores[d], readers, state_key(hashes[d], ids)) for d in stores)
        assert ref_ids.tolist() == ids == q_ids.tolist()
        for x, y in zip(q, ref):
            num += float((x - y).pow(2).sum())
            den += float(y.pow(2).sum())
    for s in stores.values():
        s.close()
    return (num / den) ** 0.5


def _read(store, readers: dict, key: str):
    from draftdata.hidden.shards import ShardReader

    loc = store.lookup([key])[key]
    if loc.shard not in readers:
        readers[loc.shard] = ShardReader(store.path(loc.shard))
    return readers[loc.shard].sample(loc.row)


def path_stats(rounds: list[dict], final: dict, device: str) -> dict:
    """One path's totals over its rounds: tok/s of real tokens by wall and by CPU time, the padded share."""
    tokens, padded = sum(r["tokens"] for r in rounds), sum(r["padded"] for r in rounds)
    out = {
        "tok_s": tokens / sum(r["seconds"] for r in rounds),
        "cpu_tok_s": tokens / sum(r["cpu_seconds"] for r in rounds),
        "pad_share": padded / (padded + tokens),
        "bytes_per_token": final["bytes"] / tokens,
        "peak_rss_mb": final["peak_rss_mb"],
        "rss_after_load_mb": final["rss_after_load_mb"],
        "seconds": [round(r["seconds"], 2) for r in rounds],
        "tokens": tokens,
        "files": final["files"],
    }
    if device == "cuda":
        out["peak_gpu_mb"] = final["peak_gpu_mb"]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def round_ratios(ours: list[dict], naive: list[dict], clock: str) -> list[float]:
    """ours/naive tok/s on each round's slice: both ran the same samples, one right after the other."""
    return [round(n[clock] / o[clock], 3) for o, n in zip(ours, naive)]  # same tokens: the ratio of times


def time_split(ours: list[dict], forward: list[dict], overlapped: tuple = ()) -> dict:
    """Where ours' wall time goes, summed over the rounds, beside the plain forward's: each timed step (the engine's
    padding, decoder and copies to host; the checks, shard packing, writes, the state store's index, the keys) and
    `other`, the wall time no timer covered (the batching, the loop). Steps in `overlapped` ran on the writer thread
    beside the rest: listed, not subtracted."""
    total, plain = sum(r["seconds"] for r in ours), sum(r["seconds"] for r in forward)
    steps: dict[str, float] = {}
    for r in ours:
        for step, sec in r["split"].items():
            steps[step] = steps.get(step, 0.0) + sec
    steps["other"] = total - sum(v for k, v in steps.items() if k not in overlapped)
    return {
        "ours_seconds": round(total, 3),
        "plain_forward_seconds": round(plain, 3),
        "seconds": {k: round(v, 3) for k, v in steps.items()},
        "share_of_ours": {k: round(v / total, 4) for k, v in steps.items()},
        # the decoder inside ours against the same decoder run plain: above 1, the capture slows the forward itself
        "decoder_vs_plain_forward": round(steps.get("decoder", 0.0) / plain, 3),
        "overlapped": list(overlapped),
    }


def capture_figures(ours: list[dict], forward: list[dict], overlapped: tuple = (), paired: bool = False) -> dict:
    """Ours against the plain forward on the same rounds: capture_vs_forward = ours' tok/s / the forward's, per
    round (both ran the same batches, paired or one right after the other), their median, and where ours' extra
    time goes."""
    per_round = round_ratios(ours, forward, "seconds")
    per_round_cpu = round_ratios(ours, forward, "cpu_seconds")
    return {
        "capture_vs_forward": round(statistics.median(per_round), 3),
        "capture_vs_forward_per_round": per_round,
        "capture_vs_forward_all_rounds": round(sum(r["seconds"] for r in forward) / sum(r["seconds"] for r in ours), 3),
        "capture_vs_forward_cpu": round(statistics.median(per_round_cpu), 3),
        "capture_vs_forward_cpu_per_round": per_round_cpu,
        "same_batches": [o["padded"] for o in ours] == [f["padded"] for f in forward],
        "forward_paired_by_batch": paired,
        "time_split": time_split(ours, forward, overlapped),
    }


def summarise(spec: Spec, runs: dict, fp8_err: float, hidden: int, naive_choice: tuple) -> dict:
    kinds = ("ours", "naive", "fp8", "forward")
    paths = {k: path_stats(runs["rounds"][k], runs["final"][k], spec.device) for k in kinds}
    ours, naive, fp8 = paths["ours"], paths["naive"], paths["fp8"]
    per_round = round_ratios(runs["rounds"]["ours"], runs["rounds"]["naive"], "seconds")
    per_round_cpu = round_ratios(runs["rounds"]["ours"], runs["rounds"]["naive"], "cpu_seconds")
    res = {
        "ours_tok_s": round(ours["tok_s"], 1),
        "naive_tok_s": round(naive["tok_s"], 1),
        # ours_tok_s / naive_tok_s, over all rounds; the median of the paired rounds is beside it, for the noise
        "ratio": round(ours["tok_s"] / naive["tok_s"], 3),
        "ratio_per_round": per_round,
        "ratio_median_of_rounds": statistics.median(per_round),
        "ratio_cpu": statistics.median(per_round_cpu),
        "ratio_cpu_per_round": per_round_cpu,
        "pad_share_ours": ours["pad_share"],
        "pad_share_naive": naive["pad_share"],
        "bytes_per_token": round(ours["bytes_per_token"], 2),
        "limit_bytes_per_token": 2 * (len(spec.layers) + 1) * hidden,  # bf16, 3 aux layers + the final state
        "fp8_bytes_per_token": round(fp8["bytes_per_token"], 2),
        "fp8_rel_err": round(fp8_err, 5),
        "fp8_rel_err_stage": round(runs["final"]["fp8"].get("fp8_rel_err_stage", 0.0), 5),
        "peak_rss_mb": round(ours["peak_rss_mb"], 1),
        "peak_rss_how": "ru_maxrss of the process that ran ours and the plain forward (spawned; naive ran in another)",
        "naive_batch": spec.naive_batch,
        "avg_padded_batch_tokens": {"ours": round(naive_choice[1]), "naive": round(naive_choice[2])},
        "forward_tok_s": round(paths["forward"]["tok_s"], 1),
        **capture_figures(
            runs["rounds"]["ours"], runs["rounds"]["forward"], overlapped(spec), not background_writes(spec)
        ),
        "paths": paths,
    }
    if spec.device == "cuda":
        res["peak_gpu_mb"] = round(ours["peak_gpu_mb"], 1)
    res["goals"] = {
        "ratio_ge_2": res["ratio"] >= 2,
        "capture_vs_forward_ge_0.95": res["capture_vs_forward"] >= 0.95,
        "bytes_per_token_within_1pct_of_limit": abs(res["bytes_per_token"] / res["limit_bytes_per_token"] - 1) <= 0.01,
        "fp8_le_0.55_of_bf16": res["fp8_bytes_per_token"] <= 0.55 * res["bytes_per_token"],
    }
    res["all_goals_met"] = all(res["goals"].values())
    return res


# ---- FLOPs, and an 8B target's shape at a depth this machine runs ------------------------------------------------ #

# Llama-3.1-8B's config.json in this module's option names, its depth aside; the 32-layer target's aux layers
LLAMA_8B = {"hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336, "vocab": 128256}
LLAMA_8B_LAYERS = 32
LLAMA_8B_SAMPLES, LLAMA_8B_ROUNDS = 4, 2  # with --llama8b: a token costs about 100x the small model's on a CPU


def flops_per_token(config: dict, batches: list[list[int]], lm_head: bool) -> dict:
    """FLOPs (2 a multiply-add) per real token over these padded batches: the decoder's matrices on every padded
    token, causal attention on every padded row (W x W scores, half computed, for QK and for AV), and the LM head on
    every padded token where it is computed. Norms, rotary and activations are left out (under 1 %)."""
    hidden, q = config["hidden_size"], config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    matrices = 2 * (hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * config["intermediate_size"])
    padded = sum(len(b) * max(b) for b in batches)
    attention = sum(len(b) * 2 * max(b) ** 2 * q for b in batches)
    real = sum(map(sum, batches))
    return {
        "layers": config["num_hidden_layers"] * (padded * matrices + attention) / real,
        "lm_head": (padded * 2 * hidden * config["vocab_size"] if lm_head else 0) / real,
    }


def flop_shares(config: dict, lens: list[int], spec) -> dict:
    """Each path's FLOPs per real token over the batches it ran, their ratio, and the LM head's share of naive's."""
    ours = flops_per_token(config, ours_batches(lens, spec.rounds, spec.batch_tokens), lm_head=False)
    naive = flops_per_token(config, naive_batches(lens, spec.rounds, spec.naive_batch), lm_head=True)
    total = {"ours": sum(ours.values()), "naive": sum(naive.values())}
    return {
        "gflop_per_token": {k: round(v / 1e9, 5) for k, v in total.items()},
        "lm_head_share_of_naive": round(naive["lm_head"] / total["naive"], 4),
        "ratio": round(total["naive"] / total["ours"], 3),  # naive's FLOPs / ours: the ratio if both ran as fast
    }


def at_depth(config: dict, depth: int) -> dict:
    return {**config, "num_hidden_layers": depth}


def real_shape(args) -> dict:
    """Llama-3.1-8B's shape at each of `--real-depths` layers, ours against naive as in the main comparison (no
    fp8); then, per path, seconds per token = fixed + per_layer x layers fitted over the depths and read at the
    real depth, beside the FLOP count there. At a few layers the LM head is a far bigger share of naive's work than
    at 32, so the ratio measured there flatters ours; the fit removes that."""
    from draftdata.drafters.layers import default_layers

    depths, t0 = {}, time.perf_counter()
    for depth in args.depths:
        config = model_config(argparse.Namespace(**{**vars(args), **LLAMA_8B, "layers": depth}))
        # the real target's three aux layers, each at most the last one here: the same copies and bytes a token
        layers = [min(layer, depth - 1) for layer in default_layers(LLAMA_8B_LAYERS)]
        spec, runs, _, _ = compare(args, config, layers, args.samples, args.rounds, fp8=False, tiled=True)
        depths[depth] = depth_stats(spec, runs, config)
        d = depths[depth]
        print(
            f"8B shape, {depth} layers: ours/naive {d['ratio']} (FLOPs: {d['flops']['ratio']}); capture_vs_forward "
            f"{d['capture_vs_forward']} (rounds {d['capture_vs_forward_per_round']})"
        )
    lens = lengths(spec.samples, spec.seed, spec.mean_len, spec.max_len)
    real = flop_shares(at_depth(config, LLAMA_8B_LAYERS), lens, spec)
    fits = {clock: extrapolate(depths, clock) for clock in ("seconds_per_token", "cpu_seconds_per_token")}
    return {
        "model": {**at_depth(config, LLAMA_8B_LAYERS), "layers_kept": default_layers(LLAMA_8B_LAYERS)},
        "depths": {str(d): v for d, v in depths.items()},
        "method": (
            "per path, seconds per real token = fixed + per_layer x layers, least squares over the depths run "
            f"(wall and CPU time), read at {LLAMA_8B_LAYERS} layers; FLOPs counted over the same batches"
        ),
        "fit": fits["seconds_per_token"]["fit"],
        "fit_cpu": fits["cpu_seconds_per_token"]["fit"],
        "ratio": fits["seconds_per_token"]["ratio"],
        "ratio_cpu": fits["cpu_seconds_per_token"]["ratio"],
        "capture_vs_forward": fits["seconds_per_token"]["capture_vs_forward"],
        "capture_vs_forward_cpu": fits["cpu_seconds_per_token"]["capture_vs_forward"],
        "tok_s": fits["seconds_per_token"]["tok_s"],
        "flops": real,
        "small_shape_flops": small_shape_flops(),
        # by CPU time: on a shared machine the wall clock's fit carries other jobs' bursts
        "implied_gflop_per_cpu_s": implied_rates(depths, fits["cpu_seconds_per_token"]["fit"]),
        "settings": {
            **{k: getattr(spec, k) for k in ("samples", "rounds", "seed", "mean_len", "max_len", "device", "threads")},
            "batch_tokens": spec.batch_tokens,
            "sigma": SIGMA,
            "naive_batch": spec.naive_batch,
            "mean_tokens_per_sample": round(sum(lens) / len(lens), 1),
            "weights": "one random block repeated (bf16); checkpoint memory-mapped, so both paths share it",
        },
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def small_shape_flops() -> dict:
    """The default run's FLOP count (no run needed: the shapes and the batches decide it), to set beside this."""
    args = parse_args([])
    lens = lengths(args.samples, args.seed, args.mean_len, args.max_len)
    size = choose_naive_batch(lens, args.rounds, args.batch_tokens)[0]
    cut = argparse.Namespace(rounds=args.rounds, batch_tokens=args.batch_tokens, naive_batch=size)
    return flop_shares(model_config(args), lens, cut)


def depth_stats(spec: Spec, runs: dict, config: dict) -> dict:
    paths = {k: path_stats(runs["rounds"][k], runs["final"][k], spec.device) for k in ("ours", "naive", "forward")}
    ours, naive = paths["ours"], paths["naive"]
    return {
        "layers": list(spec.layers),
        "ours_tok_s": round(ours["tok_s"], 2),
        "naive_tok_s": round(naive["tok_s"], 2),
        "forward_tok_s": round(paths["forward"]["tok_s"], 2),
        **capture_figures(
            runs["rounds"]["ours"], runs["rounds"]["forward"], overlapped(spec), not background_writes(spec)
        ),
        "ratio": round(ours["tok_s"] / naive["tok_s"], 3),
        "ratio_per_round": round_ratios(runs["rounds"]["ours"], runs["rounds"]["naive"], "seconds"),
        "ratio_cpu": round(ours["cpu_tok_s"] / naive["cpu_tok_s"], 3),
        "seconds_per_token": {k: 1 / p["tok_s"] for k, p in paths.items()},
        "cpu_seconds_per_token": {k: 1 / p["cpu_tok_s"] for k, p in paths.items()},
        "flops": flop_shares(config, lengths(spec.samples, spec.seed, spec.mean_len, spec.max_len), spec),
        "paths": paths,
    }


def extrapolate(depths: dict, clock: str) -> dict:
    """Per path, the line through (layers, seconds per token), read at the real depth."""
    fit = {}
    for path in next(iter(depths.values()))[clock]:
        line = statistics.linear_regression(list(depths), [d[clock][path] for d in depths.values()])
        fit[path] = {"fixed": line.intercept, "per_layer": line.slope}
    at = {k: f["fixed"] + f["per_layer"] * LLAMA_8B_LAYERS for k, f in fit.items()}
    out = {
        "fit": fit,
        "ratio": round(at["naive"] / at["ours"], 3),
        "tok_s": {k: round(1 / v, 2) for k, v in at.items()},
    }
    if "forward" in at:
        out["capture_vs_forward"] = round(at["forward"] / at["ours"], 3)
    return out


def implied_rates(depths: dict, fit: dict) -> dict:
    """GFLOP/s that each fitted term implies: a layer of ours, a layer of naive (per layer FLOPs / per_layer), and
    the LM head (its FLOPs / naive's fixed minus ours'). Close values say the fit matches the FLOP count."""
    (d0, a), (d1, b) = list(depths.items())[0], list(depths.items())[-1]
    out = {}
    for path in ("ours", "naive"):
        per_layer = 1e9 * (b["flops"]["gflop_per_token"][path] - a["flops"]["gflop_per_token"][path]) / (d1 - d0)
        out[f"{path}_layer"] = round(per_layer / fit[path]["per_layer"] / 1e9, 1)
    head = 1e9 * b["flops"]["gflop_per_token"]["naive"] * b["flops"]["lm_head_share_of_naive"]
    out["lm_head"] = round(head / (fit["naive"]["fixed"] - fit["ours"]["fixed"]) / 1e9, 1)
    return out


def print_real(r: dict) -> None:
    m = r["model"]
    print(
        f"Llama-3.1-8B's shape (hidden {m['hidden_size']}, vocab {m['vocab_size']:,}) at "
        + ", ".join(
            f"{d} layers: ratio {v['ratio']} (FLOPs {v['flops']['ratio']}, LM head "
            f"{100 * v['flops']['lm_head_share_of_naive']:.1f} % of naive's)"
            for d, v in r["depths"].items()
        )
    )
    print(
        f"fitted to {m['num_hidden_layers']} layers: ratio {r['ratio']} (by CPU time {r['ratio_cpu']}; FLOPs "
        f"{r['flops']['ratio']}, LM head {100 * r['flops']['lm_head_share_of_naive']:.1f} % of naive's); implied "
        f"GFLOP per CPU second {r['implied_gflop_per_cpu_s']}; capture_vs_forward {r['capture_vs_forward']} (by CPU "
        f"time {r['capture_vs_forward_cpu']})"
    )


def print_capture(res: dict) -> None:
    """capture_vs_forward and the time split, as `capture_figures` gives them."""
    split = res["time_split"]
    print(
        f"capture_vs_forward (ours / plain forward, tok/s): median {res['capture_vs_forward']} (rounds "
        f"{res['capture_vs_forward_per_round']}; all rounds {res['capture_vs_forward_all_rounds']}; by CPU time "
        f"{res['capture_vs_forward_cpu']}); same batches: {res['same_batches']}"
    )
    steps = sorted(split["seconds"].items(), key=lambda kv: -kv[1])
    print(
        f"ours' {split['ours_seconds']:.2f} s against the plain forward's {split['plain_forward_seconds']:.2f} s: "
        + ", ".join(f"{k} {v:.3f} s" for k, v in steps if v >= 0.0005 or k == "other")
        + f"; decoder / plain forward {split['decoder_vs_plain_forward']}"
        + (f" ({', '.join(split['overlapped'])} on the writer thread)" if split["overlapped"] else "")
    )


def print_table(res: dict) -> None:
    gpu = "peak_gpu_mb" in res["paths"]["ours"]
    print(
        f"{'path':<9} {'tok/s':>9} {'CPU tok/s':>10} {'pad %':>6} {'bytes/tok':>10} {'RSS MB':>8}"
        + (f" {'GPU MB':>8}" if gpu else "")
        + "  wall s per round"
    )
    for name, kind in (("ours", "ours"), ("forward", "forward"), ("naive", "naive"), ("ours fp8", "fp8")):
        p = res["paths"][kind]
        print(
            f"{name:<9} {p['tok_s']:>9,.0f} {p['cpu_tok_s']:>10,.0f} {100 * p['pad_share']:>6.2f} "
            f"{p['bytes_per_token']:>10,.1f} {p['peak_rss_mb']:>8,.0f}"
            + (f" {p['peak_gpu_mb']:>8,.0f}" if gpu else "")
            + f"  {' '.join(f'{s:.1f}' for s in p['seconds'])}"
        )
    print(
        f"ratio ours/naive: {res['ratio']} (tokens/s over all rounds; rounds {res['ratio_per_round']}, median "
        f"{res['ratio_median_of_rounds']}; by CPU time {res['ratio_cpu']}, rounds {res['ratio_cpu_per_round']})"
    )
    print_capture(res)
    print(
        f"naive batch {res['naive_batch']}: padded batch {res['avg_padded_batch_tokens']['naive']:,} tokens on "
        f"average, ours {res['avg_padded_batch_tokens']['ours']:,}"
    )
    print(
        f"bytes/token {res['bytes_per_token']} vs limit {res['limit_bytes_per_token']}; fp8/bf16 bytes "
        f"{res['fp8_bytes_per_token'] / res['bytes_per_token']:.3f}; fp8_rel_err {res['fp8_rel_err']} (read back; "
        f"the stage's own metric {res['fp8_rel_err_stage']})"
    )
    print(
        f"ours' RSS: {res['paths']['ours']['rss_after_load_mb']:,.0f} MB after load, {res['peak_rss_mb']:,.0f} MB "
        "peak (its own process)"
    )
    print("goals: " + ", ".join(f"{k}={'ok' if v else 'MISSED'}" for k, v in res["goals"].items()))


def parse_args(argv=None):
    from draftdata.config.schema import HiddenStatesConfig

    hs = HiddenStatesConfig()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a fast check: 60 samples")
    ap.add_argument("--samples", type=int, default=None, help="default 300 (60 with --quick, 4 with --llama8b)")
    ap.add_argument("--rounds", type=int, default=None, help="slices on which ours and naive take turns (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mean-len", type=float, default=MEAN_LEN)
    ap.add_argument("--max-len", type=int, default=MAX_LEN)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads, the same in every path")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=None, help=f"default hidden / {HEAD_DIM}")
    ap.add_argument("--kv-heads", type=int, default=None, help="default: as many as heads")
    ap.add_argument("--intermediate", type=int, default=None, help="default 8/3 hidden, to a multiple of 16")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch-tokens", type=int, default=hs.batch_tokens, help="ours: padded tokens per forward")
    ap.add_argument("--shard-max-tokens", type=int, default=hs.shard_max_tokens)
    ap.add_argument(
        "--naive-batch",
        type=int,
        default=None,
        help="naive's batch size; default: the one whose padded batches match ours on average",
    )
    ap.add_argument(
        "--llama8b",
        action="store_true",
        help="instead: Llama-3.1-8B's shape at --depths layers, fitted to its 32 (writes hidden_states_llama8b.json)",
    )
    ap.add_argument("--depths", type=lambda x: [int(d) for d in x.split(",")], default=[2, 4], help="with --llama8b")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.samples = args.samples or (60 if args.quick else LLAMA_8B_SAMPLES if args.llama8b else 300)
    args.rounds = args.rounds or (LLAMA_8B_ROUNDS if args.llama8b else 3)
    name = (
        "hidden_states_llama8b" if args.llama8b else "hidden_states_gpu" if args.device == "cuda" else "hidden_states"
    )
    args.out = args.out or RESULTS / f"{name}.json"
    return args


def build(config: dict, path: str, device: str, tiled: bool) -> None:
    builder = mp.get_context("spawn").Process(target=build_model, args=(config, path, device, tiled))
    builder.start()
    builder.join()
    if builder.exitcode:
        raise SystemExit(f"building the model failed (exit code {builder.exitcode})")


def settings(args, spec: Spec, config: dict, tokens: int) -> dict:
    from importlib.metadata import version

    return {
        **{k: v for k, v in asdict(spec).items() if k not in ("model_dir", "out_dir")},
        "layers": list(spec.layers),
        "model": config,
        "model_dtype": "bfloat16",
        "sigma": SIGMA,
        "naive_batch_rule": "given" if args.naive_batch else "matched to ours' average padded batch",
        "window_samples": math.ceil(args.samples / args.rounds),
        "store_dtype": "bfloat16",
        "mean_tokens_per_sample": round(tokens / args.samples, 1),
        "torch": version("torch"),
        "transformers": version("transformers"),
    }


def compare(args, config: dict, layers: list[int], samples: int, rounds: int, fp8: bool, tiled: bool = False):
    """Build the model, run ours and naive (and fp8) on it: (spec, runs, naive_choice, fp8 error or None)."""
    lens = lengths(samples, args.seed, args.mean_len, args.max_len)
    naive_choice = choose_naive_batch(lens, rounds, args.batch_tokens, args.naive_batch)
    with tempfile.TemporaryDirectory(prefix="bench-hidden-states-") as tmp:
        model_dir = str(Path(tmp) / "model")
        build(config, model_dir, args.device, tiled)
        spec = Spec(
            model_dir=model_dir,
            out_dir=tmp,
            device=args.device,
            threads=args.threads,
            samples=samples,
            seed=args.seed,
            mean_len=args.mean_len,
            max_len=args.max_len,
            vocab=config["vocab_size"],
            rounds=rounds,
            batch_tokens=args.batch_tokens,
            shard_max_tokens=args.shard_max_tokens,
            naive_batch=naive_choice[0],
            layers=tuple(layers),
        )
        runs = interleaved(spec, fp8)
        return spec, runs, naive_choice, fp8_rel_err(spec) if fp8 else None


NO_GPU = "--device cuda: torch sees no GPU here (torch.cuda.is_available() is False); run it where one is"


def check_device(device: str) -> None:
    """Before a model is built: without a GPU, `--device cuda` would fail in a worker with a traceback."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(NO_GPU)


def main(argv=None) -> None:
    from draftdata.drafters.layers import default_layers

    args = parse_args(argv)
    check_device(args.device)
    t0 = time.perf_counter()
    config = model_config(args)
    if args.llama8b:
        res = real_shape(args)
        print_real(res)
    else:
        spec, runs, choice, err = compare(args, config, default_layers(args.layers), args.samples, args.rounds, True)
        res = summarise(spec, runs, err, args.hidden, choice)
        res["settings"] = settings(args, spec, config, res["paths"]["ours"]["tokens"])
        print_table(res)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out} in {res['wall_s']}s")


if __name__ == "__main__":
    main()
