"""Both models in one sitting: the phase-1 convolutional ViT and the phase-2 attention ViT.

    VisionTransformer(cfg)   cfg.kind "conv": each block mixes tokens with a K×K convolution
                             cfg.kind "attn": multi-head self-attention, relative position bias, sink

The skeleton is shared: patch embedding, pre-LN blocks, final norm, mean over tokens, head. No class
token and no absolute position embedding: phase 1 gets position from the convolution's zero
padding, phase 2 from the relative position bias (Section 4.1 of the paper). Every parameter name is
the file format's (docs/FORMAT.md), e.g. ``blocks.0.conv.weight``, ``blocks.0.attn.proj.weight``.

Token layout: patches in row-major order; a patch is flattened channel-last, feature index
(py·P + px)·C + c. The conv mixer lives in :mod:`convit_convert.conv_mixer`: by default it runs as
Theorem 1's token products on CUDA (two tensor-core products per block) and as ``F.conv2d`` on the
pixel view on the CPU, each the faster there (BENCHMARKS.md, "Training on a CPU", "... on a GPU");
``conv_form`` picks one everywhere, for checking. The attention mixer lives in
:mod:`convit_convert.attention`; the forms swapped in for deployment (export, fused inference) in
:mod:`convit_convert.deploy`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from .attention import AttentionFormName, RelPosAttention
from .config import NORM_EPS, ViTConfig
from .conv_mixer import ConvFormName, ConvMixer, patchify, unpatchify  # noqa: F401  (re-exported)
from .deploy import FusedRelPosAttention


class PatchEmbed(nn.Module):
    """Image -> tokens. Identity on the flattened patch (the paper's choice, which lets phase 1 view
    tokens as pixels), or a learnable linear map P²·in_chans -> embed_dim held as
    ``patch_embed.weight`` / ``patch_embed.bias`` (docs/FORMAT.md)."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int, linear: bool) -> None:
        super().__init__()
        self.patch_size = patch_size
        if linear:
            self.weight = nn.Parameter(torch.empty(embed_dim, patch_size * patch_size * in_chans))
            self.bias = nn.Parameter(torch.zeros(embed_dim))
            nn.init.trunc_normal_(self.weight, std=0.02)
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, N, embed_dim)."""
        x = patchify(x, self.patch_size)
        return x if self.weight is None else F.linear(x, self.weight, self.bias)


class Mlp(nn.Module):
    """fc1 -> exact (erf) GELU -> fc2."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DropPath(nn.Module):
    """Stochastic depth per sample. A local copy of timm's, so the conversion path never imports
    timm (about 3.5 s of start-up)."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def draw(self, batch: int, ndim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The per-sample mask (batch, 1, ...) of 0/1 that :meth:`forward` multiplies by, drawn
        from the global RNG as forward draws it."""
        return torch.empty((batch,) + (1,) * (ndim - 1), dtype=dtype, device=device).bernoulli_(
            1.0 - self.drop_prob
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: one drawn beforehand (:meth:`draw`), where the caller draws each sample's
        masks from its own stream (stacked seeds); None: drawn here."""
        if self.drop_prob == 0.0 or not self.training:
            return x
        if mask is None:
            mask = self.draw(x.shape[0], x.ndim, x.dtype, x.device)
        return x * mask / (1.0 - self.drop_prob)


class Block(nn.Module):
    """Pre-LN transformer block: x + mixer(norm1(x)), then x + mlp(norm2(x)).

    The token mixer is registered under ``mixer_name``, the model's kind ('conv' or 'attn').
    """

    def __init__(
        self,
        dim: int,
        mixer_name: str,
        mixer: nn.Module,
        mlp_hidden_dim: int,
        norm_eps: float = NORM_EPS,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        self.mixer_name = mixer_name
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.add_module(mixer_name, mixer)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, mlp_hidden_dim)
        self.drop_path = DropPath(drop_path)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def reparameterize(self, portable: bool = False) -> None:
        """For inference: the attention mixer becomes its fused form (:mod:`convit_convert.deploy`),
        the same function; ``portable``: the form ONNX exporters trace. timm's
        ``reparameterize_model`` calls this."""
        if isinstance(self.mixer, RelPosAttention):
            setattr(self, self.mixer_name, FusedRelPosAttention(self.mixer.eval(), portable))

    def forward(
        self, x: torch.Tensor, masks: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """(B, N, dim) -> (B, N, dim); ``masks``: the two branches' drop-path masks, drawn
        beforehand (:meth:`VisionTransformer.drop_masks`), or None to draw them here."""
        m1, m2 = (None, None) if masks is None else masks
        x = x + self.drop_path(self.mixer(self.norm1(x)), m1)
        return x + self.drop_path(self.mlp(self.norm2(x)), m2)


def init_weights(module: nn.Module) -> None:
    """ViT-style init: truncated normal (std 0.02) Linear weights, zero biases."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


# ITU-R 601-2 luma, as PIL's convert("L"): a grey model given RGB sees what cmhsa eval gives it
LUMA = (0.299, 0.587, 0.114)


def check_image_shape(x: torch.Tensor, expected: tuple[int, ...]) -> torch.Tensor:
    """``x`` if it is (B, *expected), else a ValueError naming both shapes. A grey model (one
    channel) given three takes their luma (PIL's "L" weights; the weights sum to 1, so a channel-wise
    normalisation commutes with it): transformers' image-classification pipeline makes every image
    RGB; a grey image made RGB comes back exactly. A leaf for torch.fx, which cannot compare a
    traced shape: the check stays in the traced graph, as one call."""
    if expected[0] == 1 and x.ndim == 4 and x.shape[1] == 3 and tuple(x.shape[2:]) == expected[1:]:
        w = torch.tensor(LUMA, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        return (x * w).sum(1, keepdim=True)
    if tuple(x.shape[1:]) != expected:
        raise ValueError(
            f"expected images of shape (B, {', '.join(map(str, expected))}), got {tuple(x.shape)}"
        )
    return x


torch.fx.wrap("check_image_shape")


ATTENTION_PARAMS = (
    ".attn.q.weight",
    ".attn.q.bias",
    ".attn.k.weight",
    ".attn.k.bias",
    ".attn.gate",
    ".attn.content_bias",
    ".attn.rel_pos_bias",
    ".attn.sink",
)


class VisionTransformer(nn.Module):
    """patch_embed -> depth × Block(mixer) -> norm -> mean over tokens -> head.

    The token mixer follows ``cfg.kind``: a :class:`ConvMixer` ("conv") or a
    :class:`RelPosAttention` ("attn"); everything else, and every parameter name, is shared.
    """

    def __init__(
        self,
        cfg: ViTConfig,
        drop_path_rate: float = 0.0,
        attention_form: AttentionFormName = "padded",
        conv_form: ConvFormName = "auto",
    ) -> None:
        """``attention_form``: how every attention mixer computes its products ("padded" or
        "by_head", :mod:`convit_convert.attention`); ``conv_form``: how every conv mixer does
        ("pixels", "tokens", or "auto": tokens on CUDA, pixels on the CPU,
        :mod:`convit_convert.conv_mixer`). The same function either way."""
        super().__init__()
        self.attention_form = attention_form
        self.conv_form = conv_form
        cfg.validate()
        self.cfg = cfg
        self.kind = cfg.kind
        self.num_classes = cfg.num_classes
        self.in_chans = cfg.in_chans
        self.num_features = self.head_hidden_size = self.embed_dim = cfg.embed_dim  # timm's names
        self.global_pool = "avg"
        self.patch_embed = PatchEmbed(
            cfg.patch_size, cfg.in_chans, cfg.embed_dim, linear=cfg.patch_embed == "linear"
        )
        dpr = torch.linspace(
            0, drop_path_rate, cfg.depth, device="cpu"
        ).tolist()  # stochastic depth decay rule
        self.blocks = nn.ModuleList(
            Block(
                cfg.embed_dim,
                cfg.kind,
                self._mixer(cfg, attention_form, conv_form),
                cfg.mlp_hidden_dim,
                cfg.norm_eps,
                p,
            )
            for p in dpr
        )
        self.norm = nn.LayerNorm(cfg.embed_dim, eps=cfg.norm_eps)
        self.head: nn.Module = nn.Linear(cfg.embed_dim, cfg.num_classes)
        self.grad_checkpointing = False
        # timm's feature API: every block's output, (B, embed_dim, H/P, W/P) in forward_intermediates
        self.feature_info = [
            {"module": f"blocks.{i}", "num_chs": cfg.embed_dim, "reduction": cfg.patch_size}
            for i in range(cfg.depth)
        ]
        self.apply(init_weights)

    @staticmethod
    def _mixer(cfg: ViTConfig, form: AttentionFormName, conv_form: ConvFormName) -> nn.Module:
        if cfg.kind == "conv":
            return ConvMixer(
                cfg.hidden_chans, cfg.kernel_size, cfg.dilation, cfg.grid_size, cfg.patch_size, conv_form
            )
        gated = cfg.pinning == "gated"
        return RelPosAttention(
            cfg.embed_dim, cfg.grid_size, cfg.num_heads, cfg.qk_dim, cfg.v_dim, bool(cfg.sink), gated, form
        )

    def forward_features(self, x: torch.Tensor, drop_masks: list[torch.Tensor] | None = None) -> torch.Tensor:
        """(B, in_chans, H, W) images -> (B, N, embed_dim) normalised tokens. ``drop_masks``:
        :meth:`drop_masks`'s, drawn beforehand; None: each block draws its own."""
        x = self.patch_embed(check_image_shape(x, (self.cfg.in_chans, *self.cfg.img_size)))
        for i, block in enumerate(self.blocks):
            masks = None if drop_masks is None else (drop_masks[2 * i], drop_masks[2 * i + 1])
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, masks, use_reentrant=False)
            else:
                x = block(x, masks)
        return self.norm(x)

    def drop_masks(self, batch: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """Every drop-path mask one training forward of a ``batch`` draws, drawn now from the global
        RNG in the order forward draws them (each block's mixer branch, then its MLP branch), each
        (batch, 1, 1) of ``dtype`` (the branches' output dtype: autocast's, else the weights');
        the same masks forward would have drawn from the same RNG state. [] when none is drawn
        (no drop path, or eval mode)."""
        drawn = [b.drop_path for b in self.blocks if b.drop_path.drop_prob > 0.0 and b.drop_path.training]
        if not drawn:
            return []
        ones = torch.ones((batch, 1, 1), dtype=dtype, device=device)  # a block without: no draw
        return [
            dp.draw(batch, 3, dtype, device) if dp in drawn else ones
            for dp in (b.drop_path for b in self.blocks)
            for _ in range(2)
        ]

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """timm's feature API: the outputs of the blocks ``indices`` (an int n: the last n; default:
        all), as (B, embed_dim, gh, gw) ("NCHW") or (B, N, embed_dim) ("NLC"), after the final norm
        with ``norm``; and, unless ``intermediates_only``, the final normalised tokens."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be NCHW or NLC, got {output_fmt!r}")
        depth, take = len(self.blocks), self._take_indices(indices)
        b = x.shape[0]
        gh, gw = self.cfg.grid_size
        out, feats = self.patch_embed(check_image_shape(x, (self.cfg.in_chans, *self.cfg.img_size))), []
        last = max(take) if stop_early or intermediates_only else depth - 1
        for i, block in enumerate(self.blocks[: last + 1]):
            out = block(out)
            if i in take:
                f = self.norm(out) if norm else out
                feats.append(f if output_fmt == "NLC" else f.transpose(1, 2).reshape(b, -1, gh, gw))
        return feats if intermediates_only else (self.norm(out), feats)

    def _take_indices(self, indices: int | list[int] | None) -> list[int]:
        """Blocks by index (negative from the end); an int n: the last n; None: all."""
        depth = len(self.blocks)
        if isinstance(indices, int):
            if not 0 < indices <= depth:
                raise ValueError(f"the last {indices} blocks: the model has {depth}")
            return list(range(depth - indices, depth))
        take = list(range(depth)) if indices is None else list(indices)
        if not take or any(not -depth <= i < depth for i in take):
            raise ValueError(f"indices must be blocks of 0..{depth - 1}, got {take}")
        return [i % depth for i in take]

    def prune_intermediate_layers(
        self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """timm's feature API: drop the blocks after the last of ``indices`` (an int n: the last n),
        the final norm with ``prune_norm``, the head and pooling with ``prune_head``; returns the
        blocks' indices, which stay those of the unpruned model."""
        take = self._take_indices(indices)
        self.blocks = self.blocks[: max(take) + 1]
        self.cfg = dataclasses.replace(self.cfg, depth=len(self.blocks))
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """(B, N, embed_dim) -> (B, num_classes) logits, or the pooled (B, embed_dim) features;
        with ``global_pool`` "" (timm's "no pooling"), the tokens themselves."""
        if self.global_pool == "avg":
            x = x.mean(dim=1)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, num_classes)."""
        return self.forward_head(self.forward_features(x))

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new, freshly initialised head for ``num_classes`` (0: none, forward returns features)
        on the model's device and dtype; ``global_pool`` "avg" (mean over tokens) or "" (none),
        unchanged when None."""
        if global_pool is not None:
            if global_pool not in ("avg", ""):
                raise ValueError(f"global_pool must be 'avg' or '' (none), got {global_pool!r}")
            self.global_pool = global_pool
        like = next(self.parameters(), None)
        factory = {} if like is None else {"device": like.device, "dtype": like.dtype}
        self.num_classes = num_classes
        self.head = (
            nn.Linear(self.cfg.embed_dim, num_classes, **factory) if num_classes > 0 else nn.Identity()
        )
        self.head.apply(init_weights)
        self.head.train(self.training)
        if num_classes > 0:
            self.cfg = dataclasses.replace(self.cfg, num_classes=num_classes)

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """Parameter groups by name, for timm's layer-wise learning-rate decay."""
        return {
            "stem": r"^patch_embed",
            "blocks": r"^blocks\.(\d+)" if coarse else [(r"^blocks\.(\d+)", None), (r"^norm", (99999,))],
        }

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        """Parameter names to exclude from weight decay (timm's create_optimizer_v2 reads this)."""
        return {
            n
            for n, _ in self.named_parameters()
            if n.endswith(("rel_pos_bias", "sink", "gate", "content_bias"))
        }
