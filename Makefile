PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.installed

.PHONY: demo test lint bench clean shipped

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv .venv
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	.venv/bin/shardkit train

test: $(STAMP)
	.venv/bin/ruff check src tests benchmarks examples
	$(PY) -m pytest

# the planner's measurements of the catalogue's models, shipped with the package (planner/shipped.py)
shipped: $(STAMP)
	$(PY) -m shardkit.planner.ship

lint: $(STAMP)
	.venv/bin/ruff check src tests benchmarks examples

bench: $(STAMP)
	$(PY) benchmarks/apply_overhead.py --steps 30
	$(PY) benchmarks/pipeline.py --steps 10 --out runs/pipeline-bench
	$(PY) benchmarks/sequence.py --steps 3
	$(PY) benchmarks/checkpoint.py --repeats 3
	$(PY) benchmarks/recompute.py
	$(PY) benchmarks/planner.py --steps 3
	$(PY) benchmarks/calibration_spread.py
	$(PY) benchmarks/op_prices.py
	$(PY) benchmarks/memory_model.py
	$(PY) benchmarks/cold_start.py
	$(PY) benchmarks/generate.py --new 16 --rounds 1
	$(PY) benchmarks/moe.py --steps 3
	$(PY) benchmarks/cli_startup.py --repeats 5

clean:
	rm -rf .venv build dist src/*.egg-info .pytest_cache
