# ratekeeper container image.
#
#   docker build -t ratekeeper:0.1.0 --build-arg RATEKEEPER_COMMIT=$(git rev-parse --short HEAD) .
#   docker run --rm -p 8081:8081 -p 9090:9090 ratekeeper:0.1.0
#
# The image serves the example limits in examples/config/ from
# /etc/ratekeeper/limits; mount your own directory (or the Helm chart's
# ConfigMap) there. Configure it with the env vars in the README's flags table
# (e.g. -e REDIS_URL=redis://redis:6379).

# --- build ---------------------------------------------------------------
FROM rust:1-bookworm AS build
WORKDIR /src
# protoc comes from the protoc-bin-vendored crate (build.rs): no apt packages needed.
COPY . .
# The context has no .git: `ratekeeper --version` names the commit given here
# (else "unknown").
ARG RATEKEEPER_COMMIT=""
RUN cargo build --release --locked --bin ratekeeper \
 && install -D -m 0755 target/release/ratekeeper /out/ratekeeper

# --- runtime -------------------------------------------------------------
# glibc + libgcc, no shell, runs as uid/gid 65532 ("nonroot").
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/ratekeeper /usr/local/bin/ratekeeper
COPY --chown=0:0 examples/config/ /etc/ratekeeper/limits/
ENV CONFIG_DIR=/etc/ratekeeper/limits \
    GRPC_ADDR=0.0.0.0:8081 \
    METRICS_ADDR=0.0.0.0:9090
USER 65532:65532
# 8081: gRPC (Envoy RLS v3, grpc.health.v1, reflection); 9090: GET /metrics.
EXPOSE 8081 9090
ENTRYPOINT ["/usr/local/bin/ratekeeper"]
