"""`draftdata export dataset=<D> export.format=specforge|speculators`: a dataset's hidden states in a trainer's own
layout (not a DVC stage: run it where the drafter is trained).
"""

from __future__ import annotations

import json
import shutil

from draftdata.config.load import cli
from draftdata.config.schema import Config
from draftdata.errors import ConfigError
from draftdata.hidden.export import (
    LAYER_NUMBERING,
    MARKER,
    WRITERS,
    ExportTally,
    check_source,
    check_target,
    export_dir,
    marker,
    publish,
    staging_dir,
)
from draftdata.hidden.reader import HiddenStates
from draftdata.util.files import data_dir, write_json
from draftdata.util.log import log


def main(cfg: Config) -> None:
    fmt = cfg.export.format
    if fmt not in WRITERS:  # config.check says so first; kept for callers that build a Config by hand
        raise ConfigError("export.format", f"must be one of {', '.join(WRITERS)}, got {fmt!r}")
    src = data_dir(cfg.dataset) / "hidden_states"
    check_source(src, cfg.dataset)
    out = export_dir(cfg)
    check_target(out)
    hs = HiddenStates(src)
    staging, tally = staging_dir(out), ExportTally()
    try:
        WRITERS[fmt](hs, staging, tally)
        write_json(staging / MARKER, marker(fmt, hs, src, tally))  # last: its presence means complete
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(
        "export",
        dataset=cfg.dataset,
        format=fmt,
        dir=out,
        samples=tally.samples,
        tokens=tally.tokens,
        aux_layer_ids=json.dumps(hs.layers[LAYER_NUMBERING[fmt]]),
    )


def run(argv: list[str]) -> None:
    cli(main, argv=argv, prog="draftdata export")
