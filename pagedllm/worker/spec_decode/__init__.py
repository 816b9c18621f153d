"""Speculative decoding, the device half: the model runner's hook (``runner``), the
proposers (``ngram``, ``draft_model``, ``eagle_proposer`` with the EAGLE heads of
``eagle``) and the rejection sampler.  The torch-free configuration and policy the
scheduler uses are ``pagedllm/spec_decode/``."""
