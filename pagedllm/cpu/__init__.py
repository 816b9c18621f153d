"""C kernels for the CPU path, compiled at first use (``build.py``) and called through
ctypes.  Each module states what its kernel computes and when it applies; each falls back
to (and is tested against) the torch reference when the kernel does not apply or cannot
be built.

This package sits with ``kernels/`` (the Triton ones), below ``attention/``: it knows
only tensors.  The bindings whose arguments are attention metadata or a model's layers
live with those (``attention/cpu_decode.py``, ``models/cpu_decode_stack.py``); all the C
sources stay in ``csrc/`` (``build.CSRC``), where they include one another."""
