#!/bin/sh
# tests/with_pg.sh CMD... - run CMD with a throwaway PostgreSQL 15 cluster:
# initdb into a temporary directory (as nobody: initdb refuses root), start
# it on a private socket directory and a free port, export
# MODELD_TEST_INDEX_URL (a libpq URI to database "modeld"), run CMD, and stop
# the cluster (immediate) whatever CMD did. Never a system service. Exits
# with CMD's status. PGBIN overrides /usr/lib/postgresql/15/bin.
set -eu
PGBIN=${PGBIN:-/usr/lib/postgresql/15/bin}
[ -x "$PGBIN/initdb" ] || { echo "with_pg.sh: no PostgreSQL 15 in $PGBIN (make deps installs postgresql-15)" >&2; exit 2; }
DIR=$(mktemp -d /tmp/modeld-pg-XXXXXX)
chmod 755 "$DIR"
mkdir "$DIR/data" "$DIR/sock"
AS=""
if [ "$(id -u)" = 0 ]; then
    chown nobody "$DIR/data" "$DIR/sock"
    AS="runuser -u nobody --"
fi
# a free port: bind to 0 and read what the kernel chose
PORT=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cleanup() {
    $AS "$PGBIN/pg_ctl" -D "$DIR/data" -m immediate stop >/dev/null 2>&1 || true
    rm -rf "$DIR"
}
trap cleanup EXIT INT TERM
$AS "$PGBIN/initdb" -D "$DIR/data" -A trust -U modeld --no-sync >"$DIR/initdb.log" 2>&1 ||
    { cat "$DIR/initdb.log" >&2; exit 2; }
$AS "$PGBIN/pg_ctl" -w -D "$DIR/data" -l "$DIR/sock/log" \
    -o "-k $DIR/sock -p $PORT -c listen_addresses=127.0.0.1 -c fsync=off" start >/dev/null ||
    { cat "$DIR/sock/log" >&2; exit 2; }
$AS "$PGBIN/createdb" -h "$DIR/sock" -p "$PORT" -U modeld modeld
export MODELD_TEST_INDEX_URL="postgresql://modeld@127.0.0.1:$PORT/modeld"
export MODELD_TEST_PG_SOCK="$DIR/sock" MODELD_TEST_PG_PORT="$PORT"
set +e
"$@"
rc=$?
exit $rc
