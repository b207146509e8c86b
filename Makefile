# ratekeeper — `make run` starts the service, `make test` runs every test.
#
#   make run                                  in-memory store, examples/config
#   make run REDIS_URL=redis://127.0.0.1:6379  counters in Redis
#   make test                                 installs redis-server and the Python
#                                             test tools if missing, runs all tests
#   make lint                                 rustfmt + clippy -D warnings

CARGO ?= cargo
PYTHON ?= python3
VENV ?= .venv
CONFIG_DIR ?= examples/config
GRPC_ADDR ?= 0.0.0.0:8081
METRICS_ADDR ?= 0.0.0.0:9090
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run build test test-rust test-python deps redis-server python-venv lint fmt clean

run:
	$(CARGO) run --release --bin ratekeeper -- \
		--config-dir $(CONFIG_DIR) --grpc-addr $(GRPC_ADDR) --metrics-addr $(METRICS_ADDR)

build:
	$(CARGO) build --release --bin ratekeeper

test: deps test-rust test-python

test-rust:
	$(CARGO) test --all-targets

# The Python compatibility tests drive the debug binary (built as for the
# Rust integration tests, so `make test` compiles it once).
test-python: python-venv
	$(CARGO) test --quiet --no-run --test process
	RATEKEEPER_BIN=$(CURDIR)/target/debug/ratekeeper $(VENV)/bin/python -m pytest tests/python -q

deps: redis-server python-venv

redis-server:
	@command -v redis-server >/dev/null || { \
		echo "installing redis-server"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server >/dev/null; }
	@redis-server --version

python-venv: $(VENV)/.installed

$(VENV)/.installed: tests/python/requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r tests/python/requirements.txt
	touch $@

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
	rm -rf $(VENV)
