#!/usr/bin/env bash
# N `vllm serve` replicas on loopback ports behind vLLM's router (docs/router.md).
#
#   examples/router/serve_replicas.sh --replicas 2 --policy consistent_hash --port 8000 -- \
#       --scheduling-policy continuum --num-gpu-blocks-override 512
#
# Arguments before `--` go to the launcher (python -m vllm.benchmarks.router --help), the
# rest to every `vllm serve`. A job is routed and pinned by the same id: send it as the
# X-Session-ID header (what consistent_hash hashes) and as job_id. Ctrl-C stops the router
# and every replica (each runs in a process group of its own, ended as a whole).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
exec "$PY" -m vllm.benchmarks.router "$@"
