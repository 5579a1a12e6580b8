"""Model profiles in settings: [[models]] tables, validation, role defaults, footprints."""

from __future__ import annotations

from pathlib import Path

import pytest

from core import config
from core.config import ModelProfile, Settings
from core.errors import ConfigError
from core.machine.devices import HostInfo
from core.models import profiles

TOML = """
# my own comment
version = 1
[server]
model = "/models/coder.gguf"
slots = 2
[pool]
side_calls = true
ram_budget_mib = 8192

[[models]]
name = "coder"
role = "text"

[[models]]
name = "titles"
model = "/models/small.gguf"
role = "side"
slots = 1
extra_args = ["--flash-attn", "on"]
"""


def test_models_tables_load_validate_and_save_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "settings.toml"
    path.write_text(TOML)
    s = config.load(path)
    assert [m.name for m in s.models] == ["coder", "titles"]
    assert s.pool.side_calls and s.pool.ram_budget_mib == 8192
    s.models.append(ModelProfile(name="embed", model="/models/e.gguf", role="embedding"))
    config.save_changes(path, {"models": s.models})
    again = config.load(path)
    assert again.models == s.models
    assert "# my own comment" in path.read_text()
    assert "[[models]]" in path.read_text()


def test_no_profiles_means_todays_single_server() -> None:
    s = Settings()
    (only,) = profiles.profiles(s)
    assert only.primary and only.name == profiles.PRIMARY_NAME and only.ttl_s == -1
    assert profiles.server_settings(s, only) == s.server


@pytest.mark.parametrize(
    ("tables", "key"),
    [
        ([{"name": "a", "model": "/a", "colour": 1}], "models[0].colour"),
        ([{"model": "/a"}], "models[0].name"),
        ([{"name": "a", "model": "/a"}, {"name": "a", "model": "/b"}], "models[1].name"),
        ([{"name": "s", "model": "/a", "role": "side"}], "models"),
        ([{"name": "a", "model": "/a", "role": "chat"}], "models.role"),
        ([{"name": "a", "model": "/a", "ttl_s": -5}], "models.ttl_s"),
        ([{"name": "a b", "model": "/a"}], "models.name"),
        ([{"name": "s", "role": "side"}, {"name": "t"}], "models[0].model"),
        ("nope", "models"),
    ],
)
def test_invalid_profiles_name_the_key(tables: object, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.settings_from_dict({"models": tables}, path="x.toml")
    assert key in str(err.value)


def test_role_defaults_and_overrides() -> None:
    s = Settings()
    s.server.port = 9000
    s.server.extra_args = ["-fa", "on"]
    s.models = [
        ModelProfile(name="side", model="/s.gguf", role="side"),
        ModelProfile(name="coder", role="text"),
        ModelProfile(name="chat", model="/c.gguf", priority=90, ttl_s=-1, extra_args=["-x"]),
        ModelProfile(name="emb", model="/e.gguf", role="embedding", ctx_per_slot=512),
    ]
    ps = {p.name: p for p in profiles.profiles(s)}
    assert profiles.primary(s).name == "coder"  # the first 'text' profile
    assert (ps["coder"].priority, ps["coder"].ttl_s) == (100, -1)
    assert (ps["side"].priority, ps["side"].ttl_s) == (20, 600)
    assert (ps["emb"].priority, ps["emb"].ttl_s) == (50, 300)
    assert (ps["chat"].priority, ps["chat"].ttl_s) == (90, -1)
    assert profiles.side(s) == ps["side"]
    coder = profiles.server_settings(s, ps["coder"])
    assert coder.port == 9000 and coder.model == s.server.model
    chat = profiles.server_settings(s, ps["chat"])
    assert chat.port == 0 and chat.model == "/c.gguf" and chat.extra_args == ["-fa", "on", "-x"]
    assert profiles.server_settings(s, ps["emb"]).ctx_per_slot == 512


def test_footprint_from_the_fit_planner(tiny_model: Path) -> None:
    s = Settings()
    s.server.cache_ram_mib = 64
    s.models = [ModelProfile(name="tiny", model=str(tiny_model))]
    prof = profiles.primary(s)
    host = HostInfo(32 << 30, 16 << 30, 0, 0, 100 << 30)
    f = profiles.footprint(prof, profiles.server_settings(s, prof), tiny_model, [], host)
    assert f.vram == () and f.source == "fit planner"
    assert 64 * profiles.MIB < f.ram < 2048 * profiles.MIB  # weights + KV + 64 MiB RAM cache
    bigger = profiles.server_settings(s, prof)
    bigger.ctx_per_slot = 4 * 4096  # 0 (the default) lets the plan choose 4,096 here
    assert profiles.footprint(prof, bigger, tiny_model, [], host).ram > f.ram
