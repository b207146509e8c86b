# ratekeeper — `make run` starts the service, `make test` runs every test.
#
#   make run                                  in-memory store, examples/config
#   make run REDIS_URL=redis://127.0.0.1:6379  counters in Redis
#   make test                                 installs redis-server, promtool and the Python
#                                             test tools if missing, runs all tests
#   make lint                                 rustfmt + clippy -D warnings

CARGO ?= cargo
PYTHON ?= python3
VENV ?= .venv
CONFIG_DIR ?= examples/config
GRPC_ADDR ?= 0.0.0.0:8081
METRICS_ADDR ?= 0.0.0.0:9090
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run build test test-rust test-python deps redis-server python-venv promtool lint fmt clean bench soak fuzz

run:
	$(CARGO) run --release --bin ratekeeper -- \
		--config-dir $(CONFIG_DIR) --grpc-addr $(GRPC_ADDR) --metrics-addr $(METRICS_ADDR)

build:
	$(CARGO) build --release --bin ratekeeper

test: deps test-rust test-python

# --workspace: the load generator's crate (bench/) too.
test-rust:
	$(CARGO) test --workspace --all-targets

# The Python compatibility tests drive the debug binaries (built as for the
# Rust integration tests, so `make test` compiles them once).
test-python: python-venv
	$(CARGO) test --quiet --no-run --test process
	$(CARGO) build --quiet --example ws_gate
	RATEKEEPER_BIN=$(CURDIR)/target/debug/ratekeeper PROMTOOL=$(PROMTOOL) $(VENV)/bin/python -m pytest tests/python -q

deps: redis-server python-venv promtool

# redis-server (with redis-cli, for the cluster tests) and openssl (the TLS
# test makes throwaway certificates).
redis-server:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null && command -v openssl >/dev/null || { \
		echo "installing redis-server redis-tools openssl"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server redis-tools openssl >/dev/null; }
	@redis-server --version

python-venv: $(VENV)/.installed

# promtool (Prometheus' rule checker and rule unit tester: the chart's
# alerts), taken out of Debian's prometheus package rather than installing
# it, so no Prometheus server is set up or started.
PROMTOOL ?= $(or $(shell command -v promtool 2>/dev/null),$(CURDIR)/.tools/promtool)

promtool: $(PROMTOOL)

$(CURDIR)/.tools/promtool:
	@echo "extracting promtool from Debian's prometheus package"
	@rm -rf .tools/deb && mkdir -p .tools/deb
	cd .tools/deb && { apt-get download prometheus >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && apt-get download prometheus; }; } \
		&& dpkg-deb -x prometheus_*.deb root
	cp .tools/deb/root/usr/bin/promtool $@ && rm -rf .tools/deb
	@$@ --version | head -1

$(VENV)/.installed: tests/python/requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r tests/python/requirements.txt
	touch $@

# Starts its own redis-server and ratekeeper processes on free loopback
# ports; BENCH_SECONDS (default 5) and the other BENCH_* variables in
# bench/run.sh tune it.
bench:
	bench/run.sh

# Not in CI: SOAK_SECONDS (default 600) of mixed load on two ratekeeper
# replicas sharing one Redis (its own redis-server primary and replica
# behind bench/forwarder.py), with a reload every 10 s, Redis killed and
# restarted at 50% and failed over behind the address at 70%; writes the
# "Soak run" section of BENCHMARKS.md (SOAK_OUT=- prints it only). The other
# SOAK_* variables are in bench/soak.sh.
soak:
	bench/soak.sh

# The no-panic property tests (limits parser, request path, random bytes on
# the gRPC port, key injectivity) with many more cases than `make test`.
FUZZ_CASES ?= 100000
fuzz:
	PROPTEST_CASES=$(FUZZ_CASES) $(CARGO) test --release --test robustness --test properties

# Supply chain: licenses, banned crates and sources (deny.toml). cargo-deny
# is built from crates.io the first time (a few minutes).
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	@command -v cargo-deny >/dev/null || $(CARGO) install cargo-deny --locked
	cargo deny check licenses bans sources

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
	rm -rf $(VENV) .tools
