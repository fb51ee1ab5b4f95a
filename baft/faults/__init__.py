"""Failure injection as an API: one spec grammar (``spec``, pure) and its runtime (``injector``).

- ``spec``: ``FaultSpec.parse("kill:rank=1,iter=7")``, targeting decisions, fault records.
- ``injector``: ``FaultInjector`` fires due faults in a rank (SIGKILL, lose a node's or the
  whole job's stores, corrupt or delete a shard, hang, slow down) and records them in
  ``{run_dir}/faults.jsonl`` so that each fires once per job across restarts.
"""

from baft.faults.injector import (
    RECORDS_FILE,
    FaultInjector,
    append_record,
    clear_records,
    corrupt_committed,
    read_records,
    records_path,
)
from baft.faults.spec import (
    GRAMMAR,
    KINDS,
    POINTS,
    TARGETS,
    FaultRecord,
    FaultSpec,
    parse_records,
    parse_specs,
)

__all__ = [
    "GRAMMAR",
    "KINDS",
    "POINTS",
    "RECORDS_FILE",
    "TARGETS",
    "FaultInjector",
    "FaultRecord",
    "FaultSpec",
    "append_record",
    "clear_records",
    "corrupt_committed",
    "parse_records",
    "parse_specs",
    "read_records",
    "records_path",
]
