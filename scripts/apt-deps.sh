#!/usr/bin/env bash
# Install the Debian packages strata needs, only when some are missing.
#
# Usage: scripts/apt-deps.sh REQUIRED_PKGS... [-- OPTIONAL_PKGS...]
#
# Required packages must install or the script fails.  Optional packages
# (e.g. gVisor's runsc) are installed only when apt has a candidate for them;
# otherwise they are skipped with a message.  When everything is already
# installed the script only runs dpkg-query and exits quickly.
set -euo pipefail

required=()
optional=()
target=required
for arg in "$@"; do
    if [[ "$arg" == "--" ]]; then
        target=optional
        continue
    fi
    if [[ "$target" == required ]]; then
        required+=("$arg")
    else
        optional+=("$arg")
    fi
done

is_installed() {
    [[ "$(dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null)" == ii* ]]
}

has_candidate() {
    local cand
    cand="$(apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2; exit}')"
    [[ -n "$cand" && "$cand" != "(none)" ]]
}

have_apt_lists() {
    compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null
}

missing_required=()
for p in "${required[@]}"; do
    is_installed "$p" || missing_required+=("$p")
done
missing_optional=()
for p in "${optional[@]}"; do
    is_installed "$p" || missing_optional+=("$p")
done

if [[ ${#missing_required[@]} -eq 0 && ${#missing_optional[@]} -eq 0 ]]; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    if [[ ${#missing_required[@]} -gt 0 ]]; then
        echo "apt-deps: missing ${missing_required[*]} and apt-get is unavailable" >&2
        exit 1
    fi
    echo "apt-deps: skipping optional ${missing_optional[*]} (no apt-get)" >&2
    exit 0
fi

SUDO=()
if [[ "$(id -u)" != 0 ]]; then
    SUDO=(sudo -n)
fi
export DEBIAN_FRONTEND=noninteractive
APT_OPTS=(-y -q --no-install-recommends
    -o DPkg::Lock::Timeout=300
    -o Dpkg::Options::=--force-confdef
    -o Dpkg::Options::=--force-confold)

updated=0
apt_update() {
    if [[ $updated -eq 0 ]]; then
        echo "apt-deps: apt-get update" >&2
        "${SUDO[@]}" apt-get update -q </dev/null
        updated=1
    fi
}

# Refresh package lists when something required is missing, or when there
# are no lists at all (then optional candidates cannot be judged).
if [[ ${#missing_required[@]} -gt 0 ]] || ! have_apt_lists; then
    apt_update
fi

install() {
    "${SUDO[@]}" apt-get install "${APT_OPTS[@]}" "$@" </dev/null
}

if [[ ${#missing_required[@]} -gt 0 ]]; then
    echo "apt-deps: installing ${missing_required[*]}" >&2
    if ! install "${missing_required[@]}"; then
        # Lists may be stale (404 on a superseded .deb): refresh and retry once.
        updated=0
        apt_update
        install "${missing_required[@]}"
    fi
fi

for p in "${missing_optional[@]}"; do
    if ! has_candidate "$p"; then
        echo "apt-deps: optional package '$p' has no apt candidate here; skipping it" >&2
    elif ! install "$p"; then
        echo "apt-deps: optional package '$p' failed to install; continuing without it" >&2
    fi
done

for p in "${missing_required[@]}"; do
    if ! is_installed "$p"; then
        echo "apt-deps: required package '$p' failed to install" >&2
        exit 1
    fi
done
