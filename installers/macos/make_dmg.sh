#!/usr/bin/env bash
# Pack an .app into a compressed, drag-to-Applications .dmg.
#
# Usage: make_dmg.sh PATH/Warmslot.app OUT.dmg
# Uses create-dmg (https://github.com/create-dmg/create-dmg: window layout with
# an Applications link) when it is on PATH, else plain hdiutil.
set -euo pipefail
app=${1:?usage: make_dmg.sh APP DMG}
dmg=${2:?usage: make_dmg.sh APP DMG}
name=$(basename "$app" .app)
[ -d "$app/Contents/MacOS" ] || { echo "make_dmg.sh: $app is not an .app" >&2; exit 1; }

staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
ditto "$app" "$staging/$name.app"   # ditto keeps symlinks, extended attributes and signatures
rm -f "$dmg"

if command -v create-dmg >/dev/null; then
  create-dmg --volname "$name" --window-size 540 360 --icon-size 96 \
    --icon "$name.app" 140 170 --app-drop-link 400 170 --hide-extension "$name.app" \
    "$dmg" "$staging"
else
  ln -s /Applications "$staging/Applications"
  hdiutil create -volname "$name" -srcfolder "$staging" -fs HFS+ -format UDZO -ov "$dmg"
fi
hdiutil verify "$dmg"
echo "== $dmg"
