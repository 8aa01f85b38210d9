"""--tp 1 vs --tp N: the same specedge-bench cells against each server, in one run.

    python -m bench.tensor_parallel                              # --tp 1 2: ar and specedge at N = 4
    python -m bench.tensor_parallel --tp 1 2 --num-edges 4 8 --out tp-results

Every `specedge-bench` option applies (here the defaults are ar and specedge,
N = 4, no emulated RTT, 8 prompts of 48 tokens). One server runs after the
other, each measured like any bench run (its own reference pass and warm-up),
with simulated edges by default so that the edges take no CPU from the ranks.
Each --tp must give the answers --tp 1 gave (lossless); the exit status is 1
when one does not. On a machine whose few cores the ranks share, expect no gain.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

from .cli import bench_config, guarded, parse_args

DEFAULTS = [
    "--modes",
    "ar",
    "specedge",
    "--num-edges",
    "4",
    "--rtt-ms",
    "0",
    "--max-prompts",
    "8",
    "--max-tokens",
    "48",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench-results-tp"))
    own, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    # Later options win in argparse, so the user's own settings override DEFAULTS.
    args = parse_args(["run", *DEFAULTS, *rest])
    return guarded(lambda: _compare(args, own.tp, own.out))


def _compare(args: argparse.Namespace, tps: list[int], out: pathlib.Path) -> int:
    from .report import write_report
    from .run import run_benchmark

    config = bench_config(args)
    runs = {}
    for tp in tps:
        runs[tp] = run_benchmark(dataclasses.replace(config, tp=tp), progress=not args.no_progress)
        write_report(runs[tp], out / f"tp{tp}")
    same = lossless(runs)
    print(comparison(runs))
    print(f"\nevery --tp gave the answers --tp {tps[0]} gave: {same}")
    return 0 if same else 1


def lossless(runs: dict[int, dict]) -> bool:
    """Every server's reference answers equal the first's, and every cell's answers equal its server's."""
    first = next(iter(runs.values()))["references"]
    return all(
        results["references"] == first
        and all(r["identical_to_reference"] in (None, f"{r['requests']}/{r['requests']}") for r in results["records"])
        for results in runs.values()
    )


def comparison(runs: dict[int, dict]) -> str:
    base_tp, base = next(iter(runs.items()))
    lines = [
        f"| mode | N | --tp | tokens/s | vs --tp {base_tp} | tokens per server-busy-s | ITL p50 ms | acceptance |",
        "|---|---|---|---|---|---|---|---|",
    ]
    baseline = {(r["mode"], r["num_edges"], r["rtt_ms"]): r for r in base["records"]}
    for tp, results in runs.items():
        for r in results["records"]:
            ref = baseline[(r["mode"], r["num_edges"], r["rtt_ms"])]
            ratio = r["throughput_tok_s"] / ref["throughput_tok_s"] if ref["throughput_tok_s"] else float("nan")
            acceptance = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
            lines.append(
                f"| {r['mode']} | {r['num_edges']} | {tp} | {r['throughput_tok_s']:.2f} | {ratio:.2f}x | "
                f"{r['tokens_per_server_busy_s']:.2f} | {r['itl_p50_ms']:.0f} | {acceptance} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
