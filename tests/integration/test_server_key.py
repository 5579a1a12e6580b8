"""llama-server's own port answers only Warmslot (docs/security.md#llama-servers-port).

Each launch gets a random key that only Warmslot knows (docs/security.md#llama-servers-port).
Probed from another local process, as any program on the machine would: without the
key every route but the public ``/health`` answers 401, slot files included; through
the proxy everything works; a restart makes the old key useless. Real llama-server and
the tiny model throughout, except for one build that refuses the key, which a real
server cannot be made to do.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from core.engine import Core
from core.errors import ServerStartFailed
from core.server import validate
from core.server.supervisor import ServerState
from tests.conftest import MakeCore
from tests.helpers import chat_body, pid_gone, post_chat, wait_until

pytestmark = pytest.mark.integration

# Run by a separate Python process: (method, path, body, headers) in, statuses out.
_PROBE = r"""
import json, sys, urllib.error, urllib.request
base, calls = sys.argv[1], json.loads(sys.stdin.read())
out = []
for method, path, body, headers in calls:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            out.append([resp.status, dict(resp.headers), resp.read().decode(errors="replace")])
    except urllib.error.HTTPError as e:
        out.append([e.code, dict(e.headers), e.read().decode(errors="replace")])
print(json.dumps(out))
"""

# Everything Warmslot itself asks of the server, and what a stranger would try.
_GUARDED: list[tuple[str, str, Any]] = [
    ("POST", "/completion", {"prompt": "Hello", "n_predict": 2}),
    ("POST", "/v1/chat/completions", chat_body("Hello", max_tokens=2)),
    ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("POST", "/slots/0?action=save", {"filename": "stolen.bin"}),
    ("POST", "/slots/0?action=restore", {"filename": "stolen.bin"}),
    ("POST", "/slots/0?action=erase", {}),
    ("GET", "/slots", None),
    ("GET", "/props", None),
    ("POST", "/props", {}),
    ("POST", "/tokenize", {"content": "Hello"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("POST", "/apply-template", {"messages": [{"role": "user", "content": "hi"}]}),
    ("GET", "/metrics", None),
    ("GET", "/v1/models", None),
]


def _probe(base: str, calls: list[tuple[str, str, Any, dict[str, str]]]) -> list[Any]:
    """The answers another local process gets (its own interpreter, plain urllib)."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, base],
        input=json.dumps(calls),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result: list[Any] = json.loads(done.stdout)
    return result


def _proxy(core: Core) -> str:
    assert core.proxy is not None
    return f"http://127.0.0.1:{core.proxy.port}"


def _server(core: Core) -> str:
    assert core.supervisor is not None and core.supervisor.base_url is not None
    return core.supervisor.base_url


def test_port_answers_only_warmslot(running_core: Core) -> None:
    core = running_core
    sup = core.supervisor
    assert sup is not None and sup.api_key and sup.pid is not None
    key = sup.api_key
    slot_dir = core.paths.slot_dir

    # Another local process, without the key, with a wrong one, in either header.
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"}):
        answers = _probe(_server(core), [(m, p, b, headers) for m, p, b in _GUARDED])
        statuses = {f"{m} {p}": a[0] for (m, p, _), a in zip(_GUARDED, answers, strict=True)}
        assert statuses == {name: 401 for name in statuses}, (headers, statuses)
    assert not (slot_dir / "stolen.bin").exists()
    # /health stays public upstream (tools/server/server-http.cpp, public endpoints).
    [health] = _probe(_server(core), [("GET", "/health", None, {})])
    assert health[0] == 200

    # Through the proxy everything works as before, GET passthroughs included.
    answer = post_chat(core, chat_body("Hi"), timeout=120).json()
    assert answer["choices"][0]["message"]["content"] is not None
    for path in ("/props", "/slots", "/v1/models", "/health"):
        r = httpx.get(_proxy(core) + path, timeout=30)
        assert r.status_code == 200, (path, r.text)
    # And with the key, the server itself answers (the key is the only difference).
    [props] = _probe(_server(core), [("GET", "/props", None, sup.auth_headers())])
    assert props[0] == 200

    # The key shows nowhere another process or the user could read it.
    assert not any(key in arg for arg in psutil.Process(sup.pid).cmdline())
    status = httpx.get(_proxy(core) + "/warmslot/status", timeout=30).text
    assert key not in status
    assert key not in json.dumps(sup.snapshot()) and sup.snapshot()["api_key_protected"]
    for log_file in (core.paths.server_log, core.paths.core_log):
        if log_file.exists():
            assert key not in log_file.read_text("utf-8", errors="replace")
    # Its file was read at startup and is gone; the folder is the owner's alone.
    run_dir = core.paths.state_dir / "run"
    assert list(run_dir.iterdir()) == []
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700


def test_cross_site_pages_get_no_cors_grant(running_core: Core) -> None:
    """A page on another origin is granted nothing: its preflight is answered (llama-server
    answers every OPTIONS) but names only the server's own origin, without credentials."""
    evil = "http://evil.example"
    preflight_headers = {
        "Origin": evil,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    preflight, health, completion = _probe(
        _server(running_core),
        [
            ("OPTIONS", "/completion", None, preflight_headers),
            ("GET", "/health", None, {"Origin": evil}),
            ("POST", "/completion", {"prompt": "x", "n_predict": 1}, {"Origin": evil}),
        ],
    )
    for answer in (preflight, health, completion):
        headers = {k.lower(): v for k, v in answer[1].items()}
        assert headers.get("access-control-allow-origin") == _server(running_core), headers
        assert headers.get("access-control-allow-credentials", "false") == "false", headers
    assert preflight[0] == 200 and completion[0] == 401


def test_key_changes_with_every_launch(make_core: MakeCore) -> None:
    core = make_core()
    core.start(wait_ready=True, timeout=120)
    sup = core.supervisor
    assert sup is not None
    first = sup.auth_headers()
    [ok] = _probe(_server(core), [("GET", "/props", None, first)])
    assert ok[0] == 200

    core.restart_server().result(120)
    second = sup.auth_headers()
    assert second and second != first
    old, new = _probe(
        _server(core), [("GET", "/props", None, first), ("GET", "/props", None, second)]
    )
    assert (old[0], new[0]) == (401, 200)
    post_chat(core, chat_body("Hi"), timeout=120)

    # A crash restart is a launch too.
    pid = sup.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: sup.pid not in (None, pid) and sup.state is ServerState.READY, 120)
    third = sup.auth_headers()
    assert third not in (first, second)
    old, new = _probe(
        _server(core), [("GET", "/props", None, second), ("GET", "/props", None, third)]
    )
    assert (old[0], new[0]) == (401, 200)
    post_chat(core, chat_body("Hi"), timeout=120)
    assert list((core.paths.state_dir / "run").iterdir()) == []


def test_a_key_of_the_users_own_opens_the_port_too(make_core: MakeCore) -> None:
    """``--api-key`` in the settings' extra args: llama-server takes both keys, so the
    user's works and Warmslot's still does."""
    core = make_core(server__extra_args=["--api-key", "users-own-key"])
    core.start(wait_ready=True, timeout=120)
    post_chat(core, chat_body("Hi"), timeout=120)
    none, users = _probe(
        _server(core),
        [
            ("GET", "/props", None, {}),
            ("GET", "/props", None, {"Authorization": "Bearer users-own-key"}),
        ],
    )
    assert (none[0], users[0]) == (401, 200)


# A build that takes no key of Warmslot's: healthy, but 401 to everything else.
_REFUSING = r"""
import http.server, sys
args = sys.argv[1:]
if "--version" in args:
    print("version: 1 (0000000)")
    print("built with fake-cc for x86_64")
    sys.exit(0)
port = int(args[args.index("--port") + 1])

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        status = 200 if self.path == "/health" else 401
        body = b'{"status":"ok"}' if status == 200 else b'{"error":{"code":401}}'
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass

print("main: server is listening", flush=True)
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_a_server_that_refuses_the_key_does_not_count_as_started(
    make_core: MakeCore, tmp_path: Path
) -> None:
    script = tmp_path / "refusing.py"
    script.write_text(_REFUSING)
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    binary.chmod(0o755)
    core = make_core(server__binary=str(binary), binary_check=None)
    with pytest.raises(ServerStartFailed, match="refused Warmslot's API key"):
        core.start(wait_ready=True, timeout=120)
    sup = core.supervisor
    assert sup is not None and sup.state is ServerState.FAILED
    assert sup.api_key is None
    launched = sup.exits.records[-1].pid
    wait_until(lambda: pid_gone(launched), 30)
    assert list((core.paths.state_dir / "run").iterdir()) == []


def test_the_smoke_start_stays_keyless_whatever_the_environment_says(
    server_binary: Path, tiny_model: Path
) -> None:
    """A key in the user's environment would reach the smoke start's throwaway server and
    fail its one-token request with 401, condemning a working binary."""
    env = {**os.environ, "LLAMA_API_KEY": "from-the-users-shell"}
    verdict = validate.smoke_start(server_binary, tiny_model, env=env)
    assert verdict.ok, verdict.reason
