"""Does a trained EAGLE-3 drafter use the target's states? One kept run of `python -m bench.drafter` judged twice on
the held-out samples: served right, and with its states zeroed (the same weights; only the states it reads change).
A drafter that leans on the states loses accepted length and first-step accuracy without them; one that learned to
ignore them loses nothing. Run by the trainers' Python, as bench/drafter_train.py is:

    <trainers python> -I bench/drafter_ablate.py WORKDIR KEY [HELD_OUT_ROWS]

WORKDIR is the bench's --workdir (its spec.json and runs/<KEY>.pt); HELD_OUT_ROWS, the first that many held-out
samples (all by default). Prints both judgements as JSON.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch


def trainer():
    """bench/drafter_train.py, loaded by path (-I leaves this folder off sys.path, where bench/tokenize.py would hide
    the standard library's)."""
    spec = importlib.util.spec_from_file_location("drafter_train", Path(__file__).with_name("drafter_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(workdir: str, key: str, rows: str | None = None) -> None:
    dt, work = trainer(), Path(workdir)
    spec = json.loads((work / "spec.json").read_text())
    torch.set_num_threads(spec["threads"])
    run = next(r for r in spec["runs"] if r["key"] == key)
    if run["variant"]["family"] != "eagle3" or run["variant"]["final"] == "no_states":
        raise SystemExit(f"drafter_ablate: {key} is not an EAGLE-3 drafter trained on states")
    ev = spec["eval"]
    dt.EXPORTS[ev["export"]] = dt.load_export(spec["exports"][ev["export"]]["path"], spec["max_len"])
    model = dt.build_drafter(spec, run["seed"], run["variant"])
    model.load_state_dict(torch.load(work / "runs" / f"{key}.pt"), strict=False)
    if rows:
        ev["rows"] = ev["rows"][: int(rows)]
    keep = ("accepted_length", "full_acc_0", "full_acc_1", "full_acc_2")
    out = {"run": {"variant": run["variant"]["name"], "seed": run["seed"], "steps": run["steps"]}}
    out["held_out_samples"] = len(ev["rows"])
    for name, zero in (("served_right", False), ("states_zeroed", True)):
        judged = dt.evaluate_eagle3(model, spec, zero=zero)
        out[name] = {k: round(judged[k], 4) for k in keep}
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:4])
