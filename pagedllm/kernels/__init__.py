"""Triton kernels for the GPU path: paged attention, KV-cache writes, RMSNorm, rotary
embeddings, SiLU-and-mul and sampling.

Each module's public function is the contract the layers and the model runner call; each
has a pure-PyTorch twin (``pagedllm.attention.torch_ref``, ``pagedllm.layers``) that the
tests in ``tests/kernels`` use as the oracle.  Importing this package imports triton, so
CPU-only code paths should import the modules lazily.
"""
