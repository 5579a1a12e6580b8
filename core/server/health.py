"""Asking a running llama-server whether it is up, takes Warmslot's key, and makes progress.

``/health`` is answered by llama-server's HTTP thread alone, also while its main loop is
stuck; ``/metrics`` is a task for the main loop, answered between two batches, so an
answer to it proves the loop runs. Off the request path: one small request at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping

import aiohttp

__all__ = ["key_refused", "poll_health", "wait_stalled"]


async def poll_health(http: aiohttp.ClientSession, url: str, headers: Mapping[str, str]) -> None:
    """Return once ``GET url`` (``/health``) answers 200; ask again, backing off to 0.5 s."""
    delay = 0.05
    while True:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            # /health is public upstream; the key goes along in case a build gates it.
            async with http.get(url, headers=headers) as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 0.5)


async def key_refused(http: aiohttp.ClientSession, url: str, headers: Mapping[str, str]) -> str:
    """Why the healthy server does not take Warmslot's key ("" when it does). `/health`
    is public, so ``GET url`` (``/props``) is the first request that proves the key works."""
    try:
        async with http.get(url, headers=headers) as resp:
            if resp.status != 401:
                return ""
    except (aiohttp.ClientError, TimeoutError, OSError):
        return ""  # not a refusal: the watch and the clients see a dead server
    return (
        "it refused Warmslot's API key (401); an --api-key option of an unusual kind "
        "in server.extra_args?"
    )


async def wait_stalled(
    http: aiohttp.ClientSession,
    url: str,
    headers: Callable[[], Mapping[str, str]],
    *,
    every_s: float,
    timeout_s: float,
    current: Callable[[], bool],
) -> bool:
    """Ask for ``GET url`` (``/metrics``) every `every_s` until no answer comes within
    `timeout_s` (True) or the run is no longer `current` (False).

    Any answer counts, even an error status; a refused connection is a crash, which the
    supervisor's watch sees.
    """
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    while True:
        await asyncio.sleep(every_s)
        if not current():
            return False
        try:
            async with http.get(url, headers=headers(), timeout=timeout) as r:
                await r.read()
            continue
        except TimeoutError:
            pass
        except (aiohttp.ClientError, OSError):
            continue
        return current()
