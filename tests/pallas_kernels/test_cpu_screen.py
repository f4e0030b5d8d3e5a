"""The greedy tied LM head through the table's int8 screen (pallas_kernels/cpu/screen.py, head_screen.cc): its
tokens are the full fused head's (`matmul_transposed_argmax_cpu`) in every case, screened or not, and its bounds
hold against float64. Each case runs on the default build (AMX-INT8 tiles where the CPU has them, else AVX-512
VNNI) and, on a CPU with AMX, also on the build without AMX, so that the VNNI path is tested there too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged.kernels import cpu
from paged.kernels.cpu import matmul_transposed_argmax_cpu, matmul_transposed_cpu
from paged.kernels.cpu import screen as screening

pytestmark = pytest.mark.skipif(not screening.screen_native(),
                                reason="no AMX-INT8 or AVX-512 VNNI here: the greedy head reads the whole table")


@pytest.fixture(params=["default", "without_amx"])
def build(request):
    """The suffix of the FFI targets under test: "" for the default build, else the build without AMX's."""
    if request.param == "default":
        return ""
    if not cpu.matmul_on_amx():
        pytest.skip("the default build already runs without AMX here")
    suffix = cpu.matmul_target_without_amx()[len(cpu._MATMUL_TARGET):]
    if not screening.screen_native(cpu._TARGET + suffix):
        pytest.skip("the build without AMX has no AVX-512 VNNI screen on this CPU")
    return suffix


def _screen(w):
    return jax.tree.map(jnp.asarray, screening.greedy_screen(w))


def _both(x, w, live=None, build=""):
    """(the full head's tokens, the screened head's), jitted as the engine runs them, on one build."""
    live = x.shape[0] if live is None else live
    full = jax.jit(lambda *a: matmul_transposed_argmax_cpu(
        *a, _target=cpu._MATMUL_TRANSPOSED_ARGMAX_TARGET + build))(x, w, jnp.int32(live))
    screened = jax.jit(lambda *a: screening.screened_argmax_cpu(
        *a, _target=cpu._SCREENED_ARGMAX_TARGET + build))(x, w, _screen(w), jnp.int32(live))
    return np.asarray(full), np.asarray(screened)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 33, 40])
@pytest.mark.parametrize("inner, vocab", [(32, 1), (64, 100), (96, 333), (896, 4001)])
def test_screened_tokens_are_the_full_heads(rows, inner, vocab, build):
    """Row chunks of 16 and 32 and a partial one (AMX), passes of up to 12 rows (VNNI, which takes up to 32 rows
    and leaves more to the full head), K not a multiple of 64 (96, 32), a table of one row and ones whose last
    32-row block is partial, split over threads."""
    rng = np.random.default_rng(rows * 13 + inner + vocab)
    x = jnp.asarray(rng.normal(size=(rows, inner)) * 2, jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(vocab, inner)) * 0.05, jnp.bfloat16)
    full, screened = _both(x, w, build=build)
    np.testing.assert_array_equal(screened, full)


def test_live_rows(build):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 64)).astype(np.float32)
    x[17:] = np.nan  # padding rows: never read
    x = jnp.asarray(x, jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(500, 64)), jnp.bfloat16)
    full, screened = _both(x, w, live=17, build=build)
    assert not screened[17:].any()
    np.testing.assert_array_equal(screened, full)


@pytest.mark.parametrize("special, want", [
    ({300: 50.0, 700: 50.0}, 300),  # a tie across the threads' halves of the table
    ({3: 40.0, 9: 40.0}, 3),        # a tie inside one block
    ({999: 30.0}, 999),             # the table's last row, in its partial last block
])
def test_ties_take_the_first_row(special, want, build):
    """x is e_0, so row n's sum is w[n, 0] exactly: equal maxima can only be told apart by their index."""
    w = np.random.default_rng(0).normal(size=(1000, 64)).astype(np.float32)
    for row, value in special.items():
        w[row, 0] = value
    x = np.zeros((2, 64), np.float32)
    x[:, 0] = 1.0
    full, screened = _both(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), build=build)
    np.testing.assert_array_equal(full, [want, want])
    np.testing.assert_array_equal(screened, full)


def test_rows_the_int8_copy_cannot_tell_apart(build):
    """Three rows that differ by one, two and three last-place steps of one bfloat16 element (x's largest):
    their screened sums lie well inside each other's error, so only the exact sums decide, and they decide
    as the full head's do."""
    rng = np.random.default_rng(2)
    inner, vocab = 128, 3000
    w = (rng.normal(size=(vocab, inner)) * 0.05).astype(np.float32)
    x = rng.normal(size=(4, inner)).astype(np.float32)
    base = np.sign(x[0]) * 0.05
    near = [100, 1500, 2999]
    for i, row in enumerate(near):
        w[row] = base
        w[row, int(np.argmax(np.abs(x[0])))] *= 1 + i * 2.0**-7  # bf16 keeps 8 bits: 1, 2, 3 steps up
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    full, screened = _both(xb, wb, build=build)
    assert full[0] == near[-1]
    np.testing.assert_array_equal(screened, full)


@pytest.mark.parametrize("value", [np.nan, np.inf, 1e30])
def test_inputs_the_bounds_cannot_take_go_to_the_full_head(value, build):
    """A non-finite x, or one whose bounds could overflow, takes the whole table: still the full head's tokens
    (a NaN counting as +inf)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 64)).astype(np.float32)
    x[1, 5] = value
    w = jnp.asarray(rng.normal(size=(700, 64)), jnp.bfloat16)
    full, screened = _both(jnp.asarray(x, jnp.bfloat16), w, build=build)
    np.testing.assert_array_equal(screened, full)


def test_a_table_of_near_copies_overflows_the_candidates_and_reads_everything(build):
    """Every row within the screen's error of every other: more candidates than the screen keeps, so the call
    reads the whole table; the tokens are still the full head's."""
    rng = np.random.default_rng(4)
    row = rng.normal(size=64).astype(np.float32)
    w = row + rng.normal(size=(6000, 64)).astype(np.float32) * 1e-3
    x = jnp.asarray(rng.normal(size=(5, 64)), jnp.bfloat16)
    full, screened = _both(x, jnp.asarray(w, jnp.bfloat16), build=build)
    np.testing.assert_array_equal(screened, full)


def test_the_bounds_hold_in_float64():
    """For random rows of x: |x.w - s| <= e for every table row, with s and e formed from the screen's arrays as
    the kernel forms them (x's codes at max|x| / 127), the true product in float64. Also the codes' tile order:
    byte (b, s, h, q, j, e) is row 32 b + 16 h + j's code for k = 64 s + 4 q + e."""
    rng = np.random.default_rng(5)
    vocab, inner = 333, 96
    w = jnp.asarray(rng.normal(size=(vocab, inner)) * np.exp(rng.normal(size=(vocab, 1))), jnp.bfloat16)
    screen = jax.tree.map(np.asarray, screening.greedy_screen(w))
    padded, depth = 352, 128
    tiles = screen["codes"].reshape(padded // 32, depth // 64, 2, 16, 16, 4)
    all_codes = tiles.transpose(0, 2, 4, 1, 3, 5).reshape(padded, depth)
    assert not all_codes[vocab:].any() and not all_codes[:, inner:].any() and not screen["stats"][:, vocab:].any()
    codes = all_codes[:vocab, :inner].astype(np.float64)
    sigma, code_norm, slack = (screen["stats"][i, :vocab].astype(np.float64) for i in range(3))
    wide = np.asarray(w, np.float64)
    np.testing.assert_array_equal(sigma, (np.abs(wide).max(axis=1) / 127).astype(np.float32))
    np.testing.assert_array_equal(codes, np.clip(np.rint(wide / sigma[:, None]), -127, 127))
    # The per-row factors and the limits: never below their float64 values, and only just above them.
    gamma = inner * 2.0**-24 / (1 - inner * 2.0**-24)
    norms = np.linalg.norm(wide, axis=1)
    for got, want in ((code_norm, np.linalg.norm(codes * sigma[:, None], axis=1)),
                      (slack, np.linalg.norm(wide - codes * sigma[:, None], axis=1) + gamma * norms),
                      (screen["limits"][0], norms.max()), (screen["limits"][1], np.abs(wide).max())):
        assert np.all(got >= want) and np.all(got <= want * (1 + 2.0**-18))
    for _ in range(20):
        x = np.asarray(jnp.asarray(rng.normal(size=inner) * 3, jnp.bfloat16), np.float64)
        scale = np.float32(np.abs(x).max() / np.float32(127))
        x_codes = np.clip(np.rint(x / scale), -127, 127)
        s = scale * sigma * (codes @ x_codes)
        e = np.linalg.norm(x) * slack + np.linalg.norm(x - scale * x_codes) * code_norm
        assert np.all(np.abs(wide @ x - s) <= e)


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_greedy_screen_refuses_what_it_cannot_bound(value):
    table = np.random.default_rng(7).normal(size=(70, 32)).astype(np.float32)
    table[66, 3] = value  # in the last, partial block of rows
    assert screening.greedy_screen(jnp.asarray(table, jnp.bfloat16)) is None
    with pytest.raises(ValueError, match="bfloat16 table"):
        screening.greedy_screen(np.zeros((40, 32), np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        screening.greedy_screen(jnp.zeros((40, 48), jnp.bfloat16))


def test_matmul_transposed_is_what_the_screen_reproduces(build):
    """The reference itself: the full head's tokens are the first argmax of the float32 logits."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(9, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(300, 64)), jnp.bfloat16)
    transposed = matmul_transposed_cpu(x, w, _target=cpu._MATMUL_TRANSPOSED_TARGET + build)
    np.testing.assert_array_equal(_both(x, w, build=build)[1], np.argmax(np.asarray(transposed), axis=1))
