"""Settings: schema, commented TOML, validation errors, migrations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tomlkit

from core import config
from core.config import SCHEMA, Settings, migrations
from core.errors import ConfigError


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------ schema + defaults
def test_schema_declares_every_field_once_with_description() -> None:
    s = Settings()
    assert len(SCHEMA) > 30
    for name, spec in SCHEMA.items():
        assert spec.name == name
        assert spec.description.strip(), name
        assert s.get(name) == spec.default, name
        spec.validate(spec.default)  # every default passes its own validation


def test_known_defaults() -> None:
    s = Settings()
    assert (s.server.slots, s.server.ctx_per_slot, s.server.cache_ram_mib) == (0, 0, -1)  # fit plan
    assert s.server.host == "127.0.0.1"
    assert s.server.no_repack == "auto"
    assert s.proxy.port == 8089
    assert s.proxy.host == "127.0.0.1"
    assert s.proxy.api_key == ""
    assert s.server.extra_args == []


def test_missing_file_gives_defaults(tmp_path: Path) -> None:
    assert config.load(tmp_path / "nope.toml") == Settings()


def test_default_document_is_commented_and_loads_back(tmp_path: Path) -> None:
    path = tmp_path / "warmslot.toml"
    config.ensure_file(path)
    text = path.read_text(encoding="utf-8")
    assert config.load(path) == Settings()
    assert f"version = {config.SCHEMA_VERSION}" in text
    # Each key is preceded by its description as a comment.
    desc = SCHEMA["proxy.port"].description.split()[0:4]
    assert "# " + " ".join(desc) in text
    assert "# choices: auto, on, off" in text
    # ensure_file never overwrites an existing file.
    write(path, "# mine\n[proxy]\nport = 9\n")
    config.ensure_file(path)
    assert path.read_text(encoding="utf-8") == "# mine\n[proxy]\nport = 9\n"


# ------------------------------------------------------------------ round trips
def test_set_value_keeps_user_comments(tmp_path: Path) -> None:
    path = tmp_path / "warmslot.toml"
    config.ensure_file(path)
    text = path.read_text(encoding="utf-8")
    text = "# my own note at the top\n" + text.replace(
        "port = 8089", "port = 9000  # my proxy port"
    )
    write(path, text)

    new = config.set_value(path, "server.slots", 3).settings

    after = path.read_text(encoding="utf-8")
    assert "# my own note at the top" in after
    assert "port = 9000  # my proxy port" in after
    assert new is not None and new.server.slots == 3 and new.proxy.port == 9000
    assert config.load(path) == new


def test_set_value_into_sparse_file_adds_section(tmp_path: Path) -> None:
    path = write(tmp_path / "w.toml", "# hand written\nversion = 1\n")
    config.set_value(path, "cache.ttl_short_s", 120)
    doc = tomlkit.parse(path.read_text(encoding="utf-8"))
    assert doc["cache"]["ttl_short_s"] == 120  # type: ignore[index]
    assert path.read_text(encoding="utf-8").startswith("# hand written\n")
    assert config.load(path).cache.ttl_short_s == 120


def test_save_writes_changes_and_keeps_comments(tmp_path: Path) -> None:
    path = tmp_path / "w.toml"
    config.ensure_file(path)
    write(path, "# keep me\n" + path.read_text(encoding="utf-8"))
    s = config.load(path)
    s.server.extra_args = ["--verbose-prompt"]
    s.proxy.api_key = "k1"
    changes = {"server.extra_args": ["--verbose-prompt"], "proxy.api_key": "k1"}
    assert config.save_changes(path, changes).settings == s
    assert config.load(path) == s
    assert path.read_text(encoding="utf-8").startswith("# keep me\n")


def test_invalid_set_leaves_file_untouched(tmp_path: Path) -> None:
    path = tmp_path / "w.toml"
    config.ensure_file(path)
    before = path.read_bytes()
    with pytest.raises(ConfigError) as e:
        config.set_value(path, "proxy.port", 70000)
    assert e.value.key == "proxy.port"
    assert path.read_bytes() == before


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("toml", "key", "expected", "got"),
    [
        ('[proxy]\nport = "abc"\n', "proxy.port", "an integer", "abc"),
        ("[proxy]\nport = 70000\n", "proxy.port", "a port 0-65535 (0 = pick a free one)", 70000),
        ("[server]\nslots = -1\n", "server.slots", "a number ≥ 0", -1),
        ("[server]\nslots = true\n", "server.slots", "an integer", True),
        (
            '[server]\nno_repack = "maybe"\n',
            "server.no_repack",
            "one of 'auto', 'on', 'off'",
            "maybe",
        ),
        ("[server]\nextra_args = [1, 2]\n", "server.extra_args", "a list of strings", [1, 2]),
        ('[server]\nhost = "my box"\n', "server.host", "an IP address such as 127.0.0.1", "my box"),
        ('[cache]\nenabled = "yes"\n', "cache.enabled", "true or false", "yes"),
        ("[proxy]\nupstream_timeout_s = 0.5\n", "proxy.upstream_timeout_s", "a number ≥ 1", 0.5),
    ],
)
def test_errors_name_file_key_expected_and_got(
    tmp_path: Path, toml: str, key: str, expected: str, got: Any
) -> None:
    path = write(tmp_path / "bad.toml", toml)
    with pytest.raises(ConfigError) as e:
        config.load(path)
    err = e.value
    assert (err.file, err.key, err.expected, err.got) == (str(path), key, expected, got)
    text = str(err)
    assert str(path) in text and f"'{key}'" in text and expected in text and repr(got) in text


def test_unknown_key_and_section(tmp_path: Path) -> None:
    path = write(tmp_path / "a.toml", "[proxy]\nbogus = 1\n")
    with pytest.raises(ConfigError, match=r"key 'proxy\.bogus': unknown setting") as e:
        config.load(path)
    assert "warmslot config show" in e.value.hint

    path = write(tmp_path / "b.toml", "[nope]\nx = 1\n")
    with pytest.raises(ConfigError, match="unknown section") as e2:
        config.load(path)
    assert e2.value.key == "nope" and "server" in (e2.value.expected or "")

    path = write(tmp_path / "c.toml", "stray = 1\n")
    with pytest.raises(ConfigError, match="unknown section"):
        config.load(path)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path / "broken.toml", "[proxy\nport = \n")
    with pytest.raises(ConfigError, match="not valid TOML") as e:
        config.load(path)
    assert str(path) in str(e.value)


def test_newer_version_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path / "new.toml", f"version = {config.SCHEMA_VERSION + 1}\n")
    with pytest.raises(ConfigError, match="newer Warmslot") as e:
        config.load(path)
    assert e.value.key == "version" and e.value.got == config.SCHEMA_VERSION + 1
    assert "upgrade Warmslot" in e.value.user_message()


@pytest.mark.parametrize("bad", ["0", '"one"', "-3"])
def test_invalid_version(tmp_path: Path, bad: str) -> None:
    path = write(tmp_path / "v.toml", f"version = {bad}\n")
    with pytest.raises(ConfigError, match="invalid version"):
        config.load(path)


def test_settings_get_replace_and_unknown_names() -> None:
    s = Settings()
    s2 = s.replace("proxy.port", 9999)
    assert s2.proxy.port == 9999 and s.proxy.port == 8089  # a copy; the original is unchanged
    with pytest.raises(ConfigError) as e:
        s.replace("proxy.port", -1)
    assert e.value.key == "proxy.port"
    with pytest.raises(ConfigError, match="unknown setting"):
        s.get("proxy.nothing")


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("cache.enabled", "false", False),
        ("proxy.port", "9000", 9000),
        ("server.model", "/models/a b.gguf", "/models/a b.gguf"),  # a bare string
        ("server.model", '"/quoted.gguf"', "/quoted.gguf"),
        ("server.extra_args", '["-fa", "on"]', ["-fa", "on"]),
        ("proxy.upstream_timeout_s", "2.5", 2.5),
    ],
)
def test_parse_text(name: str, text: str, value: Any) -> None:
    assert SCHEMA[name].parse_text(text) == value


def test_parse_text_rejects_garbage_with_key() -> None:
    with pytest.raises(ConfigError) as e:
        SCHEMA["proxy.port"].parse_text("not a number")
    assert e.value.key == "proxy.port" and e.value.got == "not a number"


def test_int_accepted_for_float() -> None:
    value = SCHEMA["server.start_timeout_s"].coerce(30)
    assert value == 30.0 and isinstance(value, float)


# ------------------------------------------------------------------ migrations
def _rename_listen_port(doc: dict[str, Any]) -> dict[str, Any]:
    proxy = doc.setdefault("proxy", {})
    if "listen_port" in proxy:
        proxy["port"] = proxy.pop("listen_port")
    return doc


def _slots_from_parallel(doc: dict[str, Any]) -> dict[str, Any]:
    server = doc.setdefault("server", {})
    if "parallel" in server:
        server["slots"] = server.pop("parallel")
    return doc


@pytest.fixture
def two_migrations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Pretend the schema is at version 3, with migrations 1→2 and 2→3."""
    ran: list[int] = []

    def m1(doc: dict[str, Any]) -> dict[str, Any]:
        ran.append(1)
        return _rename_listen_port(doc)

    def m2(doc: dict[str, Any]) -> dict[str, Any]:
        ran.append(2)
        return _slots_from_parallel(doc)

    monkeypatch.setattr(migrations, "SCHEMA_VERSION", 3)
    monkeypatch.setattr(migrations, "MIGRATIONS", {1: m1, 2: m2})
    return ran


def test_migrations_run_in_order_from_the_file_version(
    tmp_path: Path, two_migrations: list[int]
) -> None:
    path = write(
        tmp_path / "v1.toml", "version = 1\n[proxy]\nlisten_port = 9100\n[server]\nparallel = 4\n"
    )
    s = config.load(path)
    assert (s.proxy.port, s.server.slots) == (9100, 4)
    assert two_migrations == [1, 2]

    # A file with no version is version 1.
    two_migrations.clear()
    path = write(tmp_path / "nov.toml", "[proxy]\nlisten_port = 9200\n")
    assert config.load(path).proxy.port == 9200
    assert two_migrations == [1, 2]

    # A version-2 file runs only the second migration.
    two_migrations.clear()
    path = write(tmp_path / "v2.toml", "version = 2\n[server]\nparallel = 3\n")
    assert config.load(path).server.slots == 3
    assert two_migrations == [2]

    # A current file runs none.
    two_migrations.clear()
    path = write(tmp_path / "v3.toml", "version = 3\n[server]\nslots = 5\n")
    assert config.load(path).server.slots == 5
    assert two_migrations == []


def test_set_value_upgrades_an_old_file(tmp_path: Path, two_migrations: list[int]) -> None:
    path = write(tmp_path / "old.toml", "version = 1\n[proxy]\nlisten_port = 9300\n")
    config.set_value(path, "server.threads", 2)
    doc = tomlkit.parse(path.read_text(encoding="utf-8"))
    assert doc["version"] == 3
    assert doc["proxy"]["port"] == 9300  # type: ignore[index]
    assert "listen_port" not in doc["proxy"]  # type: ignore[operator]
    s = config.load(path)
    assert (s.proxy.port, s.server.threads) == (9300, 2)


def test_a_migrated_value_is_still_validated(tmp_path: Path, two_migrations: list[int]) -> None:
    path = write(tmp_path / "old.toml", "version = 1\n[proxy]\nlisten_port = 123456\n")
    with pytest.raises(ConfigError) as e:
        config.load(path)
    assert e.value.key == "proxy.port" and e.value.got == 123456


# ------------------------------------------------------------------ network exposure
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5"])
def test_a_network_proxy_without_an_api_key_is_an_error(tmp_path: Path, host: str) -> None:
    path = write(tmp_path / "w.toml", f'[proxy]\nhost = "{host}"\n')
    with pytest.raises(ConfigError) as e:
        config.load(path)
    err = e.value
    assert (err.file, err.key, err.got) == (str(path), "proxy.host", host)
    assert "API key" in str(err) and "proxy.api_key" in err.hint
    with pytest.raises(ConfigError):
        Settings().replace("proxy.host", host)
    # `warmslot config set` refuses it too, and leaves the file as it was.
    good = tmp_path / "good.toml"
    config.ensure_file(good)
    before = good.read_bytes()
    with pytest.raises(ConfigError):
        config.set_value(good, "proxy.host", host)
    assert good.read_bytes() == before


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.5"])
def test_a_network_proxy_with_an_api_key_loads(tmp_path: Path, host: str) -> None:
    path = write(tmp_path / "w.toml", f'[proxy]\nhost = "{host}"\napi_key = "s3cret"\n')
    assert config.load(path).proxy.host == host
    # In that order on the command line: the key first, then the address.
    good = tmp_path / "good.toml"
    config.set_value(good, "proxy.api_key", "s3cret")
    after = config.set_value(good, "proxy.host", host).settings
    assert after is not None and after.proxy.host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_key(tmp_path: Path, host: str) -> None:
    path = write(tmp_path / "w.toml", f'[proxy]\nhost = "{host}"\n')
    assert config.load(path).proxy.host == host


def test_allowed_origins(tmp_path: Path) -> None:
    assert Settings().proxy.allowed_origins == []
    assert Settings().proxy.max_body_mb == 8  # docs/security.md#body-size
    path = write(
        tmp_path / "w.toml",
        '[proxy]\nallowed_origins = ["http://127.0.0.1:3000", "https://ui.example"]\n',
    )
    assert config.load(path).proxy.allowed_origins == [
        "http://127.0.0.1:3000",
        "https://ui.example",
    ]
    for bad in ('["ui.example"]', '["http://ui.example/app"]', '["*"]', '"http://x"'):
        write(path, f"[proxy]\nallowed_origins = {bad}\n")
        with pytest.raises(ConfigError) as e:
            config.load(path)
        assert e.value.key == "proxy.allowed_origins"


def test_ttl_classes_must_not_shrink(tmp_path: Path) -> None:
    s = Settings()
    with pytest.raises(ConfigError) as e:
        s.replace("cache.ttl_short_s", 7200)  # above the default long TTL (3600)
    assert e.value.key == "cache.ttl_long_s" and "short ≤ long ≤ extended" in str(e.value)
    # Several changes at once are checked on the result, not one by one.
    both = s.replace("cache.ttl_short_s", 7200, check=False).replace(
        "cache.ttl_long_s", 10_000, check=False
    )
    config.check_settings(both)
    assert (both.cache.ttl_short_s, both.cache.ttl_long_s) == (7200, 10_000)
    path = tmp_path / "settings.toml"
    path.write_text("[cache]\nttl_long_s = 100000\n")  # above extended (86400)
    with pytest.raises(ConfigError) as bad:
        config.load(path)
    assert bad.value.key == "cache.ttl_extended_s" and str(path) in str(bad.value)


def test_settings_changes_mask_secrets() -> None:
    old = Settings()
    new = old.replace("proxy.api_key", "s3cret").replace("cache.ttl_short_s", 600)
    changes = config.settings_changes(old, new, ["proxy.api_key", "cache.ttl_short_s"])
    assert changes == (("proxy.api_key", "", "***"), ("cache.ttl_short_s", 300, 600))
    assert "s3cret" not in repr(changes)


# ------------------------------------------------------------------ the file as it is
# A settings file a person wrote: their comments, their binary, model and port.
USER_FILE = """\
# my Warmslot settings
version = 1

[server]
binary = "/opt/llama/llama-server"  # my build
model = "/models/coder.gguf"

[proxy]
port = 9123   # opencode points here

[cache]
ttl_short_s = 600
ttl_long_s = 3600  # an hour
"""
# One of each kind of problem a file can have, as it appears in USER_FILE.
BAD_FILES = {
    "wrong type": ("ttl_short_s = 600", 'ttl_short_s = "two minutes"'),
    "out of range": ("ttl_short_s = 600", "ttl_short_s = 1"),
    "unknown key": ("[cache]\n", "[cache]\nttl_shortt_s = 120\n"),
    "unknown section": ("[cache]\n", "[cahce]\nx = 1\n\n[cache]\n"),
    "broken TOML": ("port = 9123", "port = 9123 9"),
}


def bad_file(tmp_path: Path, kind: str) -> Path:
    old, new = BAD_FILES[kind]
    assert old in USER_FILE
    return write(tmp_path / "settings.toml", USER_FILE.replace(old, new, 1))


@pytest.mark.parametrize("kind", [k for k in BAD_FILES if k != "broken TOML"])
def test_a_file_with_a_wrong_value_reads_with_its_own_values_and_the_problem_marked(
    tmp_path: Path, kind: str
) -> None:
    """The tray's Settings opened with the defaults when one value was wrong, and its Save
    then wrote them over the user's binary, model and port."""
    path = bad_file(tmp_path, kind)
    got = config.read_file(path)
    assert got.settings is None and got.writable and not got.ok
    assert got.values["server.binary"] == "/opt/llama/llama-server"
    assert got.values["server.model"] == "/models/coder.gguf"
    assert got.values["proxy.port"] == 9123
    assert got.values["cache.ttl_long_s"] == 3600
    (problem,) = got.problems
    where = {
        "wrong type": "cache.ttl_short_s",
        "out of range": "cache.ttl_short_s",
        "unknown key": "cache.ttl_shortt_s",
        "unknown section": "cahce",
    }[kind]
    assert problem.key == where
    if where == "cache.ttl_short_s":
        assert got.problems_at(where) == [problem] and not got.file_problems()
        assert got.values[where] == 300  # its default stands in
        assert got.written[where] == ("two minutes" if kind == "wrong type" else 1)
        assert problem.text == (
            "Expected an integer; got 'two minutes'."
            if kind == "wrong type"
            else "Expected a number ≥ 10; got 1."
        )
    else:
        assert got.file_problems() == [problem]
        assert where in problem.text and "config" not in problem.text
    # `load` is the same reading, strict: it raises that problem.
    with pytest.raises(ConfigError) as e:
        config.load(path)
    assert str(e.value) == str(problem.error) and e.value.key == where


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_saving_a_change_to_a_bad_file_writes_only_that_key(tmp_path: Path, kind: str) -> None:
    """Every other byte stays — the user's comments, binary, model, port, and the wrong
    value itself; a file that is not TOML is never written, and says where it broke."""
    path = bad_file(tmp_path, kind)
    before = path.read_bytes()
    if kind == "broken TOML":
        got = config.read_file(path)
        assert not got.writable and got.settings is None
        (problem,) = got.problems
        assert (problem.line, problem.column) == (9, 13)
        assert problem.text.startswith(f"{path} is not valid TOML at line 9, column 13")
        with pytest.raises(ConfigError, match="not valid TOML"):
            config.save_changes(path, {"cache.ttl_long_s": 7200})
        assert path.read_bytes() == before
        return
    after = config.save_changes(path, {"cache.ttl_long_s": 7200})
    assert path.read_bytes() == before.replace(
        b"ttl_long_s = 3600  # an hour", b"ttl_long_s = 7200  # an hour"
    )
    assert after.values["cache.ttl_long_s"] == 7200 and len(after.problems) == 1
    assert (after.values["server.binary"], after.values["server.model"]) == (
        "/opt/llama/llama-server",
        "/models/coder.gguf",
    )
    assert after.values["proxy.port"] == 9123


def test_fixing_the_wrong_value_makes_the_whole_file_valid(tmp_path: Path) -> None:
    path = bad_file(tmp_path, "wrong type")
    before = path.read_bytes()
    after = config.save_changes(path, {"cache.ttl_short_s": 120})
    assert path.read_bytes() == before.replace(b'"two minutes"', b"120")
    assert after.ok and after.settings is not None
    s = after.settings
    assert (s.server.binary, s.server.model, s.proxy.port) == (
        "/opt/llama/llama-server",
        "/models/coder.gguf",
        9123,
    )
    assert s.cache.ttl_short_s == 120 and config.load(path) == s


def test_a_change_that_breaks_a_rule_or_is_invalid_writes_nothing(tmp_path: Path) -> None:
    path = write(tmp_path / "settings.toml", USER_FILE)
    before = path.read_bytes()
    with pytest.raises(ConfigError) as e:  # short above long: refused, named at long
        config.save_changes(path, {"cache.ttl_short_s": 7200})
    assert e.value.key == "cache.ttl_long_s"
    with pytest.raises(ConfigError):
        config.save_changes(path, {"proxy.port": 70000})
    with pytest.raises(ConfigError, match="unknown setting"):
        config.save_changes(path, {"proxy.prot": 1})
    assert path.read_bytes() == before
    # Both at once hold the rule: written together, and nothing else.
    config.save_changes(path, {"cache.ttl_short_s": 7200, "cache.ttl_long_s": 10_000})
    assert path.read_bytes() == before.replace(b"= 600", b"= 7200").replace(
        b"= 3600  #", b"= 10000  #"
    )


def test_a_rule_is_shown_at_both_settings_in_words(tmp_path: Path) -> None:
    path = write(
        tmp_path / "settings.toml", USER_FILE.replace("ttl_short_s = 600", "ttl_short_s = 7200")
    )
    got = config.read_file(path)
    short, long_ = got.problems_at("cache.ttl_short_s"), got.problems_at("cache.ttl_long_s")
    assert [p.text for p in short] == [
        "Longer than the long TTL (3,600 s): the TTL classes go short ≤ long ≤ extended."
    ]
    assert [p.text for p in long_] == [
        "Shorter than the short TTL (7,200 s): the TTL classes go short ≤ long ≤ extended."
    ]
    assert short[0].involves == long_[0].involves == ("cache.ttl_short_s", "cache.ttl_long_s")
    # A rule is not judged on a value that is wrong itself (its default stands in).
    wrong = write(tmp_path / "w.toml", "[cache]\nttl_short_s = 7200\nttl_long_s = 'x'\n")
    assert [p.key for p in config.read_file(wrong).problems] == ["cache.ttl_long_s"]


def test_every_setting_declares_when_it_takes_effect() -> None:
    """No default kind: a setting that does not say fails at import (`meta` requires
    `applies`). The ones found wrong before: the upstream timeout and the body limit are
    read per request now, the side-call slot per request too; the pool's budgets are
    measured once, when Warmslot starts."""
    from core.config import BACKEND_SCHEMA, PROFILE_SCHEMA, WORKER_SCHEMA, Applies
    from core.config.checks import meta

    with pytest.raises(TypeError):
        meta("no kind")  # type: ignore[call-arg]
    for schema in (SCHEMA, PROFILE_SCHEMA, WORKER_SCHEMA, BACKEND_SCHEMA):
        for name, spec in schema.items():
            assert isinstance(spec.applies, Applies), name
    kinds = {n: s.applies for n, s in SCHEMA.items()}
    for name in ("proxy.upstream_timeout_s", "proxy.max_body_mb", "cache.aux_slot"):
        assert kinds[name] is Applies.LIVE, name
    for name in ("server.model", "server.binary", "server.ctx_per_slot", "cache.persist"):
        assert kinds[name] is Applies.SERVER, name
    for name in ("pool.vram_budget_mib", "pool.ram_budget_mib", "pool.ram_floor_mib"):
        assert kinds[name] is Applies.WARMSLOT, name
    assert config.applies_of("models") is Applies.WARMSLOT
    assert config.applies_of("workers") is Applies.SERVER
    assert Applies.SERVER.words == "when llama-server restarts"


def test_update_settings_on_a_stopped_core_writes_the_edited_key_only(tmp_path: Path) -> None:
    """`Core.update_settings` takes the edited settings (not a whole Settings): the file
    keeps the rest; the core uses the file once the whole of it is valid."""
    from core.config import Applies
    from core.engine import Core
    from core.paths import Paths

    paths = Paths.under(tmp_path / "home")
    path = paths.config_file
    write(path, USER_FILE.replace("ttl_short_s = 600", 'ttl_short_s = "two minutes"'))
    core = Core(paths, Settings())  # what the tray holds while the file is invalid
    before = path.read_bytes()
    update = core.update_settings({"cache.ttl_long_s": 7200}).result(10)
    assert not update.applied and [p.key for p in update.problems] == ["cache.ttl_short_s"]
    assert path.read_bytes() == before.replace(b"= 3600", b"= 7200")
    assert core.settings == Settings()  # nothing applied from an invalid file
    update = core.update_settings({"cache.ttl_short_s": 120}).result(10)
    assert update.applied
    assert (core.settings.server.model, core.settings.proxy.port) == ("/models/coder.gguf", 9123)
    assert update.waiting_for(Applies.SERVER) == ["server.binary", "server.model"]
    assert "proxy.port" in update.changed and "cache.ttl_short_s" in update.changed
    # Without persist: the running settings change, the file does not.
    written = path.read_bytes()
    core.update_settings({"cache.ttl_short_s": 90}, persist=False).result(10)
    assert core.settings.cache.ttl_short_s == 90 and path.read_bytes() == written
