"""Write conf/plots/page.html, the page `dvc plots show` fills (.dvc/config's plots.html_template), from
conf/plots/page.in.html with vega, vega-lite and vega-embed inlined at its `<!-- vendor: ... -->` line.

    python scripts/vendor_plots.py

The libraries come from the npm registry (`npm pack`, the versions below); the page then needs no network to draw.
All three are BSD-3-Clause, by the University of Washington Interactive Data Lab: conf/plots/LICENSE-vega.
Rerun after changing page.in.html or a version here.
"""

from __future__ import annotations

import re
import subprocess
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLOTS = ROOT / "conf" / "plots"
VERSIONS = {"vega": "5.33.1", "vega-lite": "5.23.0", "vega-embed": "6.29.0"}
MARKER = re.compile(r"^\s*<!-- vendor: ([a-z -]+) -->\n", re.M)


def packed(lib: str, version: str, work: Path) -> str:
    """The library's minified build, from its npm package."""
    name = subprocess.run(
        ["npm", "pack", "--silent", f"{lib}@{version}"], cwd=work, check=True, capture_output=True, text=True
    ).stdout.split()[-1]
    with tarfile.open(work / name) as tar:
        return tar.extractfile(f"package/build/{lib}.min.js").read().decode()


def page(template: str, scripts: dict[str, str]) -> str:
    match = MARKER.search(template)
    libs = match.group(1).split()
    inlined = "".join(
        f"    <script>/* {lib} {VERSIONS[lib]}, BSD-3-Clause: conf/plots/LICENSE-vega */\n{scripts[lib]}\n</script>\n"
        for lib in libs
    )
    return template[: match.start()] + inlined + template[match.end() :]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        scripts = {lib: packed(lib, version, Path(tmp)) for lib, version in VERSIONS.items()}
    out = PLOTS / "page.html"
    out.write_text(page((PLOTS / "page.in.html").read_text(), scripts))
    print(f"wrote {out.relative_to(ROOT)} ({out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
