# trtpipe: `make demo` and `make test` on a fresh clone (README.md). Everything installs into $(VENV).
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_RECIPE ?= recipes/stories-fp16.yaml
DEMO_PROMPT ?= Once upon a time

.PHONY: install test test-portable demo

install: $(VENV)/.trtpipe-installed

$(VENV)/.trtpipe-installed: pyproject.toml scripts/install.sh
	VENV=$(VENV) bash scripts/install.sh

# Each test's time goes to build/test-results.xml (JUnit XML, what CI systems read); the 15 slowest are printed.
test: install
	$(BIN)/pytest -q --durations=15 --junitxml=build/test-results.xml
	$(MAKE) test-portable

# The numeric tests again with another CPU kernel set and thread count (AVX2 kernels, 2 torch threads): their
# tolerances come from float64 references (tests/numerics.py), so they must hold on any x86-64 CPU.
PORTABLE_TESTS ?= tests/runtime tests/checkpoint/test_parity.py
test-portable: install
	ATEN_CPU_CAPABILITY=avx2 TRTPIPE_TEST_THREADS=2 $(BIN)/pytest -q $(PORTABLE_TESTS)

# Build the tiny stories260k recipe (convert -> CPU twin engine -> Triton repository), serve it on a real
# tritonserver bound to 127.0.0.1, ask one question, print the answer, stop the server whatever happened.
demo: install
	$(BIN)/trtpipe build $(DEMO_RECIPE)
	$(BIN)/trtpipe serve $(DEMO_RECIPE) --detach
	@status=0; printf '%s' "$(DEMO_PROMPT)"; \
	$(BIN)/trtpipe infer "$(DEMO_PROMPT)" --max-tokens 48 --server $(DEMO_RECIPE) || status=$$?; \
	$(BIN)/trtpipe stop $(DEMO_RECIPE); \
	exit $$status
