"""The chat-template sandbox worker: a child process of the API server that renders
client-supplied chat templates (``template_sandbox.TemplateSandbox`` drives it).

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout (ASCII
JSON, so a line never holds a raw newline; no pickle).  Request::

    {"template": str, "messages": [...], "add_generation_prompt": bool,
     "continue_final_message": bool, "kwargs": {...}, "max_chars": int, "timeout": float}

Reply: ``{"text": str}`` or ``{"error": str}`` (one line, no traceback).

Bounds, each turned into an error reply while the worker lives on:

* time: ``SIGALRM`` after ``timeout`` seconds raises inside the render (Jinja templates
  compile to Python bytecode, so the signal lands between two template steps);
* memory: ``RLIMIT_AS`` caps the address space at what the worker uses once started plus
  ``PAGEDLLM_TEMPLATE_MEMORY_BYTES`` (``MemoryError`` instead of swapping the host);
* size: a rendered prompt longer than ``max_chars`` characters is refused;
* CPU share: the worker runs at nice 10, below the API server.

The parent kills and replaces the worker if a reply is late anyway (a hang in C code).
The render itself is transformers' own (``render_jinja_template``: Jinja's
``ImmutableSandboxedEnvironment``, the same globals and ``continue_final_message``
handling as ``tokenizer.apply_chat_template``), so a template renders identically here
and in-process.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
from types import FrameType
from typing import Any

import pagedllm.envs as envs


class RenderTimeout(BaseException):
    """Raised by SIGALRM in the render.  A BaseException: template code cannot catch it."""


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise RenderTimeout


def _limit_memory(extra_bytes: int) -> None:
    """Cap the address space at its current size plus ``extra_bytes``."""
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[0]) * resource.getpagesize()
    except OSError:
        return  # not Linux: rely on the time and size bounds
    limit = current + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def render_one(req: dict[str, Any], render: Any) -> dict[str, Any]:
    """One request to one reply (never raises but for ``KeyboardInterrupt``)."""
    max_chars = int(req["max_chars"])
    signal.setitimer(signal.ITIMER_REAL, float(req["timeout"]))
    try:
        rendered, _ = render(
            conversations=[req["messages"]], chat_template=req["template"],
            add_generation_prompt=bool(req["add_generation_prompt"]),
            continue_final_message=bool(req["continue_final_message"]),
            **req["kwargs"])
        text = rendered[0]
    except RenderTimeout:
        return {"error": f"rendering the chat template took longer than {req['timeout']} s"}
    except MemoryError:
        return {"error": "rendering the chat template needed too much memory"}
    except RecursionError:
        return {"error": "the chat template recursed too deeply"}
    except Exception as e:  # Jinja syntax/runtime errors, raise_exception(), bad kwargs
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        return {"error": f"cannot apply the chat template: {msg[:500]}"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if not isinstance(text, str):
        return {"error": "the chat template did not render to text"}
    if len(text) > max_chars:
        return {"error": f"the rendered chat template is longer than {max_chars} characters"}
    return {"text": text}


def main() -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    # A burning template must not take CPU from the API server it protects.
    os.nice(10)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _limit_memory(envs.template_memory_bytes())
    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:  # EOF (the parent closed the pipe or died): exit
        try:
            req = json.loads(line)
            reply = render_one(req, render_jinja_template)
        except MemoryError:
            reply = {"error": "rendering the chat template needed too much memory"}
        except (ValueError, KeyError, TypeError) as e:
            reply = {"error": f"bad sandbox request: {type(e).__name__}"}
        try:
            payload = json.dumps(reply)  # ensure_ascii: one line, whatever the text
        except MemoryError:
            payload = json.dumps({"error": "the rendered chat template is too large"})
        out.write(payload + "\n")
        out.flush()


if __name__ == "__main__":
    main()
