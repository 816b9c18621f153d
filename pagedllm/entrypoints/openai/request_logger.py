"""vLLM's ``--enable-log-requests``: one INFO line per engine request as it is queued.

The line names the request id, the sampling params, the prompt's length in tokens and
its token ids (and its text, when the client sent text), each cut to ``--max-log-len``
characters / ids (unlimited by default, as in vLLM).  Off by default: prompts can hold
private data, and at high request rates the lines cost time on the event loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("pagedllm.api_server")


@dataclass(frozen=True)
class RequestLogger:
    max_log_len: int | None = None

    def log(self, request_id: str, prompt: Any, params: Any) -> None:
        text, ids = None, None
        if isinstance(prompt, dict):
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        elif isinstance(prompt, str):
            text = prompt
        num = len(ids) if ids is not None else None
        n = self.max_log_len
        if n is not None:
            text = text[:n] if isinstance(text, str) else text
            ids = list(ids[:n]) if ids is not None else None
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, "
                    "prompt length: %s", request_id, text, params, ids, num)
