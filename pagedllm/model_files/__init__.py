"""What a model is on disk, read without torch: where its checkpoint, config and tokenizer
are (``resolve.py``), and a GGUF file's header, metadata and tensor index
(``gguf_file.py``).  Plain data below ``config.py`` (whose ``ModelConfig`` holds a
``ResolvedModel``), ``layers/`` and ``models/``, which all read it."""
