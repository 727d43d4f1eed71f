# packer: set-up, demo, tests, and dataset refresh. Run `make help` for the list.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Installed before packer, so that packer's own `torch` requirement is already met: a bare `torch`
# requirement pulls a multi-GB CUDA build. Where torch==2.13.0 is not served as a CPU wheel (it is on
# this project's machines), pass TORCH_PIP_ARGS="--index-url <PyTorch's CPU wheel index>".
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
# SIMD=1 swaps Pillow for pillow-simd built with AVX2 (same API, faster resize).
SIMD ?= 0
RAW ?= data/raw
OUT ?= data/dataset.lmdb
FORMAT ?= jpeg
ARGS ?=
DEMO_DIR ?= data/demo
PYTEST_ARGS ?=
# make test-sanitize: seconds of fuzzing under ASan/UBSan (make test runs a short one) and its seed.
SANITIZE_SECONDS ?= 60
SANITIZE_SEED ?= 0
SANITIZE_DIR := build/sanitize
PACKAGE_DIR := build/package
# make recipe-check: the detection recipe's venv (torchvision, which packer does not need, beside its own torch).
RECIPE_DIR := build/recipe
RECIPE_SPEC ?= torch==2.14.1 torchvision==0.29.1

.PHONY: help system-deps setup demo lint docs test test-sanitize package-check recipe-check dataset dataset-verify dataset-clean bench clean

help:
	@echo "make setup      venv with packer and its dependencies (SIMD=1 for pillow-simd)"
	@echo "make demo       generate 12 MP sample photos, pack them, show info, read them back"
	@echo "make lint       ruff (lint + format check) and mypy over packer/ tests/ scripts/; the import layers"
	@echo "make docs       build docs/ into a browsable site in build/site/ (mkdocs --strict: a broken link fails)"
	@echo "make test       lint, the docs build, the test suite, and a short fuzz of the C extension under ASan/UBSan"
	@echo "make test-sanitize [SANITIZE_SECONDS=60 SANITIZE_SEED=0]   fuzz the C extension under ASan/UBSan"
	@echo "make package-check  build the sdist and wheel, install the wheel in a fresh venv, build and verify a dataset"
	@echo "make recipe-check   docs/FIELDS.md's detection recipe: Faster R-CNN for a few steps on a packed COCO subset"
	@echo "make dataset RAW=raw/ OUT=out.lmdb [FORMAT=jpeg] [ARGS=...]   refresh OUT: decode only added/changed files"
	@echo "make dataset-verify OUT=out.lmdb   re-read and check OUT (each split dataset inside it, with --split)"
	@echo "make dataset-clean OUT=out.lmdb    delete OUT and any interrupted build of it (packer's only)"
	@echo "make bench OUT=out.lmdb [ARGS=...]  DataLoader samples/s per num_workers and a stage profile (packer bench)"

# Debian/Ubuntu packages: libjpeg-turbo for PyTurboJPEG, headers to build pillow-simd. Needs root or sudo.
system-deps:
	@if ! ldconfig -p 2>/dev/null | grep -q libturbojpeg; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libturbojpeg0 libjpeg62-turbo-dev zlib1g-dev; \
	fi

$(VENV)/.installed: pyproject.toml packer/_native.c packer/_resize.c packer/_resize.h
	$(MAKE) system-deps
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	if [ "$(SIMD)" = 1 ]; then \
	  $(PIP) uninstall -q -y pillow pillow-simd; \
	  CC="cc -mavx2" $(PIP) install -q --no-cache-dir pillow-simd; \
	fi
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) -m packer.tools.sample $(DEMO_DIR)/raw --per-class 8
	$(VENV)/bin/packer build $(DEMO_DIR)/raw $(DEMO_DIR)/demo.lmdb --force
	$(VENV)/bin/packer info $(DEMO_DIR)/demo.lmdb
	$(PY) scripts/train_example.py $(DEMO_DIR)/demo.lmdb --steps 30 --batch-size 16

# ruff, mypy and import-linter settings: pyproject.toml ([tool.ruff], [tool.mypy], [tool.importlinter]).
lint: setup
	$(PY) -m ruff check packer tests scripts
	$(PY) -m ruff format --check packer tests scripts
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

# docs/ as HTML (config: mkdocs.yml), in build/site/; --strict turns every warning (a broken link or
# anchor, a page left out of the nav) into a failure, so `make test` (and CI) checks the docs too.
# Not --quiet: it drops the warnings before --strict counts them, and a broken link then passes.
docs: setup
	$(VENV)/bin/mkdocs build --strict

test: setup lint docs
	$(PY) -m pytest -q $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-sanitize SANITIZE_SECONDS=20
	$(MAKE) --no-print-directory package-check
	$(MAKE) --no-print-directory recipe-check

# What `pip install packer-datasets` gives a user, checked from the files a release would upload: the sdist,
# the wheel built from it (a file missing from the sdist fails there), and a wheel built without a C compiler
# (the extension is optional). The wheel goes into a fresh venv (torch's CPU wheel first, as in setup), and
# is run from outside the checkout, so nothing is imported from the source tree.
package-check: setup
	rm -rf $(PACKAGE_DIR) && mkdir -p $(PACKAGE_DIR)
	$(PY) -m build --outdir $(PACKAGE_DIR)/dist . > $(PACKAGE_DIR)/build.log 2>&1 || { cat $(PACKAGE_DIR)/build.log; exit 1; }
	CC=false $(PY) -m build --wheel --outdir $(PACKAGE_DIR)/no-compiler . > $(PACKAGE_DIR)/no-compiler.log 2>&1 \
	  || { cat $(PACKAGE_DIR)/no-compiler.log; exit 1; }
	$(PY) scripts/check_package.py --dist $(PACKAGE_DIR)/dist --no-compiler $(PACKAGE_DIR)/no-compiler
	$(PYTHON) -m venv $(PACKAGE_DIR)/venv
	$(PACKAGE_DIR)/venv/bin/pip install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PACKAGE_DIR)/venv/bin/pip install -q "$$(ls $(PACKAGE_DIR)/dist/*.whl)"
	cd $(PACKAGE_DIR) && venv/bin/python "$(CURDIR)/scripts/check_package.py" --installed

# The detection recipe (docs/FIELDS.md, "Training a detector"), run by tests/behaviour/test_detector.py in a venv
# of its own: torchvision's wheels need their own torch release (RECIPE_SPEC, a multi-GB CUDA build that runs
# on CPU), not the project's CPU torch, so they cannot go into $(VENV). packer is installed there editable
# from the checkout, so the recipe runs the sources as they are. PACKER_RECIPE=1: a missing torchvision fails.
$(RECIPE_DIR)/venv/.installed: pyproject.toml packer/_native.c packer/_resize.c packer/_resize.h
	$(MAKE) system-deps
	[ -x $(RECIPE_DIR)/venv/bin/python ] || $(PYTHON) -m venv $(RECIPE_DIR)/venv
	$(RECIPE_DIR)/venv/bin/pip install -q $(RECIPE_SPEC) "pytest>=7"
	$(RECIPE_DIR)/venv/bin/pip install -q -e .
	touch $@

recipe-check: setup $(RECIPE_DIR)/venv/.installed
	PACKER_RECIPE=1 $(RECIPE_DIR)/venv/bin/python -m pytest -q -p no:cacheprovider tests/behaviour/test_detector.py

# packer/_native.c and _resize.c built with AddressSanitizer and UBSan (any report aborts), then fuzzed with
# damaged and random JPEGs, crop boxes and buffer sizes (scripts/fuzz_native.py). Python itself is not
# instrumented, so the ASan runtime is preloaded and leak checks (CPython's own allocations) are off.
test-sanitize: setup
	mkdir -p $(SANITIZE_DIR)
	cc -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all -shared -fPIC \
	  -I"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
	  packer/_native.c packer/_resize.c -ljpeg -lm -o $(SANITIZE_DIR)/_native.so
	LD_PRELOAD="$$(cc -print-file-name=libasan.so)" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1 $(PY) scripts/fuzz_native.py --seconds $(SANITIZE_SECONDS) \
	  --seed $(SANITIZE_SEED) --module $(SANITIZE_DIR)/_native.so

# packer itself compares RAW with what OUT was built from: unchanged files keep their records (linked),
# and an unchanged RAW is a fast no-op. ARGS passes more build options, e.g. ARGS="--split val=0.05".
dataset: setup
	$(VENV)/bin/packer build "$(RAW)" "$(OUT)" --update --format $(FORMAT) $(ARGS)

dataset-verify: setup
	@if [ -e "$(OUT)/manifest.json" ] || case "$(OUT)" in *://*) true;; *) false;; esac; then set -- "$(OUT)"; else set -- "$(OUT)"/*/manifest.json; set -- "$${@%/manifest.json}"; fi; \
	for d in "$$@"; do $(VENV)/bin/packer verify "$$d" || exit 1; done

# Refuses anything that is not a packer dataset or build folder, and an OUT being built.
dataset-clean: setup
	$(VENV)/bin/packer clean "$(OUT)"

bench: setup
	$(VENV)/bin/packer bench "$(OUT)" $(ARGS)

clean:
	rm -rf $(VENV) data .pytest_cache .hypothesis
