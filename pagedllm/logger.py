"""The ``pagedllm`` logger: INFO to stderr by default (``PAGEDLLM_LOGGING_LEVEL`` changes
it), so start-up decisions (KV blocks, concurrency, graph sizes) are visible."""

from __future__ import annotations

import logging
import os


def init_logger() -> logging.Logger:
    logger = logging.getLogger("pagedllm")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(
            "%(levelname)s %(asctime)s %(name)s] %(message)s", datefmt="%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper())
        logger.propagate = False
    return logger
