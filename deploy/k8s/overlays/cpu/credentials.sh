#!/bin/sh
# Makes this overlay's credentials at random, once: the Postgres and Redis passwords and Quilt's
# secret key, written to credentials.env beside this script (git ignores it; keep it to redeploy
# with the same stores). An existing file is left as it is.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out="$here/credentials.env"
[ -e "$out" ] && { echo "$out exists; kept"; exit 0; }
random() { head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
pg=$(random) redis=$(random) key=$(random)$(random)
umask 077
cat > "$out" <<END
POSTGRES_PASSWORD=$pg
REDIS_PASSWORD=$redis
QUILT_DATABASE_URL=postgresql://quilt:$pg@quilt-postgres:5432/quilt
QUILT_REDIS_URL=redis://:$redis@quilt-redis:6379/0
QUILT_SECRET_KEY=$key
END
echo "wrote $out"
