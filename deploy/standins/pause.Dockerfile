# STAND-IN for registry.k8s.io/pause:3.10, built by scripts/k8s-smoke.sh only
# where no image registry answers: deploy/standins/pause/main.go (wait for a
# signal, reap children), a static binary from scratch, as the real image is.
FROM golang:1.26-bookworm AS build
COPY main.go /src/main.go
RUN cd /src && CGO_ENABLED=0 GOTOOLCHAIN=local go build -trimpath -ldflags "-s -w" -o /pause main.go

FROM scratch
COPY --from=build /pause /pause
LABEL org.kumiko.standin="registry.k8s.io/pause:3.10 stand-in: deploy/standins/pause/main.go"
USER 65535:65535
ENTRYPOINT ["/pause"]
