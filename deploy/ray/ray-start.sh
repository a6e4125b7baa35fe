#!/usr/bin/env bash
# Sessions on a Ray cluster of bare machines (deploy/README.md "Sessions on a Ray cluster").
# Every machine: the same Python, and difftape with its extras in the same place
#   python3 -m venv /opt/difftape && /opt/difftape/bin/pip install '/path/to/checkout[server,postgres,ray]'
#   (add `cuda` on GPU machines). Then, on each machine, one of:
#
#   ray-start.sh head                   the head (schedules no engine: --num-cpus 0)
#   ray-start.sh worker HEAD_HOST       an engine node: its CPUs and GPUs join the cluster
#   ray-start.sh gateway                a gateway on a node of the cluster (the head, or a
#                                       node of its own joined with `worker`): a Ray driver
#                                       there (--cluster auto), so field data moves through
#                                       that node's object store, not through Ray Client
#   ray-start.sh stop                   leave the cluster
#
# Settings the gateways share (every gateway, same values): DIFFTAPE_DATABASE_URL
# (postgresql://...), DIFFTAPE_SESSIONS_DIR (a directory every gateway mounts: NFS, CephFS),
# DIFFTAPE_CHECKPOINT_S; per gateway: DIFFTAPE_DATA_DIR (a local disk) and
# DIFFTAPE_GATEWAY_URL (http://this-host:8000). Ports: 6379 (GCS) and the nodes' Ray ports
# between the machines; 8000 from the load balancer to the gateways.
set -euo pipefail
PREFIX=${VENV:-/opt/difftape}
RAY_PORT=${RAY_PORT:-6379}
export PATH="$PREFIX/bin:$PATH"

case "${1:-}" in
    head)
        ray start --head --port="$RAY_PORT" --num-cpus=0 --dashboard-host=127.0.0.1
        ;;
    worker)
        host=${2:?usage: ray-start.sh worker HEAD_HOST}
        # CPUs and GPUs are detected; --num-gpus=N or --resources='{...}' to say otherwise.
        ray start --address="$host:$RAY_PORT"
        ;;
    gateway)
        : "${DIFFTAPE_DATABASE_URL:?set DIFFTAPE_DATABASE_URL=postgresql://...}"
        : "${DIFFTAPE_SESSIONS_DIR:?set DIFFTAPE_SESSIONS_DIR to a directory every gateway mounts}"
        exec difftape serve --host 0.0.0.0 --cluster auto
        ;;
    stop)
        ray stop
        ;;
    *)
        sed -n '2,20p' "$0"
        exit 2
        ;;
esac
