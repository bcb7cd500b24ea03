# kvgate — every target creates or reuses .venv by itself.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
SUM     := $(shell cksum < pyproject.toml | cut -d' ' -f1)
RUN_STAMP := $(VENV)/.installed-run-$(SUM)
DEV_STAMP := $(VENV)/.installed-dev-$(SUM)
PIP     := $(PY) -m pip install --quiet --disable-pip-version-check
ARGS    ?=

.DEFAULT_GOAL := help
.PHONY: help run test lint typecheck proto tokenizer helm bench audit clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

# xds-protos (a runtime dependency: the endpoint picker) ships older copies of opentelemetry-proto's
# generated modules over the real ones (tracing's OTLP exporter then fails to import): every install
# puts opentelemetry-proto's own files back
define install
	$(PIP) -e '$(1)'
	$(PIP) --no-deps --force-reinstall \
	  "opentelemetry-proto==$$($(PY) -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
endef

# `make run` needs only what running needs; test, lint and the tools add the dev set on top
# setup.py builds cachemap/_native (Cython) where it can: a change to its source installs again
$(RUN_STAMP): pyproject.toml setup.py cachemap/_native.pyx cachemap/_murmur3.h
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(call install,.)
	@rm -f $(VENV)/.installed-run-* && touch $@

$(DEV_STAMP): $(RUN_STAMP)
	$(call install,.[dev])
	@rm -f $(VENV)/.installed-dev-* && touch $@

run: $(RUN_STAMP) ## 4 simulated engines + the gateway + the agent working day per policy (ARGS=--once to exit)
	$(VENV)/bin/kvgate demo $(ARGS)

# the suite starts many gateways and engines in subprocesses: compiling the packages once
# first spares each of them compiling its imports again where PYTHONDONTWRITEBYTECODE is set (as
# on this machine kind; Python still reads the files): ~6-10% of an e2e module's time
# the console's tests drive a real headless browser: Debian's Chromium and its driver
BROWSER := /usr/bin/chromedriver
$(BROWSER):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver

# three workers (pytest-xdist) on this 2-core machine: the e2e files spend much of their time
# waiting on their servers' sockets and simulated engines, so a third worker fills CPU the
# two left idle; each takes whole test files (--dist loadfile: a module's fixtures and servers
# stay on one worker) in the order tests/conftest.py collects them, the files that
# start servers first (--no-loadscope-reorder: xdist 3.6+ otherwise hands the files out by their
# number of tests, most first, and the few-test minutes-long files came last); TEST_WORKERS=0
# runs it in one process
TEST_WORKERS ?= 3
test: $(DEV_STAMP) $(BROWSER) ## the test suite (starts its own engines and servers on loopback)
	$(PY) -m compileall -q -j0 kvgate_cli.py cachemap gateway loadgen router tools
	$(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(ARGS)
	@# cachemap's tests again on the pure-Python forms, where the compiled module is built
	$(if $(wildcard cachemap/_native*.so),KVGATE_PURE=1 $(PY) -m pytest -q -n $(TEST_WORKERS) tests/cachemap)

lint: $(DEV_STAMP) ## ruff format --check and ruff check
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

typecheck: $(DEV_STAMP) ## mypy --strict on the packages
	$(VENV)/bin/mypy

proto: $(DEV_STAMP) ## regenerate the gRPC stubs (gateway/api/grpc/_pb, loadgen/_pb) from proto/; fails if they drifted
	$(PY) -m tools.protogen

tokenizer: $(DEV_STAMP) ## rebuild the simulated engine's tokenizer (loadgen/engine/model/) from its generated corpus
	$(PY) -m tools.build_tokenizer

helm: $(DEV_STAMP) ## the chart: schema drift, helm lint --strict, helm template, kubernetes-validate --strict
	$(PY) -m tools.chart check

bench: $(DEV_STAMP) ## the gateway's CPU time per proxied request
	$(VENV)/bin/kvgate bench-cpu $(ARGS)

audit: $(DEV_STAMP) ## the Gu et al. timing audit: through kvgate (PASS) and at a bare engine (FAIL)
	$(VENV)/bin/kvgate audit-demo $(ARGS)

clean: ## remove the virtualenv
	rm -rf $(VENV)
