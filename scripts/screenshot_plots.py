"""Render the page `dvc plots show` (or `dvc plots diff`) writes in headless Chromium and save a PNG of it.

    python scripts/screenshot_plots.py [--out plots.png] [--width 1600] [--height PX] [diff EXP_A EXP_B ...]

Run it in the project directory after `dvc repro`. Arguments after the options go to `dvc plots` (default `show`).
The page (`conf/plots/page.html`) carries its own copy of vega, so it draws offline; Chromium is kept off the
network here to show it. The PNG holds the whole page (every dataset's charts): its height is the page's as drawn at
that width, unless `--height` is given. Chromium is not a Python package, so the install line does not bring it:
Debian's `chromium` (`apt-get install chromium`; `chromium` or `chromium-browser` on the PATH).
"""

from __future__ import annotations

import argparse
import re
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


def browser() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        sys.exit("error: no chromium on the PATH (Debian: apt-get install chromium; pip does not install it)")
    return found


def headless(page: Path, width: int, height: int, *what: str) -> subprocess.CompletedProcess:
    """Chromium on `page`, off the network (the page must draw from what it carries), charts given time to draw."""
    argv = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    argv += ["--proxy-server=http://127.0.0.1:9", f"--window-size={width},{height}", "--virtual-time-budget=15000"]
    return subprocess.run(
        [*argv, *what, page.resolve().as_uri()], check=True, capture_output=True, text=True, timeout=300
    )


def page_height(page: Path, width: int) -> int:
    """The page's height as drawn at `width`: the body's `data-height`, set by conf/plots/page.html."""
    dom = headless(page, width, 1000, "--dump-dom").stdout
    found = re.search(r'<body[^>]*data-height="(\d+)"', dom)
    if found is None:
        sys.exit(f"error: {page} does not say its height (not conf/plots/page.html's page?): give --height")
    return int(found[1])


def screenshot(page: Path, out: Path, width: int, height: int | None = None) -> int:
    """A PNG of the page, the whole of it unless `height` is given; the height taken."""
    height = height or page_height(page, width) + 20
    headless(page, width, height, f"--screenshot={out.resolve()}")
    return height


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("dvc_plots/plots.png"))
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--height", type=int, default=None, help="pixels (default: the whole page)")
    args, dvc_args = ap.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="dvc-plots-") as tmp:
        page = render_page(dvc_args, Path(tmp))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        height = screenshot(page, args.out, args.width, args.height)
    print(f"wrote {args.out} ({args.width}x{height})")


if __name__ == "__main__":
    main()
