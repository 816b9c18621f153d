"""Model building blocks: tensor-parallel-shaped linears, norms, rotary, embeddings, and
the ``Attention`` module that hands q/k/v to an attention backend."""
