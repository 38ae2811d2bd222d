# syntax=docker/dockerfile:1
# understudy's images, one target per binary:
#
#   docker build --target operator -t understudy-operator .
#   docker build --target router   -t understudy-router .    # the gateway and the fence sidecar
#   docker build --target prober   -t understudy-prober .    # probes, parity, the GPU agent
#   docker build --target emulator -t vllm-emulator .        # a drop-in for `vllm serve`, no GPU
#
# Each build stage runs the same `cargo build --locked -p PACKAGE --bin BINARY` that CI and
# tests/cluster/e2e.sh run, with --release. BuildKit builds only the stages a target needs. The
# runtime images are distroless (glibc, no shell, no package manager) and run as the nonroot user
# (65532); the chart also runs them with a read-only root filesystem: none of them writes outside
# what it is given. Not built in this project's CI, whose machines run no Docker engine.

FROM rust:1.95-bookworm AS source
WORKDIR /src
COPY . .

FROM source AS build-operator
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    cargo build --release --locked -p understudy-operator --bin understudy-operator

FROM source AS build-router
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    cargo build --release --locked -p understudy-router --bin understudy-router

FROM source AS build-prober
# NVML is opened at run time (the nvml feature, on by default): the image carries no NVIDIA
# library; the NVIDIA container runtime mounts libnvidia-ml.so.1 into the agent's pod.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    cargo build --release --locked -p understudy-prober --bin understudy-prober

FROM source AS build-emulator
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    cargo build --release --locked -p understudy-emulator --bin vllm-emulator

FROM gcr.io/distroless/cc-debian12:nonroot AS operator
COPY --from=build-operator /src/target/release/understudy-operator /usr/local/bin/understudy-operator
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/understudy-operator"]

FROM gcr.io/distroless/cc-debian12:nonroot AS router
COPY --from=build-router /src/target/release/understudy-router /usr/local/bin/understudy-router
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/understudy-router"]

FROM gcr.io/distroless/cc-debian12:nonroot AS prober
COPY --from=build-prober /src/target/release/understudy-prober /usr/local/bin/understudy-prober
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/understudy-prober"]

FROM gcr.io/distroless/cc-debian12:nonroot AS emulator
COPY --from=build-emulator /src/target/release/vllm-emulator /usr/local/bin/vllm-emulator
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/vllm-emulator"]
