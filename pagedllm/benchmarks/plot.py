"""``--plot FILE.png`` of ``pagedllm bench throughput | latency | serve``.

Each function takes the result its benchmark prints and writes to JSON (the same dict),
so a plot can also be redrawn from a saved ``--output-json``.  matplotlib is imported
here only, with the non-interactive Agg backend (no display needed).
"""

from __future__ import annotations

from typing import Any

_PCTS = ("mean", "p50", "p90", "p99")


def check_plot_path(path: str | None) -> None:
    """Before a benchmark runs: a ``ValueError`` naming ``plot`` when ``path`` cannot be
    written (missing directory) or matplotlib is missing, so a long run is not wasted."""
    if path is None:
        return
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"plot: cannot write {path}: {folder} is not a writable directory")
    _pyplot()


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plot: needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str) -> None:
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise ValueError(f"plot: cannot write {path}: {e.strerror or e}") from None
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def plot_throughput(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Output tokens/s per configuration (pagedllm, and HF when it was measured)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["config"] for r in rows]
    x = range(len(rows))
    has_hf = any("hf_out_tok_s" in r for r in rows)
    width = 0.4 if has_hf else 0.6
    ours = ax.bar([i - (width / 2 if has_hf else 0) for i in x],
                  [r["pagedllm_out_tok_s"] for r in rows], width, label="pagedllm")
    ax.bar_label(ours, fmt="%.0f")
    if has_hf:
        hf = ax.bar([i + width / 2 for i in x], [r.get("hf_out_tok_s", 0) for r in rows],
                    width, label="HF transformers")
        ax.bar_label(hf, fmt="%.0f")
        ax.legend()
    ax.set_xticks(list(x), names)
    ax.set_ylabel("output tokens / s")
    ax.set_title(title or "pagedllm bench throughput")
    _save(fig, path)


def plot_latency(res: dict[str, Any], path: str) -> None:
    """TTFT and TPOT of every prompt, with their medians."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, label in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        values = res[f"{key}_all_ms"]
        ax.plot(range(1, len(values) + 1), values, "o-")
        ax.axhline(res[f"{key}_ms"], linestyle="--", color="gray",
                   label=f"median {res[f'{key}_ms']:.2f} ms")
        ax.set_xlabel("prompt")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle(f"pagedllm bench latency: {res['input_len']} prompt tokens, "
                 f"{res['output_len']} output tokens ({res['device']})")
    _save(fig, path)


def plot_serve(s: dict[str, Any], path: str) -> None:
    """Percentiles of TTFT/TPOT/ITL/E2E, and the TTFT and ITL distributions (needs the
    per-request lists, ``ttfts`` and ``itls``)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    ax = axes[0]
    metrics = ("ttft", "tpot", "itl", "e2e")
    width = 0.2
    for j, pct in enumerate(_PCTS):
        ax.bar([i + (j - 1.5) * width for i in range(len(metrics))],
               [1000 * s[f"{m}_s"][pct] for m in metrics], width, label=pct)
    ax.set_xticks(range(len(metrics)), [m.upper() for m in metrics])
    ax.set_yscale("log")
    ax.set_ylabel("ms (log scale)")
    ax.set_title("latency percentiles")
    ax.legend()
    ttfts = [1000 * t for t in s.get("ttfts", []) if t is not None and t > 0]
    itls = [1000 * x for itl in s.get("itls", []) or [] for x in (itl or [])]
    for ax, values, name in ((axes[1], ttfts, "TTFT"), (axes[2], itls, "ITL")):
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 4)))
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("count")
        ax.set_title(f"{name} distribution ({len(values)} samples)")
    fig.suptitle(f"pagedllm bench serve: {s['model']} @ {s['request_rate']} req/s, "
                 f"{s['completed']} requests, {s['output_throughput']:.1f} output tok/s")
    _save(fig, path)
