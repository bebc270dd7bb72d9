"""Shared test set-up: this folder is on sys.path, so every suite can import `tandem_process`."""

import os

# The real-vLLM tier runs apart, inside a network namespace of its own (`make test-vllm`), which
# sets TANDEM_VLLM_PYTHON; a plain `pytest tests` leaves it out.
collect_ignore = [] if os.environ.get("TANDEM_VLLM_PYTHON") else ["realvllm"]
