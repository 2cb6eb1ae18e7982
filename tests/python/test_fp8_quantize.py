"""pounce.quantize_weights_fp8 on numpy arrays (CPU): the bytes and scales against a numpy quantizer written
from DESIGN §1 (scale = 2^ceil(log2(amax / 448)) per 128x128 block, 1 for an all-zero block; e4m3 fn, round
to nearest even), both orientations, partial blocks at the edges; bad arguments named."""
from __future__ import annotations

import numpy as np
import pytest

pounce = pytest.importorskip(
    "pounce", reason="the pounce Python module is not built (needs nanobind; run tools/setup.sh)"
)

E4M3_MAX = 448.0


def e4m3_table():
    """The 127 non-negative finite e4m3 fn values, indexed by code (0x00 .. 0x7e)."""
    codes = np.arange(0x7F)
    exponent, mantissa = codes >> 3, codes & 7
    return np.where(exponent == 0, mantissa * 2.0**-9, (8 + mantissa) * 2.0 ** (exponent - 10))


def to_e4m3(values):
    """float64 values (exact fp32 quotients) -> e4m3 codes: round to nearest even, saturate to 448."""
    magnitude = np.minimum(np.abs(values), E4M3_MAX)
    binade = np.maximum(np.floor(np.log2(np.where(magnitude > 0, magnitude, 1.0))), -6)
    step = 2.0 ** (binade - 3)
    rounded = np.minimum(np.round(magnitude / step) * step, E4M3_MAX)  # np.round: ties to even
    codes = np.searchsorted(e4m3_table(), rounded).astype(np.uint8)
    assert np.array_equal(e4m3_table()[codes], rounded)
    return np.where(np.signbit(values), codes | 0x80, codes).astype(np.uint8)


def quantize_blocks(w):
    """[N, K] float32 -> (codes [N, K], scales [ceil(N/128), ceil(K/128)])."""
    n, k = w.shape
    bn, bk = -(-n // 128), -(-k // 128)
    codes = np.zeros((n, k), np.uint8)
    scales = np.zeros((bn, bk), np.float32)
    for i in range(bn):
        for j in range(bk):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].astype(np.float64)
            amax = np.abs(block).max()
            exponent = 0 if amax == 0 else int(np.ceil(np.log2(amax / E4M3_MAX)))
            # log2 is not exact: settle on the smallest power of two that fits
            while amax != 0 and amax <= E4M3_MAX * 2.0 ** (exponent - 1):
                exponent -= 1
            while amax > E4M3_MAX * 2.0**exponent:
                exponent += 1
            scales[i, j] = 2.0**exponent
            codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = to_e4m3(block / 2.0**exponent)
    return codes, scales


def make_weights(experts, inter, hidden, seed):
    rng = np.random.default_rng(seed)
    gate, up = (rng.normal(0, 0.05, (experts, inter, hidden)) for _ in range(2))
    down = rng.normal(0, 0.05, (experts, hidden, inter))
    gate[0, :128, :128] = 0  # an all-zero block
    up[-1] *= 1e-4  # other scales
    return tuple(pounce.bf16_bits(w) for w in (gate, up, down))


def make_out(experts, inter, hidden, fill=0xFF):
    bi, bh = -(-inter // 128), -(-hidden // 128)
    shapes = [((inter, hidden), (bi, bh))] * 2 + [((hidden, inter), (bh, bi))] * 3 + [((inter, hidden), (bi, bh))]
    return [(np.full((experts,) + d, fill, np.uint8), np.full((experts,) + s, np.nan, np.float32)) for d, s in shapes]


@pytest.mark.parametrize("inter,hidden", [(192, 320), (128, 64)])
def test_matches_the_numpy_quantizer_in_both_orientations(inter, hidden):
    experts = 2
    routed = make_weights(experts, inter, hidden, seed=inter)
    out = make_out(experts, inter, hidden)
    pounce.quantize_weights_fp8(routed, out)
    for t, w in enumerate(routed):
        values = pounce.bf16_to_float(w)
        for e in range(experts):
            codes, scales = quantize_blocks(values[e])
            np.testing.assert_array_equal(out[t][0][e], codes, err_msg=f"tensor {t} expert {e}")
            np.testing.assert_array_equal(out[t][1][e], scales, err_msg=f"scales of tensor {t} expert {e}")
            np.testing.assert_array_equal(out[t + 3][0][e], codes.T, err_msg=f"transposed tensor {t}")
            np.testing.assert_array_equal(out[t + 3][1][e], scales.T, err_msg=f"transposed scales {t}")
    assert out[0][1][0, 0, 0] == 1.0  # the all-zero block


def test_bad_arguments_are_named():
    routed = make_weights(1, 128, 128, seed=1)
    out = make_out(1, 128, 128)
    bad_scale = list(out)
    bad_scale[4] = (out[4][0], np.zeros((1, 2, 2), np.float32))
    with pytest.raises(pounce.PounceError, match=r"'out\.up_t\.scale'"):
        pounce.quantize_weights_fp8(routed, bad_scale)
    with pytest.raises(pounce.PounceError, match=r"'routed\.down'"):
        pounce.quantize_weights_fp8((routed[0], routed[1], routed[2].astype(np.float32)), out)
    with pytest.raises(pounce.PounceError, match=r"six \(data, scale\) pairs"):
        pounce.quantize_weights_fp8(routed, out[:5])
    with pytest.raises(pounce.PounceError, match=r"'out\.gate' must be a \(data, scale\) pair"):
        pounce.quantize_weights_fp8(routed, [out[0][0]] + out[1:])
    assert "quantize_weights_fp8" in pounce.__all__
