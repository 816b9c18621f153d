"""What a model is on disk, read without torch: a GGUF file's header, metadata and tensor
index (``gguf_file.py``).  Below ``layers/`` and ``models/``, which both read it."""
