# kvgate — every target creates or reuses .venv by itself.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-$(shell cksum < pyproject.toml | cut -d' ' -f1)
ARGS    ?=

.DEFAULT_GOAL := help
.PHONY: help run test lint typecheck proto tokenizer helm bench audit clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@# xds-protos ships older copies of opentelemetry-proto's generated modules over the real ones
	@# (tracing's OTLP exporter then fails to import): put opentelemetry-proto's own files back
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall \
	  "opentelemetry-proto==$$($(PY) -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	@rm -f $(VENV)/.installed-* && touch $@

run: $(STAMP) ## 4 simulated engines + the gateway + the agent working day per policy (ARGS=--once to exit)
	$(VENV)/bin/kvgate demo $(ARGS)

test: $(STAMP) ## the test suite (starts its own engines and servers on loopback)
	$(PY) -m pytest $(ARGS)

lint: $(STAMP) ## ruff format --check and ruff check
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

typecheck: $(STAMP) ## mypy --strict on the packages
	$(VENV)/bin/mypy

proto: $(STAMP) ## regenerate the gRPC stubs (gateway/api/grpc/_pb, loadgen/_pb) from proto/; fails if they drifted
	$(PY) -m tools.protogen

tokenizer: $(STAMP) ## rebuild the simulated engine's tokenizer (loadgen/engine/model/) from its generated corpus
	$(PY) -m tools.build_tokenizer

helm: $(STAMP) ## the chart: schema drift, helm lint --strict, helm template, kubernetes-validate --strict
	$(PY) -m tools.chart check

bench: $(STAMP) ## the gateway's CPU time per proxied request
	$(VENV)/bin/kvgate bench-cpu $(ARGS)

audit: $(STAMP) ## the Gu et al. timing audit: through kvgate (PASS) and at a bare engine (FAIL)
	$(VENV)/bin/kvgate audit-demo $(ARGS)

clean: ## remove the virtualenv
	rm -rf $(VENV)
