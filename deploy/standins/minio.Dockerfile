# STAND-IN for minio/minio:latest, built by scripts/compose-smoke.sh only where
# no image registry answers. MinIO is not a Debian package; this is versitygw
# (an S3 gateway, built from its Go module) on a directory, behind the two
# commands docker-compose.yml uses: `minio server DIR` and `mc ready local`.
FROM golang:1.26-bookworm AS build
ARG GOPROXY
RUN CGO_ENABLED=0 GOBIN=/out go install github.com/versity/versitygw/cmd/versitygw@v1.8.0

FROM kumiko-standin/debian:bookworm
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends curl ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/versitygw /usr/local/bin/versitygw
COPY minio-server.sh /usr/bin/minio
COPY minio-mc.sh /usr/bin/mc
LABEL org.kumiko.standin="minio/minio:latest stand-in: versitygw v1.8.0 (S3 on a directory)"
EXPOSE 9000
ENTRYPOINT ["/usr/bin/minio"]
