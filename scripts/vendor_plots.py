"""Refresh the libraries inlined in conf/plots/page.html, the page `dvc plots show` fills (.dvc/config's
plots.html_template): vega, vega-lite and vega-embed, between its `<!-- vendor:start ... -->` and
`<!-- vendor:end -->` lines.

    python scripts/vendor_plots.py

The libraries come from the npm registry (`npm pack`, the versions below); the page then needs no network to draw.
All three are BSD-3-Clause, by the University of Washington Interactive Data Lab: conf/plots/LICENSE-vega.
Rerun after changing a version here.
"""

from __future__ import annotations

import re
import subprocess
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "conf" / "plots" / "page.html"
VERSIONS = {"vega": "5.33.1", "vega-lite": "5.23.0", "vega-embed": "6.29.0"}
BLOCK = re.compile(r"^(\s*<!-- vendor:start ([a-z -]+) -->\n).*?^(\s*<!-- vendor:end -->\n)", re.M | re.S)


def packed(lib: str, version: str, work: Path) -> str:
    """The library's minified build, from its npm package."""
    name = subprocess.run(
        ["npm", "pack", "--silent", f"{lib}@{version}"], cwd=work, check=True, capture_output=True, text=True
    ).stdout.split()[-1]
    with tarfile.open(work / name) as tar:
        return tar.extractfile(f"package/build/{lib}.min.js").read().decode()


def page(html: str, scripts: dict[str, str]) -> str:
    """`html` with the block between the vendor markers made anew from `scripts`."""
    match = BLOCK.search(html)
    inlined = "".join(
        f"    <script>/* {lib} {VERSIONS[lib]}, BSD-3-Clause: conf/plots/LICENSE-vega */\n{scripts[lib]}\n</script>\n"
        for lib in match.group(2).split()
    )
    return html[: match.start()] + match.group(1) + inlined + match.group(3) + html[match.end() :]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        scripts = {lib: packed(lib, version, Path(tmp)) for lib, version in VERSIONS.items()}
    PAGE.write_text(page(PAGE.read_text(), scripts))
    print(f"wrote {PAGE.relative_to(ROOT)} ({PAGE.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
