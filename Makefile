# The two commands of the README.
.PHONY: serve test lint
serve:
	scripts/bootstrap.sh
	.venv/bin/hybrid-jax serve

test:
	scripts/bootstrap.sh test
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q

lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check .
