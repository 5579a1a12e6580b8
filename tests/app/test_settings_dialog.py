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
from core.config import Applies, Settings
from core.engine import Core
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
    (update,) = blocker.args
    assert update.applied
    # The server is not running: nothing offered, the dialog closes.
    assert update.waiting_for(Applies.SERVER) == [
        "server.slots",
        "server.extra_args",
        "cache.persist",  # the disk tier is decided when llama-server starts
    ]
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
    assert loaded == core.settings
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
    from core.machine import autostart

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
    """Changing the proxy's port moved nothing until Warmslot restarted: now the
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
    assert saved.args[0].waiting == ()  # nothing needs a restart
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
    from core.config.keys import add_key, keys_file

    dlg = SettingsDialog(CoreBackend(core), tasks)
    qtbot.addWidget(dlg)
    host = dlg.fields["proxy.host"]
    host.set_value("0.0.0.0")
    assert host.rule_problem is not None and "API key" in host.error.text()
    assert not dlg.save_button.isEnabled()
    add_key(keys_file(core.paths.config_file), "alice")
    host.set_value("0.0.0.1")
    host.set_value("0.0.0.0")
    assert host.rule_problem is None and dlg.save_button.isEnabled()


# ------------------------------------------------------------------ a file with problems
def _stopped_core(tmp_path: Path, kind: str) -> Core:
    """What the tray holds when its settings file is invalid: a core on the defaults,
    not started (app/main.py), over a file with one problem of `kind`."""
    from tests.core.test_config import bad_file

    paths = Paths.under(tmp_path / "home")
    paths.config_file.parent.mkdir(parents=True, exist_ok=True)
    bad_file(paths.config_file.parent, kind).rename(paths.config_file)
    return Core(paths, Settings())


@pytest.mark.parametrize("kind", ["wrong type", "out of range", "unknown key"])
def test_a_file_with_a_wrong_value_opens_with_its_values_and_save_writes_only_the_edit(
    qtbot: Any, tmp_path: Path, tasks: Tasks, kind: str
) -> None:
    """The dialog opened with the defaults and its Save wrote them over the user's
    binary, model and port. Now it shows the file's values, marks what is wrong, and
    Save writes the one edited key: every other byte of the file stays."""
    core = _stopped_core(tmp_path, kind)
    path = core.paths.config_file
    before = path.read_bytes()
    dlg = SettingsDialog(CoreBackend(core), tasks)
    qtbot.addWidget(dlg)
    dlg.show()
    f = dlg.fields
    assert f["server.binary"].raw() == "/opt/llama/llama-server"
    assert f["server.model"].raw() == "/models/coder.gguf"
    assert f["proxy.port"].raw() == 9123
    assert not dlg.file_note.isHidden()
    short = f["cache.ttl_short_s"]
    if kind == "unknown key":
        assert "cache.ttl_shortt_s" in dlg.file_note.text()
        assert short.error.isHidden()
    else:
        assert not short.error.isHidden() and not short.mark.isHidden()
        assert short.error.text().startswith("In the settings file: Expected ")
        assert short.raw() == (300 if kind == "wrong type" else 1)  # a number box shows 1
        tabs = [dlg.tabs.tabText(i) for i in range(dlg.tabs.count())]
        assert "Cache ⚠" in tabs and "Server" in tabs
    assert dlg.save_button.isEnabled()  # what the file has wrong does not hold Save back
    f["cache.ttl_long_s"].set_value(7200)
    with qtbot.waitSignal(dlg.saved, timeout=10_000) as saved:
        dlg.save()
    (update,) = saved.args
    assert not update.applied and len(update.problems) == 1
    assert path.read_bytes() == before.replace(
        b"ttl_long_s = 3600  # an hour", b"ttl_long_s = 7200  # an hour"
    )
    assert dlg.isVisible() and "still has problems" in dlg.status.text()
    assert core.settings == Settings()  # nothing applied from an invalid file


def test_fixing_the_marked_value_saves_it_and_the_core_takes_the_whole_file(
    qtbot: Any, tmp_path: Path, tasks: Tasks
) -> None:
    """The user's model, binary and port survive; the core runs on them afterwards."""
    core = _stopped_core(tmp_path, "wrong type")
    path = core.paths.config_file
    before = path.read_bytes()
    dlg = SettingsDialog(CoreBackend(core), tasks)
    qtbot.addWidget(dlg)
    short = dlg.fields["cache.ttl_short_s"]
    short.use_default.click()  # the box already shows 300: this makes it the edit
    assert short.dirty and short.error.isHidden()
    with qtbot.waitSignal(dlg.saved, timeout=10_000) as saved:
        dlg.save()
    assert saved.args[0].applied
    assert path.read_bytes() == before.replace(b'"two minutes"', b"300")
    s = core.settings
    assert (s.server.binary, s.server.model, s.proxy.port) == (
        "/opt/llama/llama-server",
        "/models/coder.gguf",
        9123,
    )
    assert config_mod.load(path) == s


def test_a_file_that_is_not_toml_says_where_and_is_never_written(
    qtbot: Any, tmp_path: Path, tasks: Tasks
) -> None:
    core = _stopped_core(tmp_path, "broken TOML")
    path = core.paths.config_file
    before = path.read_bytes()
    dlg = SettingsDialog(CoreBackend(core), tasks)
    qtbot.addWidget(dlg)
    dlg.show()
    note = dlg.file_note.text()
    assert f"{path} is not valid TOML at line 9, column 13" in note
    assert not dlg.save_button.isEnabled() and not dlg.fields["proxy.port"].editor.isEnabled()
    dlg.fields["cache.ttl_long_s"].set_value(7200)
    dlg.save()
    assert path.read_bytes() == before


def test_the_ttl_rule_shows_live_in_words_and_clears_from_either_field(
    qtbot: Any, core: Core, tasks: Tasks
) -> None:
    """It was checked only on Save, in setting names, clipped; and after fixing the short
    TTL the stale error kept Save off until the long one was edited."""
    dlg = SettingsDialog(CoreBackend(core), tasks)
    qtbot.addWidget(dlg)
    dlg.resize(760, 660)
    dlg.show()
    dlg.tabs.setCurrentIndex([dlg.tabs.tabText(i) for i in range(3)].index("Cache"))
    short, long_ = dlg.fields["cache.ttl_short_s"], dlg.fields["cache.ttl_long_s"]
    short.set_value(7200)  # above long (3,600 s): shown at once, at both fields
    assert short.error.text() == (
        "Longer than the long TTL (3,600 s): the TTL classes go short ≤ long ≤ extended."
    )
    assert long_.error.text().startswith("Shorter than the short TTL (7,200 s)")
    assert "cache." not in short.error.text() + long_.error.text()
    assert not dlg.save_button.isEnabled()
    for label in (short.error, long_.error):  # the whole text fits its label
        assert label.isVisible()
        assert label.height() >= label.heightForWidth(label.width())
        assert label.width() <= label.parentWidget().width()
    short.set_value(600)  # fixed at the short field: both clear
    assert short.error.isHidden() and long_.error.isHidden() and dlg.save_button.isEnabled()
    short.set_value(7200)
    long_.set_value(10_000)  # fixed at the long field: both clear too
    assert short.error.isHidden() and long_.error.isHidden() and dlg.save_button.isEnabled()


def test_each_setting_says_when_it_takes_effect(qtbot: Any, core: Core, tasks: Tasks) -> None:
    dlg = SettingsDialog(CoreBackend(core), tasks)
    qtbot.addWidget(dlg)
    tips = {n: f.editor.toolTip() for n, f in dlg.fields.items()}
    assert tips["proxy.upstream_timeout_s"].endswith("Takes effect at once.")
    assert tips["proxy.max_body_mb"].endswith("Takes effect at once.")
    assert tips["server.model"].endswith("when llama-server restarts (↻).")
    assert tips["pool.ram_budget_mib"].endswith("when Warmslot restarts (⟳).")
    for name, spec in config_mod.SCHEMA.items():
        assert spec.applies.words in tips[name], name


def test_the_tray_with_an_invalid_file_starts_on_the_files_settings_once_fixed(
    qtbot: Any, tmp_path: Path, start_app: Any
) -> None:
    """As a user saw it: ``ttl_short_s = "two minutes"``, the tray in error, Settings…,
    Save — which moved the proxy to 8089 and emptied binary and model. Now Start does not
    run on the stand-in defaults, Save writes the fix alone, and the core then starts on
    the file's own settings."""
    import socket

    from app.menu import SETTINGS, START
    from app.state import TrayState
    from tests.app.conftest import prepare

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    paths = prepare(tmp_path / "home", **{"proxy.port": port, "server.model": "/m/coder.gguf"})
    text = paths.config_file.read_text(encoding="utf-8")
    paths.config_file.write_text(text.replace("ttl_short_s = 300", 'ttl_short_s = "two minutes"'))
    before = paths.config_file.read_bytes()
    app = start_app(tmp_path / "home", tray_available=False)
    assert app.controller.state.tray is TrayState.ERROR and not app.core.running
    app.handlers[START]()  # refused: the file is still wrong
    qtbot.waitUntil(lambda: "two minutes" in app.controller.core_error, timeout=10_000)
    assert not app.core.running
    app.handlers[SETTINGS]()
    dlg = app.settings_dialog
    assert dlg is not None and dlg.fields["proxy.port"].raw() == port
    dlg.fields["cache.ttl_short_s"].set_value(120)
    with qtbot.waitSignal(dlg.saved, timeout=10_000):
        dlg.save()
    assert paths.config_file.read_bytes() == before.replace(b'"two minutes"', b"120")
    qtbot.waitUntil(lambda: app.core.running and app.core.proxy.port == port, timeout=30_000)
    assert app.core.settings.server.model == "/m/coder.gguf"
    assert app.controller.core_error == ""
