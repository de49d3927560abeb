#!/usr/bin/env bash
# strata's story from the command line, on a fresh store: steps that run in a
# sandbox as transactions over a volume. A clone that lands, a failure that
# leaves no trace, three forks changed three ways, two steps that collide on
# one file. Self-checking: every step verifies its outcome and the script stops
# with a non-zero exit at the first surprise. `make demo` runs it.
#
# Steps run under bubblewrap (DEMO_SANDBOX=none|bwrap|gvisor to choose; without
# bwrap they run with no sandbox). Inside, each volume is at $STRATA_STORAGE/NAME.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STRATA_BIN="$PWD/.venv/bin/strata"

# Not under /tmp: a sandbox gets a private /tmp, and the steps read the upstream repo.
WORK=$(mktemp -d /var/tmp/strata-demo.XXXXXX)
cleanup() {
    "$STRATA_BIN" serve --stop >/dev/null 2>&1 || true
    grep -o " $WORK[^ ]*" /proc/self/mountinfo 2>/dev/null | sort -r \
        | xargs -r -n1 umount -l 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT
cd "$WORK"
export STRATA_STORE="$WORK/store" STRATA_SCRATCH="$WORK/scratch"
SANDBOX=${DEMO_SANDBOX:-bwrap}
if [[ $SANDBOX == bwrap ]] && ! command -v bwrap >/dev/null; then
    echo "demo: bwrap is not installed; steps run with --sandbox none" >&2
    SANDBOX=none
fi
GIT="git -c user.name=Demo -c user.email=demo@example.com -c init.defaultBranch=main"

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
# Assign the result (VAR=$(...)) so that set -e stops the script if these fail.
head_of() { "$STRATA_BIN" log "$1" -n 1 --json | python3 -c \
    'import json, sys; print(json.load(sys.stdin)[0]["id"])'; }
diff_paths() {  # "M:path A:path D:path", sorted
    "$STRATA_BIN" diff "$1" "$2" --json | python3 -c 'import json, sys
print(" ".join(sorted(d["change"][0].upper() + ":" + d["path"] for d in json.load(sys.stdin))))'
}

step "A fresh store, one volume, steps run with --sandbox $SANDBOX"
strata init
strata volume create app

step "An upstream git repository to work on (generated locally)"
mkdir upstream && cd upstream
$GIT init -q .
printf 'def greet(name):\n    return f"hello, {name}"\n' > greet.py
printf 'from greet import greet\nassert greet("x") == "hello, x"\nprint("tests pass")\n' \
    > test_greet.py
printf '# greet\nA tiny project.\n' > README.md
mkdir docs && printf 'Usage: greet(name)\n' > docs/usage.md
$GIT add -A && $GIT commit -q -m "first version"
printf 'VERSION = "1.0"\n' > version.py
$GIT add -A && $GIT commit -q -m "add a version"
$GIT log --oneline
cd "$WORK"

step "Step 1: clone it into the volume and run its tests; exit 0 publishes"
strata run --sandbox "$SANDBOX" -v app -m "clone upstream, run its tests" -- sh -c \
    'git clone -q "$1" "$STRATA_STORAGE/app" && cd "$STRATA_STORAGE/app" && python3 test_greet.py' \
    clone "$WORK/upstream"
strata log app
strata ls app
CLONED=$(head_of app)
expect_eq "$("$STRATA_BIN" cat app greet.py)" "$(cat upstream/greet.py)" "cloned file"
git_dir=$("$STRATA_BIN" ls app .git)
grep -qx HEAD <<< "$git_dir" || fail "the clone has no .git/HEAD"

step "Step 2: a step breaks things and fails (exit 1): nothing is published"
set +e
strata run --sandbox "$SANDBOX" -v app -m "break things" -- sh -c \
    'cd "$STRATA_STORAGE/app" && rm -r docs && echo "def greet(name): return 42" > greet.py &&
     echo "changed: $(git --no-optional-locks status --short | tr "\n" " ")" && python3 test_greet.py'
rc=$?
set -e
expect_eq "$rc" 1 "exit status of the failing step"
now=$(head_of app)
expect_eq "$now" "$CLONED" "the branch head after a failed step"
strata diff "app#${CLONED:0:12}" app
d=$(diff_paths "app#$CLONED" app)
expect_eq "$d" "" "diff after a failed step"
echo "exit status $rc; live is still ${CLONED:0:12}, the diff is empty: the failure left no trace"

step "Three forks of the same snapshot, each changed differently by its own step (at once)"
for name in try-a try-b try-c; do strata fork app "$name"; done
run_bg() {  # run a step in the background, narrating it first
    local ref=$1 msg=$2 script=$3
    show run --sandbox "$SANDBOX" -v "$ref" -m "$msg" -- sh -c "$script"
    "$STRATA_BIN" run --sandbox "$SANDBOX" -v "$ref" -m "$msg" -- sh -c "$script" \
        > "out.${ref#*@}" 2>&1 &
}
run_bg app@try-a "say hi, not hello" 'cd "$STRATA_STORAGE/app" && sed -i "s/hello/hi/" greet.py test_greet.py &&
    python3 test_greet.py'
run_bg app@try-b "add shout()" 'cd "$STRATA_STORAGE/app" &&
    printf "def shout(name):\n    return name.upper()\n" > shout.py'
run_bg app@try-c "version 2.0 without docs" 'cd "$STRATA_STORAGE/app" && rm -r docs && echo "VERSION = \"2.0\"" > version.py'
for job in $(jobs -p); do wait "$job" || fail "a fork step failed: $(cat out.*)"; done
cat out.try-a out.try-b out.try-c
strata diff app@try-a app@try-b
strata diff app@try-b app@try-c
d=$(diff_paths app app@try-a); expect_eq "$d" "M:greet.py M:test_greet.py" "try-a's change"
d=$(diff_paths app app@try-b); expect_eq "$d" "A:shout.py" "try-b's change"
d=$(diff_paths app app@try-c); expect_eq "$d" "D:docs D:docs/usage.md M:version.py" "try-c"
now=$(head_of app)
expect_eq "$now" "$CLONED" "live after the fork steps"
echo "live is untouched; each fork holds only its own change"

step "Two steps change version.py at the same time: one lands, the other gets a conflict"
# Both pin live's head at start and write after a pause, so neither sees the other.
COLLIDE='sleep 2; echo "VERSION = \"$1\"" > "$STRATA_STORAGE/app/version.py"'
collide() {
    local rc=0
    show run --sandbox "$SANDBOX" -v app -m "version $1" -- sh -c "$COLLIDE" step "$1"
    "$STRATA_BIN" run --sandbox "$SANDBOX" -v app -m "version $1" -- sh -c "$COLLIDE" step "$1" \
        > "collide.$1.out" 2> "collide.$1.err" || rc=$?
    echo "$rc" > "collide.$1.rc"
}
collide 1.1 & collide 1.2 & wait
rcs="$(cat collide.1.1.rc) $(cat collide.1.2.rc)"
case "$rcs" in
    "0 3") WON=1.1 LOST=1.2 ;;
    "3 0") WON=1.2 LOST=1.1 ;;
    *) fail "expected one step to publish and one to conflict, got exit statuses $rcs" ;;
esac
echo "step $WON: exit 0 (published); step $LOST: exit 3, its stderr:"
cat "collide.$LOST.err"
expect_eq "$(tail -n +2 "collide.$LOST.err")" "version.py" "the conflicting path"
REJECTED=$(grep -o 'rejected/[0-9a-f]*' "collide.$LOST.err") || fail "no rejected/<run-id> named"
live_version=$(strata cat app version.py)
echo "$live_version"
expect_eq "$live_version" "VERSION = \"$WON\"" "live's version.py"
echo "the refused change set is kept on $REJECTED, forked from the snapshot it started on:"
strata diff "app#${CLONED:0:12}" "app@$REJECTED"
d=$(diff_paths "app#$CLONED" "app@$REJECTED")
expect_eq "$d" "M:version.py" "the rejected change set"
rejected_version=$(strata cat "app@$REJECTED" version.py)
echo "$rejected_version"
expect_eq "$rejected_version" "VERSION = \"$LOST\"" "the rejected change"

step "The history: every successful step is one snapshot; the failed one is not there"
strata log app
strata branch list app
strata diff "app#${CLONED:0:12}" app
d=$(diff_paths "app#$CLONED" app); expect_eq "$d" "M:version.py" "live since the clone"
n=$("$STRATA_BIN" log app --json | python3 -c 'import json, sys; print(len(json.load(sys.stdin)))')
expect_eq "$n" 3 "snapshots on live (the empty root, the clone, the winning step)"

step "Export live and ask git: the clone is a working repository with its history"
strata export app exported
(cd exported && $GIT log --oneline && $GIT --no-optional-locks status --short)
expect_eq "$(cd exported && $GIT log --format=%s | head -1)" "add a version" "git log"
expect_eq "$(cd exported && $GIT --no-optional-locks status --short)" " M version.py" "git status"

step "Every record checks out; nothing is left mounted; stop the server"
strata fsck
left=$(grep -c " $WORK" /proc/self/mountinfo || true)
expect_eq "$left" 0 "mounts left under $WORK"
expect_eq "$(find "$STRATA_SCRATCH" -mindepth 1 -maxdepth 1 | wc -l)" 0 "scratch left behind"
strata serve --stop

printf '\n%sdemo: all steps behaved as expected%s\n' "$B" "$R"
