"""Render the page `dvc plots show` (or `dvc plots diff`) writes in headless Chromium and save a PNG of it.

    python scripts/screenshot_plots.py [--out plots.png] [--width 1600] [--height 2400] [diff EXP_A EXP_B ...]

Run it in the project directory after `dvc repro`. Arguments after the options go to `dvc plots` (default `show`).
The page (`conf/plots/page.html`) carries its own copy of vega, so it draws offline; Chromium is kept off the
network here to show it. Chromium: Debian's `chromium` package (`chromium`, or `chromium-browser`, on the PATH).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def render_page(dvc_args: list[str], out_dir: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "dvc", "plots", *(dvc_args or ["show"]), "-o", str(out_dir)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return out_dir / "index.html"


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
            "--proxy-server=http://127.0.0.1:9",  # no network: the page must draw from what it carries
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
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--height", type=int, default=2400)
    args, dvc_args = ap.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="dvc-plots-") as tmp:
        page = render_page(dvc_args, Path(tmp))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        screenshot(page, args.out, args.width, args.height)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
