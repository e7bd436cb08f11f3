# Build: a static binary (no cgo), so the runtime image needs no libc.
FROM golang:1.26-bookworm AS build
WORKDIR /src
# The module proxy to use (e.g. --build-arg GOPROXY="$(go env GOPROXY)");
# empty means Go's default. No `# syntax=` line: BuildKit then uses its
# built-in Dockerfile frontend and builds offline when the base images exist.
ARG GOPROXY
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" -o /out/kumiko-lifecycle-demo .

# Run: distroless static, non-root. No shell and no curl: the binary's own
# `healthcheck` command probes readiness. tzdata is embedded in the binary.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/kumiko-lifecycle-demo /kumiko-lifecycle-demo
# Numeric, not nonroot:nonroot: the kubelet can only enforce the Deployment's
# runAsNonRoot against a numeric user ("image has non-numeric user (nonroot),
# cannot verify user is non-root" otherwise). 65532 is distroless's nonroot.
USER 65532:65532
EXPOSE 8080 9090
# SIGTERM starts the drain (readiness 503, linger, in-flight wait, release);
# a second SIGTERM forces exit 1.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=5s --timeout=3s --start-period=120s --retries=3 CMD ["/kumiko-lifecycle-demo", "healthcheck"]
ENTRYPOINT ["/kumiko-lifecycle-demo"]
CMD ["serve"]
