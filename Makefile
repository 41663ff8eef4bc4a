# Two commands (README quick start):  `make demo`  and  `make test`.
# Each creates .venv if missing and installs the package into it; nothing else is needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint format clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,plot]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) tools/demo.py

# Lint, then the whole suite on 2 workers (TF's C++ start-up chatter silenced, output unbuffered
# so pytest's summary is the last line). pytest's exit 5 (no tests collected) is a failure.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	TF_CPP_MIN_LOG_LEVEL=3 PYTHONUNBUFFERED=1 $(PY) -m pytest -q -n 2 tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo 'pytest collected no tests: failing'; exit 1; fi; exit $$rc

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
