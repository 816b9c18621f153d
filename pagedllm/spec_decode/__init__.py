"""Speculative decoding, the torch-free half: its configuration (``config``), the per-step
policy (``policy``) and the scheduler's side (``scheduling``).  The core imports it; the
device half -- proposers, the rejection sampler and the model runner's hook -- is
``worker/spec_decode/``, which imports this, never the reverse.  See
docs/speculative_decoding.md."""
