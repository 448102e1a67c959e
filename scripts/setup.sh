# The set-up every entry point of scripts/ shares; sourced (`. scripts/setup.sh`) from the
# checkout's root, after `set -euo pipefail`:
#   use_venv NAME [EXTRAS]  create .venv (Python >= 3.11; python3-venv with apt-get if needed)
#                           and install the package with EXTRAS into it, again only when
#                           pyproject.toml changed since NAME's last install;
#   use_side_venv DIR REQS  a venv at DIR with the requirements file REQS installed, again
#                           only when REQS changed;
#   have PROGRAM            whether PROGRAM is installed (on PATH or in /usr/sbin);
#   use_apt PROGRAM [PKG]   install the Debian package PKG (default PROGRAM) with apt-get unless
#                           PROGRAM is installed; the package's services are not started;
#   run_module MODULE ARGS  run a tool of scripts/ (with scripts/ on PYTHONPATH) in .venv;
#   die MESSAGE             print "scripts/NAME: MESSAGE" and exit 1.

script="scripts/$(basename "$0")"

die() { echo "$script: $*" >&2; exit 1; }

find_python() {
    local candidate
    for candidate in python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

use_venv() {
    local name=$1 extras=${2:-} python stamp want
    if [ ! -x .venv/bin/python ]; then
        python=$(find_python) ||
            die "Python >= 3.11 is required (python3 is $(python3 -V 2>&1 || echo missing))"
        if ! "$python" -m venv .venv; then
            # Debian's python3 ships venv's ensurepip in a separate package.
            rm -rf .venv
            if command -v apt-get >/dev/null 2>&1; then
                apt-get update -qq && apt-get install -y -qq python3-venv
            fi
            "$python" -m venv .venv || die "cannot create .venv (install python3-venv)"
        fi
    fi
    stamp=.venv/.mmserver-$name
    want=$(sha256sum pyproject.toml | cut -d' ' -f1)
    if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
        # The xgboost extra installs XGBoost's CPU-only build, which brings the same module as
        # the full one: a venv made before it had the full one, which goes first.
        if .venv/bin/python -m pip show -q xgboost >/dev/null 2>&1; then
            .venv/bin/python -m pip uninstall -y -q xgboost nvidia-nccl-cu12 >/dev/null 2>&1 || true
        fi
        .venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
        echo "$want" >"$stamp"
    fi
}

# use_side_venv DIR REQUIREMENTS: a venv at DIR with the pinned packages of the requirements
# file REQUIREMENTS (another library version than the project's own: tests make models with
# it), again only when that file changed.
use_side_venv() {
    local dir=$1 requirements=$2 python stamp want
    stamp=$dir/.requirements
    want=$(sha256sum "$requirements" | cut -d' ' -f1)
    [ "$(cat "$stamp" 2>/dev/null || true)" = "$want" ] && return 0
    python=$(find_python) || die "Python >= 3.11 is required"
    rm -rf "$dir"
    "$python" -m venv "$dir" || die "cannot create $dir"
    "$dir/bin/python" -m pip install -q --disable-pip-version-check -r "$requirements" ||
        die "cannot install $requirements into $dir"
    echo "$want" >"$stamp"
}

have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }

use_apt() {
    local program=$1 package=${2:-$1} status=0 policy=""
    have "$program" && return 0
    command -v apt-get >/dev/null 2>&1 || { echo "$script: $program is required (apt-get is not available)" >&2; return 1; }
    echo "$script: installing $package with apt-get" >&2
    # The package's services are not started (a Prometheus listening on every address, say):
    # only its programs are wanted.
    if [ ! -e /usr/sbin/policy-rc.d ] && [ -w /usr/sbin ]; then
        policy=/usr/sbin/policy-rc.d
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy"
    fi
    apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$package" \
            >/dev/null || status=$?
    [ -z "$policy" ] || rm -f "$policy"
    return "$status"
}

run_module() {
    PYTHONPATH="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" exec .venv/bin/python -m "$@"
}
