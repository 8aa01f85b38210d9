"""Children that die with their parent, started without forking a process that runs gRPC.

A benchmark or test run starts servers (`specedge-server`, mosquitto) while its own gRPC channels live. Setting
the parent-death signal in a Popen `preexec_fn` makes subprocess fork() the whole process, and then gRPC's fork
handler restarts its poller in the child, where `close_fds` closes the poller's epoll descriptor before exec:
the child aborts with "Epoll1Poller ... epoll_wait error: Bad file descriptor" (grpc/grpc#43055, grpcio 1.81 on;
0.7-3.3% of starts on a 2-core Zen 4, with one idle channel in the parent). So the child is started through
this module instead:

    python bench/lifeline.py --parent PID [--cpus 0,1] -- COMMAND...

which sets the signal (and the CPUs) in its own process and execs COMMAND. Without a preexec_fn subprocess takes
vfork, which runs no fork handlers; the signal survives exec (Linux clears it only for set-user-ID programs).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def dying_with_parent(command: Sequence[str], *, cpus: set[int] | None = None) -> list[str]:
    """`command`, prefixed so that it gets SIGTERM when this process dies, even by SIGKILL or a crash: so no
    server outlives the benchmark or test run that started it (and holds its gigabytes). With `cpus`, it is also
    confined to those CPUs.

    Linux ties the signal to the thread that starts the child, not the process: off the main thread, where the
    thread's end would stop a server that should live on, there is no signal (`command` pinned where asked, else
    as is). Off Linux, `command` as is.
    """
    linux = sys.platform.startswith("linux")
    parent = ["--parent", str(os.getpid())] if linux and threading.current_thread() is threading.main_thread() else []
    pin = ["--cpus", ",".join(map(str, sorted(cpus)))] if cpus and linux else []
    if not parent and not pin:
        return list(command)
    # Run as a file, without site-packages (-I -S): it needs only the standard library, and starts in half the
    # time `-m` takes (26 against 50 ms here).
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), *parent, *pin, "--", *command]


def main(argv: Sequence[str]) -> None:
    """`[--parent PID] [--cpus 0,1] -- COMMAND...` (parsed by hand: argparse would double the start-up time)."""
    options, command = _split(argv)
    if "--parent" in options:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != int(options["--parent"]):  # the parent died before the signal was set: none will come
            os.kill(os.getpid(), signal.SIGTERM)
    if "--cpus" in options:
        os.sched_setaffinity(0, {int(cpu) for cpu in options["--cpus"].split(",")})
    try:
        os.execvp(command[0], command)
    except OSError as error:  # as a shell says it, where Popen would have raised it in the parent
        print(f"lifeline.py: cannot run {command[0]}: {error.strerror}", file=sys.stderr)
        sys.exit(127 if isinstance(error, FileNotFoundError) else 126)


def _split(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    options, rest = {}, list(argv)
    while rest[:1] in (["--parent"], ["--cpus"]) and len(rest) > 1:
        options[rest[0]] = rest[1]
        rest = rest[2:]
    if rest[:1] != ["--"] or len(rest) < 2:
        sys.exit(f"usage: lifeline.py [--parent PID] [--cpus 0,1] -- COMMAND...; got {list(argv)}")
    return options, rest[1:]


if __name__ == "__main__":
    main(sys.argv[1:])
