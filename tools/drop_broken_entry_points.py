"""Remove lm-resiliency 0.2.0's ``torchrun.handlers`` entry point from the venv.

torch's elastic agent loads every ``torchrun.handlers`` plugin in *every* torchrun agent
and worker process at import time. lm-resiliency's plugin is broken on torch 2.13
(``create_rendezvous_handler() missing ... 'params'``: a logged traceback per process) and
costs 2-5 s of imports per process on this machine, which slowed every launch of the test
suite and inflated measured restart times. baft never uses that plugin (its peer benchmark
calls lm-resiliency's Python API directly), so the section is dropped from the installed
package's metadata. Safe to run repeatedly; does nothing when lm-resiliency is absent.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re

BROKEN = {"lm-resiliency": "torchrun.handlers"}


def main() -> int:
    for dist_name, group in BROKEN.items():
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            continue
        files = [f for f in dist.files or () if f.name == "entry_points.txt"]
        for f in files:
            path = dist.locate_file(f)
            text = path.read_text()
            # drop the [group] section up to the next section or the end
            new = re.sub(rf"\[{re.escape(group)}\][^\[]*", "", text)
            if new != text:
                path.write_text(new)
                print(f"removed [{group}] entry points of {dist_name} ({path})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
