"""Restarting Warmslot right after clients were connected binds its port again at once;
a second live Warmslot on the same port is still refused."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from core.config.sections import ProxySettings
from core.errors import PortInUse
from core.proxy.app import Proxy, ProxyDeps

pytestmark = pytest.mark.skipif(os.name != "posix", reason="SO_REUSEADDR semantics of POSIX")


def make_proxy() -> Proxy:
    settings = ProxySettings(max_body_mb=1, upstream_timeout_s=5.0, stall_timeout_s=0)
    return Proxy(
        ProxyDeps(
            upstream=lambda: None,
            settings=lambda: settings,
            server_state=lambda: "stopped",
            n_slots=lambda: 2,
            emit=lambda e: None,
            status=_no_status,
        )
    )


async def _no_status() -> dict[str, object]:
    return {}


def held_connections(port: int) -> int:
    """Sockets of this port still in TIME_WAIT (from /proc/net/tcp; 0 elsewhere)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            if int(local.rsplit(":", 1)[1], 16) == port and state == "06":  # TIME_WAIT
                count += 1
    return count


async def test_a_restart_binds_over_old_connections_but_not_over_a_live_proxy() -> None:
    first = make_proxy()
    await first.start("127.0.0.1", 0)
    port = first.port
    # A client with a keep-alive connection; the proxy closes it when it stops, so the
    # proxy's side of that connection lingers in TIME_WAIT on the proxy's port.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /warmslot/status HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    await writer.drain()
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    await first.stop()
    await asyncio.wait_for(reader.read(), 10)  # the rest, then EOF: the proxy closed first
    assert reader.at_eof()
    writer.close()
    await writer.wait_closed()
    if os.path.exists("/proc/net/tcp"):  # our FIN reaches the proxy's side: TIME_WAIT
        deadline = asyncio.get_running_loop().time() + 5
        while not held_connections(port) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)  # polling a condition, bounded
        assert held_connections(port) >= 1, "the test needs a TIME_WAIT socket on the port"

    second = make_proxy()
    await second.start("127.0.0.1", port)  # the restart: must not raise PortInUse
    try:
        assert second.port == port
        third = make_proxy()
        with pytest.raises(PortInUse):
            await third.start("127.0.0.1", port)
    finally:
        await second.stop()
    with socket.socket() as s:  # and the port is free again after the stop
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
