"""numba's disk cache may only keep what it can tell is current.

numba caches a compiled kernel on disk and reuses it while the file that defines the kernel is unchanged: it
never looks at other files. A kernel that called a function or read a constant from another file would keep
the old code or value after that file changed. So every compiled file (server/_*_numba.py) must be
self-contained, and a second process must load the forward's kernels from the cache instead of compiling them.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import types
from collections.abc import Callable

import pytest

from specedge import noise
from specedge.server import race_kernel

pytest.importorskip("numba")

SERVER = pathlib.Path(race_kernel.__file__).parent
KERNEL_FILES = sorted(SERVER.glob("_*_numba.py"))
COMPILED = {"njit", "intrinsic"}  # the decorators whose functions numba compiles into a cached kernel


def _imported_from_specedge(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specedge"):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names if "specedge" in alias.name)
    return names


def _compiled(node: ast.stmt) -> bool:
    if not isinstance(node, ast.FunctionDef):
        return False
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Name) and target.id in COMPILED:
            return True
    return False


def _names_read(node: ast.AST) -> set[str]:
    return {name.id for name in ast.walk(node) if isinstance(name, ast.Name)}


def _cross_file_reads(source: str) -> list[str]:
    """Where compiled code, or a module-level value it may read, uses a name imported from another specedge file."""
    tree = ast.parse(source)
    foreign = _imported_from_specedge(tree)
    found = []
    for node in tree.body:
        if _compiled(node) or isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for name in sorted(_names_read(node) & foreign):
                found.append(f"line {node.lineno}: {name}")
    return found


def test_there_are_compiled_files_to_check():
    assert {path.name for path in KERNEL_FILES} >= {"_forward_numba.py", "_race_numba.py"}


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda path: path.name)
def test_compiled_code_reads_nothing_from_another_file(path):
    assert _cross_file_reads(path.read_text()) == []


def test_the_check_finds_a_kernel_that_calls_into_another_file():
    """What the forward's kernels looked like before they shared a file, and the race's constants before."""
    calls = "from specedge.server._matmul_numba import matmul\n\n@njit\ndef layer(x, w, y):\n    matmul(x, w, y)\n"
    constant = "from specedge import noise\n_MIX = np.uint32(noise.MIX_MULTIPLIER)\n"
    plain = "from specedge import noise\n\ndef warm_up():\n    return noise.token_hash(1)\n"  # not compiled
    assert _cross_file_reads(calls) == ["line 4: matmul"]
    assert _cross_file_reads(constant) == ["line 2: noise"]
    assert _cross_file_reads(plain) == []


def test_the_race_kernels_written_out_constants_match_their_sources():
    kernel = race_kernel.kernel()
    assert kernel is not None
    assert int(kernel._MIX) == noise.MIX_MULTIPLIER
    assert kernel._UNIFORM_BITS == noise.UNIFORM_BITS
    assert kernel.NO_TOKEN == race_kernel.NO_TOKEN
    verdicts = (race_kernel.UNDECIDED, race_kernel.REJECTED, race_kernel.ACCEPTED)
    assert (kernel.UNDECIDED, kernel.REJECTED, kernel.ACCEPTED) == verdicts


def test_a_second_process_loads_the_forward_kernels_from_the_cache():
    """The first process may compile (after a change to the file); the second must find all three on disk."""
    code = (
        "from specedge.server import _forward_numba as k\n"
        "k.warm_up()\n"
        "for f in (k.matmul, k.attend, k.decoder_layer):\n"
        "    print(f.__name__, sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values()))\n"
    )
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    counts = {name: (int(hits), int(misses)) for name, hits, misses in map(str.split, run.stdout.splitlines())}
    assert set(counts) == {"matmul", "attend", "decoder_layer"}, run.stdout
    assert all(hits >= 1 and misses == 0 for hits, misses in counts.values()), (counts, run.stderr)


@pytest.mark.parametrize(("given", "expected"), [(None, "2"), ("3", "3")])
def test_the_kernels_compile_at_numbas_level_2_unless_the_user_sets_one(given, expected):
    """At numba's default level 3 a kernel loaded from the cache ran slower than the same kernel compiled fresh
    (specedge/__init__.py); importing any of ours first sets level 2, and a user's NUMBA_OPT stands."""
    env = {key: value for key, value in os.environ.items() if key != "NUMBA_OPT"}
    if given is not None:
        env["NUMBA_OPT"] = given
    code = "import specedge.server._race_numba, numba\nprint(int(numba.core.config.OPT))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env=env)
    assert run.stdout.strip() == expected


def test_a_kernel_that_fails_to_compile_leaves_the_others_their_speed(monkeypatch, caplog):
    """Each caller warms only the kernels it runs: a layer that cannot compile still leaves the product and the
    attention compiled, and says so in one log line."""
    from specedge.server import _forward_numba, attention, layer_kernel, matmul

    def fail(panels: bool) -> None:
        raise RuntimeError("no layer today")

    accessors = (matmul.numba_kernel, attention.numba_kernel, layer_kernel.numba_kernel)
    monkeypatch.setattr(_forward_numba, "warm_up_layer", fail)
    for accessor in accessors:
        accessor.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="specedge.server.kernels"):
            assert layer_kernel.numba_kernel(matmul.panels_here()) is None
            assert matmul.numba_kernel() is _forward_numba and attention.numba_kernel() is _forward_numba
    finally:
        for accessor in accessors:
            accessor.cache_clear()  # the next caller loads them again, with the real warm-up
    [line] = caplog.messages
    assert "no layer today" in line and "layers run module by module" in line


class _Clock:
    """kernels' clock in a test: it moves only as a timed case runs, by the ms the case is said to take, so that
    the choice is tested and not the machine's sleep (timed by 10 ms sleeps, the test failed once in a suite run
    on a 2-core EPYC and passed alone)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def perf_counter(self) -> float:
        return self.seconds

    def taking(self, ms: float) -> Callable[[], None]:
        def run() -> None:
            self.seconds += ms / 1e3

        return run


def test_a_form_is_chosen_by_its_summed_time_and_remembered_per_machine(tmp_path, monkeypatch, caplog):
    """chosen_form keeps the default unless the other form's time, summed over the cases, is at most SWITCH the
    default's: a form that wins most cases by a little and loses one by a lot does not run. The first start times;
    later ones read the choice (no timing, the same form) until the kernel's file changes."""
    from specedge.server import kernels

    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "cache"))
    kernel_file = tmp_path / "kernel.py"
    kernel_file.write_text("# a kernel\n")
    kernel = types.ModuleType("kernel")
    kernel.__file__ = str(kernel_file)
    clock = _Clock()
    monkeypatch.setattr(kernels, "time", clock)
    timings = []

    def choose(subject: str, *cases: tuple[float, float]) -> str:
        def timed() -> list[dict[str, Callable[[], object]]]:
            timings.append(subject)
            return [{"default": clock.taking(default), "other": clock.taking(other)} for default, other in cases]

        return kernels.chosen_form(subject, "default", "other", kernel, timed, repeats=3, flush_bytes=0)

    with caplog.at_level("INFO", logger="specedge.server.kernels"):
        assert choose("faster", (10, 5)) == "other"
        [line] = caplog.messages
        assert line.startswith("faster: other (other took 0.5") and "timed now, remembered in" in line
        assert choose("equal", (10, 10)) == "default"  # noise within the margin keeps the default
        assert choose("slower", (10, 20)) == "default"
        assert choose("one loss", (10, 6), (10, 6), (10, 20)) == "default"  # 30 ms against 32
        assert choose("small wins", (10, 6), (10, 6), (10, 12)) == "other"  # 30 against 24
        assert timings == ["faster", "equal", "slower", "one loss", "small wins"]
        caplog.clear()
        assert choose("faster", (5, 10)) == "other"  # remembered: not timed again
        assert timings[-1] == "small wins" and "timed on " in caplog.messages[0]
        remembered = json.loads((tmp_path / "cache" / kernels.FORMS_FILE).read_text())
        assert {key.split(" | ")[0] for key in remembered} == {"faster", "equal", "slower", "one loss", "small wins"}
        kernel_file.write_text("# the kernel, edited\n")
        assert choose("faster", (5, 10)) == "default"  # timed again
        assert timings[-1] == "faster"
    assert list(json.loads((tmp_path / "cache" / kernels.FORMS_FILE).read_text())) == [
        key for key in remembered if key.startswith("faster |")
    ]  # the old kernel's choices dropped
    (tmp_path / "a file").write_text("")
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "a file" / "cache"))  # a cache dir that cannot be made
    with caplog.at_level("INFO", logger="specedge.server.kernels"):
        caplog.clear()
        assert choose("faster", (10, 5)) == choose("faster", (10, 5)) == "other"
        assert timings[-2:] == ["faster", "faster"] and "so every start times it" in caplog.messages[-1]
