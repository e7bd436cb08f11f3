# STAND-IN for gcr.io/distroless/static-debian12:nonroot, built by
# scripts/compose-smoke.sh only where no image registry answers: an image from
# scratch with what distroless static has (CA certificates, tzdata, /etc/passwd
# with root, nobody and nonroot=65532, a writable /tmp), no shell.
FROM kumiko-standin/debian:bookworm AS files
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ca-certificates tzdata \
    && mkdir -p /rootfs/etc/ssl/certs /rootfs/usr/share /rootfs/tmp /rootfs/home/nonroot \
    && cp /etc/ssl/certs/ca-certificates.crt /rootfs/etc/ssl/certs/ \
    && cp -r /usr/share/zoneinfo /rootfs/usr/share/ \
    && printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >/rootfs/etc/passwd \
    && printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' >/rootfs/etc/group \
    && chmod 1777 /rootfs/tmp && chown 65532:65532 /rootfs/home/nonroot

FROM scratch
COPY --from=files /rootfs/ /
LABEL org.kumiko.standin="gcr.io/distroless/static-debian12:nonroot stand-in: from scratch"
USER 65532:65532
WORKDIR /home/nonroot
