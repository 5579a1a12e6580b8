#!/usr/bin/env python3
"""Render every dashboard tab (and the settings dialog and tray icons) to PNG.

    .venv/bin/python scripts/screenshots.py [--out docs/screenshots] [--screen 1280x800]
        [--theme light|dark] [--grab window|screen]
    .venv/bin/python scripts/screenshots.py --live MODEL.gguf [--out docs/screenshots/live]

`--screen` is the size of the screen the dashboard opens on: the window sizes itself
to it as it does on a desktop (`Dashboard.fit_to_screen`). Runs offscreen
(``QT_QPA_PLATFORM=offscreen``, a screen of that size) unless a display is set — under
Xvfb with a window manager and a panel the window meets a real available geometry, and
``--grab screen`` shoots the whole screen, panel and frame included. ``--theme dark``
gives the application a dark palette (`app.charts.dark_palette`, what a dark desktop
theme does) and writes ``<tab>-dark.png``. The data is a month of realistic synthetic
telemetry (`tests/fixtures/demo_data.py`) in a temporary SQLite database, read through
the same telemetry queries the live dashboard uses. With ``--live``, a real core
instead: llama-server with MODEL, an opencode-shaped trace (two agent sessions with
title calls) through the real proxy, and the dashboard on the running core.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def offscreen_screen(width: int, height: int) -> None:
    """Without a display: the offscreen platform, with one screen of this size (its
    config file; the platform is made with the QApplication, after this)."""
    if os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"):
        return
    cfg = Path(tempfile.gettempdir()) / f"warmslot-screen-{width}x{height}.json"
    screen = {"name": "screen", "x": 0, "y": 0, "width": width, "height": height}
    cfg.write_text(json.dumps({"screens": [{**screen, "logicalDpi": 96, "dpr": 1}]}))
    os.environ.setdefault("QT_QPA_PLATFORM", f"offscreen:configfile={cfg}")


from app.backend import TelemetryBackend  # noqa: E402
from app.bridge import Bridge  # noqa: E402
from app.charts import dark_palette  # noqa: E402
from app.dashboard import Dashboard, Tab, ViewContext  # noqa: E402
from app.icons import state_icon  # noqa: E402
from app.menu import menu_entries, populate  # noqa: E402
from app.qt import Qt, QtCore, QtGui, QtWidgets  # noqa: E402
from app.settings_dialog import SettingsDialog  # noqa: E402
from app.state import AppState, TrayState, derive_state  # noqa: E402
from app.tasks import Tasks  # noqa: E402
from core.events import BuildProgress, LogLine  # noqa: E402
from core.telemetry import Telemetry  # noqa: E402
from tests.fixtures import demo_data as demo  # noqa: E402

LOG = """\
main: build = 7e4c0a9 (b7e41c2) with cc (GCC) 13.2.0 for x86_64-linux-gnu
system_info: n_threads = 16 / 32 | CUDA : ARCHS = 890 | F16C = 1 | AVX2 = 1 | AVX512 = 1
llama_model_loader: loaded meta data with 38 key-value pairs and 579 tensors
load_tensors: offloaded 49/49 layers to GPU
load_tensors:        CUDA0 model buffer size = 13718.16 MiB
load_tensors:   CPU_Mapped model buffer size =  4412.53 MiB
llama_context: n_ctx_per_seq (32768) < n_ctx_train (262144) -- full capacity not utilized
llama_kv_cache: size = 3072.00 MiB ( 131072 cells,  48 layers,  4/4 seqs), K (f16): 1536 MiB
srv    load_model: prompt cache is enabled, size limit: 8192 MiB
srv          init: initializing slots, n_slots = 4
main: server is listening on http://127.0.0.1:38411 - starting the main loop
srv  update_slots: all slots are idle
slot launch_slot_: id  0 | task 0 | processing task
slot update_slots: id  0 | task 0 | new prompt, n_ctx_slot = 32768, n_prompt_tokens = 12411
slot update_slots: id  0 | task 0 | n_past = 11800, memory_seq_rm [11800, end)
slot      release: id  0 | task 0 | stop processing: n_past = 12890, truncated = 0
srv  log_server_r: request: POST /v1/chat/completions 127.0.0.1 200
slot update_slots: id  1 | task 14 | n_past = 640, cache miss after divergence at token 640
srv  log_server_r: request: POST /slots/1?action=save 127.0.0.1 200"""


# A saved agent conversation, pinned: what the Cache tab's Conversations table lists.
CONVERSATION = {
    "file": "ws-conv-7d41c2e09a5f3b18.bin", "fingerprint": "3f9c0a1d2b4e5f60", "tokens": 4210,
    "bytes": int(105.7 * 2**20), "ttl_class": "long", "pinned": True, "last_used": 0.0,
    "verified": "ok", "current": True, "kind": "conversation", "session": "ses_8f2a",
    "client": "opencode", "created": 0.0,
}  # fmt: skip


def wait_refreshed(tab: Tab, timeout_ms: int = 30000) -> None:
    loop = QtCore.QEventLoop()
    done = tab.refresh_count
    tab.refreshed.connect(loop.quit)
    QtCore.QTimer.singleShot(timeout_ms, loop.quit)
    tab.refresh()
    while tab.refresh_count == done or tab.busy:
        loop.exec()
    tab.refreshed.disconnect(loop.quit)
    QtWidgets.QApplication.processEvents()


def icons_strip(path: Path) -> None:
    states = list(TrayState)
    w, h = 132, 104
    pix = QtGui.QPixmap(w * len(states), h)
    pix.fill(QtGui.QColor("white"))
    p = QtGui.QPainter(pix)
    p.setRenderHint(QtGui.QPainter.RenderHint.Antialiasing)
    for i, s in enumerate(states):
        p.drawPixmap(i * w + (w - 64) // 2, 8, state_icon(s).pixmap(64, 64))
        p.drawPixmap(i * w + (w - 22) // 2 - 14, 76, state_icon(s).pixmap(22, 22))
        p.drawPixmap(i * w + (w - 16) // 2 + 14, 79, state_icon(s).pixmap(16, 16))
    p.end()
    labels = QtGui.QPixmap(w * len(states), h + 22)
    labels.fill(QtGui.QColor("white"))
    p = QtGui.QPainter(labels)
    p.drawPixmap(0, 0, pix)
    for i, s in enumerate(states):
        p.drawText(QtCore.QRect(i * w, h, w, 20), Qt.AlignmentFlag.AlignCenter, s.value)
    p.end()
    labels.save(str(path))


def tray_menu(path: Path, state: AppState) -> None:
    menu = QtWidgets.QMenu()
    populate(menu, menu_entries(state), {})
    menu.adjustSize()
    frame = QtWidgets.QWidget()
    lay = QtWidgets.QHBoxLayout(frame)
    tip = QtWidgets.QLabel(state.tooltip())
    tip.setStyleSheet("background: #ffffe1; border: 1px solid #999; padding: 6px;")
    tip.setAlignment(Qt.AlignmentFlag.AlignTop)
    menu_shot = QtWidgets.QLabel()
    menu_shot.setPixmap(menu.grab())
    lay.addWidget(menu_shot, 0, Qt.AlignmentFlag.AlignTop)
    lay.addWidget(tip, 0, Qt.AlignmentFlag.AlignTop)
    frame.setStyleSheet("background: white;")
    frame.adjustSize()
    frame.grab().save(str(path))


def settle(ms: int = 400) -> None:
    """Let the window manager frame and place the window (and Qt follow it)."""
    loop = QtCore.QEventLoop()
    QtCore.QTimer.singleShot(ms, loop.quit)
    loop.exec()
    QtWidgets.QApplication.processEvents()


def show_fitted(dash: Dashboard) -> None:
    """Show the dashboard as the tray opens it: sized to the screen it is on."""
    dash.show()
    settle()
    frame, avail = dash.frameGeometry(), dash.available()
    fits = "fits" if dash.fits_screen() else "DOES NOT FIT"
    print(
        f"screen available {avail.width()}×{avail.height()}+{avail.x()}+{avail.y()}; window "
        f"{dash.width()}×{dash.height()}, frame {frame.width()}×{frame.height()}"
        f"+{frame.x()}+{frame.y()}: {fits}"
    )


def grab(dash: Dashboard, how: str) -> QtGui.QPixmap:
    if how == "screen":
        return dash.screen().grabWindow(0)
    return dash.grab()


def save(pix: QtGui.QPixmap, path: Path) -> None:
    # Highest PNG compression: the same pixels, about a fifth smaller than the default.
    pix.save(str(path), "PNG", 0)
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")


def shoot_tabs(dash: Dashboard, out: Path, suffix: str = "", how: str = "window") -> None:
    """Every tab of `dash`, refreshed, to ``out/<tab><suffix>.png``."""
    for i in range(dash.tabs.count()):
        dash.tabs.setCurrentIndex(i)
        page = dash.current_page()
        if page.title == "Reuse":
            page.bucket.setCurrentIndex(1)  # type: ignore[attr-defined]  # hour buckets
        if page.title == "Memory":
            page.period.setCurrentIndex(3)  # type: ignore[attr-defined]  # 24 h: bands
        if page.title == "Cache":
            wait_refreshed(page)
            if page.saved.rowCount():  # type: ignore[attr-defined]
                page.saved.selectRow(0)  # type: ignore[attr-defined]
        if page.title in ("Requests", "Events"):
            wait_refreshed(page)
            if page.table.rowCount() > 1:  # type: ignore[attr-defined]
                page.table.selectRow(1)  # type: ignore[attr-defined]
        wait_refreshed(page)
        settle(150)
        save(grab(dash, how), out / f"{page.title.lower()}{suffix}.png")


def live(model: Path, out: Path) -> int:
    """Screenshots of the dashboard on a real core after real traffic."""
    import httpx

    from app.backend import CoreBackend
    from core.bench.trace import make_trace
    from core.config import Settings
    from core.engine import Core
    from core.paths import Paths

    _app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(["warmslot-screenshots"])
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings()
        settings.proxy.port = 0
        settings.server.model = str(model)
        settings.server.slots = 3
        core = Core(Paths.under(Path(tmp)), settings, policy_factory=_policy_factory())
        core.start(wait_ready=True, timeout=600)
        try:
            assert core.proxy is not None
            url = f"http://127.0.0.1:{core.proxy.port}/v1/chat/completions"
            trace = make_trace(sessions=2, turns=3, scale=0.3, restart_before_session=None)
            for i, r in enumerate(trace):
                resp = httpx.post(url, json=r.body, headers=r.headers, timeout=600)
                print(f"request {i + 1}/{len(trace)} ({r.kind}): {resp.status_code}")
            tasks = Tasks()
            bridge = Bridge(core)
            ctx = ViewContext(backend=CoreBackend(core), tasks=tasks, bridge=bridge)
            dash = Dashboard(ctx)
            show_fitted(dash)
            shoot_tabs(dash, out)
            dash.close()
            bridge.detach()
            tasks.shutdown()
        finally:
            core.stop()
    return 0


def _policy_factory() -> object:
    from core.cache.manager import policy_factory

    return policy_factory


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--screen", default="1280x800", help="the screen's size (offscreen)")
    ap.add_argument("--theme", choices=("light", "dark"), default="light")
    ap.add_argument("--grab", choices=("window", "screen"), default="window")
    ap.add_argument("--tabs-only", action="store_true", help="no settings dialog or icons")
    ap.add_argument("--live", type=Path, help="a GGUF model: shoot a real core instead")
    args = ap.parse_args()
    width, height = (int(v) for v in args.screen.split("x"))
    offscreen_screen(width, height)
    if args.live is not None:
        out = args.out or REPO / "docs" / "screenshots" / "live"
        out.mkdir(parents=True, exist_ok=True)
        return live(args.live, out)
    args.out = args.out or REPO / "docs" / "screenshots"
    args.out.mkdir(parents=True, exist_ok=True)

    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(["warmslot-screenshots"])
    suffix = ""
    if args.theme == "dark":
        suffix = "-dark"
        app.styleHints().setColorScheme(Qt.ColorScheme.Dark)  # where the platform follows
        app.setStyle("Fusion")
        app.setPalette(dark_palette())  # offscreen and Xvfb have no dark theme of their own
    now = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "telemetry.sqlite3"
        tel = Telemetry(db, clock=lambda: now)
        n = demo.fill(tel, now)
        tel.close()
        print(f"synthetic telemetry: {n} requests")
        snapshot = demo.status(now)
        conversation = {**CONVERSATION, "last_used": now - 300, "created": now - 2400}
        snapshot["cache"]["saved"].append(conversation)  # type: ignore[arg-type]
        backend = TelemetryBackend(
            db,
            snapshot=snapshot,
            clock=lambda: now,
            commands={"pin": print, "evict": print, "rewarm": print},
        )
        tasks = Tasks()
        bridge = Bridge()
        for line in LOG.splitlines():
            level = "warn" if "not utilized" in line else "info"
            bridge.deliver(LogLine(level=level, area="", text=line, raw=line))
        bridge.deliver(
            BuildProgress(
                build_id="b7e41c2",
                percent=100,
                step="built llama-server b7e41c2",
                done=True,
                ok=True,
            )
        )
        ctx = ViewContext(backend=backend, tasks=tasks, bridge=bridge, clock=lambda: now)
        dash = Dashboard(ctx)
        show_fitted(dash)
        shoot_tabs(dash, args.out, suffix, args.grab)
        if args.tabs_only:
            dash.close()
            backend.close()
            tasks.shutdown()
            return 0

        dlg = SettingsDialog(backend, tasks, parent=dash)
        dlg.resize(760, 680)
        dlg.show()
        field = dlg.fields["server.slots"]
        field.set_value(0)  # show what a validation error looks like
        dlg.tabs.setCurrentIndex(0)
        for _ in range(5):  # let the layouts settle around the new error line
            app.processEvents()
        save(dlg.grab(), args.out / f"settings{suffix}.png")
        dlg.close()

        if not suffix:  # the tray's icons and menu are drawn on white either way
            icons_strip(args.out / "tray-icons.png")
            st = derive_state(
                {**snapshot, "last_hour": {"hit_ratio": 0.91, "requests": 212}}, pressure="nominal"
            )
            tray_menu(args.out / "tray-menu.png", st)
            print(f"wrote {args.out / 'tray-icons.png'} and tray-menu.png")
        dash.close()
        backend.close()
        tasks.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
