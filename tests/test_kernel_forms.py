"""The numba kernel's forms for other CPUs, compiled and checked here (server/_forward_numba.py's FORMS_OF_ENV).

The kernel compiles different code per machine kind: Zen 4 (AVX-512 on AMD) reads a lone row of weights row by
row, walks long chunks of K, repeats its prefetches and keeps some sums in memory; an Intel AVX-512 CPU runs panels
by default and its chunked passes take two blocks side by side; an AVX2 CPU runs 8-lane tiles of other shapes. CI
runs on whichever machine a session had, so the others' forms could break unseen for days. Each is compiled here in
a process of its own, with caches of its own, and the product and layer tests run over it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

forward_numba = pytest.importorskip("specedge.server._forward_numba")

ROOT = Path(__file__).parent.parent
# What each machine kind's forms change: Zen 4's, the plain product and the layer over it (its attention is the
# other CPUs'); an Intel AVX-512 CPU's, those and the panels its layers take by default; AVX2's, those and the
# attention loops' prefetches.
SUITES = {
    "znver4": ["tests/test_matmul.py", "tests/test_layer_kernel.py", "-k", "not panel and not tied"],
    "avx512": ["tests/test_matmul.py", "tests/test_layer_kernel.py"],
    "avx2": ["tests/test_matmul.py", "tests/test_layer_kernel.py", "tests/test_batched_forward.py"],
}

EXPECTED = {"znver4": ["True", "False", "120"], "avx512": ["True", "True", "56"], "avx2": ["False", "False", "48"]}


def _native(forms: str) -> str | None:
    """Why this machine cannot or need not compile `forms` for another, or None."""
    if forms == "avx2":
        return None if forward_numba.AVX512 else "an AVX2 CPU's forms are this CPU's own"
    if not forward_numba.AVX512:
        return "needs AVX-512"
    # This process compiled the host's own forms, so the kernel's own rule says whether they are Zen 4's.
    return f"{forms}'s forms are this CPU's own" if forward_numba._ZEN_AVX512 == (forms == "znver4") else None


def test_other_cpus_kernel_forms_compute_what_the_tests_ask(tmp_path):
    """Two run here, at once (numba compiles on one core): about a minute and a half on a 2-core Xeon."""
    runs = {}
    for forms, suite in SUITES.items():
        if _native(forms) is not None:
            continue
        env = os.environ | {
            forward_numba.FORMS_OF_ENV: forms,
            "NUMBA_CACHE_DIR": str(tmp_path / forms / "numba"),
            "SPECEDGE_CACHE": str(tmp_path / forms / "cache"),
        }
        probe = "import specedge.server._forward_numba as k; print(k.AVX512, k.PANELS, k.MAX_ROWS)"
        seen = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        # The forms the process compiles: Zen 4's limit of 120 rows and no default panels, the Xeon's panels and 56
        # rows, AVX2's 8 lanes.
        assert seen.stdout.split() == EXPECTED[forms]
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *suite]
        runs[forms] = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    if not runs:
        pytest.skip(", ".join(f"{forms}: {_native(forms)}" for forms in SUITES))
    for forms, run in runs.items():
        out, _ = run.communicate(timeout=600)
        assert run.returncode == 0, f"{forms}'s forms:\n{out[-6000:]}"
        assert " passed" in out and " failed" not in out, out[-2000:]


def test_the_forms_hook_refuses_what_it_cannot_compile(tmp_path):
    """Without caches of its own, another CPU's code would land in the caches this machine's processes read."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "SPECEDGE_CACHE")}
    for value, extra in (("avx2", {}), ("znver3", {"NUMBA_CACHE_DIR": str(tmp_path), "SPECEDGE_CACHE": str(tmp_path)})):
        run = subprocess.run(
            [sys.executable, "-c", "import specedge.server._forward_numba"],
            env=env | {forward_numba.FORMS_OF_ENV: value} | extra,
            capture_output=True,
            text=True,
        )
        assert run.returncode != 0 and "caches of its own" in run.stderr, run.stderr[-2000:]
