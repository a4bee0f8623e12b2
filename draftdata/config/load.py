"""Composition of the config: schema defaults < conf/ presets < params.yaml < command line (Hydra's grammar), and the
entry point every stage and command shares (`cli`): one line and exit status 2 for bad input, never a traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftdata.config.schema import CONF_DIR, Config, validate
from draftdata.errors import ConfigError, UserError


def _read_params(path: Path) -> dict:
    import yaml

    if not path.exists():
        return {}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(where, f"invalid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "must be a mapping at the top level")
    return data


def _check_sections(params: dict, source: str) -> None:
    """Sections the schema reads as mappings, checked before composition: OmegaConf's merge error for a list or a
    string in their place names no key."""

    def mapping(key: str, value: Any) -> None:
        if value is not None and not isinstance(value, dict):
            raise ConfigError(key, f"must be a mapping of keys, got a {type(value).__name__} [from {source}]")

    for name in Config.__dataclass_fields__:
        if name != "dataset":
            mapping(name, params.get(name))
    for name, ds in (params.get("datasets") or {}).items():
        mapping(f"datasets.{name}", ds)
        for section in ("source", "sampling", "template_kwargs"):
            mapping(f"datasets.{name}.{section}", (ds or {}).get(section))


def _omegaconf_error(e: BaseException, source: str) -> ConfigError:
    """Turn Hydra/OmegaConf's multi-line, chained messages into one line that starts with the full key.

    Hydra wraps the OmegaConf error that knows the key (`full_key`) in a composition error that does not."""
    cause: BaseException | None = e
    while cause is not None and not getattr(cause, "full_key", None):
        cause = cause.__cause__ or cause.__context__
    err = cause or e
    key = getattr(err, "full_key", None) or source
    msg = str(getattr(err, "msg", None) or err).strip().splitlines()[0]
    if msg.startswith("Key '") and " not in " in msg:  # a typo'd key: say so plainly
        msg = f"unknown key ({msg}){_did_you_mean(str(key).split('.'))}"
    if "is not a subclass of ModeConfig" in msg:  # `modes={a: 0.5}`: the forms a mode is given in
        modes, _, name = str(key).rpartition(".")
        msg += f"; a mode is a mapping: {modes}={{{name}: {{weight: 0.5}}}}, or a key at a time: {key}.weight=0.5"
    return ConfigError(key, f"{msg} [from {source}]")


def _did_you_mean(parts: list[str]) -> str:
    """`; did you mean <the nearest key>?` for an unknown key (its dotted parts), or nothing without a near one. The
    first part the schema does not know is the one mended, a section as well as a leaf (`hidden_state.layers`: did
    you mean hidden_states.layers?)."""
    import difflib
    import typing

    for i, part in enumerate(parts):
        parent = _schema_node(parts[:i])
        if typing.get_origin(parent) in (dict, typing.Dict):  # noqa: UP006 - a named entry (datasets.<name>): any name
            continue
        if not hasattr(parent, "__dataclass_fields__"):
            return ""  # below a leaf, or in a free-form mapping: nothing to compare with
        known = list(typing.get_type_hints(parent))
        if part in known:
            continue
        near = difflib.get_close_matches(part, known, n=1)
        return f"; did you mean {'.'.join(parts[:i] + near + parts[i + 1 :])}?" if near else ""
    return ""


def _backend_presets() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "backend").glob("*.yaml"))


def _known_backend(key: str, kind: Any, source: str) -> str:
    if kind not in _backend_presets():
        raise ConfigError(key, f"unknown backend {kind!r}; known: {', '.join(_backend_presets())} [from {source}]")
    return kind


def _command_line_backend(overrides: list[str]) -> tuple[str | None, list[str]]:
    """The backend kind the command line names, by `backend=K` or `backend.kind=K` (one meaning), and the other
    overrides. Both forms are taken out: the caller selects the preset and sets the kind itself."""
    named: dict[str, str] = {}  # the override as written -> its kind
    rest = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+") in ("backend", "backend.kind"):
            named[override] = _known_backend(key.lstrip("+"), value, "command line")
        else:
            rest.append(override)
    if len(set(named.values())) > 1:
        raise ConfigError("backend", f"the command line names two backends ({' and '.join(named)}); give one")
    return next(iter(named.values()), None), rest


def _select_backend(params: dict, overrides: list[str], params_path: Path) -> list[str]:
    """Overrides that select the conf/backend/ preset of the run's backend kind, so its defaults apply.

    The kind comes from the command line (`backend=K` or `backend.kind=K`), else from params.yaml's
    `backend.kind`. params.yaml's other `backend` keys merge on top of the preset either way, also when they were
    written for another kind: a run with `backend=sglang` keeps params.yaml's urls, and a key that does not fit
    the chosen kind (e.g. no urls for a server) is reported by BackendConfig.check. params.yaml's own `kind` is
    replaced by the command line's, since it is merged after the preset and would otherwise silently win."""
    kind, overrides = _command_line_backend(overrides)
    backend = params.get("backend")
    if kind is not None:
        if isinstance(backend, dict):
            params["backend"] = dict(backend, kind=kind)
    elif isinstance(backend, dict) and backend.get("kind") is not None:
        kind = _known_backend("backend.kind", backend["kind"], str(params_path))
    else:
        return overrides  # conf/config.yaml's default preset
    return [f"backend={kind}", *overrides]


_FREE = "free"  # a Dict[str, Any] field: any key below it is the user's (template_kwargs, sampling.extra, ...)


def _schema_node(parts: list[str]):
    """What the schema has at a dotted key: a dataclass, a leaf type, _FREE (inside a free-form mapping), or None
    (no such key)."""
    import dataclasses
    import typing

    node: Any = Config
    for part in parts:
        while typing.get_origin(node) is typing.Union:  # Optional[X]
            node = next(a for a in typing.get_args(node) if a is not type(None))
        if dataclasses.is_dataclass(node):
            hints = typing.get_type_hints(node)
            if part not in hints:
                return None
            node = hints[part]
        elif typing.get_origin(node) in (dict, typing.Dict):  # noqa: UP006 - the schema's annotations
            value = typing.get_args(node)[1]
            if value is Any:
                return _FREE
            node = value  # a named entry (datasets.<name>): any name
        else:
            return None  # below a leaf
    return node


def _checked_overrides(overrides: list[str], params: dict | None = None) -> list[str]:
    """The command line against the schema, before Hydra: `+key=v` adds a key, which a typo'd key must not be
    (`+datasets.D.token_budgt=5000` was taken silently); `key={a: b}` on a mapping (template_kwargs, sampling.extra,
    extra_body, vllm_kwargs; a dataset's modes) replaces the mapping's keys given, which Hydra refuses for keys not
    yet in it; and a new entry of a dataset's typed mapping (`+datasets.D.modes.think.weight=0.7`) is added whole
    (`_new_entry`), as Hydra's own `+` refuses it."""
    import dataclasses
    import typing

    out = []
    for override in overrides:
        key, sep, value = override.partition("=")
        bare = key.lstrip("+~")
        if not sep or bare in ("dataset", "backend"):
            out.append(override)
            continue
        parts = bare.split(".")
        node = _schema_node(parts)
        if node is None:
            raise ConfigError(bare, f"unknown key{_did_you_mean(parts)} [from command line]")
        if not key.startswith("~") and (entry := _new_entry(parts, value, params or {})) is not None:
            out.append(entry)
            continue
        args = typing.get_args(node)[1:]
        mapping = node is _FREE or args == (Any,) or (len(args) == 1 and dataclasses.is_dataclass(args[0]))
        if not key.startswith("+") and value.lstrip().startswith("{") and mapping:
            override = f"++{bare}={value}"
        out.append(override)
    return out


def _new_entry(parts: list[str], value: str, params: dict) -> str | None:
    """`[+]datasets.D.modes.think.weight=0.7` or `datasets.D.modes.think={weight: 0.7}` where params.yaml has no mode
    `think`: `++datasets.D.modes={think: {weight: 0.7}}`, the one form Hydra takes for a new entry of a mapping of
    typed entries (it adds the entry as a plain mapping, which the entry's type refuses). None: not such a key (a
    dataset itself is not added from the command line: its stages are dvc.yaml's)."""
    import dataclasses
    import typing

    held: Any = params
    for i in range(1, len(parts)):
        held = held.get(parts[i - 1]) if isinstance(held, dict) else None
        node = _schema_node(parts[:i])
        args = typing.get_args(node)[1:] if node is not _FREE else ()
        if i < 2 or len(args) != 1 or not dataclasses.is_dataclass(args[0]):
            continue
        if isinstance(held, dict) and parts[i] in held:
            return None  # the entry is there: Hydra sets its keys
        nested = value
        for part in reversed(parts[i + 1 :]):
            nested = f"{{{part}: {nested}}}"
        return f"++{'.'.join(parts[:i])}={{{parts[i]}: {nested}}}"
    return None


def load_config(
    dataset: str | None,
    overrides: list[str] | None = None,
    params_path: Path | None = None,
    need_dataset: bool = True,
) -> Config:
    """Compose conf/ + params.yaml + overrides into a validated `Config` object."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    params_path = params_path or Path(os.environ.get("DRAFTDATA_PARAMS", "params.yaml"))
    params = _read_params(params_path)
    _check_sections(params, str(params_path))
    overrides = _select_backend(params, _checked_overrides(list(overrides or []), params), params_path)
    cs = ConfigStore.instance()
    cs.store(name="draftdata_schema", node=Config)
    cs.store(name="draftdata_params", node=params)
    if dataset is not None:
        overrides.append(f"dataset={dataset}")
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            composed = compose("config", overrides=overrides)
        cfg: Config = OmegaConf.to_object(composed)
    except (OmegaConfBaseException, HydraException) as e:
        source = "command line" if isinstance(e, HydraException) and "override" in str(e) else str(params_path)
        raise _omegaconf_error(e, source) from None
    validate(cfg, need_dataset=need_dataset)
    return cfg


def _description(main: Callable) -> str:
    """The stage's or command's own docstring: its module's (`python -m stages.X`, `draftdata X`)."""
    module = sys.modules.get(getattr(main, "__module__", "") or "") or sys.modules.get("__main__")
    return (getattr(module, "__doc__", None) or "").strip()


def _print_help(main: Callable, need_dataset: bool, prog: str) -> None:
    """`--help`: what the stage or command does and how to call it; `--show-config` prints the config."""
    description = _description(main)
    if description:
        print(description + "\n")
    print(f"usage: {prog}{' dataset=<D>' if need_dataset else ''} [key=value ...] [--show-config]")
    sections = ", ".join(name for name in Config.__dataclass_fields__ if name != "dataset")
    print(
        "\nkey=value overrides in Hydra's grammar; last wins: schema defaults < conf/ preset < params.yaml < command "
        f"line.\nsections: {sections}; every key is explained in docs/configuration.md.\n"
        f"{prog} --show-config [key=value ...] prints the config these overrides give, as YAML; nothing runs."
    )


def _show_config(overrides: list[str]) -> None:
    """The config it would run with (params.yaml and the overrides given, composed over conf/ and the schema's
    defaults) as YAML. Nothing runs and nothing is written."""
    from omegaconf import OmegaConf

    try:  # the keys, not one dataset's run: a dataset= override is left out and no source file is looked for
        cfg: Any = load_config(None, [o for o in overrides if not o.startswith("dataset=")], need_dataset=False)
    except UserError as e:
        print(f"note: {e}; showing the schema's defaults", file=sys.stderr)
        cfg = Config()
    print(OmegaConf.to_yaml(OmegaConf.structured(cfg)), end="")


def _program(prog: str | None) -> str:
    if prog is not None:
        return prog
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return f"python -m {spec.name if spec is not None else f'stages.{Path(sys.argv[0]).stem}'}"


def _quiet_broken_pipe() -> None:
    """Output piped into `head` and cut short: end quietly, as a shell tool does, not with a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(0)


def _refuse_dashed(args: list[str], prog: str) -> None:
    """`--dataset B3`: the config takes key=value only; a dashed word reached Hydra's parser as an override and ended
    in its lexer's traceback."""
    for arg in args:
        if arg.startswith("-") and arg not in ("--show-config",):
            key = arg.lstrip("-").partition("=")[0]
            raise ConfigError(
                "command line", f"{arg}: {prog} takes key=value (e.g. {key}=...), and --help or --show-config"
            )


def _quiet_library_bars() -> None:
    """Off a terminal (a log file, a pipe), the libraries' own progress bars (transformers' "Loading weights", the
    hub's downloads) are noise in the stage's log, a line each refresh: off there, unless the user set
    HF_HUB_DISABLE_PROGRESS_BARS. The stage's own progress lines say how far it is."""
    if sys.stderr.isatty():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when huggingface_hub is imported
    if "transformers" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # imported already: its switch was read then


def cli(
    main: Callable[[Config], Any], need_dataset: bool = True, argv: list[str] | None = None, prog: str | None = None
) -> None:
    """Entry point of every stage (`python -m stages.<name> dataset=<D> [hydra overrides]`) and of the commands that
    take the config (`draftdata plan|export ...`); `--help` (`-h`) says what it does and how to call it,
    `--show-config` prints the config it would run with; neither runs anything."""
    args = sys.argv[1:] if argv is None else argv
    prog = _program(prog)
    try:
        if "--help" in args or "-h" in args:
            _print_help(main, need_dataset, prog)
            return
        if "--show-config" in args:
            _show_config([a for a in args if a != "--show-config"])
            return
    except BrokenPipeError:
        _quiet_broken_pipe()
    try:
        _refuse_dashed(args, prog)
        _quiet_library_bars()
        main(load_config(dataset=None, overrides=args, need_dataset=need_dataset))
    except BrokenPipeError:
        _quiet_broken_pipe()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("interrupted: what was finished is kept; run again to go on", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # out of disk anywhere (a shard, the store's SQLite): one line, not a traceback
        from draftdata.util.files import DiskFull, disk_full

        if not disk_full(e):
            raise
        if isinstance(e, DiskFull):  # already names the file
            print(f"error: {e}", file=sys.stderr)
        else:
            where = getattr(e, "filename", None) or ("the store (run.store_path)" if "database" in str(e) else None)
            print(
                f"error: No space left on device{f' writing {where}' if where else ''} ({str(e).splitlines()[0]});"
                " what was produced before is kept: free space (or move run.store_path / data) and run again",
                file=sys.stderr,
            )
        sys.exit(2)
