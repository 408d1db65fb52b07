#!/usr/bin/env bash
# The web UI's vendored libraries (src/mlxd/ui/static/vendor/VENDORED.md):
#   scripts/ui_vendor.sh           re-fetch them from npm (`npm pack`), then check them
#   scripts/ui_vendor.sh --check   only check the files against SHA256SUMS
# npm itself checks each tarball against the registry's integrity hash; SHA256SUMS pins
# the files we ship, so an upgrade is a visible change of that file.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=src/mlxd/ui/static/vendor

if [ "${1:-}" != "--check" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent htm@3.1.1 uplot@1.6.32 preact@10.11.3 >/dev/null)
  for t in "$tmp"/*.tgz; do
    mkdir "${t%.tgz}" && tar xzf "$t" -C "${t%.tgz}"
  done
  cp "$tmp/htm-3.1.1/package/preact/standalone.module.js" "$dest/preact-htm.module.js"
  cp "$tmp/htm-3.1.1/package/LICENSE" "$dest/LICENSE.htm"
  cp "$tmp/uplot-1.6.32/package/dist/uPlot.iife.min.js" "$dest/uPlot.iife.min.js"
  cp "$tmp/uplot-1.6.32/package/dist/uPlot.min.css" "$dest/uPlot.min.css"
  cp "$tmp/uplot-1.6.32/package/LICENSE" "$dest/LICENSE.uPlot"
  cp "$tmp/preact-10.11.3/package/LICENSE" "$dest/LICENSE.preact"
fi
(cd "$dest" && sha256sum --quiet -c SHA256SUMS)
echo "vendored UI files match SHA256SUMS"
