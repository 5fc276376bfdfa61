#!/bin/sh
# Vendor uPlot (the console's chart library) from the npm registry: `refresh-uplot.sh 1.6.32`.
# npm checks the tarball against the registry's integrity; the files are copied unchanged,
# with the licence, and VERSION records where they came from.
set -eu
version=${1:?usage: refresh-uplot.sh VERSION}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "uplot@$version" >/dev/null && tar xzf "uplot-$version.tgz")
integrity=$(npm view "uplot@$version" dist.integrity)
mkdir -p "$here/uplot"
cp "$work/package/dist/uPlot.iife.min.js" "$work/package/dist/uPlot.min.css" \
   "$work/package/LICENSE" "$here/uplot/"
cat > "$here/uplot/VERSION" <<END
uplot $version (MIT, LICENSE beside this file)
from https://registry.npmjs.org/uplot/-/uplot-$version.tgz
integrity $integrity
files: dist/uPlot.iife.min.js, dist/uPlot.min.css, LICENSE (unchanged)
refresh: service/http/console/static/vendor/refresh-uplot.sh VERSION
END
