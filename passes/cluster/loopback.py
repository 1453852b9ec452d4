"""Keep a loopback-only worker's gRPC port to this machine (Linux).

TensorFlow's gRPC server listens on every interface (``0.0.0.0:port`` / ``[::]:port``, fixed in
its C++; ``tf.distribute.Server`` and its ``ServerDef`` take a port, never an address), so
:mod:`partitioner.cli.worker` ties the listening socket to the loopback device
(``SO_BINDTODEVICE lo``) itself. This module finds this process's TCP sockets on a port (its
socket file descriptors, ``/proc/self/fd`` -> ``socket:[inode]``, each asked for its local port
and peer; ``/proc/net/tcp`` and ``/proc/net/tcp6`` for connections still waiting in the accept
queue), ties the unconnected ones (:func:`tie_listening`; :class:`EarlyTie`, a thread that does
so the moment the socket is bound, while :func:`start_server_unlocked` starts the server
without Python's interpreter lock), and shuts down connections whose peer is not a loopback
address (:func:`close_foreign_connections`): a tie refuses new connections from other hosts but
keeps those accepted before it.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import struct
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "TCP_LISTEN",
    "EarlyTie",
    "ServerHandle",
    "TcpEntry",
    "close_foreign_connections",
    "is_foreign",
    "is_loopback",
    "listening_sockets",
    "pending_foreign_connections",
    "settle_foreign_connections",
    "start_server_unlocked",
    "tcp_entries",
    "tie_listening",
]

LISTEN = "0A"
"""``/proc/net/tcp``'s state of a listening socket."""
ESTABLISHED = "01"
SYN_RECV = "03"
"""A handshake under way: the connection joins the accept queue when the client answers."""
NO_INODE = "0"
"""The inode of a connection no process holds yet (still in the listener's accept queue)."""
OPEN_STATES = frozenset({1, 8})
"""``TCP_ESTABLISHED`` and ``TCP_CLOSE_WAIT``: a connection not shut down on this side yet."""
TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
EARLY_POLL_S = 0.0
"""How long :class:`EarlyTie` sleeps between looks for the listening socket (0: it only lets
go of the interpreter lock; a look takes tens of microseconds, the server starts in a few
milliseconds)."""

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class TcpEntry:
    """One line of ``/proc/net/tcp(6)``: state (hex code), local port, peer address, inode."""

    state: str
    local_port: int
    peer: Address
    inode: str


def _address(text: str) -> Address:
    """A ``/proc/net/tcp`` address: hex 32-bit words, each in this machine's byte order."""
    words = (int(text[i : i + 8], 16) for i in range(0, len(text), 8))
    return ipaddress.ip_address(b"".join(struct.pack("=I", w) for w in words))


def tcp_entries(port: int) -> tuple[TcpEntry, ...]:
    """Every IPv4 and IPv6 TCP socket of this machine whose local port is ``port``."""
    found: list[TcpEntry] = []
    for table in TABLES:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            if int(fields[1].rpartition(":")[2], 16) != port:
                continue
            peer = _address(fields[2].rpartition(":")[0])
            found.append(TcpEntry(fields[3], port, peer, fields[9]))
    return tuple(found)


def _socket_fds() -> dict[int, str]:
    """This process's socket file descriptors: ``{fd: inode}``."""
    found: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            found[int(name)] = link[8:-1]
    return found


def _on_port(fd: int, port: int) -> tuple[socket.socket, Address | None] | None:
    """A duplicate of ``fd`` (the caller closes it) and its peer (None: not connected) if
    ``fd`` is a TCP socket of local port ``port``, else None."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:  # closed meanwhile, or not an internet socket
        return None
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            if sock.getsockname()[1] == port:
                return sock, _peer(sock)
    except OSError:
        pass
    sock.close()
    return None


def _peer(sock: socket.socket) -> Address | None:
    try:
        return ipaddress.ip_address(str(sock.getpeername()[0]).split("%")[0])
    except (OSError, ValueError):
        return None


def _tcp_state(sock: socket.socket) -> int:
    """The kernel's TCP state of ``sock`` (``tcpi_state``, the first byte of ``TCP_INFO``)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


def is_foreign(peer: Address | None) -> bool:
    """Whether ``peer`` is a host address other than loopback (``::ffff:127.0.0.1`` is
    loopback; None, no peer, and the unspecified address are not foreign)."""
    if isinstance(peer, ipaddress.IPv6Address) and peer.ipv4_mapped is not None:
        peer = peer.ipv4_mapped
    return peer is not None and not (peer.is_loopback or peer.is_unspecified)


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is on this machine's loopback (127.0.0.0/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]").rstrip(".") or host, None)
    except (OSError, UnicodeError):
        return False
    addresses = {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}
    mapped = {  # ::ffff:127.0.0.1 is 127.0.0.1
        a.ipv4_mapped if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped else a
        for a in addresses
    }
    return bool(mapped) and all(a.is_loopback for a in mapped)


TCP_LISTEN = 10
"""The kernel's ``tcpi_state`` of a listening socket."""


def listening_sockets() -> dict[str, int]:
    """This process's listening TCP sockets: ``{inode: local port}``."""
    found: dict[str, int] = {}
    for fd, inode in _socket_fds().items():
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed meanwhile, or not an internet socket
            continue
        try:
            inet = sock.family in (socket.AF_INET, socket.AF_INET6)
            if inet and sock.type == socket.SOCK_STREAM and _tcp_state(sock) == TCP_LISTEN:
                found[inode] = sock.getsockname()[1]
        except OSError:
            pass
        finally:
            sock.close()
    return found


def tie_listening(port: int, skip: Collection[str] = ()) -> tuple[set[str], str]:
    """Tie this process's unconnected TCP sockets on local ``port`` (the listening one, or
    one bound but not yet listening), but those whose inode is in ``skip``, to ``lo``: (the
    inodes tied, why one could not be: "" if none failed)."""
    tied: set[str] = set()
    problem = ""
    for fd, inode in _socket_fds().items():
        found = None if inode in skip else _on_port(fd, port)
        if found is None:
            continue
        sock, peer = found
        try:
            if peer is None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo")
                tied.add(inode)
        except OSError as exc:
            problem = exc.strerror or str(exc)
        finally:
            sock.close()
    return tied, problem


def close_foreign_connections(port: int) -> int:
    """Shut down this process's TCP connections on local ``port`` whose peer is not a
    loopback address; how many."""
    closed = 0
    for fd in _socket_fds():
        found = _on_port(fd, port)
        if found is None:
            continue
        sock, peer = found
        try:
            if is_foreign(peer) and _tcp_state(sock) in OPEN_STATES:
                sock.shutdown(socket.SHUT_RDWR)
                closed += 1
        except OSError:  # not connected any more
            pass
        finally:
            sock.close()
    return closed


def pending_foreign_connections(port: int) -> int:
    """Connections from other hosts to local ``port`` that wait in a listener's accept queue,
    or in a handshake before it (no process holds them yet), from ``/proc/net/tcp(6)``."""
    return sum(
        1
        for e in tcp_entries(port)
        if e.state in (ESTABLISHED, SYN_RECV) and e.inode == NO_INODE and is_foreign(e.peer)
    )


def settle_foreign_connections(port: int, timeout_s: float = 1.0) -> int:
    """:func:`close_foreign_connections` until none is left, also none waiting to be accepted
    (the server accepts them in a moment, then they are shut down), for at most ``timeout_s``;
    how many were shut down."""
    deadline = time.monotonic() + timeout_s
    total = 0
    while True:
        pending = pending_foreign_connections(port)  # before: one accepted meanwhile is closed
        closed = close_foreign_connections(port)
        total += closed
        if not (closed or pending) or time.monotonic() > deadline:
            return total
        if not closed:
            time.sleep(0.01)


class EarlyTie:
    """A thread that ties this process's sockets listening on ``port`` to ``lo`` as soon as
    they appear (started just before the server, :meth:`stop`\\ ped once it runs), so the
    window in which other hosts can connect is a poll interval rather than the server's
    whole start-up. Best effort: the caller still ties (and checks) after the server starts."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.tied: set[str] = set()
        self.elapsed_s: float | None = None
        """Seconds from the start to the first tie, None before one."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tie-lo-{port}", daemon=True)
        self._started = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                tied, _ = tie_listening(self.port, skip=self.tied)
            except (OSError, ValueError):
                tied = set()
            if tied and self.elapsed_s is None:
                self.elapsed_s = time.monotonic() - self._started
            self.tied |= tied
            time.sleep(EARLY_POLL_S)

    def stop(self) -> None:
        """End the thread (waits for it)."""
        self._stop.set()
        self._thread.join()


class ServerHandle:
    """A TensorFlow server started through the C API (:func:`start_server_unlocked`); it lives
    as long as the process (TensorFlow 2 has no clean shutdown of a gRPC server)."""

    def __init__(self, pointer: int, target: str) -> None:
        self.pointer = pointer
        self.target = target

    def __repr__(self) -> str:
        return f"ServerHandle({self.target})"


def start_server_unlocked(server_def: bytes) -> ServerHandle | str | None:
    """Create and start TensorFlow's server for the serialized ``ServerDef`` through its C API
    (``TF_NewServer``, ``TF_ServerStart``), called without Python's interpreter lock held, so
    that :class:`EarlyTie` runs while the server binds and starts listening
    (``tf.distribute.Server`` holds the lock all along, so the thread could only tie the
    socket after the server already serves). The handle; TensorFlow's one-line message when
    it refuses (the port in use, say); None when the C API is not at hand (the caller then
    uses ``tf.distribute.Server``)."""
    lib = _c_api()
    if lib is None:
        return None
    status = lib.TF_NewStatus()
    try:
        pointer = lib.TF_NewServer(server_def, len(server_def), status)
        if lib.TF_GetCode(status) == 0:
            lib.TF_ServerStart(pointer, status)
        if lib.TF_GetCode(status) != 0:
            message = (lib.TF_Message(status) or b"").decode(errors="replace").strip()
            return message.splitlines()[0] if message else "TensorFlow refused the server"
        target = (lib.TF_ServerTarget(pointer) or b"").decode(errors="replace")
        return ServerHandle(int(pointer), target)
    finally:
        lib.TF_DeleteStatus(status)


def _c_api() -> ctypes.CDLL | None:
    """TensorFlow's C API library (``libtensorflow_cc``, already loaded by ``import
    tensorflow``) with the server functions declared, or None."""
    import tensorflow as tf

    path = Path(tf.__file__).parent / "libtensorflow_cc.so.2"
    try:
        lib = ctypes.CDLL(str(path))
        pointer, size = ctypes.c_void_p, ctypes.c_size_t
        for name, restype, argtypes in (
            ("TF_NewStatus", pointer, []),
            ("TF_DeleteStatus", None, [pointer]),
            ("TF_GetCode", ctypes.c_int, [pointer]),
            ("TF_Message", ctypes.c_char_p, [pointer]),
            ("TF_NewServer", pointer, [ctypes.c_char_p, size, pointer]),
            ("TF_ServerStart", None, [pointer, pointer]),
            ("TF_ServerTarget", ctypes.c_char_p, [pointer]),
        ):
            function = getattr(lib, name)
            function.restype, function.argtypes = restype, argtypes
    except (OSError, AttributeError):
        return None
    return lib
