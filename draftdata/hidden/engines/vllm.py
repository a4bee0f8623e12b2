"""The `vllm` hidden-states engine: the target runs in vLLM (tensor parallelism for a target bigger than one GPU),
in a subprocess running draftdata/hidden/engines/vllm_worker.py, in a Python that has vLLM.

vLLM pins its own torch, so it usually lives in a venv of its own (`python`); the subprocess also keeps vLLM's own
process tree away from the pipeline's. Commands go to the worker as JSON lines on its stdin and answers come back on its
stdout; tensors travel as safetensors files in a temp directory that the engine owns (see the protocol in
draftdata/hidden/engines/vllm_worker.py). Each sample is one prompt of its exact token ids (no template, no tokenizer),
generating a single token, with prefix caching off (every position is computed) and chunked prefill off (each prompt is
one forward). Data parallelism runs `data_parallel_size` independent workers, each on its own slice of the GPUs, and
splits every batch among them.

Every failure of the worker (a bad model path, out of memory, a dead engine, a hang) ends in one `UserError` line;
the worker's log is kept and named in it.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

from draftdata.config.schema import ModelConfig
from draftdata.errors import UserError
from draftdata.hidden.norm import FinalNorm
from draftdata.model.load import model_dir

ROOT = Path(__file__).resolve().parents[3]
STARTUP_TIMEOUT_S = 3600.0  # loading a ~1T-parameter target over 8 GPUs takes many minutes
BATCH_TIMEOUT_S = 1800.0
CLOSE_TIMEOUT_S = 60.0


class Worker:
    """One worker process: its line protocol, a liveness check while waiting, and its log."""

    def __init__(self, argv: list[str], env: dict, log_path: Path):
        self.log_path = log_path
        with open(log_path, "wb") as log:
            try:
                # A session of its own: closing can end the worker's whole process tree (vLLM's engine core and
                # TP workers) by the worker's id.
                self.proc = subprocess.Popen(
                    argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True
                )
            except OSError as e:
                raise UserError(f"vllm engine: cannot start {argv[0]!r}: {e.strerror or e}") from None
        self._buf = b""

    def send(self, msg: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise self.died("while receiving a batch") from None

    def reply(self, timeout: float, during: str) -> dict:
        """The next answer line; a worker that exits or stays silent past `timeout` raises instead of hanging."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            if time.monotonic() > deadline:
                self.kill()
                raise UserError(
                    f"vllm engine: no answer from the worker in {timeout:.0f}s {during} ({self.keep_log()})"
                )
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise self.died(during)
                self._buf += chunk
            elif self.proc.poll() is not None:
                raise self.died(during)
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            msg = json.loads(line)
        except ValueError:
            self.kill()
            raise UserError(
                f"vllm engine: an unreadable answer from the worker {during}: {line[:200]!r} ({self.keep_log()})"
            ) from None
        if not msg.get("ok"):
            error = msg.get("error", "unknown error")
            if msg.get("fatal"):
                self.kill()
                # vLLM's own message often points "above", to a root cause that only its log has
                cause = last_error_line(self.log_path)
                error += "" if cause in error else f"; the log says: {cause}"
            raise UserError(f"vllm engine: {error} ({during}; {self.keep_log()})")
        return msg

    def died(self, during: str) -> UserError:
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = self.proc.returncode
        return UserError(
            f"vllm engine: the worker exited (status {rc}) {during}: {last_error_line(self.log_path)} "
            f"({self.keep_log()})"
        )

    def keep_log(self) -> str:
        """Copy the log out of the engine's temp directory, which close() removes."""
        fd, kept = tempfile.mkstemp(prefix="draftdata-vllm-", suffix=".log")
        os.close(fd)
        shutil.copyfile(self.log_path, kept)
        return f"log: {kept}"

    def ask_to_close(self) -> None:
        """The worker shuts vLLM down and exits on `close` (or on end of input, if it is busy)."""
        if self.proc.poll() is None and not self.proc.stdin.closed:
            try:
                self.send({"cmd": "close"})
                self.proc.stdin.close()
            except (UserError, OSError):
                pass

    def close(self) -> None:
        self.ask_to_close()
        try:
            self.proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def kill(self) -> None:
        """End what is left of the worker's process group: SIGTERM, a grace period, then SIGKILL."""
        for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break  # the group is empty
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


def last_error_line(log_path: Path) -> str:
    """The most telling line of a worker's log: its last exception line (warnings aside), else its last line."""
    try:
        lines = [x.strip() for x in log_path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        if re.search(r"\bWARNING \d\d-\d\d ", line):  # vLLM logs some handled exceptions as warnings
            continue
        tail = line.split("] ", 1)[-1]  # without vLLM's log prefix
        if re.match(r"[\w.]*(Error|Exception)\b[^:]*:", tail):
            return tail[:500]
    return lines[-1][:500] if lines else "no output"


def device_slices(data_parallel_size: int, tensor_parallel_size: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each data-parallel worker: consecutive groups of the visible GPUs (None: leave the
    environment as it is, as for a single worker)."""
    if data_parallel_size == 1:
        return [None]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(data_parallel_size * tensor_parallel_size)]
    if len(devices) < data_parallel_size * tensor_parallel_size:
        raise UserError(
            f"vllm engine: {data_parallel_size} x {tensor_parallel_size} GPUs asked for, "
            f"CUDA_VISIBLE_DEVICES has {len(devices)}"
        )
    n = tensor_parallel_size
    return [",".join(devices[i * n : (i + 1) * n]) for i in range(data_parallel_size)]


def split_batch(lengths: list[int], parts: int) -> list[list[int]]:
    """Consecutive sample indices for each worker, balanced by tokens; results are put back in batch order."""
    total = sum(lengths)
    out: list[list[int]] = [[] for _ in range(parts)]
    seen = 0
    for i, n in enumerate(lengths):
        out[min(parts - 1, seen * parts // max(total, 1))].append(i)
        seen += n
    return out


def norm_from_file(path: str, info: dict) -> FinalNorm:
    """The final norm the worker read, checked against its probe: a norm of another formula stops here, as in
    `draftdata.hidden.engines.hf.final_norm_of`, rather than silently converting the stored states wrongly."""
    import torch
    from safetensors.torch import load_file

    t = load_file(path)
    spec = FinalNorm(
        info["kind"], float(info["eps"]), t["weight"], t.get("bias"), weight_offset=float(info["weight_offset"])
    )
    if not torch.allclose(spec.apply(t["probe_in"]), t["probe_out"].float(), rtol=1e-2, atol=1e-2):
        raise UserError(
            f"model.path: the final norm ({info.get('class')}) is neither RMSNorm nor LayerNorm as known "
            "here; the post-norm state could not be derived from the stored pre-norm one"
        )
    return spec


def engine_kwargs(model_cfg: ModelConfig, llm_kwargs: dict | None) -> dict:
    """`hidden_states.vllm_kwargs` for vllm.LLM, with `model.trust_remote_code` passed on (a key of the user's own
    wins): the stages read a checkpoint that ships its own code with it, and so must vLLM."""
    trust = {"trust_remote_code": True} if model_cfg.trust_remote_code else {}
    return {**trust, **dict(llm_kwargs or {})}


class VLLMEngine:
    """See the module docstring. `path`: `extract` (vLLM's own hidden-state extraction), `hook` (draftdata's capture
    inside vLLM's forward) or `auto` (extract where it runs, else hook); `vllm_path` says which runs, `fallback` why
    not extract. `capture`, the hook path's mechanism: `auto` (vLLM's EAGLE-3 aux hidden states where the model has
    them, else forward hooks), `aux` or `hooks`. `llm_kwargs` go to `vllm.LLM` as they are (e.g. dtype,
    gpu_memory_utilization, trust_remote_code)."""

    pad_tokens = 0  # vLLM packs sequences: nothing is padded

    def __init__(
        self,
        model_cfg: ModelConfig,
        layers: list[int],
        python: str | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        max_batch_tokens: int = 16384,
        llm_kwargs: dict | None = None,
        capture: str = "auto",
        path: str = "auto",
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        batch_timeout_s: float = BATCH_TIMEOUT_S,
    ):
        if tensor_parallel_size < 1 or data_parallel_size < 1 or max_batch_tokens < 1:
            raise UserError("vllm engine: tensor_parallel_size, data_parallel_size and max_batch_tokens must be >= 1")
        self.layers = list(layers)
        self.batch_timeout_s = batch_timeout_s
        self.dir = Path(tempfile.mkdtemp(prefix="draftdata-vllm-"))
        self.workers: list[Worker] = []
        self._batches = 0
        self._finalizer = weakref.finalize(self, _cleanup, self.workers, self.dir)
        # The model's directory (a hub id's cached snapshot at its resolved commit) passed resolved, so that it
        # means the same wherever vLLM's processes run
        settings = {
            "model": str(Path(model_dir(model_cfg)).expanduser().resolve()),
            "layers": self.layers,
            "tensor_parallel_size": tensor_parallel_size,
            "max_batch_tokens": max_batch_tokens,
            "llm_kwargs": engine_kwargs(model_cfg, llm_kwargs),
            "mode": capture,
            "path": path,
        }
        try:
            self._start(python or sys.executable, settings, data_parallel_size, tensor_parallel_size, startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, python: str, settings: dict, dp: int, tp: int, timeout: float) -> None:
        # Started together, so that the replicas load at the same time; answered in turn.
        for i, devices in enumerate(device_slices(dp, tp)):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = devices
            files = {"norm_file": str(self.dir / f"norm-{i}.safetensors"), "states_dir": str(self.dir / f"states-{i}")}
            mine = dict(settings, **files)
            argv = [python, "-m", "draftdata.hidden.engines.vllm_worker", json.dumps(mine)]
            self.workers.append(Worker(argv, env, self.dir / f"worker-{i}.log"))
        deadline = time.monotonic() + timeout
        infos = [w.reply(max(1.0, deadline - time.monotonic()), "while loading the model") for w in self.workers]
        try:
            self._describe(infos[0])
        except (KeyError, TypeError, ValueError, OSError) as e:
            # A worker of another version, or one that broke mid-reply: a worker failure like any other, named by
            # its log, not a traceback from deep in the engine
            worker = self.workers[0]
            worker.kill()
            detail = (str(e).splitlines() or [""])[0][:200]
            what = f"lacks {e}" if isinstance(e, KeyError) else f"is unusable ({type(e).__name__}: {detail})"
            raise UserError(
                f"vllm engine: the worker's start-up reply {what} while loading the model ({worker.keep_log()})"
            ) from None
        bad = [i for i in self.layers if not 0 <= i < self.n_layers]
        if bad:
            raise UserError(f"hidden_states.layers: layer ids {bad} out of range for a {self.n_layers}-layer model")

    def _describe(self, first: dict) -> None:
        """The model as the worker's start-up reply describes it (the protocol in vllm_worker.py)."""
        self.n_layers = int(first["n_layers"])
        self.hidden_size = int(first["hidden_size"])
        self.max_len = int(first["max_len"])
        self.vocab_size = int(first["vocab_size"])
        self.capture = first["mode"]
        self.vllm_path = first["path"]
        self.fallback = first.get("fallback")
        self.final_norm = norm_from_file(first["norm_file"], first["norm"])

    def forward(self, batch: list[list[int]]) -> list[tuple[object, object]]:
        """Per sample of `batch`, in order: (aux [T, k, H], final pre-norm [T, H]), float32 on the CPU."""
        if not self.workers:
            raise UserError("vllm engine: forward() after close()")
        self._check(batch)
        parts = split_batch([len(x) for x in batch], len(self.workers))
        self._batches += 1
        out: list = [None] * len(batch)
        try:
            sent = [(w, rows, self._send(w, [batch[i] for i in rows])) for w, rows in zip(self.workers, parts) if rows]
            for worker, rows, stem in sent:
                path = worker.reply(self.batch_timeout_s, "while running a batch")["output"]
                os.unlink(f"{stem}.in.safetensors")
                for i, states in zip(rows, read_states(path, [len(batch[i]) for i in rows])):
                    out[i] = states
        except UserError:
            self.close()  # a worker that failed a batch is not trusted with the next
            raise
        return out

    def _send(self, worker: Worker, batch: list[list[int]]) -> str:
        stem = str(self.dir / f"batch-{self._batches}-{self.workers.index(worker)}")
        write_batch(f"{stem}.in.safetensors", batch)
        worker.send({"cmd": "forward", "input": f"{stem}.in.safetensors", "output": f"{stem}.out.safetensors"})
        return stem

    def _check(self, batch: list[list[int]]) -> None:
        """Refuse here what would fail or kill vLLM's engine (an out-of-vocabulary id crashes it): restarting a
        large target costs many minutes."""
        for ids in batch:
            if not 0 < len(ids) < self.max_len:  # one position is kept for the token vLLM generates
                raise UserError(
                    f"vllm engine: a sample of {len(ids)} tokens; this engine takes 1 to "
                    f"{self.max_len - 1} (max_batch_tokens and the model's context cap it)"
                )
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise UserError(
                    f"vllm engine: token id {max(ids) if max(ids) >= self.vocab_size else min(ids)} "
                    f"out of the model's vocabulary (0..{self.vocab_size - 1})"
                )

    def close(self) -> None:
        self._finalizer()
        self.workers.clear()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_batch(path: str, batch: list[list[int]]) -> None:
    import torch
    from safetensors.torch import save_file

    save_file(
        {
            "ids": torch.tensor([t for ids in batch for t in ids], dtype=torch.int64),
            "lengths": torch.tensor([len(ids) for ids in batch], dtype=torch.int64),
        },
        path,
    )


def read_states(path: str, lengths: list[int]) -> list[tuple[object, object]]:
    """Split a worker's file into per-sample float32 tensors, then delete it (it can be large)."""
    from safetensors.torch import load_file

    t = load_file(path)
    os.unlink(path)
    aux, final = t["aux"].float(), t["final"].float()
    out, start = [], 0
    for n in lengths:
        out.append((aux[start : start + n], final[start : start + n]))
        start += n
    if start != aux.shape[0]:
        raise UserError(f"vllm engine: the worker returned {aux.shape[0]} token rows for {start} tokens")
    return out


def _cleanup(workers: list[Worker], directory: Path) -> None:
    """Also run when the engine is garbage-collected or the interpreter exits: no worker outlives its engine."""
    for w in workers:  # all asked first: data-parallel replicas shut down together
        w.ask_to_close()
    for w in workers:
        w.close()
    shutil.rmtree(directory, ignore_errors=True)
