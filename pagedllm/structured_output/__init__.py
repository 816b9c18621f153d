"""Structured outputs, the torch-free half: validating and compiling grammars
(``backend``, xgrammar) and the engine core's waiting room for requests whose grammar
is compiling (``gate``).  The parameters are plain data below everything
(``pagedllm/structured_outputs_params.py``); the per-request matchers and the step's
bitmask live in the device half, ``worker/structured_output/``."""
