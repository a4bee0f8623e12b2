"""What the benches that drive the generate stage's own client build alike: a config of one dataset of token-id
prompts on a store in a temporary directory, and the plan of those prompts (bench/budget_live.py, bench/client.py,
bench/fleet.py), and the run of that plan on an empty store."""

from __future__ import annotations

MODEL = "bench-model"  # what the benches' servers say they serve


def stage_config(store_dir: str, backend, **dataset):
    """A Config of one dataset `bench` (a `messages` source the plan stands in for, `dataset`'s fields over the
    defaults) generated through `backend`, its store in `store_dir`, no progress display."""
    from draftdata.config.schema import Config, DatasetConfig, ModelConfig, RunConfig, SourceConfig

    ds = DatasetConfig(source=SourceConfig(shape="messages", path="-"), **dataset)
    return Config(
        dataset="bench",
        datasets={"bench": ds},
        model=ModelConfig(path=MODEL),
        backend=backend,
        run=RunConfig(store_path=f"{store_dir}/store.sqlite", progress=False, log_every_s=3600),
    )


def id_plan(prompts: list[list[int]]) -> list:
    """A planned request per token-id prompt, keyed by its ids as the store keys are (hex digests)."""
    from draftdata.generate.request import Planned
    from draftdata.util.hashing import content_hash

    return [
        Planned({"id": f"p{i}", "messages": [{"role": "user", "content": "x"}]}, content_hash(ids, n=32), ids)
        for i, ids in enumerate(prompts)
    ]


def fresh_run(plan: list, ds):
    """The generate stage's Plan of `plan` on an empty store (under `ds.landing: exact` the controller waits for the
    settled run from the first request, as the stage's; under `finished` it lands on complete answers alone)."""
    from draftdata.generate.accounting import standing
    from draftdata.generate.plan.planning import Plan

    return Plan(ds, plan, {}, standing(plan, {}, ds))
