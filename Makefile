# One entry point for setup, the main job, tests and benchmarks. Every target sets up the
# environment it needs, so `make run` and `make test` work on a fresh clone.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# what installs the project's dependencies into .venv: uv (pinned below), or INSTALLER=pip; torch always comes
# through pip, which finds its CPU build on local disk here. Elsewhere pip takes PyPI's, on Linux the CUDA build (a
# few GB): TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu takes the CPU build on a machine without a GPU
INSTALLER ?= uv
TORCH_INDEX_URL ?=
install_torch = $(1) install -q torch==2.13.0$(if $(strip $(TORCH_INDEX_URL)), --index-url '$(strip $(TORCH_INDEX_URL))')
UV_VERSION := 0.13.9
ifeq ($(INSTALLER),pip)
INSTALL_DEPS = $(BIN)/pip install -q
else
INSTALL_DEPS = $(BIN)/pip install -q 'uv==$(UV_VERSION)' && $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python
endif
# data: the local mirror beside the clone when it is there (then offline), else the Hugging Face Hub
MIRROR := $(abspath ../shared/data)
ifneq ($(wildcard $(MIRROR)/stsb/train.parquet),)
export EMBED_DATA_DIR ?= $(MIRROR)
export HF_HUB_OFFLINE ?= 1
endif
DATA_NOTE = data: $(if $(EMBED_DATA_DIR),the local mirror $(EMBED_DATA_DIR),the Hugging Face Hub (no mirror at $(MIRROR)))$(if $(filter 1,$(HF_HUB_OFFLINE)), -- offline,)
export EMBED_CACHE_DIR ?= $(abspath .cache/embed_lib)
export EMBED_STORAGE_DIR ?= $(abspath .cache/ray_results)
export MLFLOW_TRACKING_URI ?= sqlite:///$(abspath mlflow.db)
export MLFLOW_ARTIFACT_ROOT ?= $(abspath mlartifacts)
TASK ?= stsb
SWEEP_ARGS ?=
MLFLOW_PORT ?= 5000

.PHONY: venv constraints run sweep smoke serve serve-cascade teacher frontier backends cluster-start cluster-stop cluster-tools mlflow-ui baseline study retrieval test test-no-mirror fuzz bench first-run chaos clean

venv: $(STAMP)
$(STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	# torch first, the CPU build from local disk (or TORCH_INDEX_URL): letting pip resolve torch here pulls a CUDA build
	$(call install_torch,$(BIN)/pip)
	# the versions the project is tested with (constraints.txt), not whatever was released since, installed by uv
	# (parallel downloads and bytecode compilation: make venv 92 s instead of pip's 162 s, medians on fresh clones of
	# a 2-core machine); it keeps the torch above, which the constraints pin.
	# INSTALLER=pip installs them with pip instead.
	$(INSTALL_DEPS) -c constraints.txt -e '.[dev]'
	touch $(STAMP)

## constraints.txt from a fresh resolve of pyproject's ranges (a temporary venv; review the diff, then make test)
constraints:
	rm -rf /tmp/embed-constraints-venv && $(PY) -m venv /tmp/embed-constraints-venv
	$(call install_torch,/tmp/embed-constraints-venv/bin/pip)
	/tmp/embed-constraints-venv/bin/pip install -q -e '.[dev]'
	{ sed -n '/^#/p' constraints.txt; /tmp/embed-constraints-venv/bin/pip freeze --exclude-editable \
	  | sed 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/'; } > constraints.txt.new && mv constraints.txt.new constraints.txt
	rm -rf /tmp/embed-constraints-venv

## main job: local Ray cluster -> `ray job submit` of the STS-B sweep -> champion in the MLflow registry
run: venv
	@echo "$(DATA_NOTE)"
	@# options are checked here, in seconds, before a cluster starts (inside the job it took ~15 s to the same line)
	@[[ -z "$(strip $(SWEEP_ARGS))" && "$(TASK)" == stsb ]] || \
	  $(BIN)/python sweeps/pair_residual.py --task '$(TASK)' $(SWEEP_ARGS) --check-flags
	@started=0; cluster/local.sh status >/dev/null 2>&1 || { cluster/local.sh start || exit $$?; started=1; }; \
	cluster/local.sh submit -- python sweeps/pair_residual.py --task $(TASK) $(SWEEP_ARGS); rc=$$?; \
	if [[ $$started == 1 ]]; then cluster/local.sh release; else cluster/local.sh release --if-left; fi; \
	echo "MLflow store: $(MLFLOW_TRACKING_URI) -- browse it with: make mlflow-ui (http://127.0.0.1:$(MLFLOW_PORT)/#/experiments?workflowType=machine_learning)"; \
	exit $$rc

## the same sweep in this process (a local Ray started by the script), no job submission
sweep: venv
	$(BIN)/python sweeps/pair_residual.py --task $(TASK) $(SWEEP_ARGS)

smoke: venv
	$(BIN)/python sweeps/pair_residual.py --task $(TASK) --smoke-test

## the MLflow champion as a service on http://127.0.0.1:8000 (serving/config.yaml); stop: make cluster-stop. A deploy
## that fails stops the cluster it started. TASK=qqp (mrpc, paws, a pair file) serves that task's champion;
## SERVE_ARGS="KEY=VALUE ..." sets arguments of the application (serving/args.py), e.g.
## model_uri=models:/pair-residual-<task>/3
SERVE_ARGS ?=
## SERVE_PORT=8001: the service on another port of 127.0.0.1 (http_options.port of the deployed copy of the config)
SERVE_PORT ?=
# the model a TASK registered: pair-residual-<name>, <name> a built-in task's or, for a pair file or hf:<id>, its slug
# (embed_lib.data.custom_tasks.slug_of; a sweep's --task-name: give that name as TASK); a pair file warms the caches
TASK_NAME = $(if $(filter stsb mrpc qqp paws,$(TASK)),$(TASK),$(shell $(BIN)/python -c 'import sys; from \
	embed_lib.data.custom_tasks import slug_of; print(slug_of(sys.argv[1]))' '$(TASK)'))
TASK_SERVE = $(if $(filter-out stsb,$(TASK)),model_uri=models:/pair-residual-$(TASK_NAME)@champion \
	warm_corpus=$(if $(filter mrpc qqp paws,$(TASK)),task:$(TASK),$(if $(wildcard $(TASK)),$(abspath $(TASK)),null)))
# $(1): a Serve config, $(2): KEY=VALUE arguments of its application, checked before a cluster starts (with the
# MLflow store the model is read from: cluster/serve_config.py); a deploy that fails stops the cluster this started
define deploy
	@$(BIN)/python cluster/serve_config.py $(1) - $(2)
	@started=0; cluster/local.sh status >/dev/null 2>&1 || { cluster/local.sh start || exit $$?; started=1; }; \
	cluster/local.sh serve $(1) $(2) || { rc=$$?; [[ $$started == 0 ]] || cluster/local.sh stop; exit $$rc; }
endef
serve: venv
	$(call deploy,serving/config.yaml,$(TASK_SERVE) $(SERVE_ARGS) $(if $(SERVE_PORT),http_options.port=$(SERVE_PORT)))

## the teacher as a served cross-encoder: one model on all of $(TASK)'s train split, registered in MLflow as
## models:/cross-encoder-$(TASK)@current (for STS-B, once make run has trained its teacher: 3.6 min on 2 cores with AMX,
## longer where the CPU computes no bf16 and it trains in fp32)
teacher: venv
	$(BIN)/python -m embed_lib teacher --task $(TASK) --teacher-preset fast

## the champion with the difficulty-routed cascade (serving/config_cascade.yaml); needs make run and make teacher (the
## same TASK; SERVE_ARGS as for serve)
serve-cascade: venv
	$(call deploy,serving/config_cascade.yaml,$(TASK_SERVE) $(if $(TASK_SERVE),cross_encoder=models:/cross-encoder-$(TASK_NAME)@current) $(SERVE_ARGS) $(if $(SERVE_PORT),http_options.port=$(SERVE_PORT)))

cluster-start: venv
	cluster/local.sh start

cluster-stop:
	cluster/local.sh stop

## what cluster/nodes.py needs beside iproute2 and util-linux (several nodes on one machine, tests/test_multinode.py):
## nftables for the head's firewall, installed from Debian's packages when missing and this is root
cluster-tools:
	@command -v nft >/dev/null || command -v iptables >/dev/null || [[ $$(id -u) != 0 ]] || ! command -v apt-get >/dev/null \
	  || { echo "installing nftables (cluster/nodes.py's head firewall)"; { apt-get install -y -q nftables || { apt-get update -q && apt-get install -y -q nftables; }; } >/dev/null; }

MLFLOW_UI_BUSY = stop what holds it (another clone's make mlflow-ui?), or give another port: make mlflow-ui MLFLOW_PORT=5001
mlflow-ui: venv
	@python3 cluster/dashboard.py port-free 127.0.0.1 $(MLFLOW_PORT) mlflow-ui "$(MLFLOW_UI_BUSY)"
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow server --host 127.0.0.1 --port $(MLFLOW_PORT) \
	  --backend-store-uri $(MLFLOW_TRACKING_URI) --default-artifact-root $(MLFLOW_ARTIFACT_ROOT)

baseline: venv
	$(BIN)/python -m embed_lib baseline --task $(TASK)

## the reference comparison on all four tasks -> results/study_all.{md,json}. Teachers: the strong recipe on
## STS-B; the light one elsewhere keeps the one-time teacher cost of the four tasks near an hour on 2 cores, plus
## an intermediate stage per task (~8-10 min each)
## (STUDY_TEACHER=strong for the strong recipe everywhere: about 3 hours more on 2 cores)
STUDY_TEACHER ?= stsb=strong,qqp=light,mrpc=light,paws=light
study: venv
	$(BIN)/python -m embed_lib study --task all --teacher-preset $(STUDY_TEACHER) --out results/study_all.md

## the re-ranking check of the STS-B champion on QQP duplicates -> results/retrieval_qqp.{md,json}
retrieval: venv
	$(BIN)/python -m embed_lib retrieval --task qqp

## the whole suite (slow and integration tests included), a module per worker. On 2 cores two workers keep both
## busy (99% in a run of three: 1018 s against 860 s for two, so no third); tests/conftest.py gives each worker its
## share of the cores for torch and OpenMP (860 -> 791 s). TEST_WORKERS=0: serial
TEST_WORKERS ?= 2
test: venv cluster-tools
	@echo "$(DATA_NOTE)"
	$(BIN)/lint-imports  # the architecture contracts (pyproject.toml): an import against them fails the suite
	$(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

## the suite as an outside user meets it: a clone of HEAD with no data mirror beside it and no Hub (the tests make
## their own small data set and skip the mirror's published figures, saying why); its own venv and caches
NO_MIRROR_DIR ?= /tmp/embed-no-mirror
test-no-mirror:
	rm -rf $(NO_MIRROR_DIR) && mkdir -p $(NO_MIRROR_DIR) && git clone -q . $(NO_MIRROR_DIR)/clone
	cd $(NO_MIRROR_DIR)/clone && env -u EMBED_DATA_DIR -u EMBED_CACHE_DIR -u EMBED_STORAGE_DIR -u MLFLOW_TRACKING_URI \
	  -u MLFLOW_ARTIFACT_ROOT HF_HUB_OFFLINE=1 $(MAKE) test

## the API fuzz run alone (2000 generated bodies; `make test` sends 1000) -> results/benchmarks/fuzz.json
fuzz: venv
	FUZZ_BODIES=2000 FUZZ_RESULTS=$(abspath results/benchmarks/fuzz.json) $(BIN)/python -m pytest -q tests/test_serving.py -k fuzz

bench: venv
	$(BIN)/python benchmarks/encode_throughput.py
	$(BIN)/python benchmarks/baseline_cache.py
	$(BIN)/python benchmarks/seed_group.py
	$(BIN)/python benchmarks/tune_overhead.py
	$(BIN)/python benchmarks/serve_bench.py --with-proxy
	$(BIN)/python benchmarks/serve_bench.py --direct-ingress
	$(BIN)/python benchmarks/batching.py
	$(BIN)/python benchmarks/cold_bound.py

## the cascade's quality-cost frontier (STS-B and QQP) -> results/benchmarks/cascade_frontier.{json,png}
frontier: venv
	$(BIN)/python benchmarks/cascade_frontier.py --teacher-preset fast

## torch vs ONNX Runtime fp32 / int8 for the encoder and the cross-encoder -> results/benchmarks/backends.json
backends: venv
	$(BIN)/python benchmarks/backends.py

## the first make run of a newcomer, on two fresh clones beside this one, timed by stage (about 12 min a clone on 2
## cores of an AMD EPYC with AVX512-BF16; commit first: a clone takes HEAD) -> results/benchmarks/first_run.json
first-run: venv
	$(BIN)/python benchmarks/first_run.py --runs 2

## fault injection: a trial worker and a Serve replica killed mid-run (results/benchmarks/chaos.json)
chaos: venv
	$(BIN)/python benchmarks/chaos.py

clean:
	rm -rf .cache benchmarks/out
