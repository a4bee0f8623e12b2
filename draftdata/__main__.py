"""`python -m draftdata <command>`: the same as the `draftdata` console script."""

from draftdata.cli import main

main()
