#!/bin/sh
# The training image's entrypoint: it runs the command (`maxout train ...` from MLproject) as whoever owns the
# store it writes to. The pattern of the official postgres image: started as root (the image's default, so that
# `mlflow run .` needs no `-A user=...`), it hands the folders the job writes to the user it will run as, then drops
# to that user (setpriv) before anything else runs. Started as any other user (`-A user=...`), it just runs.
#
# Who the job runs as, when started as root:
# - with the embedded store: the owner of the store. `mlflow run` mounts a local SQLite store's file at
#   /mlflow/tmp/mlruns; everything the job adds to the store (rows, the run's artifacts) stays that user's. Where
#   that owner is root, the job stays root: nothing is dropped and nothing handed over, because root's files are
#   what the store already holds. Two cases give a root-owned store:
#   - a user working as root (a GPU cloud container's shell, Colab, a CI runner, a box of one's own);
#   - rootless Docker, where the invoking user's own files show up in the container as uid 0, and the container's
#     root is that user on the host: the files the job adds belong to the invoking user there.
# - without one (a tracking server): maxout, uid 10001, the image's unprivileged user.
# What it hands to that user first (a user other than root):
# - the run's artifact folder (.../<run id>/artifacts), which `mlflow run` bind-mounts and Docker creates on the
#   host, with any missing parent (mlruns/, the experiment's folder), as root. The walk up stops at the first
#   folder that is not root's, or that lies on another file system (the image's).
# - the named volumes MLproject mounts: the job's state (MAXOUT_STATE_DIR) and the Hugging Face cache (HF_HOME),
#   whatever an earlier run as another user left in them (find ! -user, like postgres's entrypoint).
set -eu

# MLproject passes HF_TOKEN and HF_ENDPOINT by name; an empty one would mean "no endpoint" to huggingface_hub.
[ -n "${HF_TOKEN-}" ] || unset HF_TOKEN
[ -n "${HF_ENDPOINT-}" ] || unset HF_ENDPOINT

[ "$(id -u)" = 0 ] || exec "$@"

store=/mlflow/tmp/mlruns
uid=10001
gid=10001
if [ -f "$store" ]; then
    uid=$(stat -c %u "$store")
    gid=$(stat -c %g "$store")
fi
# The store is root's: the job runs as root, the store's owner (see above).
[ "$uid" != 0 ] || exec "$@"

suffix="/${MLFLOW_RUN_ID:-no-run}/artifacts"
for dir in $(awk -v s="$suffix" 'substr($5, length($5) - length(s) + 1) == s { print $5 }' /proc/self/mountinfo); do
    device=$(stat -c %d "$dir")
    while [ "$dir" != / ] && [ "$(stat -c %u "$dir")" = 0 ] && [ "$(stat -c %d "$dir")" = "$device" ]; do
        chown "$uid:$gid" "$dir"
        dir=$(dirname "$dir")
    done
done

for volume in "${MAXOUT_STATE_DIR:-/var/lib/maxout}" "${HF_HOME:-/var/cache/huggingface}"; do
    [ ! -d "$volume" ] || find "$volume" ! -user "$uid" -exec chown -h "$uid:$gid" {} +
done

exec setpriv --reuid="$uid" --regid="$gid" --clear-groups -- "$@"
