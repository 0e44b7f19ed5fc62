# Shared by the set-up scripts: a virtual environment in .venv with clmq installed.
# Usage: source scripts/_env.sh EXTRAS   (EXTRAS e.g. "test"; empty for the plain install)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

apt_install() {  # apt_install PACKAGE...: install Debian packages that are missing
    local missing=()
    for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    local sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# Debian's python3 has no venv/ensurepip until python3-venv is installed.
if ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then
    apt_install python3-venv
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
# The compiled record decoder (common/_cdecode.c, optional: without it clmq decodes in
# Python, about 3 times slower per consumed message) needs a C compiler and the headers
# of the Python the virtual environment runs.
command -v cc >/dev/null 2>&1 || apt_install gcc libc6-dev
if ! .venv/bin/python -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
    apt_install python3-dev
fi
extras="${1:-}"
# setuptools prints an "Editable installation" notice (not a deprecation) on every
# editable install; this filter silences that one message only, so install stays quiet.
export PYTHONWARNINGS="ignore:Editable installation:UserWarning"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if [ -n "$extras" ]; then
    .venv/bin/python -m pip install -q -e ".[$extras]"
else
    .venv/bin/python -m pip install -q -e .
fi
unset PYTHONWARNINGS
