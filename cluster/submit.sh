#!/usr/bin/env bash
# Submit a study to a running Ray cluster (the job entrypoint is `raydp study`).
#   cluster/submit.sh cluster/paper_grid.yaml [http://head:8265]
# Ray token authentication: export RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) for the cluster's token.
# Results: RESULTS_DIR, an absolute path on storage the head mounts (default /mnt/shared/raydp/studies); the job's
# working directory is a temporary copy, so a relative path would vanish with it. Give the study file
# `storage: s3://...` (or a path every node mounts) so that trials on the workers share their outputs.
set -euo pipefail
study="${1:?usage: cluster/submit.sh STUDY_FILE [DASHBOARD_ADDRESS]}"
address="${2:-${RAY_API_SERVER_ADDRESS:-http://127.0.0.1:8265}}"
results="${RESULTS_DIR:-/mnt/shared/raydp/studies}"
case "$results" in /*) ;; *) echo "RESULTS_DIR must be absolute (got $results)" >&2; exit 2 ;; esac
exec ray job submit --address "$address" --working-dir . -- raydp study "$study" --results-dir "$results"
