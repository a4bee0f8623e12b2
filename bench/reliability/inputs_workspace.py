"""What the `inputs` suite runs stages in: a tiny target built locally, loopback servers, and throwaway project
directories with their own params.yaml (as the tests use), plus a small file system to fill up."""

from __future__ import annotations

import copy
import errno
import json
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from bench.reliability.inputs_server import CountingServer

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "sources" / "demo"
DATASET = "B"
CONTEXT = 512  # the tiny target's max_position_embeddings: small, so "longer than the context" is cheap to write
MODEL_DIR = "tiny-llama"  # every model variant lives in a directory of this name, so the servers' id matches it
OTHER_MODEL = "Qwen/Qwen3-8B"  # what the wrong server says it serves


# the base project's stages and the output each leaves in data/B/
BASE_CHAIN = (("prompts", "prompts.jsonl"), ("generate", "responses.jsonl"), ("tokenize", "samples.parquet"))


class SetupError(RuntimeError):
    """A step that prepares a case failed: the case cannot say anything about the input it was meant to test."""


def messages_row(i: int) -> dict:
    return {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"Question {i}: how do I sort a list of {i} numbers in Python?"},
            {"role": "assistant", "content": "Use sorted()."},
        ]
    }


def jsonl(rows: list) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


class Assets:
    """Built once per suite run: the target (and broken copies of it), a prompt source, the servers, and a base
    project whose outputs (prompts, responses, samples; each made when first needed) the cases that need earlier
    outputs start from."""

    def __init__(self, root: Path):
        self.root = root
        self.env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            OMP_NUM_THREADS="1",
        )  # a tiny model on a few cores: threads only contend
        self.model = self._build_model()
        self.source = root / "sources" / "prompts.jsonl"
        self.source.parent.mkdir(parents=True, exist_ok=True)
        self.source.write_text(jsonl([messages_row(i) for i in range(300)]))
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.model)
        answer = "To sort a list in Python, call sorted(xs) for a new list or xs.sort() to sort it in place. " * 2
        ids = tok(answer, add_special_tokens=False)["input_ids"][:48] + [tok.eos_token_id]
        text = tok.decode(ids, skip_special_tokens=True)
        self.right = CountingServer(MODEL_DIR, ids, text, CONTEXT).start()
        self.wrong = CountingServer(OTHER_MODEL, ids, text, CONTEXT).start()
        self.servers = (self.right, self.wrong)
        self.base = Workspace(self.root / "base", copy.deepcopy(self.params()), self)

    def close(self) -> None:
        for server in self.servers:
            server.stop()

    def requests(self) -> int:
        return sum(s.posts for s in self.servers)

    def reset(self) -> None:
        for s in self.servers:
            s.reset()

    def _build_model(self, vocab_size: int = 2048) -> Path:
        from transformers.utils import logging

        from draftdata.config.schema import TinyModelConfig
        from draftdata.model.tiny import build_model, build_tokenizer, iter_demo_texts

        logging.disable_progress_bar()  # the suite prints its own table
        out = self.root / "models" / MODEL_DIR
        cfg = TinyModelConfig(
            path=str(out), corpus_dir=str(DEMO), max_position_embeddings=CONTEXT, mean_response_tokens=24
        )
        tok = build_tokenizer(iter_demo_texts(DEMO), vocab_size)
        model = build_model(
            cfg, len(tok), tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
        )
        tok.save_pretrained(out)
        model.save_pretrained(out)
        return out

    def _variant(self, name: str) -> Path:
        out = self.root / "variants" / name / MODEL_DIR
        shutil.copytree(self.model, out)
        return out

    @cached_property
    def model_without_template(self) -> Path:
        """The target with its chat template removed (file and tokenizer_config key alike)."""
        out = self._variant("no_template")
        (out / "chat_template.jinja").unlink(missing_ok=True)
        conf = json.loads((out / "tokenizer_config.json").read_text())
        conf.pop("chat_template", None)
        (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))
        return out

    @cached_property
    def model_with_bigger_vocab(self) -> Path:
        """The target's weights (vocab 2054) beside a tokenizer trained to 4096 tokens: ids past the embedding."""
        from draftdata.model.tiny import build_tokenizer, iter_demo_texts

        out = self._variant("big_vocab")
        build_tokenizer(iter_demo_texts(DEMO), 4096).save_pretrained(out)
        return out

    def params(self) -> dict:
        return {
            "model": {"path": str(self.model), "revision": None, "chat_template": None, "template_kwargs": {}},
            "tokenize": {"max_seq_len": 1024, "on_too_long": "drop", "train_on": "last_turn"},
            "hidden_states": {"layers": None, "dtype": "bfloat16", "shard_max_tokens": 4096, "batch_tokens": 2048},
            "backend": {
                "kind": "openai",
                "urls": [self.right.url],
                "prompt_format": "ids",
                "return_token_ids": True,
                "stream": False,
                "request_timeout_s": 30.0,
                "max_retries": 1,
                "startup_timeout_s": 10.0,
            },
            "run": {"store_path": "store/store.sqlite", "log_every_s": 5.0, "progress": False},
            "datasets": {
                DATASET: {
                    "source": {"shape": "messages", "path": str(self.source)},
                    "max_prompts": None,
                    "max_prompt_tokens": None,
                    "shuffle_seed": 0,
                    "on_bad_record": "fail",
                    "token_budget": 1500,
                    "budget_unit": "completion",
                    "max_tokens": 64,
                    "sampling": {"temperature": 0.8, "top_p": 0.95, "top_k": -1},
                    "on_budget": "cancel",
                    "on_truncation": "keep",
                    "concurrency": 8,
                }
            },
        }

    def workspace(self, name: str) -> Workspace:
        return Workspace(self.root / "cases" / name, copy.deepcopy(self.params()), self)

    def base_output(self, name: str) -> Path:
        """data/B/<name> of the base project, running the stages that make it the first time it is asked for."""
        for stage, output in BASE_CHAIN:
            if not (self.base.data / output).exists():
                self.base.stage(stage)
            if output == name:
                return self.base.data / name
        raise ValueError(f"no base stage writes {name}")

    @cached_property
    def base_responses(self) -> int:
        return len(self.base_output("responses.jsonl").read_text().splitlines())


class Workspace:
    """A project directory with its own params.yaml; stages run in it as subprocesses, as a user runs them."""

    def __init__(self, path: Path, params: dict, assets: Assets):
        self.path, self.params, self.assets = path, params, assets
        self.path.mkdir(parents=True)
        self.cleanups: list[Callable[[], None]] = []
        self.fsize_limit: int | None = None  # RLIMIT_FSIZE for the judged run (the disk-full fallback)
        self.disk = ""  # how a full disk was made, when a case makes one
        self.notes: dict = {}  # what a case's setup records for its own check after the run
        self.save()

    @property
    def data(self) -> Path:
        return self.path / "data" / DATASET

    def save(self) -> None:
        (self.path / "params.yaml").write_text(yaml.safe_dump(self.params, sort_keys=False))

    def set(self, dotted: str, value: Any) -> None:
        node = self.params
        *head, last = dotted.split(".")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = value
        self.save()

    def write(self, rel: str, data: str | bytes) -> Path:
        path = self.path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return path

    def use_source(self, rel: str, data: str | bytes, shape: str = "messages", **dataset: Any) -> Path:
        """A prompt source of the workspace's own, given by its relative path (so messages name it as written)."""
        self.write(rel, data)
        self.set(f"datasets.{DATASET}.source", {"shape": shape, "path": rel})
        for key, value in dataset.items():
            self.set(f"datasets.{DATASET}.{key}", value)
        return self.path / rel

    def copy_base(self, *names: str) -> None:
        """Earlier outputs of the base project (data/B/<name>), as if this project had run those stages."""
        self.data.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copy2(self.assets.base_output(name), self.data / name)

    def command(self, stage: str, *overrides: str, dataset: str = DATASET) -> list[str]:
        return [sys.executable, "-m", f"stages.{stage}", f"dataset={dataset}", *overrides]

    def stage(self, stage: str, *overrides: str) -> None:
        """Run a stage that prepares a case; it must succeed."""
        proc = subprocess.run(
            self.command(stage, *overrides),
            cwd=self.path,
            env=self.assets.env,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=300,
        )
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
            raise SetupError(f"{stage} exited {proc.returncode}: {tail[0]}")

    def run(self, stage: str, dataset: str, overrides: tuple, timeout: float) -> subprocess.CompletedProcess:
        """The judged run. A TimeoutExpired is the caller's to report."""
        limit = self.fsize_limit
        preexec = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))) if limit else None
        return subprocess.run(
            self.command(stage, *overrides, dataset=dataset),
            cwd=self.path,
            env=self.assets.env,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            preexec_fn=preexec,
        )

    # ---- a small file system to fill up -------------------------------------------------------------------- #

    def small_fs(self, rel: str, size: str = "4m") -> None:
        """Mount a tmpfs of `size` at `rel` (real ENOSPC, as on a full disk). Where mounting is not permitted, the
        judged run gets a per-file size limit instead (RLIMIT_FSIZE: EFBIG, "File too large", for any file that
        grows past the limit, wherever it is), set by `fill`."""
        path = self.path / rel
        path.mkdir(parents=True, exist_ok=True)
        mounted = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
            ).returncode
            == 0
        )
        self.disk = "tmpfs" if mounted else "RLIMIT_FSIZE"
        if mounted:
            self.cleanups.append(lambda: _umount(path))

    def fill(self, rel: str, leave: int) -> None:
        """Leave `leave` bytes free on the tmpfs at `rel`; without one, cap every file at `leave` bytes."""
        if self.disk != "tmpfs":
            self.fsize_limit = leave
            return
        filler = self.path / rel / ".filler"
        chunk = b"\0" * (64 << 10)
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            while True:  # unbuffered writes: the last one fails with ENOSPC and nothing is left pending
                os.write(fd, chunk)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
        finally:
            os.close(fd)
        os.truncate(filler, max(0, filler.stat().st_size - leave))


def _umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
