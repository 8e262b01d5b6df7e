# The README's commands. `make run` and `make test` create their own environment on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STEPS  ?= 100
WORKSPACE ?= ./workspace
# torch 2.13.0 is the CPU build this machine's package index carries: torchrun, the ranks in tests and the
# environment a repo's own requirements inherit need it (the fake trainer is numpy).
TORCH  ?= torch==2.13.0 numpy

.PHONY: run test rehearse lint bench clean sysdeps areal-env mutate

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

# The main job: the smoke stack (stand-in inference + fake-data trainer) on a local workspace.
# STEPS=0 runs until Ctrl-C.
run: $(VENV)/.ready
	$(BIN)/podkit up --smoke --workspace $(WORKSPACE) $(if $(filter-out 0,$(STEPS)),--steps $(STEPS))

# Tools the tests run for real: fuser/lsof (psmisc, lsof), git, and a headless browser for the page
# (Debian's chromium: tests/views/test_page.py). Installed only where missing.
sysdeps:
	@missing=""; \
	command -v fuser >/dev/null || missing="$$missing psmisc"; \
	command -v lsof  >/dev/null || missing="$$missing lsof"; \
	command -v git   >/dev/null || missing="$$missing git"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq $$missing; \
	  else echo "install:$$missing" >&2; exit 1; fi; \
	fi

# AReaL's real trainer and SGLang's and AReaL's own parsers, in an environment of their own (CPU torch,
# no GPU stacks), built once and cached under ~/.cache/podkit (rehearse/env.sh): CI on the same
# machine reuses it.
areal-env:
	@PYTHON=$(PYTHON) sh rehearse/env.sh

# The CPU rehearsal of a pod: podkit up with AReaL's real GRPO trainer (configs/cpu-rehearsal.yaml) on a
# tiny local model and GSM8K-shaped data, against the generating stand-in for SGLang. STEPS=0: until
# Ctrl-C. Run it again on the same WORKSPACE and it resumes from the last recover checkpoint.
# Your own code: REPO=<url or path> ENTRY=<script in it> [CONFIG=<its AReaL YAML>] [REF=<branch of a URL>]
# [OVERRIDES=<AReaL overrides>] trains your entry on the tiny model, your YAML with rehearse/cpu-overrides,
# then PODKIT_TRAINER_OVERRIDES and OVERRIDES on top. A path is rehearsed as its files are now: a git
# checkout at its own HEAD with its uncommitted changes (rehearse/repo.py).
CONFIG    ?= config.yaml
REF       ?= main
OVERRIDES ?=
rehearse: sysdeps
	py=$$(PYTHON=$(PYTHON) sh rehearse/env.sh) && \
	$$py rehearse/assets.py $(WORKSPACE)/rehearsal && \
	$(if $(REPO),repo=$$($$py rehearse/repo.py '$(REPO)' $(WORKSPACE)/rehearsal-repo '$(REF)') && set -- $$repo && \
	  export PODKIT_REPO_URL="$$1" PODKIT_REPO_REF="$$2" \
	    PODKIT_TRAINER_ENTRY='$(ENTRY)' PODKIT_TRAINER_AREAL_CONFIG='$(CONFIG)' \
	    PODKIT_TRAINER_OVERRIDES="$$(grep -v '^#' rehearse/cpu-overrides | tr '\n' ' ') $${PODKIT_TRAINER_OVERRIDES:-} $(OVERRIDES)" && ,) \
	_PODKIT_PLACE=rehearse PYTHONPATH=$(CURDIR)/src $$py -m podkit --config configs/cpu-rehearsal.yaml up --workspace $(WORKSPACE) \
	  $(if $(filter-out 0,$(STEPS)),--steps $(STEPS))

# The suite on JOBS pytest-xdist workers: the real-trainer tests in order on one worker (their xdist_group
# mark; two trainers at once overload 2 cores), the simulated cluster on one (it mostly waits on its nodes),
# the container tests on one, the rest spread. Four by default on 2 cores: most tests wait (leases,
# back-offs, stops) more than they compute, and the workers overlap those waits (docs/testing.md).
# Bytecode is written (a machine's PYTHONDONTWRITEBYTECODE=1 had every worker rewrite and compile every test
# module again), and one collection first writes pytest's rewritten test modules, which the workers then read.
# It ends with where the time went. On a fresh machine podkit's venv and the AReaL environment are built side
# by side.
JOBS ?= 4
test:
	@$(MAKE) --no-print-directory -j3 sysdeps $(VENV)/.ready areal-env
	$(BIN)/ruff check src tests bench docker rehearse
	py=$$(PYTHON=$(PYTHON) sh rehearse/env.sh) && export AREAL_PYTHON=$$py PYTHONDONTWRITEBYTECODE= && \
	  { $(BIN)/pytest --collect-only -q >/dev/null 2>&1 || true; } && \
	  $(BIN)/pytest -n $(JOBS) --dist loadgroup --durations=10

# The linter `make test` runs first, alone.
lint: $(VENV)/.ready
	$(BIN)/ruff check src tests bench docker rehearse

# Every benchmark with the arguments bench/RESULTS.md records (tests/house/test_bench.py runs each briefly).
bench: $(VENV)/.ready sysdeps
	$(BIN)/python bench/boot.py --runs 11
	$(BIN)/python bench/reap.py --idle 500 --runs 9
	$(BIN)/python bench/sync.py --commits 3000 --runs 9
	$(BIN)/python bench/stop.py --runs 3
	PYTHON=$(PYTHON) $(BIN)/python bench/rehearse.py --steps 8 --runs 3 --env
	PYTHON=$(PYTHON) $(BIN)/python bench/entry.py --steps 6 --runs 2
	PYTHON=$(PYTHON) $(BIN)/python bench/startup.py --runs 2
	$(BIN)/python bench/page.py --steps 100000 --runs 21
	$(BIN)/python bench/remote.py --size-mib 1024 --runs 3 --seconds 30

# Mutation testing of the judge's pure modules (setup.cfg's [mutmut]), module by module, over the functions that
# decide: the standing (judge, stopped_by and its helpers), the spend (the run's totals and their sureness), the
# end's verdict (decide); each mutant runs only the fast tests that cover its function. Not part of `make test`
# (about 15 min on 2 cores). A whole module: MUTANTS_SPEND='podkit.money.spend.*'. The last result: bench/MUTATION.md;
# mutmut's copy of the project (./mutants/, large) can go after: rm -rf mutants. It mutates the working tree as it
# is: run it on a clean one (a change in progress elsewhere fails its clean run).
MUTMUT  ?= mutmut==3.8.1
MUTANTS_STANDING ?= podkit.judge.standing.x_judge* podkit.judge.standing.x_stopped_by* podkit.judge.standing.x__this_run* \
                    podkit.judge.standing.x__last* podkit.judge.standing.x_durable*
MUTANTS_SPEND    ?= podkit.money.spend.x_total* podkit.money.spend.x_sureness* podkit.money.spend.x_weakest* podkit.money.spend.x_run_total*
MUTANTS_VERDICT  ?= podkit.judge.verdict.x_decide*
mutate: $(VENV)/.ready
	$(BIN)/pip install -q --disable-pip-version-check '$(MUTMUT)'
	set -f; $(BIN)/mutmut run --max-children 2 $(MUTANTS_STANDING)
	set -f; $(BIN)/mutmut run --max-children 2 $(MUTANTS_SPEND)
	set -f; $(BIN)/mutmut run --max-children 2 $(MUTANTS_VERDICT)
	$(BIN)/mutmut results | grep -v "not checked" || true

clean:
	rm -rf $(VENV) workspace
