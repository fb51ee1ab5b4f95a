"""In-process recovery: survivors keep their processes, only the failed one is replaced.

Launch: ``torchrun [torchrun options] -m baft.inprocess train.py [ARGS]`` (or
``-m baft.inprocess -m package.module``), with the training script's body in a
function run through :func:`baft.run`::

    def main():
        dist.init_process_group("gloo")       # or nccl
        ...                                     # stages, schedule, optimizer
        ft = baft.protect(...)
        start = ft.restore()
        for it in range(start, n): ...
        ft.close()

    if __name__ == "__main__":
        baft.run(main)

Both ends live here. The supervisor's: :mod:`.supervisor` (the process torchrun starts)
holds the training process (:mod:`.child`); :mod:`.control` is the supervisors' shared
store; :mod:`.membership` watches the peers (heartbeats, and :mod:`.lease`, which tells
rank 0's supervisor at once that a peer supervisor died with its host) and shrinks an
elastic job onto the hosts left; :mod:`.policy` says when to give up and let torchrun
restart the group. The
training process's: :mod:`.channel` (its pipe to the supervisor, the abort of a
generation's sockets by :mod:`.sockets`, a SIGTERM held between generations) and
:mod:`.run` (``baft.run``: re-enter the training function). They talk in
:mod:`.messages`. The library (api, engine, recover, watchdog) sees none of it: it reads
:mod:`baft.liveness.generation`, which the channel fills in. Every bound is an
:class:`~baft.config.InprocessTimeouts` field.
"""
