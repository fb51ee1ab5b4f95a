"""``torchrun [...] -m baft.inprocess [-m MODULE | SCRIPT] [ARGS...]``: run a rank under
its supervisor (see :mod:`baft.inprocess`)."""

from __future__ import annotations

import logging
import os
import sys

from baft.inprocess.child import Target

USAGE = "usage: torchrun [...] -m baft.inprocess [-m MODULE | SCRIPT] [ARGS...]"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE, file=sys.stderr)
        return 2
    target = (
        Target(argv[1], True, tuple(argv[2:]))
        if argv[0] == "-m"
        else Target(argv[0], False, tuple(argv[1:]))
    )
    if "RANK" not in os.environ:
        print(
            "baft.inprocess: start it with torchrun (RANK, WORLD_SIZE, MASTER_ADDR/PORT unset)",
            file=sys.stderr,
        )
        return 2
    log = logging.getLogger("baft")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[baft supervisor %(process)d] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO if os.environ.get("RANK") == "0" else logging.WARNING)
    # the forkserver's imports (torch, baft) run while this process imports its own
    from baft.inprocess.preload import start_forkserver

    start_forkserver()
    from baft.inprocess.supervisor import Options, Supervisor

    return Supervisor(target, Options.from_env()).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
