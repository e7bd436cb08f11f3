# STAND-IN for haproxy:3.0, built by scripts/compose-smoke.sh only where no
# image registry answers: Debian bookworm's HAProxy 2.6 with the official
# image's interface (config at /usr/local/etc/haproxy/haproxy.cfg, master-worker
# in the foreground, not root).
FROM kumiko-standin/debian:bookworm
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends haproxy \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /usr/local/etc/haproxy
LABEL org.kumiko.standin="haproxy:3.0 stand-in: Debian bookworm HAProxy 2.6"
USER haproxy
STOPSIGNAL SIGUSR1
CMD ["haproxy", "-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]
