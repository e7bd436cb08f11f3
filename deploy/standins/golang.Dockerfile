# STAND-IN for golang:1.26-bookworm, built by scripts/compose-smoke.sh only
# where no image registry answers: the host's own Go toolchain (the build
# context is its GOROOT) on Debian bookworm with git and CA certificates.
FROM kumiko-standin/debian:bookworm
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ca-certificates git \
    && rm -rf /var/lib/apt/lists/*
COPY . /usr/local/go
ENV PATH=/go/bin:/usr/local/go/bin:$PATH GOPATH=/go GOTOOLCHAIN=local
LABEL org.kumiko.standin="golang:1.26-bookworm stand-in: the host's Go toolchain on Debian bookworm"
WORKDIR /go
