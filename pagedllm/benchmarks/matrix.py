"""The model-zoo matrix (issue 43): W1 and W4 on every listed shape, one table.

Each row is a dummy shape (``DUMMY_CONFIGS``), optionally ``+METHOD`` for
``--quantization METHOD`` (``llama3-8b+fp8``).  Per row and workload one fresh child
process runs the ordinary benchmark -- ``python -m pagedllm bench throughput --workload
W1 --no-hf`` (output tok/s) and ``python -m pagedllm bench latency`` (W4: TPOT and TTFT)
-- so a model's device memory is gone before the next starts, and a crash, a hang or an
out-of-memory stays in its row.  A row has ``--row-timeout`` seconds for all its
children; a failed or timed-out child puts its reason in the row's status and the
matrix goes on.  The weights' size comes from the child's start-up log line ``loaded
... weights ...: X MiB`` (the benchmarks' JSON does not carry it).  Exit status 0 when
every row ran cleanly, 1 otherwise (after the table).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.benchmarks.workloads import DUMMY_CONFIGS, add_dummy_overrides_arg

DEFAULT_ROWS = ("llama3-8b", "qwen3-30b-a3b", "mixtral-8x7b", "gemma-3-12b", "phi-4-14b",
                "qwen2.5-7b", "llama3-8b-w4a16", "llama3-8b-w4a16-asym", "llama3-8b+fp8")
WORKLOADS = ("W1", "W4")
# worker.py's start-up line: "loaded NAME (DTYPE, DEVICE, weights QUANT: X MiB[, ...])".
# QUANT may hold ": " itself, so the greedy ".*" takes the last ": X MiB".
_WEIGHTS_RE = re.compile(r"loaded .*weights .*: ([0-9]+(?:\.[0-9]+)?) MiB")


@dataclass(frozen=True)
class Row:
    """One line of the matrix: ``name`` as given, the dummy shape, the quantisation."""

    name: str
    dummy: str
    quantization: str | None = None


@dataclass
class ChildRun:
    """One child benchmark: its command, exit status, time, report and failure."""

    command: list[str]
    rc: int | None = None
    seconds: float = 0.0
    error: str | None = None  # None when the child exited 0 and wrote its report
    report: dict[str, Any] | None = None
    weight_mib: float | None = None
    stderr_tail: list[str] = field(default_factory=list)


def parse_rows(spec: str) -> list[Row]:
    """``--rows``' comma-separated names as rows; ``ValueError`` naming ``--rows`` for an
    unknown shape or quantisation method, or an empty list."""
    rows = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        dummy, _, quant = item.partition("+")
        if dummy not in DUMMY_CONFIGS:
            raise ValueError(f"--rows: unknown row {item!r}; a row is a dummy shape "
                             f"({', '.join(DUMMY_CONFIGS)}), optionally +METHOD for "
                             f"--quantization METHOD (e.g. llama3-8b+fp8)")
        if quant:
            from pagedllm.layers.quantization import quantization_names

            if quant not in quantization_names():
                raise ValueError(f"--rows: row {item!r}: unknown quantization {quant!r}; "
                                 f"choices: {', '.join(quantization_names())}")
        rows.append(Row(item, dummy, quant or None))
    if not rows:
        raise ValueError("--rows: no rows given")
    return rows


def parse_workloads(spec: str) -> list[str]:
    """``--workloads`` as a list of ``WORKLOADS`` members (``ValueError`` otherwise)."""
    wls = [w.strip().upper() for w in spec.split(",") if w.strip()]
    bad = [w for w in wls if w not in WORKLOADS]
    if bad or not wls:
        raise ValueError(f"--workloads: {', '.join(bad) or 'none given'}; choose from "
                         f"{', '.join(WORKLOADS)}")
    return wls


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                   help="Comma-separated rows: a dummy shape (bench throughput's "
                        "--dummy names), optionally +METHOD to run it with "
                        "--quantization METHOD (llama3-8b+fp8).")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="Comma-separated workloads per row: W1 = bench throughput "
                        "--workload W1 --no-hf (output tok/s); W4 = bench latency "
                        "(single-stream TPOT and TTFT).")
    p.add_argument("--repeats", type=int, default=1,
                   help="W1: timed runs per row (bench throughput --repeats; the median "
                        "is reported).")
    p.add_argument("--w1-num-prompts", type=int, default=None,
                   help="W1: only the first N of its requests (default: all 256; fewer "
                        "for a CPU smoke run).")
    p.add_argument("--w4-input-len", type=int, default=None,
                   help="W4: prompt tokens (default: bench latency's, 512).")
    p.add_argument("--w4-output-len", type=int, default=None,
                   help="W4: generated tokens (default: bench latency's, 256).")
    p.add_argument("--w4-num-prompts", type=int, default=None,
                   help="W4: fresh prompts, medians reported (default: bench latency's, "
                        "3).")
    add_dummy_overrides_arg(p)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="Every child's --device (auto = cuda when available).")
    p.add_argument("--extra-args", default="", metavar="ARGS",
                   help="More flags for every child, one shell-quoted string (e.g. "
                        "--extra-args='--kv-cache-dtype fp8 --max-model-len 4096'). "
                        "Default: none.")
    p.add_argument("--row-timeout", type=float, default=600.0,
                   help="Seconds one row's children may take together (start-up "
                        "included); a child still running then is killed and the row "
                        "says so.")
    p.add_argument("--log-dir", default=None,
                   help="Keep every child's stdout/stderr and report here (default: a "
                        "new temporary directory, printed at the start).")
    p.add_argument("--output-json", default=None,
                   help="Write every row's figures, statuses and the children's own "
                        "reports here as JSON.")
    p.add_argument("--markdown", action="store_true",
                   help="Print the table as Markdown (for docs/benchmarks.md).")


def child_command(row: Row, workload: str, args: argparse.Namespace,
                  report: str) -> list[str]:
    """The child's command line for ``row``'s ``workload``, writing JSON to ``report``."""
    cmd = [sys.executable, "-m", "pagedllm", "bench"]
    if workload == "W1":
        cmd += ["throughput", "--workload", "W1", "--no-hf", "--repeats", str(args.repeats)]
        if args.w1_num_prompts is not None:
            cmd += ["--num-prompts", str(args.w1_num_prompts)]
    else:
        cmd += ["latency"]
        for flag, value in (("--input-len", args.w4_input_len),
                            ("--output-len", args.w4_output_len),
                            ("--num-prompts", args.w4_num_prompts)):
            if value is not None:
                cmd += [flag, str(value)]
    cmd += ["--dummy", row.dummy, "--device", args.device, "--output-json", report]
    if row.quantization:
        cmd += ["--quantization", row.quantization]
    if args.dummy_overrides:
        cmd += ["--dummy-overrides", json.dumps(args.dummy_overrides)]
    return cmd + shlex.split(args.extra_args)


def run_child(cmd: list[str], timeout: float, log_stem: str, report: str) -> ChildRun:
    """Run ``cmd`` in its own session with at most ``timeout`` seconds; on time-out the
    whole process group (engine-core or worker processes too) is killed.  stdout and
    stderr go to ``log_stem``.out / .err; the result holds the report JSON when the child
    wrote it, else the reason it failed."""
    run = ChildRun(cmd)
    if timeout <= 0:
        run.error = "not run: the row's time was spent"
        return run
    t0 = time.perf_counter()
    with open(log_stem + ".out", "w") as out, open(log_stem + ".err", "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            run.rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            run.error = f"timed out after {timeout:.0f} s"
    run.seconds = time.perf_counter() - t0
    with open(log_stem + ".err", errors="replace") as f:
        lines = f.read().splitlines()
    run.stderr_tail = lines[-20:]
    for line in lines:
        m = _WEIGHTS_RE.search(line)
        if m:
            run.weight_mib = float(m.group(1))
            break
    if run.error is None and run.rc != 0:
        run.error = f"exit {run.rc}: {_failure_line(lines)}"
    if run.error is None:
        try:
            with open(report) as f:
                run.report = json.load(f)
        except (OSError, ValueError) as e:
            run.error = f"no report: {e}"
    return run


def _failure_line(lines: list[str]) -> str:
    """The most telling stderr line: the last exception or error line, else the last."""
    lines = [ln.strip() for ln in lines if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^([\w.]+(Error|Exception|Interrupt)\b|error:|Killed)", ln):
            return ln
    return lines[-1] if lines else "no output"


def figures(runs: dict[str, ChildRun]) -> dict[str, Any]:
    """A row's headline figures from its children's reports (None where missing)."""
    w1 = runs.get("W1")
    w4 = runs.get("W4")
    w1_rows = (w1.report or {}).get("rows") if w1 is not None else None
    w4_rep = w4.report if w4 is not None else None
    mib = next((r.weight_mib for r in runs.values() if r.weight_mib is not None), None)
    device = next((r.report.get("device") or r.report.get("meta", {}).get("device")
                   for r in runs.values() if r.report), None)
    return {"device": device,
            "w1_out_tok_s": w1_rows[0]["pagedllm_out_tok_s"] if w1_rows else None,
            "w4_tpot_ms": w4_rep["tpot_ms"] if w4_rep else None,
            "w4_ttft_ms": w4_rep["ttft_ms"] if w4_rep else None,
            "weight_gib": mib / 1024 if mib is not None else None}


def run_row(row: Row, workloads: list[str], args: argparse.Namespace,
            log_dir: str) -> dict[str, Any]:
    """Run ``row``'s workloads one child after another within ``--row-timeout``; the
    row's figures, ``ok``, a ``status`` (``ok`` or each failure) and every child run."""
    t0 = time.perf_counter()
    runs: dict[str, ChildRun] = {}
    safe = re.sub(r"[^\w.-]", "_", row.name)
    for wl in workloads:
        stem = os.path.join(log_dir, f"{safe}.{wl}")
        report = stem + ".json"
        left = args.row_timeout - (time.perf_counter() - t0)
        runs[wl] = run_child(child_command(row, wl, args, report), left, stem, report)
    failures = [f"{wl}: {r.error}" for wl, r in runs.items() if r.error is not None]
    return {"row": row.name, "dummy": row.dummy, "quantization": row.quantization,
            **figures(runs), "ok": not failures,
            "status": "; ".join(failures) if failures else "ok",
            "seconds": time.perf_counter() - t0,
            "runs": {wl: {"command": shlex.join(r.command), "rc": r.rc,
                          "seconds": r.seconds, "error": r.error,
                          "weight_mib": r.weight_mib, "report": r.report,
                          **({"stderr_tail": r.stderr_tail} if r.error else {})}
                     for wl, r in runs.items()}}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    """The matrix as aligned text, or as a Markdown table with ``markdown``."""
    head = ["row", "W1 out tok/s", "W4 TPOT ms", "W4 TTFT ms", "weights GiB", "status"]
    body = [[r["row"], _fmt(r["w1_out_tok_s"], ",.1f"), _fmt(r["w4_tpot_ms"], ".2f"),
             _fmt(r["w4_ttft_ms"], ".2f"), _fmt(r["weight_gib"], ".2f"), r["status"]]
            for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * 4 + "---|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in line) + " |"
                  for line in body]
        return "\n".join(lines)
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head) - 1)]
    out = []
    for line in [head, *body]:
        cells = [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in
                                              zip(line[1:-1], widths[1:])]
        out.append("  ".join([*cells, line[-1]]))
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out)


def _commit() -> str | None:
    """The source tree's short commit, when it is a git checkout."""
    try:
        res = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    return (res.stdout.strip() or None) if res.returncode == 0 else None


def main(args: argparse.Namespace) -> int:
    rows = parse_rows(args.rows)  # errors before anything runs
    workloads = parse_workloads(args.workloads)
    shlex.split(args.extra_args)  # a quoting error, too
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="pagedllm-matrix-")
    os.makedirs(log_dir, exist_ok=True)
    print(f"bench matrix: {len(rows)} rows x {', '.join(workloads)}; child logs in "
          f"{log_dir}", flush=True)
    results = []
    for i, row in enumerate(rows, 1):
        res = run_row(row, workloads, args, log_dir)
        results.append(res)
        print(f"[{i}/{len(rows)}] {row.name}: W1 {_fmt(res['w1_out_tok_s'], ',.1f')} tok/s, "
              f"W4 TPOT {_fmt(res['w4_tpot_ms'], '.2f')} ms, TTFT "
              f"{_fmt(res['w4_ttft_ms'], '.2f')} ms; {res['status']} "
              f"({res['seconds']:.0f} s)", flush=True)
    print()
    print(format_table(results, args.markdown))
    if args.output_json:
        meta = {"date": time.strftime("%Y-%m-%d"), "commit": _commit(),
                "workloads": workloads, "repeats": args.repeats, "device": args.device,
                "dummy_overrides": args.dummy_overrides, "extra_args": args.extra_args,
                "row_timeout_s": args.row_timeout, "log_dir": log_dir}
        with open(args.output_json, "w") as f:
            json.dump({"meta": meta, "rows": results}, f, indent=2)
    return 0 if all(r["ok"] for r in results) else 1
