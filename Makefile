# Two commands (the README's quick start):  `make demo`  and  `make test`.
# Each creates .venv if missing and installs the package into it; nothing else is needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test docs lint format clean engine-results grappler-results plan-results results-tables readme-results startup-grid startup-results demo-results

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,plot,docs]'
	touch $(STAMP)

# Trains the tiny Transformer LM: K=4 cells on 4 logical CPUs, M=8; loss falls, accuracy rises.
demo: $(STAMP)
	$(PY) tools/trainer.py --model=lm.synthetic.TransformerLmTiny --logdir=runs/lm \
	  --num_logical_cpus=4 --mode=train_and_eval

# The guides in docs/ as a site (docs/_build/html): Sphinx with MyST, warnings are errors, so a
# broken link, a missing anchor or a page outside the table of contents fails.
docs: $(STAMP)
	$(VENV)/bin/sphinx-build -q -W --keep-going -n -b html docs docs/_build/html

# Lint, the docs build, then the suite on 3 workers (on 2 cores: a worker waiting on a trainer or TF-worker
# process it started leaves its core to the others), then the measurements (marked `idle`)
# alone: under the
# other worker's load a memory peak moves by a micro-batch's activations and a trace stamp by
# several milliseconds.
# TF's C++ start-up lines (printed before it reads TF_CPP_MIN_LOG_LEVEL, flushed at exit) are
# filtered from stderr so that pytest's summary stays the last line; any other stderr is
# shown. pytest's exit 5 (no tests collected) is a failure.
TF_NOISE := ^(WARNING: All log messages before absl|I0000 |E0000 )
PYTEST := TF_CPP_MIN_LOG_LEVEL=3 PYTHONUNBUFFERED=1 $(PY) -m pytest -q --durations=30 tests
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(MAKE) docs
	for run in "-n 3 -m 'not idle'" "-m idle"; do \
	  eval $(PYTEST) $$run 2>.pytest-stderr; \
	  rc=$$?; grep -v -E '$(TF_NOISE)' .pytest-stderr >&2; rm -f .pytest-stderr; \
	  if [ $$rc -eq 5 ]; then echo 'pytest collected no tests: failing'; exit 1; fi; \
	  if [ $$rc -ne 0 ]; then exit $$rc; fi; \
	done

# The engine's figures in docs/results.md and docs/engine.md (about 60 minutes on 2 cores; run
# on an idle machine): peak memory per schedule, without and with Grappler on the cells,
# timelines of gpipe / 1f1b / zero_bubble, throughput per schedule.
RESULTS := docs/results
engine-results: $(STAMP)
	mkdir -p $(RESULTS)
	TF_CPU_ALLOCATOR_USE_BFC=true $(PY) tools/peak_memory.py --layers=32 --width=256 \
	  --batch_size=4096 --num_micro_batches=8 --activation=RELU --notick_loop \
	  --schedules=gpipe,1f1b,interleaved_1f1b,zero_bubble --output=$(RESULTS)/peak_memory.json \
	  > $(RESULTS)/peak_memory.txt
	TF_CPU_ALLOCATOR_USE_BFC=true $(PY) tools/peak_memory.py --layers=32 --width=256 \
	  --batch_size=4096 --num_micro_batches=8 --activation=RELU --tick_loop \
	  --schedules=gpipe,1f1b,interleaved_1f1b,zero_bubble \
	  --output=$(RESULTS)/peak_memory_tick_loop.json > $(RESULTS)/peak_memory_tick_loop.txt
	$(MAKE) grappler-results
	for s in gpipe 1f1b zero_bubble; do \
	  $(PY) tools/timeline.py --schedule=$$s --recompute=never --num_micro_batches=8 \
	    --output=docs/timeline_$$s.png --json > $(RESULTS)/timeline_$$s.json || exit 1; done
	$(PY) tools/benchmark.py --families=fc,transformer --micro_batches=4,8 \
	  --schedules=gpipe,1f1b,interleaved_1f1b,zero_bubble --recompute=never --runs=3 \
	  --overheads=false --output=$(RESULTS)/schedules.json > $(RESULTS)/schedules.txt
	$(MAKE) results-tables

# Without and with Grappler on the cells (cell_grappler), the tables in docs/engine.md (about
# 35 minutes): peak memory in three rounds alternating (the peak memory benchmark and the
# planner's memory check's three cases), then the schedule benchmark at M=8 each way.
PLAN_LOCAL := fc:8:1024:1:1:gpipe:never,fc:8:1024:1:4:1f1b:never,transformer:2:32:1:4:gpipe:always
grappler-results: $(STAMP)
	mkdir -p $(RESULTS)/peak_memory_grappler $(RESULTS)/plan_check_grappler
	for r in 1 2 3; do for g in nocell_grappler cell_grappler; do \
	  TF_CPU_ALLOCATOR_USE_BFC=true $(PY) tools/peak_memory.py --layers=32 --width=256 \
	    --batch_size=4096 --num_micro_batches=8 --activation=RELU --notick_loop \
	    --schedules=gpipe,1f1b,interleaved_1f1b,zero_bubble --$$g \
	    --output=$(RESULTS)/peak_memory_grappler/$${g}_$$r.json > /dev/null || exit 1; \
	  TF_CPU_ALLOCATOR_USE_BFC=true $(PY) tools/plan_check.py --local --configs=$(PLAN_LOCAL) \
	    --$$g --output=$(RESULTS)/plan_check_grappler/$${g}_$$r.json > /dev/null || exit 1; \
	  done; done
	mkdir -p $(RESULTS)/schedules_grappler
	for g in nocell_grappler cell_grappler; do \
	  $(PY) tools/benchmark.py --families=fc,transformer --micro_batches=8 \
	    --schedules=gpipe,1f1b,interleaved_1f1b,zero_bubble --recompute=never --runs=3 \
	    --overheads=false --$$g --output=$(RESULTS)/schedules_grappler/$$g.json \
	    > /dev/null || exit 1; done

# The planner's figures in docs/planning.md (about 12 minutes on 2 cores; run on an idle machine):
# predicted vs measured memory and step time, the paper's tables at their scale, one plan.
plan-results: $(STAMP)
	mkdir -p $(RESULTS)
	$(PY) tools/plan_check.py --output=$(RESULTS)/plan_check.json
	$(PY) tools/paper_scale.py --output=$(RESULTS)/paper_scale.json
	$(PY) tools/plan.py --model=lm.lm1b.TransformerLmPaper --device=tpu-v3 --num_devices=8 \
	  --output=$(RESULTS)/plan_lm1b_tpu_v3.json --plot=docs/plan_lm1b_tpu_v3.png
	$(MAKE) results-tables

# Engine v3's grid (issue 26): start-up and steady step of every schedule over K in {2, 4, 8},
# M in {4, 8, 16, 32} and L in {8, 16} (the tick loop and the unrolled executor, the default,
# in the same process) and L=64 at M=4 and 32 (the tick loop only: the unrolled executor alone
# would take hours there), beside the plain sequence (run on an idle machine: about 90 minutes
# on 2 cores).
startup-grid: $(STAMP)
	for l in 8 16; do \
	  $(PY) tools/startup.py --compare_unrolled --num_stages=2,4,8 --layers=$$l \
	    --micro_batches=4,8,16,32 --output=$(RESULTS)/startup_grid_l$$l.json \
	    > $(RESULTS)/startup_grid_l$$l.txt || exit 1; done
	$(PY) tools/startup.py --num_stages=2,4,8 --layers=64 --micro_batches=4,32 \
	  --output=$(RESULTS)/startup_grid_l64.json > $(RESULTS)/startup_grid_l64.txt
	$(MAKE) results-tables

# Start-up (trace + first call) and steady step beside the plain sequence at other settings:
# the unrolled executor alone, cells of d=256, K=8 with L=64 against the unrolled executor,
# K=4 three times round after round over M, FProp under a tape, eval, and stages on TF workers
# (run on an idle machine: about 40 minutes on 2 cores).
startup-results: $(STAMP)
	$(PY) tools/startup.py --notick_loop --num_stages=4 --layers=16 --micro_batches=4,16,32 \
	  --output=$(RESULTS)/startup_unrolled.json > $(RESULTS)/startup_unrolled.txt
	$(PY) tools/startup.py --compare_unrolled --dim=256 --num_stages=4 --layers=8 \
	  --micro_batches=4,16 \
	  --output=$(RESULTS)/startup_tick_loop_d256.json > $(RESULTS)/startup_tick_loop_d256.txt
	$(PY) tools/startup.py --compare_unrolled --dim=256 --batch_size=256 --num_stages=4 \
	  --layers=8 --micro_batches=8 --schedules=1f1b,gpipe --steps=7 \
	  --output=$(RESULTS)/startup_tick_loop_d256_b256.json \
	  > $(RESULTS)/startup_tick_loop_d256_b256.txt
	$(PY) tools/startup.py --compare_unrolled --num_stages=8 --layers=64 --micro_batches=4,32 \
	  --schedules=1f1b --output=$(RESULTS)/startup_k8_l64.json > $(RESULTS)/startup_k8_l64.txt
	$(PY) tools/startup.py --num_stages=4 --layers=16,64 --micro_batches=4,32 --schedules=1f1b \
	  --repeats=3 --steps=3 --output=$(RESULTS)/startup_repeats_k4.json \
	  > $(RESULTS)/startup_repeats_k4.txt
	for g in off on; do \
	  flag=$$( [ $$g = on ] && echo --cell_grappler || echo --nocell_grappler ); \
	  $(PY) tools/startup.py $$flag --num_stages=4 --layers=16,64 --micro_batches=4,32 \
	    --schedules=1f1b --repeats=3 --steps=3 \
	    --output=$(RESULTS)/startup_repeats_k4_grappler_$$g.json \
	    > $(RESULTS)/startup_repeats_k4_grappler_$$g.txt || exit 1; done
	$(PY) tools/startup.py --measure=fprop --compare_unrolled --num_stages=4 --layers=16 \
	  --micro_batches=4,16,32 --output=$(RESULTS)/startup_fprop.json > $(RESULTS)/startup_fprop.txt
	$(PY) tools/startup.py --measure=eval --compare_unrolled --num_stages=4 --layers=16 \
	  --micro_batches=4,16,32 --output=$(RESULTS)/startup_eval.json > $(RESULTS)/startup_eval.txt
	for m in train eval fprop; do \
	  suffix=$$( [ $$m = train ] || echo _$$m ); \
	  $(PY) tools/startup.py --workers --compare_unrolled --measure=$$m --num_stages=2 \
	    --layers=4 --dim=128 --micro_batches=4,16 \
	    --output=$(RESULTS)/startup_workers$$suffix.json \
	    > $(RESULTS)/startup_workers$$suffix.txt || exit 1; done
	$(MAKE) results-tables

# The quick start's demo figures: both demos trained (and the translation decoded), measured.
demo-results: $(STAMP)
	$(PY) tools/demo_results.py --out=$(RESULTS)/demos.json
	$(MAKE) results-tables

# The results tables of the README and docs/*.md, rewritten from the JSON files under docs/results
# (no figure typed). readme-results is the old name.
results-tables readme-results: $(STAMP)
	$(PY) tools/results_table.py --write

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache docs/_build
