#!/usr/bin/env bash
# Submit a study to a running Ray cluster (the job entrypoint is `raydp study`).
#   cluster/submit.sh trials/paper_grid.yaml [http://head:8265]
# Ray token authentication: export RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) for the cluster's token.
set -euo pipefail
study="${1:?usage: cluster/submit.sh STUDY_FILE [DASHBOARD_ADDRESS]}"
address="${2:-${RAY_API_SERVER_ADDRESS:-http://127.0.0.1:8265}}"
exec ray job submit --address "$address" --working-dir . -- raydp study "$study" --results-dir "${RESULTS_DIR:-runs/studies}"
