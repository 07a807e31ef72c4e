#!/bin/sh
# The training image's entrypoint: it runs the command (`maxout train ...` from MLproject) as an unprivileged user,
# never as root. The pattern of the official postgres image: started as root (the image's default, so that
# `mlflow run .` needs no `-A user=...`), it hands the folders the job writes to the user it will run as, then drops
# to that user (setpriv) before anything else runs. Started as any other user (`-A user=...`), it just runs.
#
# Who the job runs as, when started as root:
# - with the embedded store: the owner of the store. `mlflow run` mounts a local SQLite store's file at
#   /mlflow/tmp/mlruns; everything the job adds to the store (rows, the run's artifacts) stays that user's.
# - without one (a tracking server): maxout, uid 10001, the image's unprivileged user.
# What it hands to that user first:
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
if [ "$uid" = 0 ]; then
    echo "maxout: error: the local MLflow store mounted at $store belongs to root, and this image never trains as" \
         "root: run mlflow run as the ordinary user who owns mlflow.db (chown it to that user first)" >&2
    exit 2
fi

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
