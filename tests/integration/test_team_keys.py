"""Serving a team (docs/security.md#serving-a-team), on a real llama-server (tiny model):
two named keys, 401s in each API's own shape, requests accounted per user, revocation
without a restart, the local CLI's own key, and no open proxy beyond loopback."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx

from core.cache.manager import policy_factory
from core.cli.main import fetch_status, format_status
from core.config.keys import add_key, keys_file, remove_key
from core.paths import Paths
from tests.conftest import MakeCore
from tests.helpers import post_chat, wait_until

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MESSAGES = {
    "model": "t",
    "max_tokens": 2,
    "messages": [{"role": "user", "content": "hi"}],
}


def test_two_users_with_named_keys(tmp_path: Path, make_core: MakeCore) -> None:
    home = tmp_path / "team"
    paths = Paths.under(home)
    alice = add_key(keys_file(paths.config_file), "alice")
    bob = add_key(keys_file(paths.config_file), "bob")
    core = make_core(home=home, policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=180)
    assert core.proxy is not None
    url = f"http://127.0.0.1:{core.proxy.port}"

    # No key, a wrong key: 401 in OpenAI's shape for chat, Anthropic's for Messages.
    for headers in ({}, {"Authorization": "Bearer wsk-wrong"}):
        r = post_chat(url, CHAT, headers=headers, expect=401)
        assert r.json()["error"]["type"] == "authentication_error"
    for headers in ({}, {"x-api-key": "wsk-wrong"}):
        r = post_chat(url, MESSAGES, path="/v1/messages", headers=headers, expect=401)
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/warmslot/status", timeout=30).status_code == 401

    # alice: two chat requests in one session (Bearer); bob: one Messages request (x-api-key),
    # naming the same session id: each user's session is their own.
    sid = uuid.uuid4().hex
    for _ in range(2):
        r = post_chat(url, CHAT, headers={"Authorization": f"Bearer {alice}", "x-session-id": sid})
        assert r.headers["X-Warmslot-Session"] == f"alice/{sid}"
    r = post_chat(
        url, MESSAGES, path="/v1/messages", headers={"x-api-key": bob, "x-session-id": sid}
    )
    assert r.headers["X-Warmslot-Session"] == f"bob/{sid}"

    def users() -> dict[str, dict[str, Any]]:
        return {u["user"]: u for u in core.query("per_user").result(10)}

    wait_until(lambda: users().get("bob", {}).get("requests") == 1, timeout=30)
    by_user = users()
    assert by_user["alice"]["requests"] == 2 and by_user["bob"]["requests"] == 1
    assert by_user["alice"]["prompt_tokens"] + by_user["alice"]["cached_tokens"] > 0
    assert by_user["bob"]["prompt_tokens"] + by_user["bob"]["cached_tokens"] > 0
    assert by_user["alice"]["prefill_s"] >= 0
    # The 401s were not accounted to anyone.
    assert set(by_user) == {"alice", "bob"}
    rows = core.query("recent_requests", limit=10).result(10)
    assert {(r["user"], r["session"]) for r in rows} == {
        ("alice", f"alice/{sid}"),
        ("bob", f"bob/{sid}"),
    }

    metrics = httpx.get(url + "/metrics", headers={"x-api-key": bob}, timeout=60).text
    assert 'warmslot_user_requests_total{user="alice"} 2.0' in metrics.splitlines()
    assert 'warmslot_user_requests_total{user="bob"} 1.0' in metrics.splitlines()

    # /warmslot/status with a key lists the users; `warmslot status` on this machine gets
    # in with the running instance's local key (no named key on the command line).
    st = httpx.get(url + "/warmslot/status", headers={"x-api-key": alice}, timeout=60).json()
    assert {u["user"] for u in st["users"]} == {"alice", "bob"}
    local = fetch_status(paths, timeout=60)
    assert local is not None and {u["user"] for u in local["users"]} >= {"alice", "bob"}
    text = format_status(local)
    assert "users (all time):" in text
    assert any(line.split()[:3] == ["alice", "2", "req"] for line in text.splitlines())

    # Removing bob's key revokes it at once; alice's still works.
    assert remove_key(keys_file(paths.config_file), "bob")
    post_chat(url, MESSAGES, path="/v1/messages", headers={"x-api-key": bob}, expect=401)
    post_chat(url, CHAT, headers={"Authorization": f"Bearer {alice}"})


def test_beyond_loopback_with_no_key_left_nobody_gets_in(
    tmp_path: Path, make_core: MakeCore
) -> None:
    """Settings bound to 0.0.0.0 are refused when loaded without a key
    (tests/core/test_keys.py); here the last key is removed while the proxy runs there:
    it fails closed."""
    home = tmp_path / "lan"
    paths = Paths.under(home)
    alice = add_key(keys_file(paths.config_file), "alice")
    core = make_core(home=home, proxy__host="0.0.0.0")
    core.start(wait_ready=True, timeout=180)
    assert core.proxy is not None
    url = f"http://127.0.0.1:{core.proxy.port}"
    post_chat(url, CHAT, headers={"Authorization": f"Bearer {alice}"})
    assert remove_key(keys_file(paths.config_file), "alice")
    for headers in ({}, {"Authorization": f"Bearer {alice}"}):
        post_chat(url, CHAT, headers=headers, expect=401)
    # nor does the local CLI's key: a proxy beyond loopback with no key lets nobody in
    assert fetch_status(paths, timeout=30) is None


def test_the_key_is_not_stored_in_telemetry(tmp_path: Path, make_core: MakeCore) -> None:
    home = tmp_path / "k"
    paths = Paths.under(home)
    key = add_key(keys_file(paths.config_file), "carol")
    core = make_core(home=home)
    core.start(wait_ready=True, timeout=180)
    assert core.proxy is not None
    url = f"http://127.0.0.1:{core.proxy.port}"
    post_chat(url, CHAT, headers={"Authorization": f"Bearer {key}"})
    wait_until(lambda: bool(core.query("recent_requests", limit=5).result(10)), timeout=30)
    core.stop()  # flushes and closes the database
    stored = b"".join(p.read_bytes() for p in paths.state_dir.rglob("telemetry.sqlite3*"))
    assert b"carol" in stored  # the name is recorded …
    assert key.encode() not in stored  # … never the key
