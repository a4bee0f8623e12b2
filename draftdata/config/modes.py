"""A dataset's generation modes (`datasets.<D>.modes`): the mode each row gets, each mode's settings, and its share
of the token budget. Pure functions of the config and a row's content key, so a row keeps its mode under any
budget, on every run."""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

from draftdata.config.schema import Config, DatasetConfig, mode_sampling
from draftdata.errors import UserError


def mode_of(row_id: str, ds: DatasetConfig) -> str | None:
    """The mode of the row whose content key is `row_id` (None: the dataset has no modes). Each mode draws a time
    from the key, exponential at its weight's rate, and the first wins (weighted rendezvous hashing): a mode gets
    its weight's share of the rows, and adding a mode or raising its weight moves rows into it only, never
    between the others, so the rows stored under the other modes stay theirs."""
    if not ds.modes:
        return None
    return min(sorted(ds.modes), key=lambda name: -math.log(_uniform(f"{name}\0{row_id}")) / ds.modes[name].weight)


def _uniform(text: str) -> float:
    """A point in (0, 1] drawn from `text`."""
    return (int.from_bytes(hashlib.sha256(f"mode\0{text}".encode()).digest()[:8], "big") + 1) / 2**64


def budget_shares(ds: DatasetConfig) -> dict[str, int]:
    """Each mode's share of the token budget, by weight, in whole tokens that add up to the budget (the largest
    remainders get the tokens rounding leaves, ties in name order)."""
    names = sorted(ds.modes)
    total = sum(ds.modes[n].weight for n in names)
    exact = {n: ds.token_budget * ds.modes[n].weight / total for n in names}
    shares = {n: int(exact[n]) for n in names}
    for n in sorted(names, key=lambda n: (shares[n] - exact[n], n))[: ds.token_budget - sum(shares.values())]:
        shares[n] += 1
    return shares


def mode_config(cfg: Config, name: str) -> Config:
    """The config a mode's rows are generated under: the dataset's, the mode's template_kwargs and sampling over
    its own, and its share of the budget."""
    ds, mode = cfg.ds, cfg.ds.modes[name]
    sub = replace(
        ds,
        template_kwargs={**ds.template_kwargs, **mode.template_kwargs},
        sampling=mode_sampling(ds.sampling, mode),
        token_budget=budget_shares(ds)[name],
        modes={},
    )
    return replace(cfg, datasets={**cfg.datasets, cfg.dataset: sub})


def split_rows(cfg: Config, rows: list[dict]) -> list[tuple[str | None, Config, list[dict]]]:
    """The stage's parts: (mode, its config, its rows in order), one per mode in name order; (None, cfg, rows)
    where the dataset has no modes."""
    if not cfg.ds.modes:
        return [(None, cfg, rows)]
    drawn = [mode_of(row["id"], cfg.ds) for row in rows]
    return [
        (name, mode_config(cfg, name), [row for row, m in zip(rows, drawn) if m == name])
        for name in sorted(cfg.ds.modes)
    ]


def by_recorded_mode(cfg: Config, rows: list[dict], where: str) -> list[tuple[Config, list[dict]]]:
    """Rows an earlier stage wrote, grouped by the mode each records, with the config each mode's rows were made
    under ((cfg, rows) where the dataset has no modes). `where` names the file, for a row whose mode the config
    does not have."""
    if cfg.dataset is None or not cfg.ds.modes:  # (a config made for no one dataset: a library caller's)
        return [(cfg, rows)]
    groups: dict[str, list[dict]] = {name: [] for name in sorted(cfg.ds.modes)}
    for row in rows:
        if row.get("mode") not in groups:
            raise UserError(
                f"{where}: row {row['id']} has mode {row.get('mode')!r}, not one of datasets.{cfg.dataset}.modes "
                f"({', '.join(groups)}); rerun the stage before it"
            )
        groups[row["mode"]].append(row)
    return [(mode_config(cfg, name), group) for name, group in groups.items()]


def mode_warnings(cfg: Config, dataset: str | None = None) -> list[str]:
    """One line per dataset (`dataset` alone, if given) whose mode weights do not add up to 1: they are taken as
    shares of the rows and the budget (weight / their sum), which is said rather than done without a word."""
    lines = []
    for name, ds in cfg.datasets.items():
        if dataset is not None and name != dataset:
            continue
        total = sum(m.weight for m in ds.modes.values())
        if ds.modes and not math.isclose(total, 1.0, rel_tol=1e-9):
            shares = ", ".join(f"{m} {ds.modes[m].weight / total:.0%}" for m in sorted(ds.modes))
            lines.append(f"datasets.{name}.modes: the weights add up to {total:g}, not 1; taken as shares: {shares}")
    return lines
