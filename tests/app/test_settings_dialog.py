"""The settings dialog: generated from the schema, errors at the field, TOML round-trip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.backend import CoreBackend
from app.qt import Qt, QtWidgets
from app.settings_dialog import SettingsDialog, humanize
from app.tasks import Tasks
from core import config as config_mod
from core.config import Settings
from core.engine import Core
from core.errors import ConfigError
from core.paths import Paths


def test_every_setting_has_an_editor_with_its_description(
    qtbot: Any, core: Core, tasks: Tasks
) -> None:
    dlg = SettingsDialog(CoreBackend(core), tasks)
    qtbot.addWidget(dlg)
    assert set(dlg.fields) == set(config_mod.SCHEMA)
    for name, spec in config_mod.SCHEMA.items():
        f = dlg.fields[name]
        assert f.editor.toolTip().startswith(spec.description)
        assert f.check() == (core.settings.get(name), None)
    assert isinstance(dlg.fields["cache.persist"].editor, QtWidgets.QCheckBox)
    assert isinstance(dlg.fields["cache.prefix_class"].editor, QtWidgets.QComboBox)
    assert isinstance(dlg.fields["server.slots"].editor, QtWidgets.QSpinBox)
    assert isinstance(dlg.fields["pressure.ram_low_pct"].editor, QtWidgets.QDoubleSpinBox)
    assert isinstance(dlg.fields["server.extra_args"].editor, QtWidgets.QLineEdit)
    assert humanize("cache.ttl_short_s") == "TTL short (s)"
    assert dlg.save_button.isEnabled()


def test_round_trip_to_the_toml_file_with_validation_errors(
    qtbot: Any, core: Core, tasks: Tasks
) -> None:
    dlg = SettingsDialog(CoreBackend(core), tasks)
    qtbot.addWidget(dlg)
    dlg.show()
    f = dlg.fields
    # Invalid values: the schema's own messages appear under the fields; Save is off.
    f["server.ctx_per_slot"].set_value(100)
    f["server.host"].set_value("not-an-address")
    f["server.extra_args"].set_value("")
    f["server.extra_args"].editor.setText('--flag "unterminated')
    assert f["server.ctx_per_slot"].error.isVisible()
    assert f["server.ctx_per_slot"].error.text() == "Expected 0 or a number ≥ 256; got 100."
    assert f["server.host"].error.text().startswith("Expected an IP address")
    assert "cannot split" in f["server.extra_args"].error.text()
    assert not dlg.save_button.isEnabled()
    assert set(dlg.problems) == {"server.ctx_per_slot", "server.host", "server.extra_args"}
    assert dlg.status.text().startswith("3 settings need attention")
    # Fix them and change one setting of every kind.
    f["server.ctx_per_slot"].set_value(core.settings.server.ctx_per_slot)
    f["server.slots"].set_value(3)
    f["server.host"].set_value("127.0.0.1")
    f["server.extra_args"].editor.setText("--flash-attn on --alias 'my model'")
    f["cache.ttl_short_s"].set_value(120)
    f["cache.prefix_class"].editor.setCurrentText("long")
    f["cache.persist"].editor.setChecked(False)
    f["pressure.ram_low_pct"].set_value(12.5)
    f["proxy.api_key"].editor.setText("sekrit")
    assert not f["server.ctx_per_slot"].error.isVisible()
    assert dlg.save_button.isEnabled()
    with qtbot.waitSignal(dlg.saved, timeout=10_000) as blocker:
        qtbot.mouseClick(dlg.save_button, Qt.MouseButton.LeftButton)
    new, restart = blocker.args
    assert restart == ["server.slots", "server.extra_args"]  # the server is not running
    qtbot.waitUntil(lambda: not dlg.isVisible())
    assert dlg.result() == QtWidgets.QDialog.DialogCode.Accepted
    # The file (with its comments) holds the new values; the core uses them.
    path = core.paths.config_file
    loaded = config_mod.load(path)
    assert loaded.server.slots == 3
    assert loaded.server.extra_args == ["--flash-attn", "on", "--alias", "my model"]
    assert loaded.cache.ttl_short_s == 120
    assert loaded.cache.prefix_class == "long"
    assert loaded.cache.persist is False
    assert loaded.pressure.ram_low_pct == 12.5
    assert loaded.proxy.api_key == "sekrit"
    assert loaded.as_dict() == new.as_dict() == core.settings.as_dict()
    text = path.read_text()
    assert "# TTL class 'short' in seconds." in text and "ttl_short_s = 120" in text
    # Opening the dialog again shows what is in the file.
    again = SettingsDialog(CoreBackend(core), tasks)
    qtbot.addWidget(again)
    assert again.fields["server.extra_args"].editor.text() == "--flash-attn on --alias 'my model'"
    assert again.fields["cache.persist"].editor.isChecked() is False


def test_offers_a_restart_when_restart_settings_change(
    qtbot: Any, core: Core, tasks: Tasks
) -> None:
    restarted: list[bool] = []
    dlg = SettingsDialog(
        CoreBackend(core),
        tasks,
        restart=lambda: restarted.append(True),
        server_running=lambda: True,
    )
    qtbot.addWidget(dlg)
    dlg.show()
    dlg.fields["server.ctx_per_slot"].set_value(4096)
    dlg.fields["proxy.upstream_timeout_s"].set_value(30.0)  # applies live: no restart
    with qtbot.waitSignal(dlg.saved, timeout=10_000):
        dlg.save()
    assert dlg.isVisible() and dlg.restart_box.isVisible()
    assert "Context per slot" in dlg.restart_text.text()
    assert "Upstream timeout" not in dlg.restart_text.text()
    qtbot.mouseClick(dlg.restart_now, Qt.MouseButton.LeftButton)
    assert restarted == [True]
    assert not dlg.isVisible()
    assert core.settings.proxy.upstream_timeout_s == 30.0


def test_saves_to_the_file_when_the_core_is_not_running(
    qtbot: Any, tmp_path: Path, tasks: Tasks
) -> None:
    c = Core(Paths.under(tmp_path / "off"), Settings())
    dlg = SettingsDialog(CoreBackend(c), tasks)
    qtbot.addWidget(dlg)
    dlg.fields["proxy.port"].set_value(9999)
    with qtbot.waitSignal(dlg.saved, timeout=10_000):
        dlg.save()
    assert config_mod.load(c.paths.config_file).proxy.port == 9999
    assert c.settings.proxy.port == 9999


def test_durations_in_words_errors_in_place_and_autostart(
    qtbot: Any, core: Core, tasks: Tasks, tmp_path: Path
) -> None:
    from core import autostart

    dlg = SettingsDialog(CoreBackend(core), tasks)
    qtbot.addWidget(dlg)
    ttl = dlg.fields["cache.ttl_extended_s"]
    assert ttl.in_words is not None and ttl.in_words.text() == "= 24.0 h"
    ttl.set_value(300)
    assert ttl.in_words.text() == "= 5 min"
    assert dlg.fields["server.slots"].in_words is None  # not a duration
    # An error takes the description's place (the form keeps its height).
    ttl.set_value(1)
    assert not ttl.error.isHidden() and ttl.caption.isHidden()
    assert ttl.in_words.text() == ""
    ttl.set_value(90_000)
    assert ttl.error.isHidden() and not ttl.caption.isHidden()
    assert ttl.in_words.text() == "= 25.0 h"
    # Start at login: written on save, into XDG_CONFIG_HOME (the tests' own).
    entry = autostart.entry_path()
    assert entry.is_relative_to(tmp_path)
    assert not dlg.autostart.isChecked()
    dlg.autostart.setChecked(True)
    with qtbot.waitSignal(dlg.saved, timeout=10_000):
        dlg.save()
    assert autostart.is_enabled() and "Exec=" in entry.read_text()
    again = SettingsDialog(CoreBackend(core), tasks)
    qtbot.addWidget(again)
    assert again.autostart.isChecked()
    again.autostart.setChecked(False)
    with qtbot.waitSignal(again.saved, timeout=10_000):
        again.save()
    assert not entry.exists()


def test_rules_between_settings_are_checked_on_the_whole_edit(
    qtbot: Any, core: Core, tasks: Tasks
) -> None:
    """Raising short above the old long TTL is fine when long is raised too; an order
    that does not hold is shown at the field the rule names."""
    dlg = SettingsDialog(CoreBackend(core), tasks)
    qtbot.addWidget(dlg)
    dlg.fields["cache.ttl_short_s"].set_value(7200)
    dlg.fields["cache.ttl_long_s"].set_value(10_000)
    with qtbot.waitSignal(dlg.saved, timeout=10_000):
        dlg.save()
    assert (core.settings.cache.ttl_short_s, core.settings.cache.ttl_long_s) == (7200, 10_000)
    dlg2 = SettingsDialog(CoreBackend(core), tasks)
    qtbot.addWidget(dlg2)
    dlg2.fields["cache.ttl_extended_s"].set_value(5000)  # below long (10,000)
    dlg2.save()
    field = dlg2.fields["cache.ttl_extended_s"]
    assert not field.error.isHidden() and "short ≤ long ≤ extended" in field.error.text()
    assert core.settings.cache.ttl_extended_s == 86400  # nothing was saved


def test_a_new_proxy_port_applies_at_once(qtbot: Any, core: Core, tasks: Tasks) -> None:
    """Changing the proxy's port moved nothing until Warmslot restarted (issue 18): now the
    proxy listens on the new port when the settings are saved, and the change is an event."""
    import json
    import socket
    import urllib.error
    import urllib.request

    from tests.helpers import wait_until

    assert core.proxy is not None
    old = core.proxy.port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        new = s.getsockname()[1]
    dlg = SettingsDialog(CoreBackend(core), tasks, server_running=lambda: True)
    qtbot.addWidget(dlg)
    dlg.fields["proxy.port"].set_value(new)
    with qtbot.waitSignal(dlg.saved, timeout=10_000) as saved:
        dlg.save()
    assert saved.args[1] == []  # nothing needs a restart
    assert core.proxy.port == new
    assert json.loads(core.paths.runtime_file.read_text())["proxy_port"] == new
    with urllib.request.urlopen(f"http://127.0.0.1:{new}/warmslot/status", timeout=10) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{old}/warmslot/status", timeout=5)
    events = wait_until(
        lambda: core.query("recent_events", category="settings").result(10), 10, message="event"
    )
    assert events[0]["reason"] == f"proxy.port: 0 → {new}"
    # A port that is taken changes nothing: the proxy stays, the file keeps its value.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        dlg2 = SettingsDialog(CoreBackend(core), tasks)
        qtbot.addWidget(dlg2)
        dlg2.fields["proxy.port"].set_value(busy)
        dlg2.save()
        qtbot.waitUntil(lambda: "already in use" in dlg2.status.text(), timeout=10_000)
    assert core.proxy.port == new
    assert config_mod.load(core.paths.config_file).proxy.port == new


def test_a_named_key_lets_the_dialog_bind_beyond_loopback(
    qtbot: Any, core: Core, tasks: Tasks
) -> None:
    """docs/security.md#serving-a-team: with named keys (no proxy.api_key) a non-loopback
    proxy.host is valid in the dialog as in `warmslot config set`."""
    from core.keys import add_key, keys_file

    dlg = SettingsDialog(CoreBackend(core), tasks)
    qtbot.addWidget(dlg)
    dlg.fields["proxy.host"].set_value("0.0.0.0")
    with pytest.raises(ConfigError, match="needs an API key"):
        dlg.new_settings()
    add_key(keys_file(core.paths.config_file), "alice")
    assert dlg.new_settings().proxy.host == "0.0.0.0"
