#!/usr/bin/env bash
# Make a fresh Debian machine ready for twophase: Java + ZooKeeper + PostgreSQL, .venv, the package.
# Idempotent and fast on re-runs. Exports nothing: source scripts/env.sh afterwards.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { echo "[bootstrap] $*"; }

pick_python() {
    local py
    for py in python3.13 python3.12 python3.11 python3; do
        if command -v "$py" >/dev/null 2>&1 &&
            "$py" -c 'import sys, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            command -v "$py"
            return 0
        fi
    done
    return 1
}

pkgs=()
command -v java >/dev/null 2>&1 || pkgs+=(default-jre-headless)
[[ -f /usr/share/java/zookeeper.jar ]] || pkgs+=(zookeeper)
# The PostgreSQL server binaries for twophase/pgserver.py (its tests and the PostgreSQL sink's).
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || pkgs+=(postgresql)
command -v kcat >/dev/null 2>&1 || pkgs+=(kcat)  # a librdkafka client the broker tests use
[[ -x .venv/bin/python ]] || pick_python >/dev/null || pkgs+=(python3 python3-venv)
if ((${#pkgs[@]})); then
    sudo=()
    [[ $(id -u) -eq 0 ]] || sudo=(sudo)
    say "apt-get install ${pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
fi
say "java: $(java -version 2>&1 | head -n1)"

if [[ ! -x .venv/bin/python ]]; then
    py=$(pick_python) || { echo "[bootstrap] no python >= 3.11 with venv support" >&2; exit 1; }
    say "creating .venv with $py ($("$py" -V 2>&1))"
    "$py" -m venv .venv
fi

stamp=.venv/.twophase-bootstrap-stamp
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    say "pip install -e '.[dev]'"
    .venv/bin/python -m pip install -q -e '.[dev]'
    echo "$want" >"$stamp"
else
    say "python deps up to date"
fi
