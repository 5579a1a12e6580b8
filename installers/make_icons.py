"""Render the app icon resources/installer/warmslot.svg to PNG, ICO and ICNS.

    QT_QPA_PLATFORM=offscreen python installers/make_icons.py

The outputs are committed (resources/installer/warmslot.{png,ico,icns}), so the
Windows and macOS builds need neither Pillow nor iconutil. ICO and ICNS hold
PNG-compressed images (supported since Windows Vista and macOS 10.7).
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

from PySide6 import QtCore, QtGui, QtSvg

HERE = Path(__file__).resolve().parent
ICON_DIR = HERE.parent / "resources" / "installer"
SVG = ICON_DIR / "warmslot.svg"

ICO_SIZES = (16, 24, 32, 48, 64, 128, 256)
# ICNS element types holding PNG data, by pixel size.
ICNS_TYPES = (
    (b"icp4", 16), (b"icp5", 32), (b"icp6", 64), (b"ic07", 128),
    (b"ic08", 256), (b"ic09", 512), (b"ic10", 1024),
    (b"ic11", 32), (b"ic12", 64), (b"ic13", 256), (b"ic14", 512),
)  # fmt: skip


def render_png(renderer: QtSvg.QSvgRenderer, size: int) -> bytes:
    img = QtGui.QImage(size, size, QtGui.QImage.Format.Format_ARGB32)
    img.fill(0)
    painter = QtGui.QPainter(img)
    painter.setRenderHint(QtGui.QPainter.RenderHint.Antialiasing)
    renderer.render(painter)
    painter.end()
    buf = QtCore.QBuffer()
    buf.open(QtCore.QIODevice.OpenModeFlag.WriteOnly)
    if not img.save(buf, "PNG"):
        raise RuntimeError(f"could not encode a {size}px PNG")
    return bytes(buf.data().data())


def ico(images: dict[int, bytes]) -> bytes:
    header = struct.pack("<HHH", 0, 1, len(images))
    entries, data = b"", b""
    offset = 6 + 16 * len(images)
    for size, png in sorted(images.items()):
        dim = 0 if size >= 256 else size  # 0 means 256
        entries += struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(png), offset + len(data))
        data += png
    return header + entries + data


def icns(images: dict[int, bytes]) -> bytes:
    body = b""
    for kind, size in ICNS_TYPES:
        png = images[size * 2 if kind in (b"ic11", b"ic12", b"ic13", b"ic14") else size]
        body += kind + struct.pack(">I", 8 + len(png)) + png
    return b"icns" + struct.pack(">I", 8 + len(body)) + body


def main() -> int:
    QtGui.QGuiApplication(sys.argv[:1])
    renderer = QtSvg.QSvgRenderer(str(SVG))
    if not renderer.isValid():
        raise SystemExit(f"cannot read {SVG}")
    sizes = set(ICO_SIZES) | {s for _, s in ICNS_TYPES} | {1024}
    pngs = {s: render_png(renderer, s) for s in sorted(sizes)}
    (ICON_DIR / "warmslot.png").write_bytes(pngs[256])
    (ICON_DIR / "warmslot.ico").write_bytes(ico({s: pngs[s] for s in ICO_SIZES}))
    (ICON_DIR / "warmslot.icns").write_bytes(icns(pngs))
    for name in ("warmslot.png", "warmslot.ico", "warmslot.icns"):
        print(ICON_DIR / name, (ICON_DIR / name).stat().st_size, "bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
