"""Process-level liveness: a rank that hangs or is told to stop ends as a failure or a flush.

None of these modules keeps checkpoint state; they act on the process.

- :mod:`.watchdog` bounds every wait by the job's timeout and runs a heartbeat and hang
  detector per rank that ends the process (torchrun restarts the group) or, under
  in-process recovery, names the frozen ranks to their supervisors.
- :mod:`.termination` turns SIGTERM into a flag the engine votes on, and lets the process
  die of the signal at once when a peer can no longer vote (:mod:`.absence`: its process
  exited, its heartbeat stopped), else after a grace period.
- :mod:`.generation` is the one seam to in-process recovery (:mod:`baft.inprocess`): the
  generation this process runs in, and its line to its supervisor.

- :mod:`.loader` keeps forked DataLoader workers alive through a preemption's SIGTERM.

They import nothing from baft above them (and not torch at import), so every layer above
(engine, recover, api, inprocess) may use them.
"""
