"""Phase 2: the attention ViT, multi-head self-attention with a relative position bias and a sink."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ViTConfig
from .vit import VisionTransformer


def relative_position_index(grid_size: tuple[int, int]) -> torch.Tensor:
    """(N, N) index into a flattened (2Gh-1, 2Gw-1) table: query (y, x) to key (y+dy, x+dx) reads
    entry (dy + Gh - 1, dx + Gw - 1)."""
    gh, gw = grid_size
    ys, xs = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    ys, xs = ys.flatten(), xs.flatten()
    dy = ys[None, :] - ys[:, None] + gh - 1  # [query, key]
    dx = xs[None, :] - xs[:, None] + gw - 1
    return dy * (2 * gw - 1) + dx


class RelPosAttention(nn.Module):
    """MHSA with a learnable relative position bias per head and, optionally, a sink per head.

    logits_h(q, k) = (W_Q x_q)·(W_K x_k) / sqrt(qk_dim) + rel_pos_bias[h, dy+Gh-1, dx+Gw-1]

    The sink is one extra key per head with zero key and zero value whose logit is the learnable
    scalar ``sink[h]``: a head can attend to "nothing" (output 0). That is what makes the converted
    model exact at the image border, where zero padding has no patch to attend to.
    """

    def __init__(
        self,
        dim: int,
        grid_size: tuple[int, int],
        num_heads: int,
        qk_dim: int,
        v_dim: int,
        sink: bool = True,
    ) -> None:
        super().__init__()
        self.num_heads, self.qk_dim, self.v_dim = num_heads, qk_dim, v_dim
        self.grid_size = grid_size
        self.q = nn.Linear(dim, num_heads * qk_dim)
        self.k = nn.Linear(dim, num_heads * qk_dim)
        self.v = nn.Linear(dim, num_heads * v_dim)
        self.proj = nn.Linear(num_heads * v_dim, dim)
        gh, gw = grid_size
        self.rel_pos_bias = nn.Parameter(torch.zeros(num_heads, 2 * gh - 1, 2 * gw - 1))
        self.sink = nn.Parameter(torch.zeros(num_heads)) if sink else None
        self.register_buffer("rel_pos_index", relative_position_index(grid_size), persistent=False)

    def position_bias(self) -> torch.Tensor:
        """(heads, N, N): the relative position bias gathered for every query/key pair."""
        return self.rel_pos_bias.flatten(1)[:, self.rel_pos_index]

    def attn_bias(self) -> torch.Tensor:
        """(heads, N, N) bias, or (heads, N, N+1) with the sink as the last key."""
        bias = self.position_bias()
        if self.sink is None:
            return bias
        n = bias.shape[1]
        return torch.cat([bias, self.sink.view(-1, 1, 1).expand(-1, n, 1)], dim=-1)

    def qkv(self, x: torch.Tensor, pad_sink: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, N, dim) -> q, k (B, h, N[+1], qk_dim), v (B, h, N[+1], v_dim); with a sink and
        ``pad_sink``, k and v end with the null key and value (zeros), as the ONNX form uses them."""
        b, n, _ = x.shape
        h = self.num_heads
        q = self.q(x).view(b, n, h, self.qk_dim).transpose(1, 2)
        k = self.k(x).view(b, n, h, self.qk_dim).transpose(1, 2)
        v = self.v(x).view(b, n, h, self.v_dim).transpose(1, 2)
        if self.sink is not None and pad_sink:  # the null key: q·0 = 0, so its logit is the sink bias alone
            k = F.pad(k, (0, 0, 0, 1))
            v = F.pad(v, (0, 0, 0, 1))
        return q, k, v

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h, N, v_dim) head outputs -> (B, N, dim) through ``proj``."""
        b, h, n, vd = x.shape
        return self.proj(x.transpose(1, 2).reshape(b, n, h * vd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, dim) -> (B, N, dim).

        Written out rather than through ``F.scaled_dot_product_attention``: no fused kernel takes an
        arbitrary bias with v_dim = 768 (SDPA falls back to its math path), and padding the
        9·768-wide values for the sink costs a copy. The sink (logit s_h, value zero) only enlarges
        the softmax's denominator, so it enters through the log-sum-exp:

            weights = exp(logits - lse),   lse = log(exp(s_h) + Σ_j exp(logits_j))

        which keeps the (B, h, N, N) weights contiguous for the P·V product. The logits stay in
        float32 under autocast (the float32 bias promotes them). bench/gpu_suite.py measures the
        forms against each other.
        """
        q, k, v = self.qkv(x, pad_sink=False)
        logits = (q @ k.transpose(-2, -1)) * self.qk_dim**-0.5 + self.position_bias()
        if self.sink is None:
            weights = logits.softmax(dim=-1)
        else:
            lse = torch.logaddexp(logits.logsumexp(dim=-1, keepdim=True), self.sink.view(1, -1, 1, 1))
            weights = (logits - lse).exp()
        return self.merge_heads(weights.to(v.dtype) @ v)


class AttnViT(VisionTransformer):
    """Phase-2 model (kind "attn")."""

    kind = "attn"
    mixer_name = "attn"

    def __init__(self, cfg: ViTConfig, drop_path_rate: float = 0.0) -> None:
        super().__init__(
            cfg,
            lambda: RelPosAttention(
                cfg.embed_dim, cfg.grid_size, cfg.num_heads, cfg.qk_dim, cfg.v_dim, bool(cfg.sink)
            ),
            drop_path_rate,
        )

    def no_weight_decay(self) -> set[str]:
        return {name for name, _ in self.named_parameters() if name.endswith(("rel_pos_bias", "sink"))}
