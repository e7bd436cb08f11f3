# STAND-IN for postgres:16, built by scripts/compose-smoke.sh only where no
# image registry answers. It is Debian bookworm's PostgreSQL 15, not 16, with
# the official image's interface as docker-compose.yml uses it:
# POSTGRES_USER/POSTGRES_PASSWORD/POSTGRES_DB, port 5432, pg_isready.
FROM kumiko-standin/debian:bookworm
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql-15 \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /var/run/postgresql && chown postgres:postgres /var/run/postgresql
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
LABEL org.kumiko.standin="postgres:16 stand-in: Debian bookworm PostgreSQL 15"
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]
