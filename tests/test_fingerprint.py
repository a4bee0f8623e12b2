"""The model fingerprint changes whenever any byte of the model does, and reads as little as it can to know it."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest

from draftdata.errors import ConfigError
from draftdata.model import fingerprint as target
from draftdata.model.fingerprint import model_fingerprint
from draftdata.util.hashing import content_hash

# The size above which the fingerprint once looked at names and sizes only; weights built larger than this show
# that their content counts.
_OLD_NAME_AND_SIZE_ABOVE = 64 << 20


@pytest.fixture
def reads(monkeypatch) -> list[Path]:
    """The files the fingerprint read in full, in order."""
    seen: list[Path] = []
    real = target._hash_file

    def spy(path: Path) -> str:
        seen.append(Path(path))
        return real(path)

    monkeypatch.setattr(target, "_hash_file", spy)
    return seen


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def expected(files: dict[str, str], revision: str | None = None) -> str:
    """The formula response stores are keyed by: name -> full-content sha256 of each top-level file."""
    return content_hash({"files": files, "revision": revision})


def fingerprint(path: Path, revision: str | None = None, cache_path: Path | None = None) -> str:
    """A fresh look each time: model_fingerprint memoises per (path, revision, cache_path)."""
    model_fingerprint.cache_clear()
    return model_fingerprint(str(path), revision, cache_path)


def test_other_seed_same_sizes_other_fingerprint(tmp_path):
    """Two fine-tunes of one base have the same file names and sizes: only the bytes tell them apart."""
    from draftdata.config.schema import TinyModelConfig
    from draftdata.model.tiny import build_model

    dirs = []
    for seed in (0, 1):
        # hidden_size 1536, one layer: ~108 MB of float32 weights, above the old name-and-size threshold
        cfg = TinyModelConfig(seed=seed, vocab_size=2048, hidden_size=1536, num_layers=1, num_heads=4)
        out = tmp_path / f"seed{seed}"
        build_model(cfg, cfg.vocab_size, eos_id=0, pad_id=1).save_pretrained(out)
        dirs.append(out)
    sizes = [{f.name: f.stat().st_size for f in d.iterdir()} for d in dirs]
    assert sizes[0] == sizes[1]
    assert sizes[0]["model.safetensors"] > _OLD_NAME_AND_SIZE_ABOVE
    assert fingerprint(dirs[0]) != fingerprint(dirs[1])


def test_small_files_keep_the_old_formula(tiny_model, tmp_path):
    """Existing response stores keep their keys: top-level regular files, dot-files and folders left out."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (model / "sub").mkdir()
    (model / "sub" / "extra.bin").write_bytes(b"not part of the model's top level")
    files = {f.name: sha256(f) for f in sorted(model.iterdir()) if f.is_file() and not f.name.startswith(".")}
    assert "model.safetensors" in files and "tokenizer.json" in files
    assert fingerprint(model, "rev1") == expected(files, "rev1")
    assert fingerprint(model, None) == expected(files, None) != expected(files, "rev1")


def test_hash_cache_is_used_until_the_file_changes(tmp_path, reads, monkeypatch, capsys):
    # Files changed this recently are not cached (their stat may not yet show a later write); shrink the window
    # so the test need not wait seconds, and wait it out.
    monkeypatch.setattr(target, "_RACY_NS", 50_000_000)
    monkeypatch.setattr(target, "_LOG_ABOVE_BYTES", 1 << 20)
    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(os.urandom(9 << 20))  # more than one read chunk
    cache = tmp_path / "state" / "hashes.json"
    time.sleep(0.1)

    first = fingerprint(model, cache_path=cache)
    assert first == expected({"model.safetensors": sha256(weights)})
    assert reads == [weights] and cache.exists()
    assert "fingerprint hashing_files=1" in capsys.readouterr().out

    assert fingerprint(model, cache_path=cache) == first
    assert reads == [weights]  # answered from the cache, not read again

    # Other bytes, same size, same inode, mtime set back: only ctime shows the change.
    before = weights.stat()
    with open(weights, "r+b") as f:
        f.write(os.urandom(4096))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = weights.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    second = fingerprint(model, cache_path=cache)
    assert second != first and second == expected({"model.safetensors": sha256(weights)})
    assert reads == [weights, weights]


def test_a_file_written_just_now_is_not_cached(tmp_path, reads):
    """A write in the same timestamp tick could leave every stat field as it was: such a hash is not kept."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(os.urandom(1 << 20))
    cache = tmp_path / "hashes.json"
    fingerprint(model, cache_path=cache)
    fingerprint(model, cache_path=cache)
    assert len(reads) == 2


def test_a_corrupt_cache_is_rebuilt(tmp_path, reads, monkeypatch):
    monkeypatch.setattr(target, "_RACY_NS", 0)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights" * 1000)
    want = expected({"model.safetensors": sha256(model / "model.safetensors")})
    cache = tmp_path / "hashes.json"
    for garbage in ("{not json", "[1, 2]", '{"version": 1, "files": {"x": 3}}'):
        cache.write_text(garbage)
        assert fingerprint(model, cache_path=cache) == want
    reads.clear()
    assert fingerprint(model, cache_path=cache) == want
    assert reads == []  # the last run rewrote a good cache


def test_hub_cache_blob_names_are_used_without_reading(tmp_path, reads):
    """HF's cache stores LFS files as blobs/<sha256>; other files as blobs/<git sha1>, which must be read."""
    repo = tmp_path / "models--org--name"
    blobs = repo / "blobs"
    blobs.mkdir(parents=True)
    weights = os.urandom(1 << 20)
    weights_sha = hashlib.sha256(weights).hexdigest()
    (blobs / weights_sha).write_bytes(weights)
    config = b'{"model_type": "llama"}'
    config_sha1 = hashlib.sha1(config).hexdigest()
    (blobs / config_sha1).write_bytes(config)
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(f"../../blobs/{weights_sha}")
    (snapshot / "config.json").symlink_to(f"../../blobs/{config_sha1}")

    got = fingerprint(snapshot)
    assert got == expected({"model.safetensors": weights_sha, "config.json": hashlib.sha256(config).hexdigest()})
    assert reads == [snapshot / "config.json"]


def test_hub_blob_name_is_taken_as_is(tmp_path, reads):
    """The name, not the bytes, is what counts: a blob named by another sha256 gives that sha256."""
    named = "0123456789abcdef" * 4
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / named).write_bytes(b"anything")
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "model.safetensors").symlink_to(f"../blobs/{named}")
    assert fingerprint(tmp_path / "snap") == expected({"model.safetensors": named})
    assert reads == []


def test_local_dir_download_metadata(tmp_path, reads):
    """`hf download --local-dir` records each file's etag (the sha256 for LFS files): trusted while ctime says
    the file is untouched since, whatever its mtime says."""
    # the module whose writer `hf download --local-dir` uses
    from huggingface_hub import _local_folder

    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(os.urandom(1 << 20))
    (model / "config.json").write_text('{"model_type": "llama"}')
    _local_folder.write_download_metadata(model, "model.safetensors", commit_hash="c" * 40, etag=sha256(weights))
    # a regular (non-LFS) file's etag is its git sha1: not a sha256, so the file is read
    _local_folder.write_download_metadata(model, "config.json", commit_hash="c" * 40, etag="f" * 40)

    fresh = fingerprint(model)
    assert fresh == expected({"model.safetensors": sha256(weights), "config.json": sha256(model / "config.json")})
    assert reads == [model / "config.json"]

    # Downloaded 5 s ago, rewritten now, mtime set back to the download: the etag no longer holds.
    meta = _local_folder.get_local_download_paths(model, "model.safetensors").metadata_path
    commit, etag, written_at = meta.read_text().splitlines()
    meta.write_text(f"{commit}\n{etag}\n{float(written_at) - 5}\n")
    mtime = weights.stat().st_mtime_ns - 10 * 10**9
    weights.write_bytes(os.urandom(1 << 20))
    os.utime(weights, ns=(mtime, mtime))
    reads.clear()
    stale = fingerprint(model)
    assert stale != fresh
    assert stale == expected({"model.safetensors": sha256(weights), "config.json": sha256(model / "config.json")})
    assert weights in reads


COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def hub_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], ref: str | None = "main") -> Path:
    """An HF hub cache entry as huggingface_hub writes it: refs/<ref> holds the commit, snapshots/<commit>/ links
    to blobs/<sha256> (what the hub names LFS files by)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / sha).write_bytes(data)
        (snapshot / name).symlink_to(f"../../blobs/{sha}")
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_a_hub_id_is_the_files_of_its_cached_snapshot(hub_cache, reads):
    """`revision: main` (or null) resolves through refs/main to a commit and fingerprints that snapshot's files:
    weights re-uploaded under the same branch are another target, not the old one's stored responses."""
    config = b'{"model_type": "llama"}'
    old = {"config.json": config, "model.safetensors": b"old weights"}
    hub_snapshot(hub_cache, "org/name", COMMIT_A, old)
    first = fingerprint(Path("org/name"), "main")
    assert fingerprint(Path("org/name"), None) == first  # null is the default branch
    sha = {n: hashlib.sha256(d).hexdigest() for n, d in old.items()}
    assert first == expected(sha, COMMIT_A)
    assert first == fingerprint(hub_cache / "models--org--name" / "snapshots" / COMMIT_A, COMMIT_A)
    assert reads == []  # every blob is named by its sha256: nothing read

    hub_snapshot(hub_cache, "org/name", COMMIT_B, {"config.json": config, "model.safetensors": b"new weights"})
    second = fingerprint(Path("org/name"), "main")
    assert second != first
    # a commit hash names its snapshot directly, whatever the refs say
    assert fingerprint(Path("org/name"), COMMIT_A) == first
    assert fingerprint(Path("org/name"), COMMIT_B) == second


def test_hf_home_locates_the_hub_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    hub_snapshot(tmp_path / "hf" / "hub", "org/name", COMMIT_A, {"model.safetensors": b"w"})
    assert fingerprint(Path("org/name"), None) == expected(
        {"model.safetensors": hashlib.sha256(b"w").hexdigest()}, COMMIT_A
    )


@pytest.mark.parametrize(
    ("path", "revision"),
    [("org/not-downloaded", None), ("org/name", "v2"), ("org/name", "c" * 40), ("gpt2", "main")],
)
def test_a_hub_id_not_in_the_local_cache_is_refused(hub_cache, path, revision):
    """Refused in one line that names the keys and the download command, before any request is planned."""
    hub_snapshot(hub_cache, "org/name", COMMIT_A, {"model.safetensors": b"w"})
    with pytest.raises(ConfigError) as err:
        fingerprint(Path(path), revision)
    msg = str(err.value)
    assert err.value.key == "model.path" and "\n" not in msg
    assert "model.revision" in msg and f"hf download {path} --revision {revision or 'main'}" in msg


def test_a_hub_id_with_a_missing_snapshot_is_refused(hub_cache):
    """refs/main names a commit whose snapshot folder is gone (a pruned cache): not resolvable here."""
    repo = hub_cache / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT_B)
    with pytest.raises(ConfigError, match=r"^model\.path: .*download it first"):
        fingerprint(Path("org/name"), "main")


def test_a_hub_id_is_loaded_from_the_snapshot_its_fingerprint_names(hub_cache, tiny_model, monkeypatch):
    """The tokenizer, the model's limits and its weights load from the cached snapshot at the commit the revision
    resolves to, the one the stores record, not by the revision (which, with a network, fetches the hub's newest)."""
    from draftdata.config.schema import ModelConfig
    from draftdata.model.load import load_model, model_dir, model_limits
    from draftdata.model.tokenizer import load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing here may need the hub
    files = {p.name: p.read_bytes() for p in tiny_model.iterdir() if p.is_file()}
    a = hub_snapshot(hub_cache, "org/tiny", COMMIT_A, files)
    b = hub_snapshot(hub_cache, "org/tiny", COMMIT_B, dict(files, **{"chat_template.jinja": b"{{ 'B' }}"}))
    for revision, snapshot, template in [(None, b, "{{ 'B' }}"), (COMMIT_A, a, files["chat_template.jinja"].decode())]:
        cfg = ModelConfig(path="org/tiny", revision=revision)
        assert model_dir(cfg) == str(snapshot)
        tok = load_tokenizer(cfg)
        assert tok.name_or_path == str(snapshot) and tok.chat_template == template
    cfg = ModelConfig(path="org/tiny", revision=COMMIT_A)
    assert model_limits(cfg).vocab == load_model(cfg).config.vocab_size
