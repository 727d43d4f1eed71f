# packer: set-up, demo, tests, and dataset refresh. Run `make help` for the list.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel: a bare `torch` requirement pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# SIMD=1 swaps Pillow for pillow-simd built with AVX2 (same API, faster resize).
SIMD ?= 0
RAW ?= data/raw
OUT ?= data/dataset.lmdb
FORMAT ?= jpeg
DEMO_DIR ?= data/demo
PYTEST_ARGS ?=

.PHONY: help system-deps setup demo test dataset dataset-verify dataset-clean bench clean

help:
	@echo "make setup      venv with packer and its dependencies (SIMD=1 for pillow-simd)"
	@echo "make demo       generate 12 MP sample photos, pack them, show info, read them back"
	@echo "make test       run the test suite"
	@echo "make dataset RAW=raw/ OUT=out.lmdb [FORMAT=jpeg]   (re)build only when raw/ changed"

# Debian/Ubuntu packages: libjpeg-turbo for PyTurboJPEG, headers to build pillow-simd. Needs root or sudo.
system-deps:
	@if ! ldconfig -p 2>/dev/null | grep -q libturbojpeg; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libturbojpeg0 libjpeg62-turbo-dev zlib1g-dev; \
	fi

$(VENV)/.installed: pyproject.toml
	$(MAKE) system-deps
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	if [ "$(SIMD)" = 1 ]; then \
	  $(PIP) uninstall -q -y pillow pillow-simd; \
	  CC="cc -mavx2" $(PIP) install -q --no-cache-dir pillow-simd; \
	fi
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) -m packer.sample $(DEMO_DIR)/raw --per-class 8
	$(VENV)/bin/packer build $(DEMO_DIR)/raw $(DEMO_DIR)/demo.lmdb --force
	$(VENV)/bin/packer info $(DEMO_DIR)/demo.lmdb
	$(PY) scripts/train_example.py $(DEMO_DIR)/demo.lmdb --steps 30 --batch-size 16

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Rebuild OUT only when a file under RAW is newer than the last successful build (or RAW's listing changed).
dataset: setup
	@stamp="$(OUT).stamp"; listing=$$(find "$(RAW)" -printf '%P %s %T@\n' | sort | sha256sum | cut -c1-64); \
	if [ -e "$(OUT)/manifest.json" ] && [ -e "$$stamp" ] && [ "$$(cat $$stamp)" = "$$listing" ]; then \
	  echo "$(OUT) is up to date with $(RAW)"; \
	else \
	  $(VENV)/bin/packer build "$(RAW)" "$(OUT)" --format $(FORMAT) --force && echo "$$listing" > "$$stamp"; \
	fi

dataset-verify: setup
	$(VENV)/bin/packer info "$(OUT)"

dataset-clean:
	rm -rf "$(OUT)" "$(OUT).stamp"

clean:
	rm -rf $(VENV) data .pytest_cache .hypothesis
