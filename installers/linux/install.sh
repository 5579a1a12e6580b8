#!/usr/bin/env bash
# Install the Warmslot bundle for the current user (no root needed).
#
# Usage: install.sh [--prefix DIR] [--bundle DIR] [--autostart] [--service [--enable]]
#   --prefix DIR  where to install (default ~/.local): the bundle goes to
#                 DIR/lib/warmslot, links to DIR/bin/warmslot and DIR/bin/warmslot-tray
#   --bundle DIR  the built bundle (default: the folder this script is in when it is
#                 a bundle, else installers/linux/dist/warmslot of the checkout)
#   --autostart   start the tray at login (XDG autostart entry); opt-in
#   --service     install the systemd --user unit warmslot.service (headless
#                 `warmslot serve`, restarted on failure); --enable also enables
#                 and starts it. Use the tray or the service, not both.
#
# Always installed: the menu entry (warmslot.desktop) and the icon. Every file
# written is listed in DIR/lib/warmslot/.install-manifest, which uninstall.sh reads.
# Honors XDG_DATA_HOME and XDG_CONFIG_HOME.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
PREFIX="$HOME/.local"
BUNDLE=""
AUTOSTART=0
SERVICE=0
ENABLE=0

while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX="$2"; shift ;;
    --bundle) BUNDLE="$2"; shift ;;
    --autostart) AUTOSTART=1 ;;
    --service) SERVICE=1 ;;
    --enable) ENABLE=1; SERVICE=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ -z "$BUNDLE" ]; then
  if [ -x "$HERE/warmslot" ] && [ -d "$HERE/_internal" ]; then
    BUNDLE="$HERE"
  else
    BUNDLE="$HERE/dist/warmslot"
  fi
fi
BUNDLE=$(cd "$BUNDLE" 2>/dev/null && pwd) \
  || { echo "install.sh: no bundle at $BUNDLE (build it: installers/linux/build.sh)" >&2; exit 1; }
for f in warmslot warmslot-tray _internal/resources/linux/warmslot.desktop; do
  [ -e "$BUNDLE/$f" ] || { echo "install.sh: $BUNDLE is not a Warmslot bundle (no $f)" >&2; exit 1; }
done

mkdir -p "$PREFIX"
PREFIX=$(cd "$PREFIX" && pwd)
DATA_HOME="${XDG_DATA_HOME:-$HOME/.local/share}"
CONFIG_HOME="${XDG_CONFIG_HOME:-$HOME/.config}"
LIBDIR="$PREFIX/lib/warmslot"
BINDIR="$PREFIX/bin"
APPS="$DATA_HOME/applications"
ICONS="$DATA_HOME/icons/hicolor"
AUTOSTART_DIR="$CONFIG_HOME/autostart"
UNIT_DIR="$CONFIG_HOME/systemd/user"
RES="$LIBDIR/_internal/resources"

case "$LIBDIR" in *$'\n'*|*'"'*|*'\'*|*'$'*|*'`'*|*'%'*)
  echo "install.sh: the install folder $LIBDIR has characters desktop/systemd files cannot hold" >&2
  exit 1 ;;
esac

# An argument quoted for Exec= of .desktop files and ExecStart= of units (both
# take "…" around an argument with spaces; the characters needing escapes are refused above).
quote() { case "$1" in *' '*) printf '"%s"' "$1" ;; *) printf '%s' "$1" ;; esac; }

manifest=()
# Write a template with its Exec/TryExec/ExecStart pointing at the installed bundle.
render() {  # render TEMPLATE DEST
  local tray cli
  tray=$(quote "$LIBDIR/warmslot-tray")
  cli=$(quote "$LIBDIR/warmslot")
  mkdir -p "$(dirname "$2")"
  sed -e "s|^Exec=warmslot-tray|Exec=$tray|" \
      -e "s|^TryExec=warmslot-tray|TryExec=$LIBDIR/warmslot-tray|" \
      -e "s|^ExecStart=/usr/bin/warmslot |ExecStart=$cli |" \
      "$1" > "$2.tmp"
  chmod 0644 "$2.tmp"
  mv -f "$2.tmp" "$2"
  manifest+=("$2")
}

# ------------------------------------------------------------ the bundle
if [ "$BUNDLE" != "$LIBDIR" ]; then
  echo "installing $BUNDLE -> $LIBDIR"
  mkdir -p "$PREFIX/lib"
  rm -rf "$LIBDIR.new"
  cp -a "$BUNDLE" "$LIBDIR.new"
  rm -rf "$LIBDIR.old"
  [ -e "$LIBDIR" ] && mv "$LIBDIR" "$LIBDIR.old"
  mv "$LIBDIR.new" "$LIBDIR"
  rm -rf "$LIBDIR.old"
fi
manifest+=("$LIBDIR")

mkdir -p "$BINDIR"
for exe in warmslot warmslot-tray; do
  ln -sfn "$LIBDIR/$exe" "$BINDIR/$exe"
  manifest+=("$BINDIR/$exe")
done

# ------------------------------------------------------------ menu entry + icon
render "$RES/linux/warmslot.desktop" "$APPS/warmslot.desktop"
install -D -m 0644 "$RES/installer/warmslot.svg" "$ICONS/scalable/apps/warmslot.svg"
install -D -m 0644 "$RES/installer/warmslot.png" "$ICONS/256x256/apps/warmslot.png"
manifest+=("$ICONS/scalable/apps/warmslot.svg" "$ICONS/256x256/apps/warmslot.png")

# ------------------------------------------------------------ opt-in extras
if [ "$AUTOSTART" = 1 ]; then
  render "$RES/linux/warmslot-autostart.desktop" "$AUTOSTART_DIR/warmslot.desktop"
  echo "the tray starts at login ($AUTOSTART_DIR/warmslot.desktop)"
fi
if [ "$SERVICE" = 1 ]; then
  render "$RES/linux/warmslot.service" "$UNIT_DIR/warmslot.service"
  echo "installed the systemd user unit $UNIT_DIR/warmslot.service"
fi

printf '%s\n' "${manifest[@]}" > "$LIBDIR/.install-manifest"

# ------------------------------------------------------------ caches of the desktop
command -v update-desktop-database >/dev/null && update-desktop-database -q "$APPS" 2>/dev/null || true
command -v gtk-update-icon-cache >/dev/null && gtk-update-icon-cache -q -t "$ICONS" 2>/dev/null || true
if [ "$SERVICE" = 1 ] && command -v systemctl >/dev/null; then
  if systemctl --user daemon-reload 2>/dev/null; then
    if [ "$ENABLE" = 1 ]; then
      systemctl --user enable --now warmslot.service
    else
      echo "start it with: systemctl --user enable --now warmslot"
    fi
  else
    echo "(no systemd user session here: run 'systemctl --user daemon-reload' in your session)"
  fi
fi

echo "Warmslot $(cat "$LIBDIR/VERSION" 2>/dev/null || echo '') installed in $LIBDIR"
case ":$PATH:" in *":$BINDIR:"*) ;; *) echo "note: $BINDIR is not on PATH" ;; esac
"$LIBDIR/warmslot" doctor >/dev/null 2>&1 \
  || echo "next: run 'warmslot doctor' — e.g. set a model: warmslot config set server.model /path/to/model.gguf"
echo "uninstall: $LIBDIR/uninstall.sh  (--purge also deletes caches and state)"
