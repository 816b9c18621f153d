"""Chat templates: which ``chat_template_kwargs`` a client may set, and the sandbox that
renders client-supplied templates (``--trust-request-chat-template``).

Why a process: a template is code.  Jinja's sandbox stops attribute tricks, but not a
loop of 10^10 iterations or a 100 MB string, and a Python thread cannot be stopped.  So
a request's own template renders in one long-lived child process
(``template_worker``) bounded in time (``SIGALRM`` there; a kill from here if the reply
is still late), in memory (``RLIMIT_AS``) and in output size, and the API process only
ever sees a bounded string or a one-line error (400 naming ``chat_template``).  The
server's own template (the model's, or ``--chat-template``) is the operator's and is
rendered in-process, in a worker thread.

Renders through the sandbox are serialised (one worker): request templates are an
opt-in, rarely used feature, and one slow template then delays only other requests
that brought their own template.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from typing import Any

from pagedllm.entrypoints.openai.protocol import RequestError

logger = logging.getLogger(__name__)

RENDER_TIMEOUT_S = 5.0
# apply_chat_template's own parameters and the variables the renderer sets: a client
# setting one through chat_template_kwargs would collide with them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "conversations", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of ``chat_template_kwargs``; 400 naming it if it sets a reserved name."""
    extra = dict(kwargs or {})
    bad = sorted(set(extra) & RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(bad)}",
                           "chat_template_kwargs")
    return extra


class TemplateSandbox:
    """Renders untrusted chat templates in a bounded child process (see module doc).

    ``max_chars`` bounds the rendered text; ``timeout`` the render time."""

    def __init__(self, max_chars: int = 16 * 1024 * 1024,
                 timeout: float = RENDER_TIMEOUT_S) -> None:
        self.max_chars = max_chars
        self.timeout = timeout
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def _spawn(self) -> asyncio.subprocess.Process:
        # Replies are ASCII JSON: at most 12 bytes per character (a surrogate pair).
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pagedllm.entrypoints.openai.template_worker",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, limit=12 * self.max_chars + 65536)
        assert proc.stdout is not None
        try:
            ready = await asyncio.wait_for(proc.stdout.readline(), 120)
        except asyncio.TimeoutError:
            ready = b""
        if not ready.startswith(b'{"ready"'):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise RuntimeError("the chat-template sandbox did not start")
        return proc

    async def start(self) -> None:
        """Start the worker now (it imports transformers: ~1 s) instead of at first use."""
        async with self._lock:
            if self._proc is None or self._proc.returncode is not None:
                self._proc = await self._spawn()

    async def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    @staticmethod
    async def _exchange(proc: asyncio.subprocess.Process, line: bytes) -> bytes:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(line)
        await proc.stdin.drain()
        return await proc.stdout.readline()

    async def render(self, template: str, messages: list[dict[str, Any]], *,
                     add_generation_prompt: bool, continue_final_message: bool,
                     kwargs: dict[str, Any]) -> str:
        """The rendered text, or ``RequestError`` (400, ``param="chat_template"``)."""
        line = json.dumps({
            "template": template, "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message, "kwargs": kwargs,
            "max_chars": self.max_chars, "timeout": self.timeout}).encode() + b"\n"
        async with self._lock:
            if self._proc is None or self._proc.returncode is not None:
                self._proc = await self._spawn()
            proc = self._proc
            try:
                # The worker answers its own timeout; this one is for hangs in C code.
                reply = await asyncio.wait_for(self._exchange(proc, line),
                                               self.timeout + 2.0)
                result = json.loads(reply) if reply else {"error": "the sandbox exited"}
            except asyncio.CancelledError:
                await self._kill()  # its reply would answer the next request
                raise
            except (asyncio.TimeoutError, OSError, ValueError) as e:
                logger.warning("chat-template sandbox failed (%s); restarting it",
                               type(e).__name__)
                await self._kill()
                result = {"error": "rendering the chat template did not finish in "
                                   f"{self.timeout} s within its bounds"}
            if "error" in result:
                if self._proc is not None and self._proc.returncode is not None:
                    await self._kill()
                raise RequestError(f"chat_template: {result['error']}", "chat_template")
            return str(result["text"])

    async def close(self) -> None:
        async with self._lock:
            await self._kill()
