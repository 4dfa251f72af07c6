"""The token layout of a read graph, proved (:func:`feature_order`) and undone on the weights
(:func:`to_checkpoint`): the result is in cmhsa's layout (docs/FORMAT.md) whatever the graph used."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..config import ViTConfig
from ..errors import CmhsaError
from .read import Structure


def feature_order(s: Structure, patch_size: int, path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    """Prove the token layout and return the feature permutations into cmhsa's layout:
    ``pi[f]`` is the cmhsa feature of the graph's feature f, ``rho[g]`` the same for the patch
    embedding's input (linear embedding only)."""

    def bad(msg: str) -> CmhsaError:
        return CmhsaError(f"token layout: {msg}", path)

    b, *tok, d = s.residual_shape
    n = math.prod(tok)
    h, w = s.img_size
    p, gw = patch_size, s.img_size[1] // patch_size
    first = s.blocks[0].layout_in
    c = first.shape[1]
    for i, blk in enumerate(s.blocks):
        if not np.array_equal(blk.layout_in, first):
            raise bad(f"block {i}'s Conv sees the tokens in another layout than block 0's")
        total = first.size
        if not np.array_equal(np.sort(blk.layout_in.reshape(-1)), np.arange(total)):
            raise bad(f"block {i}'s Conv input is not a rearrangement of the tokens")
        if blk.layout_out.size != total or not np.array_equal(
            blk.layout_out.reshape(-1)[blk.layout_in.reshape(-1)], np.arange(total)
        ):
            raise bad(f"block {i}'s Conv output is not laid out as tokens the way its input was read")
    sample, ch, y, x = np.indices(first.shape)
    idx = first  # graph's residual element read at each pixel
    s_m, n_m, f_m = idx // (n * d), (idx // d) % n, idx % d
    if not np.array_equal(s_m, sample):
        raise bad("the Conv mixes images of a batch")
    token = sample * n + (y // p) * gw + x // p  # cmhsa's token of each pixel
    feature = ((y % p) * p + x % p) * c + ch  # cmhsa's feature of each pixel
    tok_map = np.full(b * n, -1)
    tok_map[(s_m * n + n_m).reshape(-1)] = token.reshape(-1)
    if not np.array_equal(tok_map[s_m * n + n_m], token):
        raise bad(f"a token is not one {p}x{p} patch")
    feat = np.full((b * n, d), -1)
    feat[s_m * n + n_m, f_m] = feature
    pi = feat[0]
    if not (feat == pi).all():
        raise bad("tokens do not all order their pixels the same way")
    # the image reaches the tokens patch by patch
    pix = s.patchify.reshape(b * n, -1)
    if s.patch_embed is None:
        if s.patchify.size != idx.size or not np.array_equal(
            s.patchify.reshape(-1)[idx.reshape(-1)], np.arange(idx.size)
        ):
            raise bad("with no patch-embedding layer, the first Conv does not see the input image unchanged")
        return pi, None
    c_in = s.in_chans
    s_i, c_i, y_i, x_i = np.unravel_index(pix, (b, c_in, h, w))
    if not np.array_equal(s_i * n + (y_i // p) * gw + x_i // p, np.broadcast_to(tok_map[:, None], pix.shape)):
        raise bad("the patch embedding does not read each token's own patch")
    rho_all = ((y_i % p) * p + x_i % p) * c_in + c_i
    rho = rho_all[0]
    if not (rho_all == rho).all() or not np.array_equal(np.sort(rho), np.arange(p * p * c_in)):
        raise bad("the patch embedding's input is not every pixel of the patch once, in one order")
    return pi, rho


def to_checkpoint(s: Structure, path: Path) -> tuple[ViTConfig, dict[str, torch.Tensor], str]:
    """The cmhsa config and tensors (docs/FORMAT.md names and layout) of a read structure, and the
    graph's token layout: "cmhsa" (as is) or "permuted" (undone on the weights)."""
    d = s.residual_shape[-1]
    blk0 = s.blocks[0]
    c, k = blk0.conv_weight.shape[0], blk0.conv_weight.shape[2]
    p = math.isqrt(d // c) if d % c == 0 else 0
    if p * p * c != d:
        raise CmhsaError(f"embed_dim {d} is not P² x {c} (the Conv's channels) for any whole P", path)
    for i, blk in enumerate(s.blocks):
        if blk.conv_weight.shape != blk0.conv_weight.shape or blk.dilation != blk0.dilation:
            raise CmhsaError(f"block {i}'s Conv differs in shape or dilation from block 0's", path)
        if blk.fc1.weight.shape != blk0.fc1.weight.shape:
            raise CmhsaError(f"block {i}'s MLP width differs from block 0's", path)
    eps = {n.eps for blk in s.blocks for n in (blk.norm1, blk.norm2)} | {s.norm.eps}
    if len(eps) != 1:
        raise CmhsaError(
            f"LayerNorm epsilons differ between layers ({sorted(eps)}); cmhsa models share one", path
        )
    pi, rho = feature_order(s, p, path)
    cfg = ViTConfig(
        img_size=s.img_size,
        patch_size=p,
        in_chans=s.in_chans,
        hidden_chans=int(c),
        embed_dim=int(d),
        patch_embed="identity" if s.patch_embed is None else "linear",
        depth=len(s.blocks),
        mlp_hidden_dim=int(blk0.fc1.weight.shape[0]),
        num_classes=int(s.head.weight.shape[0]),
        norm_eps=float(str(np.float32(eps.pop()))),  # 1e-06, not 9.99999997e-07
        kernel_size=int(k),
        dilation=int(blk0.dilation),
    )
    cfg.validate(path)

    def rows(wt: np.ndarray) -> np.ndarray:  # vector entries / matrix rows into cmhsa's order
        out = np.empty_like(wt)
        out[pi] = wt
        return out

    def cols(wt: np.ndarray, order: np.ndarray) -> np.ndarray:
        out = np.empty_like(wt)
        out[:, order] = wt
        return out

    t: dict[str, np.ndarray] = {}
    if s.patch_embed is not None:
        t["patch_embed.weight"] = cols(rows(s.patch_embed.weight), rho)
        t["patch_embed.bias"] = rows(s.patch_embed.bias)
    for i, blk in enumerate(s.blocks):
        b = f"blocks.{i}."
        t[b + "norm1.weight"], t[b + "norm1.bias"] = rows(blk.norm1.weight), rows(blk.norm1.bias)
        t[b + "conv.weight"], t[b + "conv.bias"] = blk.conv_weight, blk.conv_bias
        t[b + "norm2.weight"], t[b + "norm2.bias"] = rows(blk.norm2.weight), rows(blk.norm2.bias)
        t[b + "mlp.fc1.weight"], t[b + "mlp.fc1.bias"] = cols(blk.fc1.weight, pi), blk.fc1.bias
        t[b + "mlp.fc2.weight"], t[b + "mlp.fc2.bias"] = rows(blk.fc2.weight), rows(blk.fc2.bias)
    t["norm.weight"], t["norm.bias"] = rows(s.norm.weight), rows(s.norm.bias)
    t["head.weight"], t["head.bias"] = cols(s.head.weight, pi), s.head.bias
    dtype = np.result_type(*t.values())
    tensors = {name: torch.from_numpy(np.array(v, dtype=dtype, order="C")) for name, v in t.items()}
    layout = (
        "cmhsa"
        if np.array_equal(pi, np.arange(d)) and (rho is None or np.array_equal(rho, np.arange(rho.size)))
        else "permuted"
    )
    return cfg, tensors, layout
