"""Head counts against an independent reference: which patches an impulse response touches."""

from __future__ import annotations

import pytest
import torch

from convit_convert.theory import head_count, heads_needed, patch_offsets, same_padding


def touched_offsets(k: int, p: int, d: int) -> set[tuple[int, int]]:
    """Patch offsets whose pixels influence patch (gy, gx) in the middle of a large image, found by
    back-propagating through nn.Conv2d(padding='same') itself."""
    g = 2 * ((d * (k - 1)) // p + 2) + 1  # grid wide enough that nothing reaches the border
    conv = torch.nn.Conv2d(1, 1, k, padding="same", dilation=d, bias=False)
    torch.nn.init.ones_(conv.weight)
    x = torch.zeros(1, 1, g * p, g * p, requires_grad=True)
    c = g // 2
    conv(x)[0, 0, c * p : (c + 1) * p, c * p : (c + 1) * p].sum().backward()
    ys, xs = torch.nonzero(x.grad[0, 0], as_tuple=True)
    return {(int(y) // p - c, int(x_) // p - c) for y, x_ in zip(ys, xs, strict=True)}


@pytest.mark.parametrize("k", range(1, 12))
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("d", [1, 2, 3])
def test_offsets_match_impulse_response(k: int, p: int, d: int) -> None:
    assert set(patch_offsets(k, p, d)) == touched_offsets(k, p, d)


def test_paper_numbers() -> None:
    for p in (4, 8, 16, 32):
        for k in range(3, 2 * p):  # Corollary 4: 9 heads while K < 2P
            assert heads_needed(k, p) == 9, (k, p)
        # Theorem 1's (2⌈(K-1)/2P⌉+1)² is still 9 at K = 2P+1; K = 2P+2 reaches 2 patches on one side
        assert heads_needed(2 * p + 1, p) == 9
        assert heads_needed(2 * p + 2, p) == 16
        assert heads_needed(2 * p + 3, p) == 25
    for k in range(1, 12):  # Corollary 3: pixel input needs K² heads, with or without dilation
        for d in (1, 2, 3):
            assert heads_needed(k, 1, d) == k * k
    assert heads_needed(1, 16) == 1
    assert heads_needed(11, 4) == 25
    assert heads_needed(2, 16) == 4  # PyTorch pads an even kernel on one side only
    assert same_padding(4, 1) == (1, 2)


def rank_of_theorem6_matrix(k: int, p: int, d: int, seed: int = 0) -> int:
    """rank of W^C from the proof of Theorem 6 (C_in = C_out = 1), built from impulse responses:
    column δ holds, for every (output pixel t, input pixel s), the weight from pixel s of patch
    q + δ to pixel t of patch q."""
    offsets = patch_offsets(k, p, d)
    g = 2 * ((d * (k - 1)) // p + 2) + 1
    c = g // 2
    w = torch.randn(1, 1, k, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    cols = []
    for dy, dx in offsets:
        col = []
        for s in range(p * p):
            x = torch.zeros(1, 1, g * p, g * p, dtype=torch.float64)
            x[0, 0, (c + dy) * p + s // p, (c + dx) * p + s % p] = 1.0
            y = torch.nn.functional.conv2d(x, w, padding="same", dilation=d)
            col.append(y[0, 0, c * p : (c + 1) * p, c * p : (c + 1) * p].flatten())
        cols.append(torch.stack(col, 1).flatten())  # rows (t, s)
    return int(torch.linalg.matrix_rank(torch.stack(cols, 1)))


@pytest.mark.parametrize(("k", "p", "d"), [(3, 3, 1), (3, 4, 1), (5, 8, 1), (2, 4, 1), (3, 5, 2), (4, 4, 1)])
def test_theorem6_lower_bound_is_the_rank(k: int, p: int, d: int) -> None:
    """Where Theorem 6 applies (P >= extent), the proof's matrix has rank |Δ|: every touched offset
    needs its own head, so the lower bound equals the construction's count."""
    hc = head_count(k, p, d)
    assert hc.patch_lower_bound == hc.patch_heads
    assert rank_of_theorem6_matrix(k, p, d) == hc.patch_heads


def test_no_bound_claimed_where_unproven() -> None:
    hc = head_count(7, 4)  # extent 7 > P = 4
    assert hc.patch_heads == 9 and hc.patch_lower_bound is None
    assert head_count(5, 1, channels=3).pixel_lower_bound == 3  # Theorem 5: min(K², C)
    assert head_count(5, 1).patch_lower_bound == 25


def test_theory_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, convit_convert.theory; print('torch' in sys.modules)"
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        == "False"
    )


def test_offset_tap_share_matches_the_corner_rule_figures() -> None:
    """Dropping the 4 diagonal offsets loses 0.17% of the taps at K = 3, P = 16, 9% at K = 5, P = 4
    (counted here by brute force over pixels and taps)."""
    from convit_convert.theory import offset_tap_share

    for k, p, expected in ((3, 16, 4 / 48**2), (5, 4, 4 * (3 / 20) ** 2)):
        share = offset_tap_share(k, p)
        assert sum(share.values()) == pytest.approx(1.0)
        diagonal = sum(v for (dy, dx), v in share.items() if dy and dx)
        assert diagonal == pytest.approx(expected)
    assert round(100 * sum(v for (dy, dx), v in offset_tap_share(3, 16).items() if dy and dx), 2) == 0.17
    assert round(100 * sum(v for (dy, dx), v in offset_tap_share(5, 4).items() if dy and dx)) == 9
    # brute force at K = 5, P = 4, dilation 2: every (pixel, tap) pair counted once
    share, pairs = offset_tap_share(5, 4, 2), {}
    for ty in range(4):
        for tx in range(4):
            for ky in range(5):
                for kx in range(5):
                    o = ((ty - 4 + 2 * ky) // 4, (tx - 4 + 2 * kx) // 4)
                    pairs[o] = pairs.get(o, 0) + 1
    assert share == pytest.approx({o: n / 400 for o, n in pairs.items()})
