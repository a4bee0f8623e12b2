"""`draftdata <command>`: what a user runs beside `dvc repro`.

    draftdata plan [dataset=<D>] [plan.tok_s=<N>] [plan.out=<path>] [overrides]   what each dataset will cost
    draftdata export dataset=<D> export.format=specforge|speculators|modelopt      states in a trainer's layout
    draftdata verify dataset=<D> [verify.engine=hf|vllm] [verify.samples=3]       stored states recomputed, compared
    draftdata compare [dataset=<D> ...]                                            experiments side by side
    draftdata reference [--write]                                                  the configuration reference

Overrides use Hydra's grammar, as the stages do; `draftdata <command> --help` says more.
"""

from __future__ import annotations

import sys
from importlib import import_module

# command -> (module, one line); modules load only when their command runs (plan and export import torch)
COMMANDS = {
    "plan": ("draftdata.cli.plan", "what each dataset will cost: tokens to generate, requests, generation time, disk"),
    "export": ("draftdata.cli.export", "a dataset's hidden states, policy or samples in a trainer's own layout"),
    "verify": ("draftdata.cli.verify", "a few stored hidden states recomputed by another engine or batch size"),
    "compare": ("draftdata.cli.compare", "one short row per experiment from each dataset's summary.json"),
    "reference": ("draftdata.cli.reference", "the configuration reference table (--write: into docs/configuration.md)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return (
        "usage: draftdata <command> [args]\n\ncommands:\n"
        + "\n".join(lines)
        + "\n\n`draftdata <command> --help` for each."
    )


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}\n{usage()}", file=sys.stderr)
        sys.exit(2)
    import_module(COMMANDS[name][0]).run(rest)
