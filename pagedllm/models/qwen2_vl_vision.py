"""The Qwen2-VL and Qwen2.5-VL vision transformers (dynamic resolution).

The processor cuts an image, resized to a multiple of ``patch_size * merge``, into patches
of ``C x temporal_patch_size x P x P`` pixels (a still image is repeated over the two
temporal slots), listed merge-block-major, and reports its grid ``(t, h, w)`` in patches::

  pixels [N, C*T*P*P] -> patch embed (the Conv3d with stride = kernel, as one linear)
    -> blocks: x + attn(norm1 x) ; x + mlp(norm2 x)    (2-D rotary on q, k: each head's
       first half rotated by the patch's row, second half by its column)
    -> PatchMerger: norm, 2x2 neighbours concatenated -> MLP -> [N / 4, text hidden]

Attention never crosses an image (nor a frame): one segment per ``h * w`` patches.

* Qwen2-VL: LayerNorm, ``fc1 -> act -> fc2`` MLP (``mlp_ratio``), every block global.
* Qwen2.5-VL: RMSNorm, SwiGLU MLP with biases, and **window attention**: the merged
  units are reordered window by window (``window_size`` pixels square; edge windows
  smaller), so each window is a contiguous segment; blocks in ``fullatt_block_indexes``
  attend over the whole image instead.  The merger's output is put back in raster order.

Both equal transformers' modules (fp32, SDPA per segment).  ``forward(pixels, grid_thw)``
returns the merged tokens of all images, in order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.rope import apply_rotary
from pagedllm.models.clip_vision import vision_activation


def activation(name: str) -> Any:
    """``hidden_act`` of a Qwen vision tower (``silu`` for 2.5, ``quick_gelu`` for 2)."""
    return F.silu if name == "silu" else vision_activation(name)


class VisionRMSNorm(nn.Module):
    """transformers' Qwen2RMSNorm (float32 statistics, weight applied after the cast)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class PatchEmbed(nn.Module):
    """The Conv3d patch embedding as a linear over a patch's ``C*T*P*P`` values (the
    checkpoint's ``[E, C, T, P, P]`` weight is flattened at load)."""

    def __init__(self, in_features: int, embed_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, embed_dim, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels.to(self.proj.weight.dtype))


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        dtype = q.dtype  # rotated in float32, as transformers does
        q = apply_rotary(q.float(), cos, sin).to(dtype)
        k = apply_rotary(k.float(), cos, sin).to(dtype)
        return self.proj(segment_attention(q, k, v, cu_seqlens).reshape(n, -1))


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens: list[int]) -> torch.Tensor:
    """Bidirectional attention within each segment ``[cu[i], cu[i + 1])`` of ``q, k, v
    [N, H, D]``: segments of one length run as one batched SDPA call (an image's windows
    are mostly full ones), so the launches scale with distinct lengths, not windows."""
    out = torch.empty_like(q)
    by_len: dict[int, list[int]] = {}
    for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        by_len.setdefault(e - s, []).append(s)
    for length, starts in by_len.items():
        if len(starts) == 1:
            s = starts[0]
            seg = [t[s:s + length].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
            out[s:s + length] = F.scaled_dot_product_attention(*seg)[0].transpose(0, 1)
            continue
        idx = (torch.tensor(starts).unsqueeze(1) + torch.arange(length)).to(q.device)
        seg = [t[idx].transpose(1, 2) for t in (q, k, v)]  # [segments, H, L, D]
        out[idx] = F.scaled_dot_product_attention(*seg).transpose(1, 2)
    return out


class VisionMlp(nn.Module):
    """Qwen2-VL: ``fc2(act(fc1 x))``."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = activation(act)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionSwiGLU(nn.Module):
    """Qwen2.5-VL: ``down(act(gate x) * up x)``, with biases."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, norm: type[nn.Module],
                 mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = norm(dim, eps=1e-6)
        self.norm2 = norm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = norm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(),
                                 nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


def patch_rows_cols(grid_thw: list[list[int]], merge: int) -> torch.Tensor:
    """``[N, 2]`` (row, column) of every patch, in the processor's merge-block-major
    order (each image's frames repeat its grid)."""
    out = []
    for t, h, w in grid_thw:
        hh = torch.arange(h).unsqueeze(1).expand(h, w)
        ww = torch.arange(w).unsqueeze(0).expand(h, w)
        shape = (h // merge, merge, w // merge, merge)
        pos = torch.stack([hh.reshape(shape).transpose(1, 2).flatten(),
                           ww.reshape(shape).transpose(1, 2).flatten()], dim=-1)
        out.append(pos.repeat(t, 1))
    return torch.cat(out)


def frame_seqlens(grid_thw: list[list[int]]) -> list[int]:
    """Cumulative segment bounds: one segment per frame (``h * w`` patches)."""
    bounds = [0]
    for t, h, w in grid_thw:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def window_index(grid_thw: list[list[int]], merge: int, window: int,
                 ) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's window order: ``(merged-unit order [N / merge^2], cumulative window
    bounds in patches)``.  A window is ``window`` merged units square; edge windows
    are cut by the grid (empty ones vanish)."""
    order: list[torch.Tensor] = []
    bounds = [0]
    base = 0
    unit = merge * merge
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        idx = torch.arange(t * gh * gw).view(t, gh, gw)
        # transformers pads a full window even when the grid divides evenly.
        ph, pw = window - gh % window, window - gw % window
        nh, nw = (gh + ph) // window, (gw + pw) // window
        padded = F.pad(idx, (0, pw, 0, ph), value=-1)
        padded = padded.view(t, nh, window, nw, window).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(t, nh * nw, window * window)
        sizes = (padded >= 0).sum(-1).flatten()
        flat = padded.flatten()
        order.append(flat[flat >= 0] + base)
        for n in sizes.tolist():
            if n:
                bounds.append(bounds[-1] + n * unit)
        base += t * gh * gw
    return torch.cat(order), bounds


class Qwen2VisionTransformer(nn.Module):
    """Qwen2-VL's tower (``vision_config`` of ``qwen2_vl``) and, with ``qwen2_5=True``,
    Qwen2.5-VL's (``qwen2_5_vl``); parameter names are transformers' under ``visual.``."""

    def __init__(self, config: Any, qwen2_5: bool = False) -> None:
        super().__init__()
        self.qwen2_5 = qwen2_5
        self.merge = int(config.spatial_merge_size)
        self.patch = int(config.patch_size)
        in_features = (int(config.in_channels) * int(config.temporal_patch_size)
                       * self.patch * self.patch)
        if qwen2_5:
            dim, out_dim = int(config.hidden_size), int(config.out_hidden_size)
            norm: type[nn.Module] = VisionRMSNorm
            mlps: list[nn.Module] = [
                VisionSwiGLU(dim, int(config.intermediate_size), config.hidden_act)
                for _ in range(config.depth)]
            self.window = int(config.window_size) // self.merge // self.patch
            self.full_blocks = set(config.fullatt_block_indexes)
        else:
            dim, out_dim = int(config.embed_dim), int(config.hidden_size)
            norm = nn.LayerNorm
            mlps = [VisionMlp(dim, int(dim * config.mlp_ratio), config.hidden_act)
                    for _ in range(config.depth)]
        heads = int(config.num_heads)
        head_dim = dim // heads
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta",
                                                                             10000.0))
        spatial = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.patch_embed = PatchEmbed(in_features, dim)
        self.blocks = nn.ModuleList(VisionBlock(dim, heads, norm, m) for m in mlps)
        self.merger = PatchMerger(out_dim, dim, self.merge, norm)

    def _rotary(self, grid: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        pos = patch_rows_cols(grid, self.merge).to(self.inv_freq.device)
        freqs = (pos.unsqueeze(-1).float() * self.inv_freq).flatten(1)  # [N, D/2]: h | w
        return freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixels [N, C*T*P*P]``, ``grid_thw [images, 3]`` -> ``[N / merge^2, out]``."""
        grid = [[int(v) for v in row] for row in grid_thw.tolist()]
        x = self.patch_embed(pixels)
        cos, sin = self._rotary(grid)
        full = frame_seqlens(grid)
        if not self.qwen2_5:
            for blk in self.blocks:
                x = blk(x, full, cos, sin)
            return self.merger(x)
        order, windows = window_index(grid, self.merge, self.window)
        order = order.to(x.device)
        unit = self.merge * self.merge

        def by_window(t: torch.Tensor) -> torch.Tensor:
            n = t.shape[0]
            return t.reshape(n // unit, unit, *t.shape[1:])[order].reshape(t.shape)

        x, cos, sin = by_window(x), by_window(cos), by_window(sin)
        for i, blk in enumerate(self.blocks):
            x = blk(x, full if i in self.full_blocks else windows, cos, sin)
        return self.merger(x)[torch.argsort(order)]
