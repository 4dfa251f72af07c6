"""Inference-only re-parameterisation of the attention model (like RepVGG's, or timm's
``reparameterize_model``): fold per-head weight products into one matrix each.

For head h with W_v,h (v_dim × d), W_o,h (d × v_dim) the columns of proj for that head:

    out_i = Σ_h Σ_j p_h(i, j) (W_o,h (W_v,h x_j + b_v,h)) + b_o
          = Σ_h P_h · (X U_h) + (Σ_j p_h(i, j)) c_h + b_o,     U_h = W_v,h^T W_o,h^T (d × d),
                                                                 c_h = W_o,h b_v,h

(Σ_j p_h(i, j) < 1 where the sink takes weight). With qk_dim ≥ d/2 the query/key product folds
the same way: q_i·k_j = [x_i, 1] A_h [x_j, 1]^T with A_h = [W_q,h, b_q,h]^T [W_k,h, b_k,h], a
(d+1)² matrix instead of two qk_dim × d projections. The sink's key stays exactly zero: the
augmented key of the sink is the zero vector.

This cuts d² · (2·heads) multiply-adds per token per block (v and proj become one product) and,
with qk_dim = d, another d² · heads. The result equals the unfused model up to float rounding.
Use :func:`fuse_attention` on a trained model in eval mode; the fused model cannot be trained or
saved in the checkpoint format.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attn_vit import RelPosAttention


class FusedRelPosAttention(nn.Module):
    """The same function as a :class:`RelPosAttention`, with weight products folded (no grad)."""

    def __init__(self, attn: RelPosAttention) -> None:
        super().__init__()
        h, qk, vd = attn.num_heads, attn.qk_dim, attn.v_dim
        d = attn.q.in_features
        self.num_heads = h
        self.scale = qk**-0.5
        with torch.no_grad():
            wo = attn.proj.weight.view(d, h, vd).permute(1, 2, 0)  # (h, vd, d_out)
            u = attn.v.weight.view(h, vd, d).transpose(1, 2) @ wo  # (h, d_in, d_out)
            self.register_buffer("u", u.permute(1, 0, 2).reshape(d, h * d).contiguous())  # x @ u = [X U_h]_h
            self.register_buffer("c", torch.einsum("hv,hvd->hd", attn.v.bias.view(h, vd), wo).contiguous())
            self.register_buffer("proj_bias", attn.proj.bias.detach().clone())
            self.fold_qk = 2 * qk >= d
            if self.fold_qk:
                wq = torch.cat([attn.q.weight, attn.q.bias[:, None]], 1).view(h, qk, d + 1)
                wk = torch.cat([attn.k.weight, attn.k.bias[:, None]], 1).view(h, qk, d + 1)
                a = wq.transpose(1, 2) @ wk  # (h, d+1, d+1): q·k = [x,1] A_h [x,1]^T
                self.register_buffer(
                    "a", (a * self.scale).permute(1, 0, 2).reshape(d + 1, h * (d + 1)).contiguous()
                )
            else:
                self.q, self.k = attn.q, attn.k
                self.qk_dim = qk
            self.register_buffer("bias", attn.position_bias())  # a fresh (h, N, N) tensor
            self.register_buffer("sink", None if attn.sink is None else attn.sink.detach().clone())

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, d) -> (B, heads, N, N) attention logits, bias included: products in x's dtype,
        the sum in float32 or wider (a bf16 bias would round the pinning margin)."""
        b, n, d = x.shape
        h, dtype = self.num_heads, x.dtype
        acc = torch.promote_types(dtype, torch.float32)
        if self.fold_qk:
            xa = torch.cat([x, x.new_ones(b, n, 1)], -1)  # (B, N, d+1)
            z = xa @ self.a.to(dtype)  # (B, N, h·(d+1)); head h is a column block
            xt = xa.transpose(1, 2)
            out = self.bias.to(acc).expand(b, h, n, n).contiguous()
            for i in range(h):
                zi = z[:, :, i * (d + 1) : (i + 1) * (d + 1)]
                if dtype == acc:
                    out[:, i].baddbmm_(zi, xt)
                else:
                    out[:, i] += torch.bmm(zi, xt)
            return out
        q = F.linear(x, self.q.weight.to(dtype), self.q.bias.to(dtype)).view(b, n, h, self.qk_dim)
        k = F.linear(x, self.k.weight.to(dtype), self.k.bias.to(dtype)).view(b, n, h, self.qk_dim)
        q = (q.transpose(1, 2) * self.scale).reshape(b * h, n, self.qk_dim)
        k = k.transpose(1, 2).reshape(b * h, n, self.qk_dim).transpose(1, 2)
        bias = self.bias.to(acc).expand(b, h, n, n).reshape(b * h, n, n)
        qk = torch.baddbmm(bias, q, k) if dtype == acc else torch.bmm(q, k).to(acc) + bias
        return qk.view(b, h, n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, d) -> (B, N, d). Under autocast the block runs its products in the autocast dtype
        itself (its in-place GEMMs are not autocast ops)."""
        device = x.device.type
        if torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                return self._forward(x.to(torch.get_autocast_dtype(device)))
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        d, dtype = x.shape[-1], x.dtype
        logits = self.logits(x)
        m = logits.amax(-1, keepdim=True)
        if self.sink is not None:  # the null key: in the denominator, with zero value
            m = torch.maximum(m, self.sink.view(1, -1, 1, 1))
        p = (logits - m).exp_()
        denom = p.sum(-1, keepdim=True)
        if self.sink is not None:
            denom = denom + (self.sink.view(1, -1, 1, 1) - m).exp()
        p = p.div_(denom).to(dtype)  # (B, h, N, N)
        y = x @ self.u.to(dtype)  # (B, N, h·d): X U_h for every head, one GEMM
        out = (p.sum(-1).transpose(1, 2) @ self.c.to(dtype)).add_(self.proj_bias.to(dtype))  # off the sink
        for i in range(self.num_heads):
            out.baddbmm_(p[:, i], y[:, :, i * d : (i + 1) * d])  # strided slice: no copy
        return out


@torch.no_grad()
def fuse_attention(model: nn.Module) -> nn.Module:
    """Replace every RelPosAttention in ``model`` (in place) by its fused equivalent; eval only."""
    model.eval()
    for block in getattr(model, "blocks", []):
        if isinstance(getattr(block, "attn", None), RelPosAttention):
            block.attn = FusedRelPosAttention(block.attn)
    return model
