"""`[[workers]]` settings: llama.cpp RPC workers, validated with errors that say where."""

from __future__ import annotations

from pathlib import Path

import pytest

from core import config
from core.config import Settings, WorkerSettings
from core.errors import ConfigError


def load_text(tmp_path: Path, text: str) -> Settings:
    path = tmp_path / "warmslot.toml"
    path.write_text(text, encoding="utf-8")
    return config.load(path)


def test_workers_load_with_defaults_and_labels(tmp_path: Path) -> None:
    s = load_text(
        tmp_path,
        '[[workers]]\naddress = "10.0.0.2"\n\n'
        '[[workers]]\naddress = "gpu-box.lan"\nport = 50100\nname = "box"\nlayers = 12\n',
    )
    assert s.workers == [
        WorkerSettings(address="10.0.0.2"),
        WorkerSettings(address="gpu-box.lan", port=50100, name="box", layers=12),
    ]
    assert s.workers[0].endpoint == "10.0.0.2:50052"  # ggml-rpc-server's default port
    assert s.workers[0].label == "10.0.0.2:50052"
    assert s.workers[1].label == "box (gpu-box.lan:50100)"


def test_no_workers_by_default(tmp_path: Path) -> None:
    assert Settings().workers == []
    assert load_text(tmp_path, "[proxy]\nport = 9000\n").workers == []


@pytest.mark.parametrize(
    ("table", "key", "words"),
    [
        ("port = 50052\n", "workers[0].address", "missing value"),
        ('address = "::1"\n', "workers[0].address", "IPv6"),
        ('address = "[fe80::1]"\n', "workers[0].address", "IPv6"),
        ('address = "bad host"\n', "workers[0].address", "host name"),
        ('address = "-x.lan"\n', "workers[0].address", "host name"),
        ('address = "a,b"\n', "workers[0].address", "host name"),
        ('address = "10.0.0.2"\nport = 0\n', "workers[0].port", "≥ 1"),
        ('address = "10.0.0.2"\nport = 70000\n', "workers[0].port", "≤ 65535"),
        ('address = "10.0.0.2"\nport = "50052"\n', "workers[0].port", "an integer"),
        ('address = "10.0.0.2"\nname = "a b"\n', "workers[0].name", "letters, digits"),
        ('address = "10.0.0.2"\nlayers = -1\n', "workers[0].layers", "≥ 0"),
        ('address = "10.0.0.2"\nhost = "x"\n', "workers[0].host", "one of address, port"),
    ],
)
def test_invalid_worker_tables_name_the_table_and_key(
    tmp_path: Path, table: str, key: str, words: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_text(tmp_path, "[[workers]]\n" + table)
    text = str(err.value)
    assert f"key '{key}'" in text, text
    assert words in text, text
    assert "warmslot.toml" in text  # the file is named too


def test_a_worker_listed_twice_or_a_name_used_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"workers\[1\]'.*listed twice.*10.0.0.2:50052"):
        load_text(
            tmp_path,
            '[[workers]]\naddress = "10.0.0.2"\n[[workers]]\naddress = "10.0.0.2"\n',
        )
    with pytest.raises(ConfigError, match=r"workers\[1\].name'.*duplicate worker name"):
        load_text(
            tmp_path,
            '[[workers]]\naddress = "10.0.0.2"\nname = "w"\n'
            '[[workers]]\naddress = "10.0.0.3"\nname = "w"\n',
        )
    # The same address on another port is another worker (two on one machine).
    s = load_text(
        tmp_path,
        '[[workers]]\naddress = "10.0.0.2"\n[[workers]]\naddress = "10.0.0.2"\nport = 50053\n',
    )
    assert [w.endpoint for w in s.workers] == ["10.0.0.2:50052", "10.0.0.2:50053"]


def test_workers_must_be_tables(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"a list of tables \(\[\[workers\]\]\)"):
        load_text(tmp_path, 'workers = ["10.0.0.2:50052"]\n')


def test_save_writes_workers_and_loads_them_back(tmp_path: Path) -> None:
    path = tmp_path / "warmslot.toml"
    s = Settings()
    s.workers = [WorkerSettings(address="127.0.0.1", port=50100, name="left", layers=2)]
    config.save_changes(path, {"workers": s.workers})
    text = path.read_text(encoding="utf-8")
    assert "[[workers]]" in text
    assert config.load(path).workers == s.workers
    # Removing them removes the tables; other settings stay as they were.
    s.workers = []
    config.save_changes(path, {"workers": s.workers})
    assert "[[workers]]" not in path.read_text(encoding="utf-8")
    assert config.load(path) == Settings()
