#!/usr/bin/env bash
# Runs a command the way the rendered engine container runs, without a container runtime:
#   run-as-engine-container.sh UID HOME [--model DIR] -- COMMAND...
# uid and gid UID (non-root), no capabilities (effective, inherited or bounding), no_new_privs,
# the root filesystem read-only, and only HOME, /tmp and /dev/shm writable (the pod's emptyDirs).
# Needs root and util-linux (unshare, setpriv); everything happens in a private mount namespace:
#   unshare -m --propagation private scripts/run-as-engine-container.sh 1000 /home/vllm -- ...
# /root is 0700 here, so the interpreter's trees under it are bind-mounted onto a fresh /root.
# --model DIR shows DIR read-only at /mnt/model, as the pod's model volume: the checkout may lie
# under /tmp or /root, which the container does not see.
set -euo pipefail
uid=$1 home=$2
shift 2
model=
if [[ ${1:-} == --model ]]; then
    model=$2
    shift 2
fi
[[ ${1:-} == -- ]] && shift
mount -t tmpfs tmpfs /mnt  # staging, private to this namespace
stage=/mnt/stage
if [[ -n $model ]]; then
    mkdir -p /mnt/model
    mount --bind "$model" /mnt/model
    mount -o remount,bind,ro /mnt/model
fi
for tree in /root/.pyenv /root/.cache/tandem; do
    [[ -d $tree ]] || continue
    mkdir -p "$stage$tree"
    mount --bind "$tree" "$stage$tree"
done
mount -t tmpfs -o mode=755 tmpfs /root
for tree in /root/.pyenv /root/.cache/tandem; do
    [[ -d $stage$tree ]] || continue
    mkdir -p "$tree"
    mount --bind "$stage$tree" "$tree"
done
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=755 tmpfs "$(dirname "$home")"
mkdir -p "$home"
mount -t tmpfs -o "mode=700,uid=$uid,gid=$uid" tmpfs "$home"
mount -o remount,bind,ro /
cd "$home"
export HOME=$home
exec setpriv --reuid="$uid" --regid="$uid" --clear-groups --no-new-privs \
    --inh-caps=-all --bounding-set=-all "$@"
