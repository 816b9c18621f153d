"""Multi-LoRA, the device half: ``peft``: loading a PEFT adapter's weights into tensors;
``layers``: the stacked slot weights of one linear layer and the batched ``y += scale * x
A^T B^T``; ``manager``: which adapter sits in which GPU slot, an LRU of adapters on the
CPU, and the per-step token -> slot mapping.  The torch-free request, adapter files and
registry are ``pagedllm/lora/``."""
