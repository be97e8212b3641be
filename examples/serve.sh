#!/bin/bash
# serve.sh - what `make run` runs: start ./modeld, deploy the committed
# FashionMNIST classifier as `fashion` when the store does not have it yet,
# then wait on the server, forwarding SIGINT/SIGTERM to it. A port something
# already listens on: exit 1 at once, starting and deploying nothing.
#
#   examples/serve.sh [modeld flags...]      e.g. examples/serve.sh --port 9000
#
# Settings are modeld's own: flags given here, MODELD_* variables, --config.
# Two defaults differ from a bare ./modeld, so that every command of README.md
# works against this one server:
#   allowed_paths  Debian's FashionMNIST directory (dataset-fashion-mnist) and
#                  this repository's examples/, unless MODELD_ALLOWED_PATHS or
#                  --allowed-paths says otherwise; DATA=DIR[,DIR...] (what
#                  `make run DATA=DIR` sets) adds directories to that list
#   store          ./modeld-data of the directory it is started from (modeld's
#                  default; git-ignored in this repository)
# MODELD (no underscore) names another binary, e.g. a sanitizer build.
set -u

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
bin=${MODELD:-$repo/modeld}

if [ -z "${MODELD_ALLOWED_PATHS+set}" ]; then
    datasets=$(dpkg -L dataset-fashion-mnist 2>/dev/null | grep -m1 'idx3-ubyte' || true)
    datasets=$(dirname "${datasets:-/usr/share/datasets/fashion-mnist/x}")
    export MODELD_ALLOWED_PATHS="$datasets,$here"
fi
# DATA appends, so README's commands keep working beside the user's own
# data (--allowed-paths replaces the list, flags winning over MODELD_*).
# Relative directories are taken from where serve.sh (make run) starts.
if [ -n "${DATA:-}" ]; then
    IFS=, read -ra data_dirs <<< "$DATA"
    for dir in "${data_dirs[@]}"; do
        [ -n "$dir" ] || continue
        if ! abs=$(cd "$dir" 2>/dev/null && pwd); then
            echo "serve.sh: DATA=$DATA: $dir is not a directory" >&2
            exit 2
        fi
        MODELD_ALLOWED_PATHS="${MODELD_ALLOWED_PATHS:+$MODELD_ALLOWED_PATHS,}$abs"
    done
    export MODELD_ALLOWED_PATHS
fi

# The effective port and host, from the same settings the server will use. A
# bad setting: let modeld itself say so (one line, exit 2).
if ! config=$("$bin" --print-config "$@" 2>/dev/null); then
    exec "$bin" "$@"
fi
port=$(printf '%s\n' "$config" | sed -n 's/^ *"port": *\([0-9]*\).*/\1/p')
host=$(printf '%s\n' "$config" | sed -n 's/^ *"host": *"\([^"]*\)".*/\1/p')
case "$host" in "" | 0.0.0.0 | "::" | "[::]") host=127.0.0.1 ;; esac
probe=$host
case "$host" in *:*) host="[$host]" ;; esac
url="http://$host:$port"

# A port someone already listens on (another `make run`, any server): stop
# here. Started anyway, modeld would fail to bind, but the readiness loop
# below could first reach the other server, deploy into it and call it ours.
# A TCP connect is the test: it needs no answer from whatever holds the port.
# (A server that takes the port between this check and modeld's bind is not
# caught; that takes two starts within milliseconds.)
if timeout 5 bash -c 'exec 3<>"/dev/tcp/$1/$2"' probe "$probe" "$port" 2>/dev/null; then
    echo "serve.sh: port $port on $probe is already in use (another modeld, or a second" \
        "\`make run\`?); nothing was started. Stop that server, or pick another port:" \
        "make run PORT=$((port + 1))" >&2
    exit 1
fi

"$bin" "$@" &
pid=$!
# A background child of a script starts with SIGINT ignored, so Ctrl-C is
# passed on as SIGTERM, which modeld treats the same way (drain, then exit 0;
# a second one exits at once).
trap 'kill -TERM "$pid" 2>/dev/null' TERM INT

# Ready means the store is open and every deployed model is loaded.
until curl -sf -o /dev/null "$url/readyz"; do
    if ! kill -0 "$pid" 2>/dev/null; then
        wait "$pid"
        exit $?
    fi
    sleep 0.2
done

status=$(curl -s -o /dev/null -w '%{http_code}' "$url/models/fashion")
if [ "$status" = 404 ]; then
    echo "serve.sh: deploying examples/fashion_mnist as model \"fashion\"" >&2
    if ! curl -sS -f -o /dev/null "$url/models/fashion/versions" \
            -F checkpoint=@"$here/fashion_mnist/model.pt" \
            -F "config=<$here/fashion_mnist/model.json" \
            -F "metrics=<$here/fashion_mnist/metrics.json"; then
        echo "serve.sh: the deploy failed; the server keeps running without it" >&2
    fi
fi
echo "serve.sh: modeld (pid $pid) serving on $url; Ctrl-C stops it" >&2

# `wait` returns early when a trapped signal arrives; wait again until the
# server has finished draining and exited, and exit with its status.
while :; do
    wait "$pid"
    rc=$?
    kill -0 "$pid" 2>/dev/null || exit "$rc"
done
