"""Abort a blocked gloo collective from another thread: shut its TCP connections down.

gloo has no abort (pytorch #130345): ``destroy_process_group`` or ``ProcessGroup.abort``
from another thread leave a collective blocked in ``recv`` until the *peer* closes its end
(measured here: a survivor blocked on another live survivor waited until that one's
process exited, 3 s later). The one lever that works is the kernel's: ``shutdown(2)`` on
the process's own TCP sockets makes every blocked read and write on them return at once,
and gloo raises the error in the waiting thread, as it does when a peer dies.

Which sockets: the TCP sockets this process opened since :func:`tcp_inodes` took its
snapshot (the caller takes it before the training function opens its process groups):
gloo's pairs, the c10d store clients of that generation, baft's own groups. Sockets that
existed before (and every non-TCP socket: the supervisor's pipe is a Unix socket) stay.
Linux only (``/proc``); elsewhere nothing is found and the bounded waits apply.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from pathlib import Path

log = logging.getLogger("baft")


_LISTEN = "0A"
"""TCP state LISTEN in /proc/net/tcp: never shut down (gloo's listener thread aborts the
process on ``accept: Invalid argument``)."""


def _tcp_table_inodes() -> set[int]:
    """Inodes of every connected (not listening) TCP socket in this network namespace
    (/proc/net/tcp and tcp6)."""
    out: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/self/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] != _LISTEN:
                out.add(int(fields[9]))
    return out


def _socket_fds() -> dict[int, int]:
    """This process's socket file descriptors: fd -> socket inode."""
    out: dict[int, int] = {}
    try:
        entries = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for entry in entries:
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(entry)] = int(target[8:-1])
    return out


def tcp_inodes() -> set[int]:
    """Inodes of this process's connected TCP sockets now (the snapshot to keep)."""
    tcp = _tcp_table_inodes()
    return {inode for inode in _socket_fds().values() if inode in tcp}


def shutdown_tcp(keep: set[int]) -> int:
    """``shutdown(SHUT_RDWR)`` every TCP socket of this process whose inode is not in
    ``keep``; returns how many. The descriptors stay open (their owners close them)."""
    tcp = _tcp_table_inodes()
    done = 0
    for fd, inode in _socket_fds().items():
        if inode not in tcp or inode in keep:
            continue
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with contextlib.suppress(OSError):  # already shut, or not connected
            s.shutdown(socket.SHUT_RDWR)
            done += 1
        s.close()
    return done
