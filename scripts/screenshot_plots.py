"""Render the page `dvc plots show` (or `dvc plots diff`) writes in headless Chromium and save a PNG of it.

    python scripts/screenshot_plots.py [--out plots.png] [--vega-dir DIR] [--width 1600] [--height 4200] \
        [diff EXP_A EXP_B ...]

Run it in the project directory after `dvc repro`. Arguments after the options go to `dvc plots` (default `show`).
The page (`conf/plots/page.html`) loads vega, vega-lite and vega-embed from a CDN; on a machine without internet,
`--vega-dir` names a directory with `vega.min.js`, `vega-lite.min.js` and `vega-embed.min.js` (e.g. unpacked from
`npm pack vega@5.33.1 vega-lite@5.23.0 vega-embed@6.29.0`, the versions the page names), and the page is made to
load them from there.
Chromium: Debian's `chromium` package (`chromium`, or `chromium-browser`, on the PATH).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

LIBS = {"vega": "vega.min.js", "vega-lite": "vega-lite.min.js", "vega-embed": "vega-embed.min.js"}


def render_page(dvc_args: list[str], out_dir: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "dvc", "plots", *(dvc_args or ["show"]), "-o", str(out_dir)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return out_dir / "index.html"


def use_local_libs(page: Path, vega_dir: Path) -> None:
    """Point the page's CDN script tags at local copies (copied beside the page)."""
    html = page.read_text()
    for lib, name in LIBS.items():
        src = next(vega_dir.rglob(name), None)
        if src is None:
            sys.exit(f"error: --vega-dir {vega_dir}: no {name} in it")
        shutil.copy(src, page.parent / name)
        html = re.sub(rf'src="https://cdn\.jsdelivr\.net/npm/{re.escape(lib)}@[^"]*"', f'src="{name}"', html)
    page.write_text(html)


def screenshot(page: Path, out: Path, width: int, height: int) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("error: no chromium on the PATH (Debian: apt-get install chromium)")
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--window-size={width},{height}",
            "--virtual-time-budget=15000",
            f"--screenshot={out.resolve()}",
            page.resolve().as_uri(),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("dvc_plots/plots.png"))
    ap.add_argument("--vega-dir", type=Path, default=None)
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--height", type=int, default=4200)
    args, dvc_args = ap.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="dvc-plots-") as tmp:
        page = render_page(dvc_args, Path(tmp))
        if args.vega_dir is not None:
            use_local_libs(page, args.vega_dir)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        screenshot(page, args.out, args.width, args.height)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
