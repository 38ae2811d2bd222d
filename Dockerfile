# The operator image. Not built in this project's CI (its machines run no Docker engine);
# build it with `docker build -t understudy-operator .` and load it into kind with
# `kind load docker-image understudy-operator`.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p understudy-operator --bin understudy-operator

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/understudy-operator /understudy-operator
USER nonroot
ENTRYPOINT ["/understudy-operator"]
