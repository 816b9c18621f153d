"""The model runner's encoder cache: each image is encoded once, its output scattered into
the placeholder rows of every step that computes part of its run.

```
 step k:   chunk [.. t t <img 0..9>]      encode A -> cache[id_A] (held by r1)
 step k+1: chunk [<img 10..24> t t ..]    rows 10..24 of cache[id_A]; run done -> released
 r2, same image, while r1 holds it:       cache hit, no encoder run
```

Entries are keyed by the image's content identifier (``MultiModalFeature.identifier``)
and reference-counted by the requests holding them: the scheduler names each step's
encoder inputs (``SchedulerOutput.scheduled_encoder_inputs``) and the ones whose runs are
done (``free_encoder_inputs``); a request that leaves the batch (finished, aborted or
preempted) drops its holds, so a recomputed request encodes again or hits another's entry.
Steps without images never reach ``embedder`` (it returns None): their inputs, and the
CUDA graphs, are unchanged.

A model whose image tokens attend to their whole run (``whole_placeholder_runs``: Gemma
3) also gets, in its image steps, each token's last visible key position
(``query_limits`` -> ``AttentionMetadata.query_limits``): the run's last position for a
token of a run, its own position otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.core.outputs import SchedulerOutput
from pagedllm.multimodal.inputs import MultiModalFeature, overlapping


class EncoderCache:
    """Encoder outputs by identifier, the requests holding each, and the step's
    ``inputs_embeds``.  ``model`` provides ``embed_multimodal`` and
    ``get_input_embeddings`` (models/llava.py)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        # Image tokens see their whole run (models/gemma3_mm.py): ``query_limits``.
        self.whole_runs = bool(getattr(model, "whole_placeholder_runs", False))
        self.features: dict[str, list[MultiModalFeature]] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.holders: dict[str, set[str]] = {}
        # Counters (an image requested while another request holds it is a hit).
        self.num_hits = 0
        self.num_encoded = 0
        # Time in the encoder, only once a benchmark asks (``start_timing``).
        self.timer: EncoderTimer | None = None

    def start_timing(self) -> EncoderTimer:
        """Time every later encode (``EncoderTimer``); returns the timer."""
        if self.timer is None:
            self.timer = EncoderTimer(self.device)
        return self.timer

    # -- bookkeeping ------------------------------------------------------------------
    def update(self, sched: SchedulerOutput) -> None:
        """Apply the step's diffs (forks, departures, new requests), then encode the
        step's encoder inputs; call after the runner applied the same diffs."""
        for f in sched.forks:
            feats = self.features.get(f.parent_req_id)
            if feats:
                self.features[f.child_req_id] = feats
        for rid in sched.finished_req_ids:
            self._drop_holds(rid)
            if rid not in sched.preempted_req_ids:
                self.features.pop(rid, None)
        for nr in sched.new_reqs:
            if nr.mm_features:
                self.features[nr.req_id] = nr.mm_features
        if sched.scheduled_encoder_inputs:
            self._encode(sched.scheduled_encoder_inputs)

    def release(self, free: dict[str, list[int]]) -> None:
        """Drop the holds whose placeholder runs are computed (after the forward)."""
        for rid, idxs in free.items():
            feats = self.features.get(rid)
            if feats is not None:
                for i in idxs:
                    self._release(feats[i].identifier, rid)

    def _release(self, ident: str, rid: str) -> None:
        holders = self.holders.get(ident)
        if holders is None:
            return
        holders.discard(rid)
        if not holders:
            del self.holders[ident]
            del self.outputs[ident]

    def _drop_holds(self, rid: str) -> None:
        for f in self.features.get(rid, ()):
            self._release(f.identifier, rid)

    # -- encoding ---------------------------------------------------------------------
    def _encode(self, scheduled: dict[str, list[int]]) -> None:
        """Encode the scheduled features not cached yet, images of one tensor layout
        in one ``embed_multimodal`` call."""
        todo: dict[str, MultiModalFeature] = {}
        for rid, idxs in scheduled.items():
            feats = self.features[rid]
            for i in idxs:
                f = feats[i]
                if f.identifier in self.outputs or f.identifier in todo:
                    self.num_hits += 1
                else:
                    todo[f.identifier] = f
                self.holders.setdefault(f.identifier, set()).add(rid)
        groups: dict[Any, list[MultiModalFeature]] = {}
        for f in todo.values():
            layout = tuple((k, v.dtype, tuple(v.shape)) for k, v in sorted(f.data.items()))
            groups.setdefault(layout, []).append(f)
        for feats in groups.values():
            mark = self.timer.start() if self.timer is not None else None
            batch = {k: torch.from_numpy(np.stack([f.data[k].to_numpy() for f in feats]))
                     .to(self.device) for k in feats[0].data}
            outs = self.model.embed_multimodal(batch)  # type: ignore[operator]
            if mark is not None:
                self.timer.stop(mark)  # type: ignore[union-attr]
            for f, out in zip(feats, outs):
                if out.shape[0] != f.length:
                    raise ValueError(f"the image encoder gave {out.shape[0]} rows for a "
                                     f"placeholder run of {f.length} tokens")
                self.outputs[f.identifier] = out
            self.num_encoded += len(feats)

    # -- the step's embeddings --------------------------------------------------------
    def embedder(self, order: list[str], num_computed: np.ndarray, num_new: np.ndarray,
                 query_start_loc: np.ndarray,
                 ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A function ``input ids [T] -> inputs_embeds [T, hidden]`` for this step:
        token embeddings with the encoder outputs written over the placeholder rows the
        step computes; None when no scheduled chunk meets an image."""
        features = self.features
        if not features:  # no live request has images: the text path, O(1)
            return None
        dst: list[np.ndarray] = []
        src: list[torch.Tensor] = []
        for i, rid in enumerate(order):
            feats = features.get(rid)
            if not feats:
                continue
            start = int(num_computed[i])
            end = start + int(num_new[i])
            for _, f in overlapping(feats, start, end):
                lo, hi = max(start, f.offset), min(end, f.end)
                out = self.outputs.get(f.identifier)
                if out is None:
                    raise RuntimeError(f"request {rid}: image {f.identifier[:12]} is "
                                       "not encoded (the scheduler did not schedule it)")
                src.append(out[lo - f.offset:hi - f.offset])
                q0 = int(query_start_loc[i]) + lo - start
                dst.append(np.arange(q0, q0 + hi - lo))
        if not src:
            return None
        rows = torch.from_numpy(np.concatenate(dst)).to(self.device)
        values = torch.cat(src)
        model = self.model

        def embed(ids: torch.Tensor) -> torch.Tensor:
            emb = model.get_input_embeddings(ids)  # type: ignore[operator]
            return emb.index_copy(0, rows, values.to(emb.dtype))

        return embed

    def query_limits(self, order: list[str], num_computed: np.ndarray, num_new: np.ndarray,
                     query_start_loc: np.ndarray) -> np.ndarray:
        """``[num tokens]`` int32: each of the step's tokens' last visible key position
        (module doc; ``AttentionMetadata.query_limits``).  ``RuntimeError`` when a chunk
        ends inside a run: the scheduler keeps runs whole for such models
        (``core/encoder_budget.py``), and a split run would attend to unwritten keys."""
        counts = num_new.astype(np.int64)
        req = np.repeat(np.arange(len(order)), counts)
        tok = np.arange(int(counts.sum()))
        limits = (num_computed[req] + tok - query_start_loc[:-1][req]).astype(np.int32)
        for i, rid in enumerate(order):
            feats = self.features.get(rid)
            if not feats:
                continue
            start = int(num_computed[i])
            end = start + int(num_new[i])
            for _, f in overlapping(feats, start, end):
                if f.end > end:
                    raise RuntimeError(f"request {rid}: a chunk ends inside an image's "
                                       "placeholder run, which this model computes whole")
                q0 = int(query_start_loc[i]) + max(start, f.offset) - start
                limits[q0:q0 + f.end - max(start, f.offset)] = f.end - 1
        return limits


class EncoderTimer:
    """Seconds spent encoding images (pixels to the device, then the tower), for a
    benchmark's "encoder share of the step time".  Off unless asked: on a GPU each encode
    records two CUDA events on the stream (no host sync in the step); ``seconds`` waits
    for them once, when read.  On the CPU the host clock times the (synchronous) call."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[Any, Any]] = []
        self._seconds = 0.0
        self.calls = 0

    def start(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, mark: Any) -> None:
        self.calls += 1
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._pending.append((mark, ev))
        else:
            self._seconds += time.perf_counter() - mark

    def seconds(self) -> float:
        """Total so far (synchronises with the events recorded since the last read)."""
        for a, b in self._pending:
            b.synchronize()
            self._seconds += a.elapsed_time(b) / 1000.0
        self._pending.clear()
        return self._seconds
