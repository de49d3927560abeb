# strata developer entry points.  `make test` is what CI runs (via .ci/run).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.stamp

# Debian packages: required ones must install; optional ones (gVisor's runsc)
# are installed when apt has a candidate and skipped with a message otherwise.
# The day benchmark (`make day`) also runs its peers over the same moto bucket: s3fs,
# s3backer (with ext4 on its block device), rclone mount, and npm for its `npm ci`
# (npm comes with this machine's nodejs build; Debian's own npm package conflicts with it).
# The image tests build real images with umoci, skopeo and busybox-static, and a Debian
# root with mmdebstrap (from the machine's Debian mirror, cached in .pytest_cache).
# The fleet fault tests run members with their wall clocks off through faketime.
APT_PKGS     := fuse3 libfuse3-dev pkg-config bubblewrap git sqlite3 rsync iproute2 \
                chromium chromium-driver zstd e2fsprogs nodejs iptables \
                umoci skopeo busybox-static mmdebstrap faketime
APT_OPTIONAL := runsc s3fs s3backer rclone

.PHONY: deps apt-deps lint test demo bench bench-scale bench-fleet day fuzz clean

deps: apt-deps $(STAMP)

apt-deps:
	@bash scripts/apt-deps.sh $(APT_PKGS) -- $(APT_OPTIONAL)

$(VENV)/pyvenv.cfg:
	$(PYTHON) -m venv $(VENV)

# Re-run pip only when pyproject.toml is newer than the stamp (or the venv is new).
$(STAMP): pyproject.toml | $(VENV)/pyvenv.cfg
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $@

lint: deps
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy src

test: deps lint
	$(BIN)/pytest -q

demo: deps
	bash scripts/demo.sh

bench: deps
	$(BIN)/python -m bench

# Each cost on a ~1M-object bucket store beside the same on ~100k (about 6 minutes);
# SCALE=--large: 10M beside 1M, SCALE=--quick: 100k beside 10k.
bench-scale: deps
	$(BIN)/python -m bench --only scale $(SCALE) --out bench/results/scale.json

# Three fleet members on loopback: failover after SIGKILL (20 kills), planned moves
# (20), routing overhead (about 4 minutes).
bench-fleet: deps
	$(BIN)/python -m bench --only fleet --out bench/results/fleet.json

# One agent's day on every rung: local disk, upload at stop, s3fs, s3backer,
# rclone mount, NFS when the kernel has nfsd, and the strata workspace. Sizes: DAY_* env vars.
day: deps
	$(BIN)/python -m bench --only day

# Longer randomized checks than `make test` runs: a 600-step isolation history (steps,
# forks, SIGKILLed runners and servers), the store state machine with more examples,
# schemathesis with 1000 examples per API operation and mode (20,000 publish bodies), and
# 60 s of gzip, slow and oversized traffic beside legitimate clients (each call under 1 s,
# the server under 512 MiB over idle), every broken fleet build, and 100 fleet fault rounds.
fuzz: deps
	STRATA_HISTORY_STEPS=600 $(BIN)/pytest -q -s tests/run/test_history.py
	STRATA_STATEFUL_EXAMPLES=1000 $(BIN)/pytest -q tests/test_stateful.py
	STRATA_FUZZ_EXAMPLES=1000 STRATA_FUZZ_STATEFUL=1000 $(BIN)/pytest -q tests/server/test_fuzz_api.py
	STRATA_FUZZ_TRAFFIC=60 $(BIN)/pytest -q -s tests/server/test_fuzz_traffic.py
	FLEET_BROKEN_FENCE=1 $(BIN)/pytest -q -s tests/fleet/test_faults.py -k broken
	FLEET_ROUNDS=100 $(BIN)/pytest -q -s tests/fleet/test_faults.py -k rounds --timeout=0

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -path ./.git -prune -o \( -name '__pycache__' -o -name '*.egg-info' \) \
		-type d -prune -exec rm -rf {} +
