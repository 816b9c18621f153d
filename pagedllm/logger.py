"""The ``pagedllm`` logger: INFO to stderr by default (``PAGEDLLM_LOGGING_LEVEL`` changes
it), so start-up decisions (KV blocks, concurrency, graph sizes) are visible."""

from __future__ import annotations

import logging
from typing import Any

import pagedllm.envs as envs

# One timestamp format for every line a server prints: the API process, the engine-core
# process (engine/core_proc.py) and uvicorn's access log.
DATE_FORMAT = "%m-%d %H:%M:%S"
LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s] %(message)s"


def init_logger() -> logging.Logger:
    logger = logging.getLogger("pagedllm")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt=DATE_FORMAT))
        logger.addHandler(handler)
        logger.setLevel(envs.logging_level())
        logger.propagate = False
    return logger


def uvicorn_log_config(level: str, access_log: bool) -> dict[str, Any]:
    """uvicorn's logging in our format, on stderr: its errors at ``level``, and with
    ``access_log`` one line per HTTP request (client, request line, status)."""
    access_fmt = ('%(levelname)s %(asctime)s %(name)s] %(client_addr)s - "%(request_line)s" '
                  '%(status_code)s')
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "default": {"format": LOG_FORMAT, "datefmt": DATE_FORMAT},
            "access": {"()": "uvicorn.logging.AccessFormatter", "fmt": access_fmt,
                       "datefmt": DATE_FORMAT, "use_colors": False},
        },
        "handlers": {
            "default": {"class": "logging.StreamHandler", "formatter": "default",
                        "stream": "ext://sys.stderr"},
            "access": {"class": "logging.StreamHandler", "formatter": "access",
                       "stream": "ext://sys.stderr"},
        },
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},
            "uvicorn.access": {"handlers": ["access"], "propagate": False,
                               "level": "INFO" if access_log else "CRITICAL"},
        },
    }
