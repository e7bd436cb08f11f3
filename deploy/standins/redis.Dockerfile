# STAND-IN for redis:7, built by scripts/compose-smoke.sh only where no image
# registry answers: Debian bookworm's redis-server 7.0 and redis-cli, run like
# the official image without a config file (all interfaces, no protected mode).
FROM kumiko-standin/debian:bookworm
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data
LABEL org.kumiko.standin="redis:7 stand-in: Debian bookworm redis-server 7.0"
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--dir", "/data"]
