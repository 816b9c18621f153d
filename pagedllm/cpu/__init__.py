"""C kernels for the CPU path, compiled at first use (``build.py``) and called through
ctypes.  Each module states what its kernel computes and when it applies; each falls back
to (and is tested against) the torch reference when the kernel does not apply or cannot
be built."""
