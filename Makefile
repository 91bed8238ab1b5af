# Every entry point of the course. The first use creates .venv from requirements.txt.
SHELL := /bin/bash
PY := .venv/bin/python
STAGE ?=
IMPL ?= solution
export PYTHONHASHSEED := 0
export TOKENIZERS_PARALLELISM := false
# Triton kernels run in its CPU interpreter unless there is an NVIDIA GPU to compile them for.
export TRITON_INTERPRET ?= $(if $(wildcard /dev/nvidia0),0,1)

.PHONY: setup test grade lab bench serve check lint format mutants

setup: .venv/.installed

.venv/.installed: requirements.txt
	@test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	@# make the course importable from notebooks and subprocesses started anywhere
	@echo "$(CURDIR)" > $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/llm_course.pth
	@touch $@

## make test: the whole suite against the reference solutions, plus the course guarantees (tests/meta)
test: setup
	$(PY) -m labkit.check

## make grade [STAGE=02]: grade your own stage code
grade: setup
	$(PY) -m labkit.grade $(if $(STAGE),--stage $(STAGE))

## make mutants [STAGE=04]: plant each catalogued learner bug in a copy of the solutions; count what the tests catch
mutants: setup
	nice -n 10 $(PY) -m labkit.mutants $(if $(STAGE),--stage $(STAGE))

## make lab: Jupyter on the notebooks
lab: setup
	LABS_IMPL=$${LABS_IMPL:-student} .venv/bin/jupyter lab --notebook-dir=$(CURDIR)

## make bench STAGE=02: one stage's benchmark (reference solution unless IMPL=student)
bench: setup
	@test -n "$(STAGE)" || { echo "usage: make bench STAGE=02"; exit 2; }
	LABS_IMPL=$(IMPL) $(PY) -m labkit.bench $(STAGE)

## make serve [IMPL=student]: stage 04's OpenAI-compatible server on the tiny target, 127.0.0.1:8000
serve: setup
	$(PY) -m $(if $(filter solution,$(IMPL)),solutions.)stage04_batching.serve

## make check: lint and format check
check lint: setup
	.venv/bin/ruff check . && .venv/bin/ruff format --check .

format: setup
	.venv/bin/ruff format . && .venv/bin/ruff check --fix .
