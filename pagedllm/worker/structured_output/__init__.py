"""Structured outputs, the device half: per-request grammar matchers (``matcher``), the
step's batched advance and bitmask fill (``batch``) and the model runner's helper that
drives them (``runner``).  Grammars are compiled by ``pagedllm/structured_output/``;
the sampler applies the bitmask (``sample/token_constraints.py``)."""
