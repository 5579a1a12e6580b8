#!/usr/bin/env bash
# Remove Warmslot installed by install.sh for the current user.
#
# Usage: uninstall.sh [--prefix DIR] [--purge] [--purge-config] [--yes]
#   --prefix DIR    the --prefix given to install.sh (default ~/.local; when this
#                   script runs from an installed bundle, that install)
#   --purge         ALSO delete Warmslot's data: the cache (llama.cpp builds),
#                   the state (saved KV-cache slot files, telemetry, logs) and the
#                   data folder (the assembled demo model). This cannot be undone.
#   --purge-config  with --purge: also delete the settings (warmslot.toml)
#   --yes           do not ask before purging
#
# Without --purge only the program, its menu/autostart entries, the icon and the
# systemd user unit are removed; settings, models, caches and logs stay.
# Honors XDG_DATA_HOME, XDG_CONFIG_HOME, XDG_CACHE_HOME, XDG_STATE_HOME and WARMSLOT_HOME.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
PREFIX=""
PURGE=0
PURGE_CONFIG=0
YES=0

while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX="$2"; shift ;;
    --purge) PURGE=1 ;;
    --purge-config) PURGE_CONFIG=1 ;;
    --yes|-y) YES=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "uninstall.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ "$PURGE_CONFIG" = 1 ] && [ "$PURGE" = 0 ]; then
  echo "uninstall.sh: --purge-config goes with --purge" >&2
  exit 2
fi

if [ -z "$PREFIX" ]; then
  if [ -f "$HERE/.install-manifest" ] && [ "$(basename "$(dirname "$HERE")")" = lib ]; then
    PREFIX=$(dirname "$(dirname "$HERE")")  # running from PREFIX/lib/warmslot
  else
    PREFIX="$HOME/.local"
  fi
fi
LIBDIR="$PREFIX/lib/warmslot"
DATA_HOME="${XDG_DATA_HOME:-$HOME/.local/share}"
CONFIG_HOME="${XDG_CONFIG_HOME:-$HOME/.config}"

# ------------------------------------------------------------ what to purge
# The same folders as core/paths.py (platformdirs on Linux, or $WARMSLOT_HOME).
if [ -n "${WARMSLOT_HOME:-}" ]; then
  purge_dirs=("$WARMSLOT_HOME/cache" "$WARMSLOT_HOME/state" "$WARMSLOT_HOME/logs" "$WARMSLOT_HOME/data")
  config_dir="$WARMSLOT_HOME/config"
else
  purge_dirs=(
    "${XDG_CACHE_HOME:-$HOME/.cache}/warmslot"
    "${XDG_STATE_HOME:-$HOME/.local/state}/warmslot"
    "$DATA_HOME/warmslot"
  )
  config_dir="$CONFIG_HOME/warmslot"
fi
[ "$PURGE_CONFIG" = 1 ] && purge_dirs+=("$config_dir")

if [ "$PURGE" = 1 ]; then
  echo "WARNING: --purge permanently deletes:"
  for d in "${purge_dirs[@]}"; do
    size=$(du -sh "$d" 2>/dev/null | cut -f1 || true)
    echo "  $d${size:+  ($size)}"
  done
  echo "  (llama.cpp builds, saved KV-cache slots, telemetry, logs, assembled models$(
    [ "$PURGE_CONFIG" = 1 ] && echo ', settings'))"
  if [ "$YES" != 1 ]; then
    if [ ! -t 0 ]; then
      echo "uninstall.sh: not a terminal; pass --yes to purge" >&2
      exit 2
    fi
    read -r -p "Delete them? [y/N] " answer
    case "$answer" in y|Y|yes|YES) ;; *) echo "nothing deleted"; exit 1 ;; esac
  fi
fi

# ------------------------------------------------------------ stop what runs
if command -v systemctl >/dev/null && [ -f "$CONFIG_HOME/systemd/user/warmslot.service" ]; then
  systemctl --user disable --now warmslot.service 2>/dev/null || true
fi

# ------------------------------------------------------------ remove the program
removed=()
remove() {
  local p
  for p in "$@"; do
    if [ -e "$p" ] || [ -L "$p" ]; then
      rm -rf -- "$p"
      removed+=("$p")
    fi
  done
}
if [ -f "$LIBDIR/.install-manifest" ]; then
  mapfile -t listed < "$LIBDIR/.install-manifest"
  for p in "${listed[@]}"; do
    [ "$p" = "$LIBDIR" ] || remove "$p"
  done
fi
# Links only when they point into this install (never a warmslot from elsewhere).
for exe in warmslot warmslot-tray; do
  link="$PREFIX/bin/$exe"
  if [ -L "$link" ] && [ "$(readlink "$link")" = "$LIBDIR/$exe" ]; then
    remove "$link"
  fi
done
remove "$DATA_HOME/applications/warmslot.desktop" \
       "$CONFIG_HOME/autostart/warmslot.desktop" \
       "$CONFIG_HOME/systemd/user/warmslot.service" \
       "$DATA_HOME/icons/hicolor/scalable/apps/warmslot.svg" \
       "$DATA_HOME/icons/hicolor/256x256/apps/warmslot.png"
[ -d "$LIBDIR" ] && [ -x "$LIBDIR/warmslot" ] && remove "$LIBDIR"

command -v systemctl >/dev/null && systemctl --user daemon-reload 2>/dev/null || true
command -v update-desktop-database >/dev/null \
  && update-desktop-database -q "$DATA_HOME/applications" 2>/dev/null || true

if [ "$PURGE" = 1 ]; then
  remove "${purge_dirs[@]}"
fi

if [ ${#removed[@]} -eq 0 ]; then
  echo "Warmslot was not installed under $PREFIX (nothing removed)"
else
  printf 'removed %s\n' "${removed[@]}"
fi
if [ "$PURGE" = 0 ]; then
  echo "kept settings, models, caches and logs: ${purge_dirs[*]} $config_dir"
  echo "(uninstall.sh --purge [--purge-config] deletes them)"
fi
