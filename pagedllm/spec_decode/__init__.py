"""Speculative decoding: proposers (``ngram``), the rejection sampler, the per-step
policy and the scheduler/runner hooks.  See docs/architecture.md, "Speculative decoding"."""
