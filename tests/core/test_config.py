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

    new = config.set_value(path, "server.slots", 3)

    after = path.read_text(encoding="utf-8")
    assert "# my own note at the top" in after
    assert "port = 9000  # my proxy port" in after
    assert new.server.slots == 3 and new.proxy.port == 9000
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
    config.save(path, s)
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


# ------------------------------------------------------------------ network exposure (issue 19)
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
    assert config.set_value(good, "proxy.host", host).proxy.host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_key(tmp_path: Path, host: str) -> None:
    path = write(tmp_path / "w.toml", f'[proxy]\nhost = "{host}"\n')
    assert config.load(path).proxy.host == host


def test_allowed_origins(tmp_path: Path) -> None:
    assert Settings().proxy.allowed_origins == []
    assert Settings().proxy.max_body_mb == 8  # issue 19: docs/security.md#body-size
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
