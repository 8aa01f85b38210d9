"""The real 1.5B's 1 x 1 and 8 x 1 forwards on the numba path, in turn with the same model's matrix products alone
at M = 1 and 8: how much of a small step is its products, and how much everything else (attention, norms, glue).

    python scripts/forward_against_products.py [--repeats 7] [--rounds 2]

Each forward reads 200 cached tokens a row, as `specedge-bench engine`'s do. The products are the model's own
projection modules (every layer's q/k/v, o, gate/up and down, and the LM head: 6.17 GB), each called once on
random rows, in forward order. Medians in ms, one line a round.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from specedge.bench.engine import Step, prefixed_runner
from specedge.registry import resolve
from specedge.server.kernels import in_turn_ms
from specedge.server.loading import load_target
from specedge.server.matmul import PanelLinear, PlainLinear

PREFIX = 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    target = load_target(resolve("qwen2.5-coder-1.5b"), device=torch.device("cpu"), dtype=torch.float32, matmul="numba")
    model = target.model
    steps = [Step.parse(name) for name in ("1x1", "8x1")]
    runner, _, ids = prefixed_runner(model, steps, PREFIX, torch.float32)
    linears = [module for module in model.modules() if isinstance(module, (PlainLinear, PanelLinear))]
    print(f"{len(linears)} products, {sum(4 * m.in_features * m.out_features for m in linears) / 1e9:.2f} GB (float32)")

    def products(rows: int):
        calls = [(linear, torch.randn(rows, linear.in_features)) for linear in linears]
        return lambda: [linear(x) for linear, x in calls]

    calls = {
        f"{step.name} forward": functools.partial(runner.forward_packed, step.requests(PREFIX, ids)) for step in steps
    }
    calls |= {f"products M={rows}": products(rows) for rows in (1, 8)}
    for _ in range(args.rounds):
        timed = in_turn_ms(calls, args.repeats)
        print("  ".join(f"{name} {statistics.median(times):.1f}" for name, times in timed.items()))


if __name__ == "__main__":
    main()
