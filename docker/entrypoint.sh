#!/bin/sh
# The training image's entrypoint: it runs the command (`maxout train ...` from MLproject) as an unprivileged user.
#
# Started as the image's user (maxout, uid 10001: the default) or any other non-root user, it just runs it.
# Started as root, which `mlflow run` against the embedded store needs (`-A user=root`, README), it first hands
# back what Docker created as root, then runs the command as the owner of the store, never as root (unless the
# store itself belongs to root):
# - `mlflow run` mounts a local SQLite store's file at /mlflow/tmp/mlruns: its owner is the user to run as;
# - it also bind-mounts the run's new artifact folder (.../<run id>/artifacts), which Docker creates on the host,
#   with any missing parent (mlruns/, the experiment's folder), as root. Those folders go to the store's owner;
#   the walk up stops at the first folder that is not root's, or that lies on another file system (the image's).
# Without a local store (a tracking server) it runs the command as maxout.
set -eu

[ "$(id -u)" = 0 ] || exec "$@"

store=/mlflow/tmp/mlruns
[ -f "$store" ] || exec setpriv --reuid=10001 --regid=10001 --clear-groups -- "$@"
uid=$(stat -c %u "$store")
gid=$(stat -c %g "$store")

suffix="/${MLFLOW_RUN_ID:-no-run}/artifacts"
for dir in $(awk -v s="$suffix" 'substr($5, length($5) - length(s) + 1) == s { print $5 }' /proc/self/mountinfo); do
    device=$(stat -c %d "$dir")
    while [ "$dir" != / ] && [ "$(stat -c %u "$dir")" = 0 ] && [ "$(stat -c %d "$dir")" = "$device" ]; do
        chown "$uid:$gid" "$dir"
        dir=$(dirname "$dir")
    done
done

[ "$uid" != 0 ] || exec "$@"
exec setpriv --reuid="$uid" --regid="$gid" --clear-groups -- "$@"
