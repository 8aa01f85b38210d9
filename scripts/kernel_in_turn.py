"""Whole forwards of one model with two versions of the numba kernels, server/_forward_numba.py as installed and a
changed copy of it, the model loaded once and each step's forwards taken in turn: how a kernel change moves whole steps,
at the same hour's stream for both (the comparison two processes, or two engine runs, cannot make).

    cp server/_forward_numba.py /tmp/variant.py   # then change the copy
    python scripts/kernel_in_turn.py /tmp/variant.py --dtype bfloat16 --matmul onednn-numba --steps 1x1 1x5 8x1

Every forward runs with the kernel getters the engine calls in a step (the products', the attention's and the compiled
layers') answering with one version or the other; the rounds alternate which goes first, and the first forward of each
is untimed (the copy compiles then, into its own numba cache beside it). The weights are laid out once, by the installed
kernel's rules, so the copy must keep the constants that decide a layout (PANEL, the pairs, which forms run) and change
only how the kernels read it. Printed (bench/engine.py's forwards_in_turn): each step's medians in ms, the copy's time
over the installed one's a round, and whether every logit had the same bits. docs/engine-cpu.md's "A lone tile of pairs
prefetches nothing" came from the probe that became this script.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
from collections.abc import Callable
from types import ModuleType

import torch

from specedge.bench.engine import DTYPES, Step, forwards_in_turn, prefixed_runner
from specedge.registry import resolve
from specedge.server import attention, layer_kernel, matmul
from specedge.server.loading import load_target
from specedge.server.runner import ForwardRequest

# (module, name) of each kernel getter a step calls: each returns server/_forward_numba.py's module, or None.
GETTERS = (
    (matmul, "numba_kernel"),
    (attention, "numba_kernel"),
    (attention, "numba_bfloat16_kernel"),
    (layer_kernel, "numba_kernel"),
)


def load_copy(path: pathlib.Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("specedge_kernel_copy", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"kernel_in_turn: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def switcher(copy: ModuleType) -> Callable[[bool], None]:
    """use(True) points every getter at the copy (where the installed one answers at all), use(False) back."""
    installed = {(owner, name): getattr(owner, name) for owner, name in GETTERS}

    def answering(original: Callable[..., ModuleType | None]) -> Callable[..., ModuleType | None]:
        return lambda *args: copy if original(*args) is not None else None

    copies = {key: answering(original) for key, original in installed.items()}

    def use(the_copy: bool) -> None:
        for (owner, name), original in installed.items():
            setattr(owner, name, copies[owner, name] if the_copy else original)

    return use


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("copy", type=pathlib.Path, help="a changed copy of server/_forward_numba.py")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--matmul", default="auto")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--steps", nargs="+", default=["1x1", "1x5", "8x1", "8x5"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=200)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    dtype, steps = DTYPES[args.dtype], [Step.parse(name) for name in args.steps]
    model = load_target(resolve(args.target), device=torch.device("cpu"), dtype=dtype, matmul=args.matmul).model
    runner, _, token_ids = prefixed_runner(model, steps, args.prefix, dtype)
    use = switcher(load_copy(args.copy))

    def with_kernels(the_copy: bool) -> Callable[[list[ForwardRequest]], list[torch.Tensor]]:
        def forward(requests: list[ForwardRequest]) -> list[torch.Tensor]:
            use(the_copy)  # four attributes set: nothing beside a forward's time
            return runner.forward(requests)

        return forward

    try:
        lines = forwards_in_turn(
            {"copy": with_kernels(True), "installed": with_kernels(False)}, steps, args.prefix, token_ids, args.rounds
        )
    finally:
        use(False)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
