"""Command `plan`: what the configured budgets will cost, before any GPU time is spent.

`draftdata plan [dataset=<D>] [plan.tok_s=<N>] [plan.out=<path>] [hydra overrides]` prints, per dataset:
the prompts available, the budget, the tokens the response store already holds toward it (keys computed exactly
as generate computes them: tokenizer and model fingerprint, no weights), the tokens and requests still to
generate, the generation time they take at a given or measured rate, and the disk the whole budget takes (responses,
samples, hidden states); it warns of a dataset whose longest sample (max_prompt_tokens + max_tokens) exceeds
`tokenize.max_seq_len` or the target's context, and, where the target's tokenizer is on this disk, refuses in one
line a chat template that ends the turn on a token the target does not stop on (as check_params and generate do).
With `datasets.<D>.turns: all` each assistant turn is a request: the store is walked conversation by
conversation as generate walks it (the turns it holds count, the first it lacks is next), the turns still to send
are those left of each conversation's source turns (its prompt record's `slots`), and a note gives the turns and
completion tokens a conversation holds on average (the disk counts every turn's prompt: where one sample holds a
conversation, an upper bound). Nothing is sent to any server and no backend is started; the only things it may
write are the model's file-hash cache beside the store (as every stage does) and, with `plan.out`, a JSON copy.

`plan.*` keys are this command's own (not in params.yaml): `plan.tok_s` is the generation rate to assume, in
tokens per second (default: the `new_tok_per_s` of the dataset's last `generate_metrics.json`); `plan.out` a file
to write the plan to as JSON.
"""

from __future__ import annotations

import math

from draftdata.cli.costs import DatasetPlan, Options, model_shape, plan_dataset
from draftdata.cli.plan_table import render, to_json
from draftdata.config.load import cli
from draftdata.config.schema import Config, check_all, length_warnings, template_kwargs_of
from draftdata.errors import ConfigError
from draftdata.generate.store import ResponseStore
from draftdata.model.load import ModelNotBuilt, model_dir, model_limits
from draftdata.model.tokenizer import end_of_turn_line, has_tokenizer_files, load_tokenizer
from draftdata.util.files import write_json
from draftdata.util.sqlite import resolve_store_path

OPTIONS = ("plan.tok_s", "plan.out")


def split_options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """This command's `plan.*` overrides, and the rest (for the config loader, whose schema has no `plan`)."""
    mine, rest = {}, []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.startswith("plan."):
            mine[key] = value
        else:
            rest.append(arg)
    return mine, rest


def parse_options(raw: dict[str, str]) -> Options:
    for key in raw:
        if key not in OPTIONS:
            raise ConfigError(key, f"unknown key; known: {', '.join(OPTIONS)} [from command line]")
    opts = Options(out=raw.get("plan.out") or None)
    if "plan.tok_s" in raw:
        try:
            opts.tok_s = float(raw["plan.tok_s"])
        except ValueError:
            opts.tok_s = -1.0
        if not (opts.tok_s > 0 and math.isfinite(opts.tok_s)):
            raise ConfigError(
                "plan.tok_s", f"must be a positive number of tokens per second, got {raw['plan.tok_s']!r}"
            )
    return opts


def main(cfg: Config, opts: Options | None = None) -> list[DatasetPlan]:
    opts = opts or Options()
    check_all(cfg)  # params.yaml whole, as the check_params stage does
    names = [cfg.dataset] if cfg.dataset is not None else list(cfg.datasets)
    try:
        shape = model_shape(cfg)
    except ModelNotBuilt as e:  # a fresh clone before the demo: say so, and plan from the sources alone
        shape, not_built = None, str(e)
    # samples tokenize would drop (or generate refuse) for their length: told here, not refused
    if shape is None:
        warnings = [f"{not_built}; until then prompts are counted from the sources and hidden states are not sized"]
        warnings += length_warnings(cfg, names, None)
    else:
        warnings = length_warnings(cfg, names, model_limits(cfg.model).context)
    tokenizer = _tokenizer_loader(cfg) if shape else None
    ends: list[str] = []
    if tokenizer is not None and has_tokenizer_files(model_dir(cfg.model)):
        # as check_params and generate: a template that ends the turn where the target does not stop, in one line;
        # else which token it is
        ends = sorted({end_of_turn_line(tokenizer(), cfg.model, template_kwargs_of(cfg, name)) for name in names})
    store_path = resolve_store_path(cfg.run.store_path)
    store = ResponseStore(store_path) if store_path.exists() else None  # no store yet: nothing stored, none made
    try:
        plans = [plan_dataset(cfg, name, tokenizer, store, shape, opts) for name in names]
    finally:
        if store is not None:
            store.close()
    print(render(plans, shape, cfg, warnings, ends))
    if opts.out:
        write_json(opts.out, to_json(plans, shape, warnings))
    return plans


def _tokenizer_loader(cfg: Config):
    """The tokenizer, loaded the first time something needs it (the end-of-turn check, a dataset with prompts)."""
    from functools import cache

    return cache(lambda: load_tokenizer(cfg.model))


def run(argv: list[str]) -> None:
    raw, rest = split_options(argv)
    # with dataset=<D> the loader checks that D exists, as for every stage; without it, all datasets are planned
    one = any(a.partition("=")[0].lstrip("+") == "dataset" for a in rest)
    cli(lambda cfg: main(cfg, parse_options(raw)), need_dataset=one, argv=rest, prog="draftdata plan")
