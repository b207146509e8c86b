# ratekeeper container image.
#
#   docker build -t ratekeeper:0.1.0 --build-arg RATEKEEPER_COMMIT=$(git rev-parse --short HEAD) .
#   docker run --rm -p 8081:8081 -p 9090:9090 ratekeeper:0.1.0
#
# The binary is /bin/ratelimit, where envoyproxy/ratelimit's image has its
# own, so that deployments written for that image (Envoy Gateway's runs
# `command: ["/bin/ratelimit"]` with its own environment) run ratekeeper
# unchanged. The image sets no environment: every setting comes from the
# deployment (the README's flags table), nothing here can shadow
# RUNTIME_ROOT, GRPC_PORT or any other variable it sets.
#
# With no setting at all it serves the example limits in examples/config/,
# from ./config under the working directory /etc/ratekeeper (the default
# limits directory when CONFIG_DIR and every RUNTIME_* are unset). Mount your
# own directory there, or point CONFIG_DIR or RUNTIME_ROOT elsewhere.
#
# It runs as uid/gid 65534 (nobody, as Envoy Gateway's Deployment asks) and
# writes nothing to disk: a read-only root filesystem is fine.

# --- build ---------------------------------------------------------------
FROM rust:1-bookworm AS build
WORKDIR /src
# protoc comes from the protoc-bin-vendored crate (build.rs): no apt packages needed.
COPY . .
# The context has no .git: `ratekeeper --version` names the commit given here
# (else "unknown").
ARG RATEKEEPER_COMMIT=""
RUN cargo build --release --locked --bin ratekeeper \
 && install -D -m 0755 target/release/ratekeeper /out/ratelimit

# --- runtime -------------------------------------------------------------
# glibc + libgcc, no shell.
FROM gcr.io/distroless/cc-debian12
COPY --from=build /out/ratelimit /bin/ratelimit
COPY --chown=0:0 examples/config/ /etc/ratekeeper/config/
WORKDIR /etc/ratekeeper
USER 65534:65534
# 8081: gRPC (Envoy RLS v3, grpc.health.v1, reflection); 8080: HTTP (POST
# /json, GET /healthcheck, which Envoy Gateway's probes ask); 6070: the
# debug port (/rlconfig, /stats); 9090: GET /metrics.
EXPOSE 8080 8081 6070 9090
ENTRYPOINT ["/bin/ratelimit"]
