"""Whole forwards of one model on two or more matrix paths, all loaded in one process, each step's forwards taken in
turn: the comparison `specedge-bench engine` cannot make, since it loads one path after another while the hour's
stream moves.

    python scripts/forwards_in_turn.py --matmul onednn-numba onednn --dtype bfloat16 --steps 1x1 8x1 8x5 --rounds 6

Each round runs every step once on each path, one path after the other, the order reversed each round, after an
untimed round (bench/engine.py's forwards_in_turn). The medians are printed in ms, with each round's ratio of the
first path's time to the second's, and whether every path gave the same logits bit for bit, else the same argmax at
every position (paths round differently). Steps are named as the engine bench
names them (bench/engine.py's Step), on 200 cached tokens a row by default. docs/engine-cpu.md's `onednn-numba`
figures came from it.
"""

from __future__ import annotations

import argparse

import torch

from specedge.bench.engine import DTYPES, Step, forwards_in_turn, prefixed_runner
from specedge.registry import resolve
from specedge.server.loading import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--matmul", nargs="+", required=True, help="two or more paths; ratios are first / second")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--steps", nargs="+", default=["1x1", "1x5", "8x1", "8x5", "16x5", "p155"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prefix", type=int, default=200)
    args = parser.parse_args()
    if len(args.matmul) < 2:
        parser.error("--matmul needs two paths or more")
    torch.set_grad_enabled(False)
    dtype, resolved = DTYPES[args.dtype], resolve(args.target)
    steps = [Step.parse(name) for name in args.steps]
    runners = {}
    for path in args.matmul:
        model = load_target(resolved, device=torch.device("cpu"), dtype=dtype, matmul=path).model
        runner, _, token_ids = prefixed_runner(model, steps, args.prefix, dtype)
        runners[path] = runner
    forwards = {path: runner.forward for path, runner in runners.items()}
    print("\n".join(forwards_in_turn(forwards, steps, args.prefix, token_ids, args.rounds)))


if __name__ == "__main__":
    main()
