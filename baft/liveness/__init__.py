"""Process-level liveness: a rank that hangs or is told to stop ends as a failure or a flush.

Neither module keeps checkpoint state; both act on the process. :mod:`.watchdog` bounds
every wait by the job's timeout and runs a heartbeat and hang detector per rank that
ends the process (torchrun restarts the group); :mod:`.termination` turns SIGTERM into a
flag the engine votes on, and lets the process die of the signal at once when a peer can
no longer vote (:mod:`.absence`: its process exited, its heartbeat stopped), else after a
grace period.
They import nothing from baft, so every layer above (engine, recover, api) may use them.
"""
