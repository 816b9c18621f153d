"""Images in (vision-language models): the plain data a request carries and the front
end that makes it.

* ``inputs.py``    ``MultiModalFeature`` / ``TensorData``: one image's placeholder run in
                   the prompt, its content hash and its processed tensors (msgspec, so it
                   crosses the engine-core process boundary as raw bytes)
* ``config.py``    ``MultiModalConfig`` (``limit_mm_per_prompt``) and the composite
                   config's text fields lifted to the top (``lift_text_config``)
* ``hashing.py``   content identifiers and the prefix-cache key of a block with images
* ``parse.py``     ``multi_modal_data`` and chat content parts -> PIL images
* ``media.py``     images a client names by URL (data, http(s), file), under bounds
* ``processor.py`` the model's own transformers processor, run in the front end
* ``media.py``     images a client names by URL (data:, http(s)://, file://), fetched
                   and decoded under byte, pixel and time bounds (the server's chat
                   endpoints)

Torch-free (layer 1, below ``messages.py``): the processor returns numpy arrays; the
worker turns ``TensorData`` into tensors (``worker/encoder_cache.py``).
"""
