"""Leases: a peer supervisor's death seen at once, not after ``peer_silence_s`` of silence.

Every supervisor but rank 0's holds one TCP connection to rank 0's supervisor for its
whole life and never writes to it after its rank. When its process dies (its host's
processes killed, its torchrun agent's whole tree gone), the kernel closes that
connection and rank 0's supervisor reads end-of-file within milliseconds. Heartbeats in
the control store stay for what sends no end-of-file (a frozen host, a pulled cable):
those are still found by ``peer_silence_s`` of silence (5 s by default), which made every
lost host cost in-process recovery 5 s before its group restart.

Plain sockets, not the control store: a c10d ``TCPStore`` server sees its clients go but
does not tell its Python owner. A supervisor that cannot connect (a firewall between
hosts) keeps only the heartbeats, and logs so.
"""

from __future__ import annotations

import logging
import select
import socket

log = logging.getLogger("baft")

_CONNECT_S = 10.0
"""How long a peer supervisor tries to reach rank 0's lease listener."""
_HELLO_S = 2.0
"""How long rank 0's supervisor waits for a new connection to name its rank."""


class LeaseServer:
    """Rank 0's supervisor's end: a listener and one connection per peer supervisor."""

    def __init__(self) -> None:
        if socket.has_dualstack_ipv6():  # MASTER_ADDR may name an IPv4 or IPv6 address
            self.listener = socket.create_server(
                ("", 0), family=socket.AF_INET6, backlog=128, dualstack_ipv6=True
            )
        else:
            self.listener = socket.create_server(("", 0), backlog=128)
        self.listener.setblocking(False)
        self.port = int(self.listener.getsockname()[1])
        self._conns: dict[socket.socket, int] = {}

    def waitables(self) -> list[socket.socket]:
        """What the supervisor's ``wait()`` should wake up for."""
        return [self.listener, *self._conns]

    def held(self) -> set[int]:
        """Ranks whose supervisor holds a lease now."""
        return set(self._conns.values())

    def poll(self) -> list[int]:
        """Accept new leases; the ranks whose lease ended since the last call (their
        supervisor's process is gone). Never blocks longer than a new peer's hello."""
        ready, _, _ = select.select(self.waitables(), [], [], 0.0)
        gone: list[int] = []
        for sock in ready:
            if sock is self.listener:
                self._accept()
                continue
            try:
                data = sock.recv(64)
            except OSError:
                data = b""
            if not data:  # end-of-file or reset: the peer's process is gone
                gone.append(self._conns.pop(sock))
                sock.close()
        return sorted(gone)

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        conn.settimeout(_HELLO_S)
        try:
            hello = conn.recv(16)
            rank = int(hello.decode().strip())
        except (OSError, ValueError):
            conn.close()
            return
        conn.setblocking(False)
        self._conns[conn] = rank

    def close(self) -> None:
        for sock in [self.listener, *self._conns]:
            sock.close()
        self._conns.clear()


def serve_leases() -> LeaseServer | None:
    """Rank 0's supervisor's listener, or None (logged) when it cannot listen: the peers
    are then told port 0 and keep only their heartbeats."""
    try:
        return LeaseServer()
    except OSError as e:
        log.warning("baft supervisor 0: no lease listener (%s): lost hosts are found by "
                    "heartbeat silence only", e)  # fmt: skip
        return None


def hold_lease(host: str, port: int, rank: int) -> socket.socket | None:
    """A peer supervisor's end: connect to rank 0's supervisor and name this rank; the
    socket must stay open (referenced) for the supervisor's life. None (logged) when
    rank 0's listener cannot be reached: its heartbeats alone then tell it is alive;
    None at once for port 0 (rank 0 has no listener, :func:`serve_leases`)."""
    if port == 0:
        return None
    try:
        sock = socket.create_connection((host, port), timeout=_CONNECT_S)
        sock.sendall(f"{rank}\n".encode())
    except OSError as e:
        log.warning(
            "baft supervisor %d: no lease with rank 0's supervisor at %s:%d (%s): a lost "
            "host is found by heartbeat silence only", rank, host, port, e,
        )  # fmt: skip
        return None
    return sock
