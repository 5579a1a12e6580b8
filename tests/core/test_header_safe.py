"""Header values are made safe in one place (core.proxy.headers.safe_headers).

The real-server test that sends every control character through every client string that
reaches a header is tests/integration/test_reliability.py::test_control_characters_*.
"""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from core.proxy.headers import MAX_HEADER_CHARS, header_safe, safe_headers

CONTROLS = [*map(chr, range(0x20)), "\x7f"]


@pytest.mark.parametrize("c", CONTROLS, ids=lambda c: f"{ord(c):#04x}")
def test_every_control_character_is_escaped(c: str) -> None:
    out = header_safe(f"a{c}b")
    assert out == f"a\\x{ord(c):02x}b"


def test_text_that_is_not_ascii_is_escaped_not_lost() -> None:
    assert header_safe("café \udc80 …") == "caf\\xe9 \\udc80 \\u2026"
    assert len(header_safe("x" * 5000)) == MAX_HEADER_CHARS


async def test_aiohttp_writes_every_escaped_value() -> None:
    """Unescaped, aiohttp refuses such a value and closes the connection unanswered."""
    hostile = "".join(CONTROLS) + "é"

    async def handler(_: web.Request) -> web.Response:
        return web.Response(text="ok", headers=safe_headers({"X-Warmslot-Warning": hostile}))

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/")
        assert resp.status == 200 and await resp.text() == "ok"
        assert resp.headers["X-Warmslot-Warning"] == header_safe(hostile)
