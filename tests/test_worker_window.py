"""Hostile input (issue 34, campaign 34e: D1): a loopback-only worker keeps no connection from
another host, not even one made while it starts.

TensorFlow's server listens on every interface before the worker ties its socket to ``lo``;
a connection accepted in that window survived the tie (an HTTP/2 PING still answered after
"ready"). Now :mod:`passes.cluster.loopback` ties the socket the moment it is bound, and the
worker shuts down every connection whose peer is not loopback before it says it is ready and
while it serves.

The unit cases connect from a non-loopback address of this machine (skipped when it has none)
and from 127.0.0.1, to a listener in this process. The slow case runs a real worker whose
window is held open on purpose (its listening socket untied for a moment), so it does not
depend on winning a race.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from passes.cluster.loopback import (
    EarlyTie,
    close_foreign_connections,
    is_foreign,
    pending_foreign_connections,
    settle_foreign_connections,
    tie_listening,
)

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 5.0


def _local_address() -> str | None:
    """A non-loopback IPv4 address of this machine (its routing table's LOCAL /32 hosts)."""
    try:
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
    except OSError:
        return None
    last = ""
    for line in lines:
        text = line.strip()
        if text.startswith("|--"):
            last = text[3:].strip()
        elif text == "/32 host LOCAL" and not last.startswith("127."):
            return last
    return None


LOCAL = _local_address()
needs_local = pytest.mark.skipif(
    LOCAL is None or not sys.platform.startswith("linux"),
    reason="this machine has no non-loopback IPv4 address (or is not Linux)",
)


def _listener(family: socket.AddressFamily = socket.AF_INET) -> socket.socket:
    server = socket.socket(family, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    server.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
    server.listen(8)
    return server


def _client(source: str, port: int) -> socket.socket:
    """A connection from ``source`` to the same address (``127.0.0.1`` or this machine's
    other address), port ``port``."""
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.bind((source, 0))
    client.settimeout(WAIT_S)
    client.connect((source, port))
    return client


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, list[socket.socket]]]:
    """A listener and the sockets to close after the case."""
    server = _listener()
    opened: list[socket.socket] = [server]
    yield server, opened
    for sock in opened:
        sock.close()


@needs_local
def test_only_the_connection_from_another_address_is_shut_down(
    pair: tuple[socket.socket, list[socket.socket]],
) -> None:
    server, opened = pair
    port = server.getsockname()[1]
    assert LOCAL is not None
    foreign = _client(LOCAL, port)
    opened.append(foreign)
    foreign_side, _ = server.accept()
    local = _client("127.0.0.1", port)
    opened.append(local)
    local_side, _ = server.accept()
    opened += [foreign_side, local_side]

    assert close_foreign_connections(port) == 1
    assert foreign.recv(16) == b"", "the connection from another address is still open"
    local_side.sendall(b"still here")
    assert local.recv(16) == b"still here"
    assert close_foreign_connections(port) == 0, "a shut-down connection was counted again"
    late = _client("127.0.0.1", port)
    opened.append(late)


@needs_local
@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6], ids=["tcp", "tcp6"])
def test_a_queued_connection_is_counted_then_shut_down_once_accepted(
    family: socket.AddressFamily,
) -> None:
    """One from another address that waits in the accept queue is seen in /proc/net/tcp(6)
    (an IPv4-mapped peer for a dual-stack listener); the settle waits for the accept."""
    try:
        server = _listener(family)
    except OSError as exc:
        pytest.skip(f"no {family.name} listener here: {exc}")
    port = server.getsockname()[1]
    assert LOCAL is not None
    foreign = _client(LOCAL, port)
    local = _client("127.0.0.1", port)
    accepted: list[socket.socket] = []
    try:
        deadline = time.monotonic() + WAIT_S
        while pending_foreign_connections(port) != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pending_foreign_connections(port) == 1
        assert close_foreign_connections(port) == 0  # nobody holds it yet

        def accept_later() -> None:
            time.sleep(0.2)
            accepted.extend(server.accept()[0] for _ in range(2))

        thread = threading.Thread(target=accept_later)
        thread.start()
        assert settle_foreign_connections(port, timeout_s=WAIT_S) == 1
        thread.join()
        assert foreign.recv(16) == b""
        assert pending_foreign_connections(port) == 0
    finally:
        for sock in (server, foreign, local, *accepted):
            sock.close()


def test_loopback_peers_are_not_foreign() -> None:
    import ipaddress

    for text in ("127.0.0.1", "127.3.4.5", "::1", "::ffff:127.0.0.1", "0.0.0.0", "::"):
        assert not is_foreign(ipaddress.ip_address(text)), text
    for text in ("192.0.2.2", "10.0.0.1", "::ffff:192.0.2.2", "2001:db8::1"):
        assert is_foreign(ipaddress.ip_address(text)), text
    assert not is_foreign(None)


@needs_local
def test_early_tie_ties_the_socket_as_soon_as_it_is_bound() -> None:
    """Before it even listens; a connection from another address is then refused, one from
    127.0.0.1 accepted, and connected sockets on the port are not tied."""
    probe = _listener()
    port = probe.getsockname()[1]
    probe.close()
    early = EarlyTie(port)
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("0.0.0.0", port))
        deadline = time.monotonic() + WAIT_S
        while not early.tied and time.monotonic() < deadline:
            time.sleep(0.001)
        device = server.getsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, 16)
        assert device.rstrip(b"\0") == b"lo", "not tied before listen"
        assert early.elapsed_s is not None
        server.listen(8)
        assert LOCAL is not None
        with pytest.raises(ConnectionRefusedError):
            _client(LOCAL, port).close()
        with _client("127.0.0.1", port):
            accepted, _ = server.accept()
            with accepted:
                assert tie_listening(port, skip=early.tied) == (set(), "")
    finally:
        early.stop()
        server.close()


# -- a real worker ---------------------------------------------------------------------------

WORKER_SCRIPT = textwrap.dedent(
    """
    import json, os, socket, sys, threading, time
    from partitioner.cli import worker

    LOCAL, PORT = sys.argv[1], int(sys.argv[2])
    PREFACE = b"PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n" + bytes.fromhex("000000040000000000")
    PING = bytes.fromhex("000008060000000000") + b"12345678"
    results = {}

    def listening_sockets():
        own = []
        for name in os.listdir("/proc/self/fd"):
            try:
                sock = socket.socket(fileno=os.dup(int(name)))
            except OSError:
                continue
            try:
                if sock.type == socket.SOCK_STREAM and sock.getsockname()[1] == PORT:
                    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        raise OSError
                    own.append(sock)
                    continue
            except (OSError, IndexError, TypeError):
                pass
            sock.close()
        return own

    def sneak_in():
        # Untie the listener (the start-up window, held open), connect from LOCAL, retie.
        own = listening_sockets()
        for sock in own:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"")
        conn = socket.create_connection((LOCAL, PORT), timeout=5)
        conn.sendall(PREFACE)
        answered = bool(conn.recv(64))
        for sock in own:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo")
            sock.close()
        return conn, answered

    def pinged(conn):
        try:
            conn.sendall(PING)
            got = b""
            while b"12345678" not in got:
                data = conn.recv(4096)
                if not data:
                    return False
                got += data
            return True
        except OSError:
            return False

    original = worker._start_server

    def start_server(*args):
        server = original(*args)
        results["start_conn"], results["start_answered"] = sneak_in()
        return server

    worker._start_server = start_server

    def while_serving():
        conn, results["serving_answered"] = sneak_in()
        time.sleep(1.5)  # the worker sweeps every 0.5 s
        results["serving_alive"] = pinged(conn)
        out = {k: v for k, v in results.items() if not k.endswith("conn")}
        print(json.dumps(out), flush=True)
        os._exit(0)

    def on_ready(task, address):
        results["start_alive_at_ready"] = pinged(results["start_conn"])
        threading.Thread(target=while_serving, daemon=True).start()

    worker.run_worker(0, {"worker": [f"127.0.0.1:{PORT}"]}, on_ready=on_ready)
    """
)


@pytest.fixture(scope="module")
def raced_worker(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bool]:
    """A worker with a connection from another address made before its tie and one made while
    it serves (its socket untied for a moment each time): what became of them."""
    from partitioner.cli.worker import free_ports

    assert LOCAL is not None
    script = tmp_path_factory.mktemp("window") / "raced_worker.py"
    script.write_text(WORKER_SCRIPT)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(REPO))
    env.pop("TF_CONFIG", None)
    proc = subprocess.Popen(
        [sys.executable, str(script), LOCAL, str(free_ports(1)[0])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"the worker script said nothing (status {proc.returncode}): {err[-2000:]}"
    result: dict[str, bool] = json.loads(lines[-1])
    return result


@pytest.mark.slow
@needs_local
def test_a_connection_made_before_the_tie_is_shut_before_ready(
    raced_worker: dict[str, bool],
) -> None:
    assert raced_worker["start_answered"], "the setup did not get a gRPC answer"
    assert not raced_worker["start_alive_at_ready"], "it still answers a PING after ready"


@pytest.mark.slow
@needs_local
def test_a_connection_from_another_host_is_shut_while_serving(
    raced_worker: dict[str, bool],
) -> None:
    assert raced_worker["serving_answered"], "the setup did not get a gRPC answer"
    assert not raced_worker["serving_alive"], "it still answers a PING a sweep later"
