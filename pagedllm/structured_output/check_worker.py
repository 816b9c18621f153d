"""The grammar-check worker: a child process of the API server that parses, checks and
test-compiles one request's constraint at a time (``checker.GrammarChecker`` drives it).

Protocol: one JSON object per line on stdin, one reply per line on stdout (ASCII JSON;
no pickle).  The first line configures the worker::

    {"tokenizer_info": str | null}      # xgrammar TokenizerInfo.serialize_json()

and it answers ``{"ready": true}``.  Then each request::

    {"params": {StructuredOutputsParams fields}, "field": str, "max_bytes": int}

is answered ``{"bytes": int}`` (the compiled grammar's size, 0 without a tokenizer) or
``{"error": str}`` (one line, no traceback, no path).  The worker runs the very checks
the engine would (``limits.check_limits``, ``backend.validate``) and then compiles the
grammar against the model's vocabulary, as the engine core will: a constraint that
compiles here within the parent's time budget compiles there in about the same time.
Time is bounded by the parent, which kills the worker when a reply is late (xgrammar
is C++: no signal interrupts it); the worker runs at nice 10, below the API server.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def check_one(req: dict[str, Any], compiler: Any) -> dict[str, Any]:
    from pagedllm.structured_output.backend import _grammar, validate
    from pagedllm.structured_output.limits import check_limits
    from pagedllm.structured_outputs_params import StructuredOutputsParams

    field = str(req.get("field") or "structured_outputs")
    try:
        p = StructuredOutputsParams(**req["params"])
        check_limits(p, field)
        validate(p, field)
    except (TypeError, ValueError) as e:
        return {"error": str(e).splitlines()[0]}
    if compiler is None:
        return {"bytes": 0}
    try:
        size = int(compiler.compile_grammar(_grammar(p)).memory_size_bytes)
    except Exception as e:  # xgrammar: RuntimeError for anything it refuses
        from pagedllm.structured_output.backend import clean_error

        return {"error": f"{field}: could not compile: {clean_error(e)}"}
    max_bytes = int(req.get("max_bytes") or 0)
    if max_bytes and size > max_bytes:
        return {"error": f"{field}: the compiled grammar takes {size / 2**20:.1f} MiB; "
                         f"the limit is {max_bytes / 2**20:.0f} MiB"}
    return {"bytes": size}


def main() -> None:
    os.nice(10)
    import xgrammar as xgr

    config = json.loads(sys.stdin.readline() or "{}")
    compiler = None
    if config.get("tokenizer_info"):
        info = xgr.TokenizerInfo.deserialize_json(config["tokenizer_info"])
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    import pagedllm.structured_output.backend  # noqa: F401  (imported before "ready")

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            reply = check_one(json.loads(line), compiler)
        except Exception as e:  # a malformed line: answer it, stay alive
            reply = {"error": f"structured_outputs: could not check ({type(e).__name__})"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
