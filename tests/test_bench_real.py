"""specedge-bench --quick on the real pair, through the real command line: the CI smoke test.

Checks that the run completes and that results.json is well-formed, never the
speed (timings belong to bench/results/, not to tests). Smaller than --quick
proper (2 prompts, 16 tokens, one answer per edge) to keep CI short.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specedge.bench.config import MODES
from specedge.bench.metrics import REQUIRED_FIELDS

pytestmark = pytest.mark.real_model


def test_quick_run_completes_with_every_mode_and_a_well_formed_results_json(tmp_path):
    out = tmp_path / "bench"
    command = [
        os.path.join(os.path.dirname(sys.executable), "specedge-bench"),
        "--quick",
        "--max-prompts",
        "2",
        "--max-tokens",
        "16",
        "--requests-per-edge",
        "1",
        "--out",
        str(out),
        "--no-progress",
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    records = {(r["mode"], r["num_edges"]): r for r in results["records"]}
    assert set(records) == {(mode, n) for mode in MODES for n in (1, 4)}
    for (mode, _), record in records.items():
        assert all(field in record for field in REQUIRED_FIELDS), record.keys()
        assert record["throughput_tok_s"] > 0 and record["itl_p50_ms"] > 0 and record["cost_per_mtok_usd"] > 0
        assert record["requests"] == record["num_edges"]
        assert record["identical_to_reference"] == f"{record['requests']}/{record['requests']}"
        if mode == "server_spec":  # edges may be advised not to draft at all; the server's own k is fixed
            assert 0 <= record["acceptance_rate"] <= 1
    assert results["meta"]["profile"]["draft"] == "qwen2.5-coder-0.5b"
    assert "## Against server-only decoding" in (out / "summary.md").read_text()
    assert (out / "plots.png").stat().st_size > 10_000
