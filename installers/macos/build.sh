#!/usr/bin/env bash
# Build Warmslot for macOS: installers/macos/dist/Warmslot.app (tray-only:
# LSUIElement, no Dock icon) and Warmslot-VERSION-macos-ARCH.dmg.
#
# Usage: installers/macos/build.sh [--with-model] [--no-dmg] [--python PY]
#   --with-model  also bundle the ~250 MB demo model packages
#   --no-dmg      only the .app
#   --python PY   an interpreter with warmslot[gui] (+ default-model) installed;
#                 default: a private venv in installers/macos/build/venv
# Environment: WARMSLOT_CODESIGN_IDENTITY="Developer ID Application: …" signs the
# app (default: ad-hoc). Notarization is not done here.
#
# The CLI is inside the app: Warmslot.app/Contents/MacOS/warmslot
# llama-server is not bundled on macOS: `brew install llama.cpp` and
# `warmslot config set server.binary /opt/homebrew/bin/llama-server`, or `warmslot build`.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
WORK="$HERE/build"
DIST="$HERE/dist"
PY="${PYTHON:-}"
WITH_MODEL=0
DMG=1
while [ $# -gt 0 ]; do
  case "$1" in
    --with-model) WITH_MODEL=1 ;;
    --no-dmg) DMG=0 ;;
    --python) PY="$2"; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ "$(uname -s)" = Darwin ] || { echo "build.sh: run this on macOS" >&2; exit 2; }
mkdir -p "$WORK" "$DIST"

if [ -z "$PY" ]; then
  PY="$WORK/venv/bin/python"
  [ -x "$PY" ] || python3 -m venv "$WORK/venv"
  extras=gui
  [ "$WITH_MODEL" = 1 ] && extras="gui,default-model"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "$ROOT[$extras]" "pyinstaller>=6.10"
fi
version=$(cd "$ROOT" && "$PY" -c 'from core.cli.main import __version__; print(__version__)')

rm -rf "$DIST/warmslot" "$DIST/Warmslot.app"
(
  cd "$ROOT"
  WARMSLOT_WITH_MODEL=$WITH_MODEL "$PY" -m PyInstaller --noconfirm --clean --log-level WARN \
    --distpath "$DIST" --workpath "$WORK/pyinstaller" "$ROOT/installers/pyinstaller/warmslot.spec"
)
app="$DIST/Warmslot.app"
plutil -lint "$app/Contents/Info.plist"
[ "$(/usr/libexec/PlistBuddy -c 'Print :LSUIElement' "$app/Contents/Info.plist")" = true ] \
  || { echo "build.sh: LSUIElement is not set" >&2; exit 1; }
"$app/Contents/MacOS/warmslot" --version
rm -rf "$DIST/warmslot"  # the plain folder; the .app holds the same files

if [ "$DMG" = 1 ]; then
  "$HERE/make_dmg.sh" "$app" "$DIST/Warmslot-$version-macos-$(uname -m).dmg"
fi
