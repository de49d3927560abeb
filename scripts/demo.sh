#!/usr/bin/env bash
# A walk through the strata engine from the command line, on a fresh store.
# Self-checking: every step verifies its outcome and the script stops with a
# non-zero exit at the first surprise. `make demo` runs it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STRATA_BIN="$PWD/.venv/bin/strata"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/strata-demo.XXXXXX")
trap '"$STRATA_BIN" serve --stop >/dev/null 2>&1; chmod -R u+w "$WORK" 2>/dev/null; rm -rf "$WORK"' EXIT
cd "$WORK"
export STRATA_STORE="$WORK/store"

if [[ -t 1 ]]; then B=$'\e[1m' D=$'\e[2m' R=$'\e[0m'; else B="" D="" R=""; fi
exec 3>&1  # the narration goes here even when a step captures stdout
step() { printf '\n%s== %s%s\n' "$B" "$*" "$R" >&3; }
show() {
    local line="$ strata" arg
    for arg in "$@"; do
        if [[ $arg =~ ^[A-Za-z0-9_./@#:=-]+$ ]]; then line+=" $arg"
        else line+=" '${arg//\'/\'\\\'\'}'"; fi
    done
    printf '%s%s%s\n' "$D" "$line" "$R" >&3
}
# Run strata, echoing the command line first (its output follows as is).
strata() { show "$@"; "$STRATA_BIN" "$@"; }
fail() { printf 'demo: FAILED: %s\n' "$*" >&2; exit 1; }
expect_eq() { [[ "$1" == "$2" ]] || fail "$3: expected '$2', got '$1'"; }

step "A fresh store in $STRATA_STORE"
strata init

step "A volume: branch 'live' starts at the empty snapshot"
strata volume create demo
strata branch list demo

step "A small project to import: code, an executable, a symlink, a hard link, an xattr"
mkdir -p project/src/app project/docs
printf 'def greet(name):\n    return f"hello, {name}"\n' > project/src/app/greet.py
printf 'from app.greet import greet\nprint(greet("world"))\n' > project/src/main.py
printf '#!/bin/sh\nexec python3 src/main.py\n' > project/run.sh
chmod 755 project/run.sh
printf '# demo project\n' > project/README.md
ln -s ../README.md project/docs/index.md
ln project/README.md project/docs/README.copy
head -c 200000 /dev/urandom > project/data.bin
setfattr_ok=1
python3 -c 'import os; os.setxattr("project/src/main.py", "user.owner", b"demo")' \
    2>/dev/null || setfattr_ok=0
find project | sort

step "Import it: one change set, one snapshot"
strata import demo project -m "import the project" | tee import.id
IMPORTED=$(cat import.id)
strata ls -l demo
expect_eq "$("$STRATA_BIN" cat demo src/app/greet.py)" "$(cat project/src/app/greet.py)" "cat"
nlink=$("$STRATA_BIN" stat demo docs/README.copy --json | python3 -c \
    'import json,sys; print(json.load(sys.stdin)["nlink"])')
expect_eq "$nlink" 2 "hard link count"

step "Fork: a new branch at the same snapshot, in constant time"
FORK_HEAD=$(strata fork demo experiment)
echo "$FORK_HEAD"
expect_eq "$FORK_HEAD" "$IMPORTED" "fork head"

step "Change the fork only: 'put' publishes a one-file change"
printf 'def greet(name):\n    return f"hi there, {name}!"\n' \
    | strata put demo@experiment src/app/greet.py -m "friendlier greeting"
strata log demo@experiment

step "A stale base: remember live's head, then let live move on"
BASE=$IMPORTED
echo "base = ${BASE:0:12}"
echo "v2 notes" | strata put demo NOTES.md -m "notes on live" >/dev/null
strata log demo -n 2

step "A writer still on the old base changes another file: replayed onto the new head"
echo "CHANGELOG from an old base" \
    | strata put demo CHANGELOG.md --base "${BASE:0:12}" -m "changelog (stale base)"
strata log demo -n 3
strata ls demo
expect_eq "$("$STRATA_BIN" cat demo NOTES.md)" "v2 notes" "replay kept live's change"
expect_eq "$("$STRATA_BIN" cat demo CHANGELOG.md)" "CHANGELOG from an old base" "replayed change"

step "Live changes src/main.py; a writer on the old base changes it too: a conflict"
printf 'from app.greet import greet\nprint(greet("live"))\n' \
    | strata put demo src/main.py -m "live edits main.py" >/dev/null
HEAD_BEFORE=$("$STRATA_BIN" log demo -n 1 --json | python3 -c \
    'import json,sys; print(json.load(sys.stdin)[0]["id"])')
set +e
printf 'from app.greet import greet\nprint(greet("stale"))\n' \
    | strata put demo src/main.py --base "${BASE:0:12}" 2> conflict.err
rc=$?
set -e
cat conflict.err
expect_eq "$rc" 3 "exit code of a conflict"
expect_eq "$(tail -n +2 conflict.err)" "src/main.py" "conflicting paths on stderr"
HEAD_AFTER=$("$STRATA_BIN" log demo -n 1 --json | python3 -c \
    'import json,sys; print(json.load(sys.stdin)[0]["id"])')
expect_eq "$HEAD_AFTER" "$HEAD_BEFORE" "nothing published on conflict"
echo "exit code $rc; live is unchanged"

step "What differs between live and the fork"
strata diff demo demo@experiment
"$STRATA_BIN" diff demo demo@experiment --json > diff.json
python3 - <<'EOF' || fail "diff between live and the fork"
import json
got = {(d["path"], d["change"]) for d in json.load(open("diff.json"))}
want = {("src/app/greet.py", "modified"), ("NOTES.md", "deleted"),
        ("CHANGELOG.md", "deleted"), ("src/main.py", "modified")}
assert got == want, got
EOF

step "Export the imported snapshot and compare it with the source"
strata export "demo#${IMPORTED:0:12}" exported
diff -r project exported || fail "the export differs from the source"
echo "diff -r project exported: identical"
expect_eq "$(stat -c %h exported/docs/README.copy)" 2 "hard link in the export"
expect_eq "$(stat -c %a exported/run.sh)" 755 "mode in the export"
expect_eq "$(stat -c %Y.%y project/src/main.py)" "$(stat -c %Y.%y exported/src/main.py)" \
    "mtime in the export"
if [[ $setfattr_ok == 1 ]]; then
    expect_eq "$(python3 -c 'import os; print(os.getxattr("exported/src/main.py",
        "user.owner").decode())')" demo "xattr in the export"
fi

step "Every record checks out"
strata fsck

printf '\n%sdemo: all steps behaved as expected%s\n' "$B" "$R"
