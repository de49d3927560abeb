#!/bin/sh
# Commit a file per commit, with git's own fsyncs on; report each commit after it returns.
set -e
mkdir -p "$1" && cd "$1"
[ -d .git ] || git init -q .
rm -f .git/index.lock .git/HEAD.lock .git/refs/heads/*.lock  # left by the lost host
git config core.fsync all
git config core.fsyncMethod fsync
git config user.email t@t && git config user.name t
sync -f .  # git init and git config do not fsync (on a local disk neither)
i=$(git rev-list --count HEAD 2>/dev/null || echo 0)
while :; do
  i=$((i + 1))
  head -c 20000 /dev/urandom > "f$((i % 50))"
  git add -A
  git commit -qm "c$i"
  echo "$(git rev-parse HEAD)"
done
