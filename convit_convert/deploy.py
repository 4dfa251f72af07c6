"""Deployment forms of a trained attention ViT, swapped in place for its :class:`RelPosAttention`
mixers (as timm's ``reparameterize_model``), each computing the same function:

    prepare_for_export(model)   ExportAttention: explicit softmax, bias (and sink) as one constant,
                                the trained form as ONNX exporters trace it (``cmhsa export --form trained``)
    fuse_attention(model)       FusedRelPosAttention: weight products folded for inference;
                                ``portable=True``, in plain MatMuls (``cmhsa export``'s default form)
    for_inference(model)        the fused form where it matches the model within a tolerance

A model's blocks also fuse themselves through timm's ``reparameterize_model`` (``Block.reparameterize``).
Below :mod:`convit_convert.model` in the layers: it knows the blocks only by their ``blocks`` list.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .attention import RelPosAttention, aligned
from .kernels import head_products
from .options.values import DEFAULT_TOL


class ExportAttention(nn.Module):
    """:class:`RelPosAttention` for export: explicit attention, bias and sink as one constant.

    logits_h = q_h k_h^T / sqrt(qk_dim) + B_h,   B = attn_bias(): (heads, N, N[+1])

    With a sink, keys and values end with a zero row (as in training), so the last logit column
    is q·0 + sink_h = sink_h and its value is zero. A gated layer's positional attention does not
    depend on the input: it is one constant too, and the content softmax is written out beside it.
    """

    def __init__(self, attn: RelPosAttention) -> None:
        super().__init__()
        self.attn = attn
        self.scale = attn.qk_dim**-0.5
        self.gated = attn.gate is not None
        with torch.no_grad():
            if self.gated:
                g, mixed_pos = attn.frozen_gate()
                self.register_buffer(
                    "bias", attn.position_bias(attn.content_bias).detach().clone().unsqueeze(0)
                )
                self.register_buffer("mixed_pos", mixed_pos)
                self.register_buffer("g", g)
            else:
                self.register_buffer(
                    "bias", attn.attn_bias().detach().clone().unsqueeze(0)
                )  # (1, h, N, N[+1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, dim) -> (B, N, dim)."""
        q, k, v = self.attn.qkv(x, pad_sink=not self.gated)
        weights = torch.softmax((q @ k.transpose(-2, -1)) * self.scale + self.bias, dim=-1)
        if self.gated:
            weights = self.mixed_pos + self.g * weights
        return self.attn.merge_heads(weights @ v)


def prepare_for_export(model: nn.Module) -> nn.Module:
    """Swap every attention mixer for :class:`ExportAttention`, in place; eval mode."""
    for block in model.blocks:
        if isinstance(block.mixer, RelPosAttention):
            setattr(block, block.mixer_name, ExportAttention(block.mixer))
    return model.eval()


class FusedRelPosAttention(nn.Module):
    """The same function as a :class:`RelPosAttention`, with weight products folded, for inference
    (like RepVGG's re-parameterisation). For head h with W_v,h (v_dim × d), W_o,h (d × v_dim) the
    columns of proj for that head:

        out_i = Σ_h Σ_j p_h(i, j) (W_o,h (W_v,h x_j + b_v,h)) + b_o
              = [P_1 X̃, ..., P_H X̃] Ũ + b_o,      X̃ = [X, 1],   Ũ = [Ũ_1; ...; Ũ_H],
        Ũ_h = [U_h; c_h] ((d+1) × d),  U_h = W_v,h^T W_o,h^T,  c_h = W_o,h b_v,h

    The column of ones carries each head's value bias c_h weighted by Σ_j p_h(i, j), which is < 1
    where the sink takes weight (the sink's key row of X̃ is zero). The heads' P_h X̃ are written
    side by side into one (B, N, H·d̃) tensor (:func:`head_products`) and a single GEMM with
    reduction length H·d̃ sums the heads, so no (B, N, d) accumulator is read and written once per
    head. With qk_dim ≥ d/2 the query/key product folds the same way: q_i·k_j = x̃_i A_h x̃_j^T
    with A_h = [W_q,h, b_q,h]^T [W_k,h, b_k,h], a (d+1)² matrix instead of two qk_dim × d
    projections. Keys are padded as in :meth:`RelPosAttention.forward` (the sink is the first
    padded key) and X̃ with zero rows and columns to (N_pad, d̃), d̃ = d+1 rounded up to a
    multiple of 8, so every product's rows are 16-byte aligned and its reduction length a
    multiple of 8: cuBLAS runs its aligned kernels.

    This cuts d² · (2·heads) multiply-adds per token per block (v and proj become one product) and,
    with qk_dim = d, another d² · heads. The result equals the unfused model up to float rounding.
    Use :func:`fuse_attention` on a trained model in eval mode; the fused model cannot be trained or
    saved in the checkpoint format.
    """

    def __init__(self, attn: RelPosAttention, portable: bool = False) -> None:
        """``portable``: plain batched matmuls instead of the custom per-head ops and in-place GEMMs
        (:meth:`forward_portable`), the form ONNX exporters can trace; the same function."""
        super().__init__()
        self.portable = portable
        h, qk, vd = attn.num_heads, attn.qk_dim, attn.v_dim
        d = attn.q.in_features
        self.num_heads = h
        self.scale = qk**-0.5
        with torch.no_grad():
            da = aligned(d + 1)  # x̃ = [x, 1, 0 ...]
            wo = attn.proj.weight.view(d, h, vd).permute(1, 2, 0)  # (h, vd, d_out)
            u = attn.v.weight.view(h, vd, d).transpose(1, 2) @ wo  # (h, d_in, d_out)
            c = torch.einsum("hv,hvd->hd", attn.v.bias.view(h, vd), wo)  # (h, d_out)
            u = F.pad(torch.cat([u, c[:, None]], 1), (0, 0, 0, da - d - 1))  # (h, d̃, d_out): [U_h; c_h; 0]
            self.register_buffer("u", u.reshape(h * da, d).contiguous())  # [P_h X̃]_h @ u
            self.register_buffer("proj_bias", attn.proj.bias.detach().clone())
            self.fold_qk = 2 * qk >= d
            if self.fold_qk:

                def augmented(lin: nn.Linear) -> torch.Tensor:  # [W, b, 0] per head: (h, qk, d̃)
                    return F.pad(torch.cat([lin.weight, lin.bias[:, None]], 1), (0, da - d - 1)).view(
                        h, qk, da
                    )

                a = augmented(attn.q).transpose(1, 2) @ augmented(attn.k)  # (h, d̃, d̃): q·k = x̃ A_h x̃^T
                self.register_buffer("a", (a * self.scale).permute(1, 0, 2).reshape(da, h * da).contiguous())
            else:
                self.q, self.k = attn.q, attn.k
                self.qk_dim = qk
            self.gated = attn.gate is not None
            if self.gated:  # content logits carry the content bias; the positional part is a constant
                g, mixed_pos = attn.frozen_gate()
                self.register_buffer("bias", attn.padded_bias(attn.content_bias, sink=False).detach().clone())
                n, npad = mixed_pos.shape[-2], self.bias.shape[-1]
                self.register_buffer("mixed_pos", F.pad(mixed_pos, (0, npad - n)))
                self.register_buffer("g", g)
            else:
                self.register_buffer("bias", attn.padded_bias().detach().clone())  # (h, N, N_pad)

    def logits(self, x: torch.Tensor, xa: torch.Tensor) -> torch.Tensor:
        """(B, N, d) tokens and (B, N_pad, d̃) x̃ -> (B, heads, N, N_pad) attention logits, bias and
        sink included: products in x's dtype, the sum in float32 or wider (a bf16 bias would round
        the pinning margin)."""
        b, n, _ = x.shape
        h, dtype = self.num_heads, x.dtype
        npad = self.bias.shape[-1]
        acc = torch.promote_types(dtype, torch.float32)
        bias = self.bias.to(acc).expand(b, h, n, npad)
        if self.fold_qk:
            da = self.a.shape[0]
            z = xa[:, :n] @ self.a.to(dtype)  # (B, N, h·d̃); head h is a column block
            xt = xa.transpose(1, 2)  # (B, d̃, N_pad): zero padded keys
            out = bias.contiguous()
            for i in range(h):
                zi = z[:, :, i * da : (i + 1) * da]
                if dtype == acc:
                    out[:, i].baddbmm_(zi, xt)
                else:
                    out[:, i] += torch.bmm(zi, xt)
            return out
        q = F.linear(x, self.q.weight.to(dtype), self.q.bias.to(dtype)).view(b, n, h, self.qk_dim)
        k = F.linear(x, self.k.weight.to(dtype), self.k.bias.to(dtype)).view(b, n, h, self.qk_dim)
        q = (q.transpose(1, 2) * self.scale).reshape(b * h, n, self.qk_dim)
        k = F.pad(k.transpose(1, 2), (0, 0, 0, npad - n)).reshape(b * h, npad, self.qk_dim).transpose(1, 2)
        bias = bias.reshape(b * h, n, npad)
        qk = torch.baddbmm(bias, q, k) if dtype == acc else torch.bmm(q, k).to(acc) + bias
        return qk.view(b, h, n, npad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, d) -> (B, N, d). Under autocast the block runs its products in the autocast dtype
        itself (its in-place GEMMs are not autocast ops)."""
        if self.portable:
            return self.forward_portable(x)
        device = x.device.type
        if torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                return self._forward(x.to(torch.get_autocast_dtype(device)))
        return self._forward(x)

    def forward_portable(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, d) -> (B, N, d) as :meth:`forward`, written in MatMul / Softmax / Add only:

        logits = [x̃ A_h x̃^T]_h + bias   (or q k^T / sqrt(qk_dim) + bias),   P = softmax(logits)
        out    = [P_1 X̃, ..., P_H X̃] Ũ + b_o
        """
        n, h = x.shape[1], self.num_heads
        npad, da = self.bias.shape[-1], self.u.shape[0] // h
        xa = self.augmented(x)
        if self.fold_qk:
            z = (xa[:, :n] @ self.a).reshape(-1, n, h, da).transpose(1, 2)  # (B, h, N, d̃)
            logits = z @ xa.transpose(1, 2).unsqueeze(1) + self.bias
        else:
            q = self.q(x).reshape(-1, n, h, self.qk_dim).transpose(1, 2) * self.scale
            k = F.pad(self.k(x).reshape(-1, n, h, self.qk_dim).transpose(1, 2), (0, 0, 0, npad - n))
            logits = q @ k.transpose(-2, -1) + self.bias
        p = logits.softmax(-1)  # (B, h, N, N_pad)
        if self.gated:
            p = self.mixed_pos + self.g * p
        z = (p @ xa.unsqueeze(1)).transpose(1, 2).reshape(-1, n, h * da)  # [P_1 X̃, ..., P_h X̃]
        return z @ self.u + self.proj_bias

    def augmented(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, d) tokens -> (B, N_pad, d̃) X̃ = [X, 1], zero padded to the padded keys and d̃."""
        b, n, d = x.shape
        npad, da = self.bias.shape[-1], self.u.shape[0] // self.num_heads
        return F.pad(torch.cat([x, x.new_ones(b, n, 1)], -1), (0, da - d - 1, 0, npad - n))

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        dtype = x.dtype
        xa = self.augmented(x)
        p = self.logits(x, xa).softmax(-1)  # (B, h, N, N_pad); padded keys weigh 0, the sink's row of x̃ is 0
        if self.gated:
            p = self.mixed_pos + self.g * p
        z = head_products(p.to(dtype), xa)  # (B, N, h·d̃): [P_1 X̃, ..., P_h X̃]
        return torch.addmm(self.proj_bias.to(dtype), z.view(b * n, -1), self.u.to(dtype)).view(b, n, d)


@torch.no_grad()
def for_inference(model: nn.Module, tol: float = DEFAULT_TOL, seed: int = 0) -> tuple[nn.Module, str]:
    """``(model, form)`` to run for inference: a fused copy ("fused") where its logits match the
    model's within ``tol`` (max |Δ| / max |logits|, on 2 seeded random images), else the model itself
    ("trained"); a model without attention as it is ("conv"). The model is put in eval mode."""
    model.eval()
    if not any(isinstance(getattr(b, "attn", None), RelPosAttention) for b in getattr(model, "blocks", [])):
        return model, "conv"
    cfg = model.cfg
    p = next(model.parameters())
    x = torch.randn(2, cfg.in_chans, *cfg.img_size, generator=torch.Generator().manual_seed(seed))
    x = x.to(p.device, p.dtype)
    ref = model(x)
    fused = fuse_attention(copy.deepcopy(model))
    err = ((fused(x) - ref).abs().max() / ref.abs().max().clamp_min(torch.finfo(ref.dtype).tiny)).item()
    return (fused, "fused") if err <= tol else (model, "trained")


@torch.no_grad()
def fuse_attention(model: nn.Module, portable: bool = False) -> nn.Module:
    """Replace every RelPosAttention in ``model`` (in place) by its fused equivalent; eval only.
    ``portable``: the form ONNX exporters trace (:meth:`FusedRelPosAttention.forward_portable`)."""
    model.eval()
    for block in getattr(model, "blocks", []):
        block.reparameterize(portable)  # model.Block's: one place swaps the mixer
    return model
