"""specedge-bench engine: the cost model by hand, then the whole sub-command on the tiny target."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from specedge.bench import cli
from specedge.bench.engine import (
    ATTENTION_STEPS,
    DEFAULT_PATHS,
    DEFAULT_STEPS,
    CostModel,
    PrivatePeak,
    Step,
    _below_roofline_lines,
    forwards_in_turn,
)
from specedge.server.attention import tiles_here
from specedge.server.matmul import numba_kernel, panels_here
from specedge.server.model import ModelArgs
from specedge.server.runner import ForwardRequest

# Qwen2.5-Coder-1.5B's shape: 1.54 B matrix-weight parameters, the LM head tied to the embedding.
QWEN_1_5B = ModelArgs(151936, 1536, 8960, 28, 12, 2, 128, 1e-6, True, True, 32768)


def test_steps_parse_into_rows_on_a_prefix_and_a_prefill_row_from_zero():
    mixed = Step.parse("7x5+p120")
    assert (mixed.rows, mixed.new_tokens, mixed.prefill, mixed.num_tokens, mixed.num_logits) == (7, 5, 120, 155, 36)
    requests = mixed.requests(200, list(range(300)))
    assert [(r.slot, r.num_cached, len(r.token_ids), r.all_logits) for r in requests] == [
        *((slot, 200, 5, True) for slot in range(7)),
        (7, 0, 120, False),
    ]
    assert Step.parse("p155").requests(200, list(range(300)))[0].num_cached == 0
    for bad in ("8y5", "x5", "8x", "p0", "0x0", ""):
        with pytest.raises(ValueError, match="--steps wants ROWSxTOKENS"):
            Step.parse(bad)


def test_forwards_in_turn_alternates_the_versions_and_says_how_alike_their_logits_are():
    steps = [Step.parse("2x3"), Step.parse("1x2+p4")]
    calls: list[str] = []

    def version(name: str, change: float) -> Callable[[list[ForwardRequest]], list[torch.Tensor]]:
        def forward(requests: list[ForwardRequest]) -> list[torch.Tensor]:
            calls.append(name)
            # Logits whose argmax is the position's token id (all below 5 here), and stays so for `change` below 0.2.
            return [
                torch.nn.functional.one_hot(torch.tensor(r.token_ids[-r.num_logits :]), 5).float().mul(1 - change)
                + change * torch.arange(5.0)
                for r in requests
            ]

        return forward

    lines = forwards_in_turn({"a": version("a", 0.0), "b": version("b", 0.0)}, steps, 6, list(range(20)), 3)
    assert [line.split(":")[0] for line in lines] == ["2x3", "1x2+p4"]
    assert all(line.endswith("logits the same bits") and "a / b" in line for line in lines)
    assert all(len(line.split("(")[1].split(")")[0].split(", ")) == 3 for line in lines)  # a ratio a timed round
    # An untimed round and three timed ones, each step's versions in the reverse order of the round before.
    assert calls == [*["b", "a"] * 2, *["a", "b"] * 2, *["b", "a"] * 2, *["a", "b"] * 2]

    lines = forwards_in_turn({"a": version("a", 0.0), "c": version("c", 0.1)}, steps, 6, list(range(20)), 1)
    assert all(line.endswith("argmax the same") for line in lines)
    lines = forwards_in_turn({"a": version("a", 0.0), "d": version("d", 0.9)}, steps, 6, list(range(20)), 1)
    assert all(line.endswith("argmax differs") for line in lines)


def test_roofline_counts_a_tied_head_once_and_runs_it_only_for_wanted_logits():
    cost = CostModel.of(QWEN_1_5B, torch.float32)
    assert cost.layer_params + cost.head_params == 1_543_569_408
    assert cost.weight_bytes == 4 * 1_543_569_408  # 6.17 GB: the floor of every fp32 forward
    attention_per_key = 4 * 28 * 12 * 128
    assert cost.flops(Step.parse("1x1"), 200) == 2 * 1_543_569_408 + attention_per_key * 201
    # A 155-token prefill runs the LM head once, not 155 times.
    prefill = cost.flops(Step.parse("p155"), 200)
    assert prefill == 2 * (155 * cost.layer_params + cost.head_params) + attention_per_key * 155 * 156 // 2
    # Each row's keys and values are read once: 28 layers x (K and V) x 2 KV heads x 128 x 4 bytes a position.
    assert cost.kv_bytes_per_key == 28 * 2 * 2 * 128 * 4
    assert cost.bytes(Step.parse("8x1"), 2000) == cost.weight_bytes + 8 * 2001 * cost.kv_bytes_per_key
    assert cost.bytes(Step.parse("7x5+p120"), 200) == cost.weight_bytes + (7 * 205 + 120) * cost.kv_bytes_per_key
    # One token is bandwidth-bound; 155 tokens are compute-bound at 400 GFLOP/s.
    one = cost.weight_bytes + 201 * cost.kv_bytes_per_key
    assert cost.roofline_s(Step.parse("1x1"), 200, 45.0, 400.0) == pytest.approx(one / 45e9)
    assert cost.roofline_s(Step.parse("p155"), 200, 45.0, 400.0) == pytest.approx(prefill / 400e9)


def test_engine_bench_times_every_step_on_both_paths(tiny_target_dir, tmp_path, capsys):
    out = tmp_path / "engine"
    status = cli.main(
        [
            "engine",
            "--target",
            str(tiny_target_dir),
            "--repeats",
            "1",
            "--stream-gb",
            "0.02",
            "--prefix",
            "16",
            "--gemm-m",
            "8",
            "--kernel-m",
            "3",
            "--attention-keys",
            "8",
            "--hf-decode",
            "2",
            "--host-rows",
            "4",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    captured = capsys.readouterr()
    assert status == 0, captured.err
    results = json.loads((out / "engine.json").read_text())

    figures = {
        "stream GB/s": results["limits"]["stream"]["gb_s_median"],
        "GEMM peak": results["limits"]["gemm"]["peak_gflop_s"],
        "weight bytes": results["model"]["weight_bytes"],
        "HF ms per token": results["hf"].get("ms_per_token"),
        "host fraction in the race": results["host"]["flat"].get("fraction_within_race_bound"),
        **{
            f"host {case} {kind}": results["host"][case].get(kind, {}).get("ms")
            for case in ("flat", "peaked", "text")
            for kind in ("read", "greedy", "sampled", "rejection")
        },
        "host text tokens": results["host"]["text"].get("tokens"),
        **{f"roofline {name}": results["roofline"].get(name, {}).get("ms") for name in DEFAULT_STEPS},
    }
    for path in DEFAULT_PATHS:
        run = results["paths"].get(path, {})
        assert run.get("matmul") == path, f"{path}: the path that ran was {run.get('matmul')}"
        figures |= {f"{path} {name}": run.get("steps", {}).get(name, {}).get("ms") for name in DEFAULT_STEPS}
        # The compiled attention (the CPU float32 default) and the row loop, both timed on every step.
        assert run.get("attention") == "numba"
        figures |= {
            f"{path} {name} on the row loop": run.get("steps", {}).get(name, {}).get("rows_attention_ms")
            for name in DEFAULT_STEPS
        }
        # The numba path's compiled layers, and the same forwards through the modules, both timed on every step.
        assert run.get("compiled_layers") == (path == "numba")
        if path == "numba":
            figures |= {
                f"{path} {name} module by module": run.get("steps", {}).get(name, {}).get("modules_ms")
                for name in DEFAULT_STEPS
            }
        figures |= {
            f"{path} {key}": run.get(key)
            for key in ("kv_cache_bytes", "peak_rss_bytes", "rss_anon_bytes", "load_s", "load_private_peak_bytes")
        }
        assert run.get("load_private_peak_bytes", 0) <= run.get("peak_rss_bytes", 0)  # a part of the RSS, never more
    missing = {name: value for name, value in figures.items() if not (isinstance(value, (int, float)) and value > 0)}
    assert not missing, f"missing or non-positive figures: {missing}"
    assert {row["path"] for row in results["limits"]["gemm"]["rows"]} == set(DEFAULT_PATHS)
    [kernels] = results["limits"]["kernels"]["rows"]
    assert kernels["m"] == 3 and all(kernels[name] > 0 for name in ("eager", "onednn@1", "onednn@16", "numba"))
    # inductor's frozen product compiles where a C++ compiler is found; otherwise the table says why not
    assert (isinstance(kernels["inductor"], float) and kernels["inductor"] > 0) or kernels["inductor"].startswith(
        "not run:"
    )
    assert len(results["hf"]["times_ms"]) == 2 and results["host"]["logits_shape"] == [20, 384]
    assert results["roofline"]["7x5+p120"]["tokens"] == 155 and results["roofline"]["7x5+p120"]["logits"] == 36

    table = (out / "engine.md").read_text()
    assert table in captured.out
    header = (
        "| step | tokens | eager ms | onednn ms | numba ms | roofline ms | eager/roofline | onednn/roofline | "
        "numba/roofline | fastest vs eager |"
    )
    assert header in table
    kernel = numba_kernel()
    if kernel.AVX512:  # AVX-512: the numba product the path does not run, beside the one it does
        other = "numba plain" if panels_here() else "numba panels"
        assert kernels[other] > 0
        columns = f"| M | eager ms | onednn@1 ms | onednn@16 ms | inductor ms | numba ms | {other} ms | best / floor |"
        assert f"{columns} numba / {other} |" in table
        assert f"| {kernels['numba'] / kernels[other]:.2f}x |" in table
    else:
        assert "| M | eager ms | onednn@1 ms | onednn@16 ms | inductor ms | numba ms | best / floor |" in table
    # The stream is the faster of two reads of the same tensor, both reported.
    stream = results["limits"]["stream"]
    assert set(stream["readers"]) == {"torch sum", "numba product, M=1"} and stream["by"] in stream["readers"]
    assert stream["gb_s_median"] == max(read["gb_s_median"] for read in stream["readers"].values())
    assert "| memory stream (used) |" in table
    # The host draws against one read of the same logits, taken in turn with them.
    assert "| draws | flat ms | x read | peaked ms | x read | text ms | x read |" in table
    cases = ("flat", "peaked", "text")
    assert all(len(results["host"][case][kind]["times_ms"]) == 1 for case in cases for kind in ("read", "greedy"))
    # The text case: the logits at each position of the prompts' text (as many as the cache holds).
    assert 0 <= results["host"]["text"]["accepted_per_chain"] <= 4
    for case in cases:
        assert f"{results['host'][case]['greedy']['ms'] / results['host'][case]['read']['ms']:.2f}x" in table
    assert "## Attention: numba against the row loop" in table
    layer = results["limits"]["attention"]
    assert [(row["cached"], row["step"]) for row in layer["rows"]] == [(8, name) for name in ATTENTION_STEPS]
    assert all(row["numba"] > 0 and row["rows"] > 0 for row in layer["rows"]), layer
    if kernel.AVX512:  # the same kernel through the attention tiles or loops this process did not choose
        default, other = ("tiles", "loops") if tiles_here() else ("loops", "tiles")
        assert (layer["numba"], layer["other"]) == (default, other) and all(row[other] > 0 for row in layer["rows"])
        assert (
            f"| cached keys | step | numba ({default}) ms | {other} ms | rows ms | numba / rows | numba / {other} |"
            in table
        )
    else:
        assert layer["other"] is None
        assert "| cached keys | step | numba ms | rows ms | numba / rows |" in table
    assert "| 8 | 8x5 |" in table
    assert "| step | eager: numba ms | rows ms | ratio | onednn: numba ms | rows ms | ratio |" in table
    assert "| step | numba: compiled ms | modules ms | ratio |" in table
    # Every step's forwards in turn with reads of the embedding table and the peak's product; a roofline from both.
    gemm = results["limits"]["gemm"]
    assert gemm["peak_gflop_s"] == max(row["gflop_s"] for row in gemm["rows"] if row["path"] == gemm["peak"]["path"])
    for path in DEFAULT_PATHS:
        for name in DEFAULT_STEPS:
            step, roofline = results["paths"][path]["steps"][name], results["roofline"][name]
            floor = roofline["gbytes"] * 1e3 / step["stream_gb_s"]
            compute = roofline["gflop"] * 1e3 / step["gemm_gflop_s"]
            assert step["roofline_in_turn_ms"] == pytest.approx(max(floor, compute)), (path, name)
    assert "| step | eager ms | GB/s | GFLOP/s | roofline ms | eager/roofline | onednn ms |" in table
    forwards, attention = table.split("## Forwards (")[1].split("## Attention")
    forwards, in_turn = forwards.split("## Forwards against the limits measured in turn with them")
    layers = table.split("## Compiled layers against the modules")[1]
    for section in (forwards, in_turn, attention.split("\n## ")[0], layers.split("\n## ")[0]):
        rows = [
            line for line in section.splitlines() if line.startswith(tuple(f"| {name} |" for name in DEFAULT_STEPS))
        ]
        assert len(rows) == len(DEFAULT_STEPS) and all("| - |" not in row for row in rows), rows


def test_a_forward_under_its_in_turn_roofline_is_named_with_the_reading_that_ran_slow():
    """A 2-core Xeon's recorded run had oneDNN's 7 x 5 + p120 at 0.78x its in-turn roofline: the GEMM rate read in
    turn with it (183 GFLOP/s) was far under the run's peak (281). No forward beats its roofline; the report says so."""
    limits = {"gemm": {"peak_gflop_s": 281.0}, "stream": {"gb_s_median": 25.6}}
    roofline = {"7x5+p120": {"gbytes": 6.2, "gflop": 479.0}, "1x1": {"gbytes": 6.2, "gflop": 3.1}}

    def step(name: str, ms: float, stream: float, gemm: float) -> dict:
        in_turn = max(roofline[name]["gbytes"] * 1e3 / stream, roofline[name]["gflop"] * 1e3 / gemm)
        return {"ms": ms, "stream_gb_s": stream, "gemm_gflop_s": gemm, "roofline_in_turn_ms": in_turn}

    paths = {
        "onednn": {
            "steps": {"7x5+p120": step("7x5+p120", 1803.5, 26.9, 183.0), "1x1": step("1x1", 300.0, 26.0, 240.0)}
        },
        "numba": {"steps": {"7x5+p120": step("7x5+p120", 2000.0, 26.9, 250.0), "1x1": step("1x1", 225.0, 25.0, 240.0)}},
    }
    [blank, note] = _below_roofline_lines({"limits": limits, "roofline": roofline, "paths": paths}, ["onednn", "numba"])
    assert blank == "" and "Under the roofline measured in turn by more than 5%" in note
    assert "onednn 7x5+p120 (0.69x; the GEMM rate, 183 GFLOP/s against 281 read once)" in note
    assert "numba 1x1 (0.91x; the stream, 25.0 GB/s against 25.6 read once)" in note
    assert "numba 7x5+p120" not in note and "onednn 1x1" not in note  # 1.04x and 1.26x: nothing to say
    paths["onednn"]["steps"]["7x5+p120"]["ms"] = paths["numba"]["steps"]["1x1"]["ms"] = 1e9
    assert _below_roofline_lines({"limits": limits, "roofline": roofline, "paths": paths}, ["onednn", "numba"]) == []


def test_one_path_gets_the_only_columns(tiny_target_dir, capsys):
    status = cli.main(
        [
            "engine",
            "--target",
            str(tiny_target_dir),
            "--matmul",
            "onednn",
            "--steps",
            "2x3",
            "--repeats",
            "1",
            "--stream-gb",
            "0.01",
            "--prefix",
            "4",
            "--gemm-m",
            "4",
            "--kernel-m",
            "--attention-keys",
            "--hf-decode",
            "0",
            "--host-rows",
            "1",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    row, in_turn_row, attention_row = [line for line in out.splitlines() if line.startswith("| 2x3 |")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert len(cells) == 5 and cells[1] == "6" and float(cells[2]) > 0 and cells[4].endswith("x")
    cells = [cell.strip() for cell in in_turn_row.strip("|").split("|")]
    assert len(cells) == 6 and all(float(cell) > 0 for cell in cells[1:5]) and cells[5].endswith("x")
    assert "| step | tokens | onednn ms | roofline ms | onednn/roofline |" in out
    cells = [cell.strip() for cell in attention_row.strip("|").split("|")]
    assert len(cells) == 4 and float(cells[1]) > 0 and float(cells[2]) > 0 and cells[3].endswith("x")
    assert "| step | onednn: numba ms | rows ms | ratio |" in out
    assert "Skipped: --hf-decode 0." in out and "Matrix kernels" not in out  # --kernel-m with no M skips them
    assert "One layer's attention" not in out  # nor --attention-keys with no count


def test_bad_engine_options_end_in_one_line(capsys, tmp_path):
    for bad in (
        ["--steps", "8y5"],
        ["--matmul", "cuda"],
        ["--dtype", "float16"],
        ["--repeats", "0"],
        ["--stream-gb", "0"],
        ["--target", str(tmp_path / "nowhere")],
    ):
        assert cli.main(["engine", *bad, "--no-progress"]) == 2, bad
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 6 and all(line.startswith("specedge-bench: ") for line in lines), lines
    assert "--steps wants ROWSxTOKENS" in lines[0] and "--matmul takes eager and/or onednn and/or numba" in lines[1]
    assert "--dtype takes float32 or bfloat16" in lines[2] and "no such model" in lines[5]


def test_the_bench_runs_as_a_module(tmp_path):
    """`python -m specedge.bench.cli` runs a command as the console script does (its guard once preceded a
    command's function, so every command run that way died with a NameError)."""
    command = [sys.executable, "-m", "specedge.bench.cli", "engine", "--target", str(tmp_path / "nowhere")]
    done = subprocess.run([*command, "--no-progress"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("specedge-bench: "), done.stderr
    assert "no such model" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_private_peak_sees_memory_freed_before_the_block_ends():
    """ru_maxrss counts a load's memory-mapped checkpoint; the private peak is sampled, so it must catch a
    short-lived allocation that is gone by the time anyone reads the RSS after."""
    import time

    import numpy as np

    size = 256 * 2**20
    with PrivatePeak(interval_s=0.001) as peak:
        before = peak.bytes
        held = np.ones(size, dtype=np.uint8)  # touched, so resident
        time.sleep(0.05)
        del held
    assert before is not None and peak.bytes is not None
    assert peak.bytes >= before + 0.9 * size, (before, peak.bytes)
