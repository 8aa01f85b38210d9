"""`specedge-bench neighbours` end to end on a tiny model: every setting measured, the figures where they belong.

Timings are the benchmark's business; this checks what holds whatever the machine: with a fixed fair
budget, B's 64-node rounds are cut; in arrival order nothing is cut and the batch cap is 512.
"""

from __future__ import annotations

import json
import re

from bench import cli


def test_neighbours_measures_every_setting(tiny_target_dir, tmp_path, capsys):
    out = tmp_path / "neighbours"
    status = cli.main(
        [
            "neighbours",
            "--target",
            str(tiny_target_dir),
            "--a-rounds",
            "4",
            "--b-alone-s",
            "1",
            "--long-prompt",
            "100",
            "--step-tokens",
            "32",
            "--out",
            str(out),
        ]
    )
    assert status == 0, capsys.readouterr().err
    results = json.loads((out / "neighbours.json").read_text())
    assert list(results["settings"]) == ["fair", "fair-no-gather", "arrival"]
    fair, no_gather, arrival = results["settings"].values()
    for figures in (fair, no_gather, arrival):
        assert figures["a_itl_alone_p50_ms"] > 0 and figures["a_itl_beside_p50_ms"] > 0
        assert figures["b_alone"]["rounds_per_s"] > 0 and figures["long_prefill"]["b_ttft_s"] > 0
    # A fixed budget (--step-tokens) caps every step, alone too: B's 4 x 65-token rounds are cut to 32 tokens.
    for figures in (fair, no_gather):
        assert figures["b_alone"]["cut_nodes"] > 0 and figures["step"]["budget_tokens"] == 32
    assert arrival["b_alone"]["cut_nodes"] == 0 and arrival["step"]["budget_tokens"] == 512
    table = capsys.readouterr().out
    assert "| ratio beside / alone |" in table
    # B's rate beside A is a rate, or says that A's few rounds ended before any of B's (a fast machine)
    assert re.search(r"\| B beside A: tokens verified/s \|( (\d+\.\d|no round in [\d.]+ s) \|){3}\n", table)
    assert len(results["load_average_before"]) == 3
