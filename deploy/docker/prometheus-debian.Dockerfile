# Prometheus from Debian's package, for machines where prom/prometheus cannot be pulled (a private
# registry mirror missing, no registry access): the same command line and data folder as the
# upstream image, so compose.yaml runs it unchanged. scripts/compose_check.sh builds it there:
#
#   docker build -f deploy/docker/prometheus-debian.Dockerfile -t relayrl-local/prometheus:debian \
#       --build-arg BASE_IMAGE=debian:bookworm-slim deploy/docker
#   PROMETHEUS_IMAGE=relayrl-local/prometheus:debian docker compose up -d
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus /etc/prometheus \
 && chown nobody:nogroup /prometheus
# The upstream image runs as nobody with its data in /prometheus; a new named volume mounted there
# takes this ownership.
USER nobody
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
