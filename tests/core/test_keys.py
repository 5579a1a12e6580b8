"""API keys per user (core.keys, core.cli.keys): the key file, checking, config rules,
the CLI, and the fair share of slots and disk between users (docs/security.md)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from core import config as config_mod
from core.cache.retention_plan import MIB, plan_disk_sweep
from core.cache.slots import SlotMap
from core.cache.store import StateRecord
from core.cli import main as cli
from core.config.keys import (
    DEFAULT_USER,
    LOCAL_USER,
    KeyFileError,
    KeyRing,
    add_key,
    digest,
    load_keys,
    presented_key,
    remove_key,
)
from core.errors import ConfigError
from core.paths import Paths


def test_a_key_is_shown_once_and_only_its_hash_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    key = add_key(path, "alice", clock=lambda: 1000.0)
    assert key.startswith("wsk-") and len(key) > 40
    text = path.read_text()
    assert key not in text and digest(key) in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    (k,) = load_keys(path)
    assert (k.name, k.created) == ("alice", 1000.0)
    assert add_key(path, "bob") != key  # random per key


@pytest.mark.parametrize("name", ["", "a b", "x" * 65, "../etc", DEFAULT_USER, LOCAL_USER])
def test_bad_or_reserved_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(KeyFileError):
        add_key(tmp_path / "keys.toml", name)


def test_a_taken_name_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    add_key(path, "alice")
    with pytest.raises(KeyFileError, match="exists"):
        add_key(path, "alice")


def test_the_ring_names_the_caller_and_rereads_the_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    ring = KeyRing(path, lambda: "shared-secret", local="local-secret")
    assert ring.required()  # proxy.api_key alone makes keys required
    alice, bob = add_key(path, "alice"), add_key(path, "bob")
    assert ring.user_for(alice) == "alice"
    assert ring.user_for(bob) == "bob"
    assert ring.user_for("shared-secret") == DEFAULT_USER
    assert ring.user_for("local-secret") == LOCAL_USER
    assert ring.user_for(alice + "x") is None
    assert ring.user_for("") is None
    assert ring.names() == [DEFAULT_USER, "alice", "bob"]
    assert remove_key(path, "bob")
    assert ring.user_for(bob) is None  # revoked without a restart
    assert ring.user_for(alice) == "alice"
    assert not remove_key(path, "bob")


def test_no_keys_means_none_required_and_the_local_key_alone_changes_nothing(
    tmp_path: Path,
) -> None:
    ring = KeyRing(tmp_path / "keys.toml", lambda: "", local="local-secret")
    assert not ring.required()
    assert ring.user_for("local-secret") == LOCAL_USER


def test_an_unreadable_key_file_fails_closed(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text("[[keys]]\nname = 'alice'\nsha256 = 'not hex'\n")
    ring = KeyRing(path)
    assert ring.required()  # a broken file does not open the proxy
    assert ring.user_for("anything") is None
    assert "sha256" in ring.problem


def test_the_presented_key_comes_from_bearer_or_x_api_key() -> None:
    assert presented_key({"Authorization": "Bearer abc"}) == "abc"
    assert presented_key({"authorization": "bearer  abc "}) == "abc"
    assert presented_key({"x-api-key": "xyz"}) == "xyz"
    assert presented_key({"Authorization": "Basic Zm9v", "X-Api-Key": "xyz"}) == "xyz"
    assert presented_key({}) == ""


def test_binding_beyond_loopback_needs_a_key(tmp_path: Path) -> None:
    paths = Paths.under(tmp_path)
    paths.config_file.parent.mkdir(parents=True)
    paths.config_file.write_text('[proxy]\nhost = "0.0.0.0"\n')
    with pytest.raises(ConfigError, match="needs an API key") as e:
        config_mod.load(paths.config_file)
    assert "warmslot keys add" in e.value.user_message()
    add_key(paths.config_file.with_name("keys.toml"), "alice")
    assert config_mod.load(paths.config_file).proxy.host == "0.0.0.0"
    # `config set` checks with the same key file
    config_mod.set_value(paths.config_file, "proxy.host", "::")


def test_cli_keys_add_list_remove(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = ["--dev-dir", str(tmp_path)]
    assert cli.main(["keys", "add", "alice", *home]) == 0
    shown = capsys.readouterr().out.splitlines()
    key = shown[1]
    assert key.startswith("wsk-")
    assert cli.main(["keys", "list", "--json", *home]) == 0
    listed = capsys.readouterr().out
    assert key not in listed
    (row,) = json.loads(listed)
    assert row["name"] == "alice" and row["last_used"] is None and row["requests"] == 0
    assert cli.main(["keys", *home]) == 0
    assert "alice" in capsys.readouterr().out
    # the last key of a proxy bound beyond loopback cannot be removed
    config_mod.set_value(Paths.under(tmp_path).config_file, "proxy.host", "0.0.0.0")
    assert cli.main(["keys", "remove", "alice", *home]) == 1
    assert "last API key" in capsys.readouterr().err
    config_mod.set_value(Paths.under(tmp_path).config_file, "proxy.host", "127.0.0.1")
    assert cli.main(["keys", "remove", "alice", *home]) == 0
    assert cli.main(["keys", "remove", "alice", *home]) == 1


def test_the_api_key_is_masked_in_setting_changes() -> None:
    old = config_mod.Settings()
    new = old.replace("proxy.api_key", "s3cret")
    ((name, before, after),) = config_mod.settings_changes(old, new, ["proxy.api_key"])
    assert (name, before, after) == ("proxy.api_key", "", "***")


# ------------------------------------------------------------------ fair share: slots
def test_a_user_within_their_share_keeps_their_slot() -> None:
    slots = SlotMap(n_slots=4, reserve_aux=lambda: True, clock=iter(range(1, 100)).__next__)
    # alice's session holds slot 0; bob fills the other two agent slots
    assert slots.pick("alice/a1", "agent", owner="alice")[0] == 0
    slots.pick("bob/b1", "agent", owner="bob")
    slots.pick("bob/b2", "agent", owner="bob")
    for s in slots.slots:
        s.last_used = 10.0 + s.id  # alice's slot is the least recently used
    # bob's third session: before, it took the LRU slot (alice's); now bob holds 2 > 1.5
    # of the 3 agent slots, so it reuses one of his own
    slot, _ = slots.pick("bob/b3", "agent", owner="bob")
    assert slots.slots[slot].owner == "bob" and slot != 0
    assert slots.sessions["alice/a1"] == 0
    # a third user under their share may take a slot of a user above it (bob: 2 > 1)
    slot, _ = slots.pick("carol/c1", "agent", owner="carol")
    assert slots.slots[slot].owner == "carol" and slot != 0


def test_without_keys_the_least_recently_used_slot_goes() -> None:
    slots = SlotMap(n_slots=3, reserve_aux=lambda: True)
    slots.pick("a", "agent")
    slots.pick("b", "agent")
    slots.slots[0].last_used, slots.slots[1].last_used = 1.0, 2.0
    assert slots.pick("c", "agent")[0] == 0


# ------------------------------------------------------------------ fair share: disk
def _rec(name: str, owner: str, last_used: float, size: int = 10 * MIB) -> StateRecord:
    return StateRecord(
        filename=f"ws-{name:0>32}.bin",
        identity="id1",
        fingerprint=name,
        client="c",
        source="s",
        prefix_n=1,
        n_tokens=1,
        bytes=size,
        sha256="",
        ttl_class="extended",
        pinned=False,
        created=last_used,
        last_used=last_used,
        verified_at=None,
        verify_result="",
        probe={},
        kind="conversation",
        owner=owner,
    )


def _sweep(records: list[StateRecord], cap_mib: int) -> list[str]:
    plan = plan_disk_sweep(
        records,
        now=1000.0,
        ttl=lambda _c: 1e9,
        keep_recent=0,
        cap_bytes=cap_mib * MIB,
        current_identities={"id1"},
        in_use=set(),
        file_size=lambda r: r.bytes,
    )
    return [e.rec.fingerprint for e in plan.evictions]


def test_one_users_saves_do_not_evict_another_user_within_their_share() -> None:
    # alice: 2 old states (20 MiB); bob: 6 newer ones (60 MiB); cap 60 MiB → share 30
    recs = [_rec(f"a{i}", "alice", 10.0 + i) for i in range(2)]
    recs += [_rec(f"b{i}", "bob", 100.0 + i) for i in range(6)]
    gone = _sweep(recs, 60)
    assert gone == ["b0", "b1"]  # bob's oldest, not alice's older ones
    # without owners the same records lose the oldest: alice's
    plain = [_rec(r.fingerprint, "", r.last_used) for r in recs]
    assert _sweep(plain, 60) == ["a0", "a1"]


async def test_a_flood_of_one_users_states_leaves_another_users_share_on_disk(
    tmp_path: Path,
) -> None:
    """Real index (SQLite) and real files under a 6 MiB cap: bob's six newer states push
    the total to 9 MiB; alice's older ones (a pinned prefix and an unpinned one, 3 MiB:
    her share of 6 ÷ 2) stay, and only bob's oldest go. Each state is a little under its
    MiB, leaving room for its record beside it (it counts: core.cache.retention_plan)."""
    import dataclasses

    from core.config import Settings
    from tests.core.bg_support import add_state, make_manager

    s = Settings()
    s.cache.keep_recent, s.cache.disk_cap_mb = 0, 6
    core, mgr = make_manager(tmp_path, s)

    def owned(owner: str, **kw: object) -> StateRecord:
        rec = dataclasses.replace(add_state(core, mgr, **kw), owner=owner)  # type: ignore[arg-type]
        mgr.state.store.add(rec)
        return rec

    mib = MIB - 2048
    alice_pinned = owned("alice", name_seed="a-pin", size=mib, age=900, pinned=True)
    alice_prefix = owned("alice", name_seed="a-prefix", size=2 * mib, age=800)
    bob = [owned("bob", name_seed=f"b{i}", size=mib, age=100 - i) for i in range(6)]
    assert {r.owner for r in mgr.state.store.all()} == {"alice", "bob"}  # stored with the state
    out = await mgr.retention.sweep_disk()
    left = {r.filename for r in mgr.state.store.all()}
    assert {alice_pinned.filename, alice_prefix.filename} <= left
    assert left.isdisjoint(r.filename for r in bob[:3]) and {r.filename for r in bob[3:]} <= left
    assert 6 * mib < out.details["total_bytes"] <= 6 * MIB  # the states and their records
    assert all(not (core.paths.slot_dir / r.identity / r.filename).exists() for r in bob[:3])
    reasons = [e.reason for e in core.cache_events("evicted")]
    assert len(reasons) == 3 and all("user 'bob'" in r and "fair share" in r for r in reasons)


def test_client_snippets_read_the_key_when_only_named_keys_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = ["--dev-dir", str(tmp_path)]
    assert cli.main(["clients", *home]) == 0
    assert "WARMSLOT_API_KEY" not in capsys.readouterr().out  # no key: none needed
    add_key(Paths.under(tmp_path).config_file.with_name("keys.toml"), "alice")
    assert cli.main(["clients", *home]) == 0
    out = capsys.readouterr().out
    assert "requires an API key" in out and "{env:WARMSLOT_API_KEY}" in out
