# trtpipe: `make demo` and `make test` on a fresh clone (README.md). Everything installs into $(VENV).
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_RECIPE ?= recipes/stories-fp16.yaml
DEMO_PROMPT ?= Once upon a time

.PHONY: install lint test test-fast test-portable demo

install: $(VENV)/.trtpipe-installed

$(VENV)/.trtpipe-installed: pyproject.toml scripts/install.sh
	VENV=$(VENV) bash scripts/install.sh

# ruff (its version pinned in the test extra, its rules in pyproject.toml [tool.ruff]): the linter and the formatter's
# check; `make test` runs it first. `ruff format .` fixes what the second line finds.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Each test's time goes to build/test-results.xml (JUnit XML, what CI systems read); the 15 slowest are printed.
test: lint
	$(BIN)/pytest -q --durations=15 --junitxml=build/test-results.xml
	$(MAKE) test-portable

# The unit tier for the edit loop: no tritonserver, mpirun, ModelOpt oracle, chaos, GPU or other slow test
# (tests/conftest.py marks every such test `slow`, so `-m "not slow"` is the whole selection).
test-fast: install
	$(BIN)/pytest -q -m "not slow" --durations=5

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
