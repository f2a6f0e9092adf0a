#!/bin/sh
# Rendered by gatewayctl from the gateway config (envoy.hot_restart); edit that and re-render.
# One epoch of the standalone Envoy. hot-restarter.py runs this with RESTART_EPOCH=0 at start and
# with the next epoch on each SIGHUP (systemctl reload llm-gateway-envoy): the new Envoy takes the
# listeners' sockets and the stats over from the running one through the domain sockets and shared
# memory of --base-id, the running one drains its listeners for --drain-time-s and exits after
# --parent-shutdown-time-s, cutting what it still serves then. Every epoch needs the same --base-id.
# Further arguments are Envoy's (hot-restarter.py checks each new epoch's config with --mode validate).
set -eu
exec ${ENVOY_BIN} -c ${CONFIG} \
  --restart-epoch "$${RESTART_EPOCH:?set by hot-restarter.py}" \
  --base-id ${BASE_ID} \
  --drain-time-s ${DRAIN_TIME_S} \
  --parent-shutdown-time-s ${PARENT_SHUTDOWN_TIME_S} \
  --concurrency ${CONCURRENCY} \
  "$$@"
