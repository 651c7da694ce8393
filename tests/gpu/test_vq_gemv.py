"""The VQ GEMV (kernels/vq/gemv.cu), both forms (`mma`: entries into tensor-core fragments; `fma`: CUDA-core
products), against the float64 product with the dequantized weight, on fresh random layers and activations: both
presets' configurations (GPTVQ-2: d 4, 8-bit indices, 256x256 tiles; AQLM-3: d 8, 12-bit indices, two residual
codebooks per tensor), odd shapes (ragged row and column tiles, K = 576, rows not a multiple of a block's, index rows
not a whole number of 16-byte words), with and without re-indexing, every cache variant (GC, SC, the derived tiers,
and forced tiers that put entries in all three places: registers or replicas, single shared copies, global memory),
M = 1, 3, 16.

Outputs are poisoned with NaN before each launch, so an element the kernel forgets to write fails the test;
`synced` makes a faulting launch fail here rather than in a later test. A stories260K checkpoint quantized with the
gptvq-2 preset runs through `VQLinear` on CUDA with the kernel and gives the reference's outputs.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from qtool.layouts.vq.layout import VQWeight, tile_counts
from qtool.layouts.vq.module import VQLinear
from tests.gpu.helpers import dependent_chain_runs, gpu_ready, rel_err, synced

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]

# fp16 activations and entries; fma: each vector's d products summed in fp16x2 and widened, fp32 across vectors;
# mma: fp32 accumulation throughout; fp16 output.
TOL = 3e-3
MS = (1, 3, 16)
PRESETS = {  # (d, index bits, residuals, tile_rows, tile_cols)
    "gptvq-2": (4, 8, 1, 256, 256),
    "aqlm-3": (8, 12, 2, None, None),
}
# (N, K) per preset: ragged row and column tiles (K = 576: column tiles of 256, 256, 64), one short row tile,
# 12-bit index rows of 27 and 49 words (scalar loads), K long enough to split along K at 16 tokens.
SHAPES = {
    "gptvq-2": [(100, 576), (300, 576), (64, 1024), (17, 256)],
    "aqlm-3": [(72, 576), (130, 1040), (64, 2048)],
}
# Forced (n_reg, n_shared) per form: hot tier (registers / replicas) + shared + global; shared + global; hot tier +
# global; (mma) every entry replicated.
FORCED = {
    ("fma", "gptvq-2"): [(32, 64), (0, 128), (64, 64)],
    ("fma", "aqlm-3"): [(32, 256), (64, 1024), (0, 512)],
    ("mma", "gptvq-2"): [(64, 128), (0, 128), (32, 32), (256, 256)],
    ("mma", "aqlm-3"): [(256, 1024), (0, 512), (64, 64)],
}


@pytest.fixture(autouse=True)
def _fresh_inputs():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed {seed}")


def random_vq(n: int, k: int, preset: str, reindex: bool, seed: int, bias: bool = False) -> VQLinear:
    """Skewed random codes (a few hot entries, as trained codebooks have) and random codebooks of the preset's
    configuration, sized so outputs are O(1) for unit-variance inputs."""
    d, bits, z, tr, tc = PRESETS[preset]
    g = torch.Generator().manual_seed(seed)
    e = 1 << bits
    probs = torch.rand(e, generator=g) ** 4
    codes = torch.multinomial(probs, z * n * (k // d), replacement=True, generator=g).reshape(z, n, k // d)
    r, c = tile_counts(n, k, tr, tc)
    books = torch.randn(r, c, z, e, d, generator=g) / (z * k) ** 0.5
    w = VQWeight.from_codes(codes, books, tr, tc, reindex=reindex)
    b = (torch.randn(n, generator=g) * 0.1).half() if bias else None
    return VQLinear(w, b).to("cuda")


def reference64(layer: VQLinear, x: torch.Tensor, with_bias: bool) -> torch.Tensor:
    y = x.double().cpu() @ layer.layout_with(lambda t: t.cpu()).dequantize(torch.float32).double().T
    if with_bias and layer.bias is not None:
        y = y + layer.bias.double().cpu()
    return y


def _check(layer: VQLinear, p, m: int, seed: int, with_bias: bool, **kw) -> None:
    from qtool.cuda import split_k
    from qtool.layouts.vq import cuda as vq

    x = torch.randn(m, layer.in_features, device="cuda", dtype=torch.float16)
    out = torch.full((m, layer.out_features), float("nan"), device="cuda", dtype=torch.float16)
    case = f"N={layer.out_features} K={layer.in_features} M={m} seed {seed} {kw}"
    try:
        y = synced(vq.gemv(x, p, layer.bias if with_bias else None, out=out, **kw))
    except Exception as exc:
        plans = {k: v for k, v in p.plans.items() if k[0] == vq.token_slots(m)}
        raise AssertionError(f"{case}: {type(exc).__name__}: {exc}; plans {plans}") from exc
    assert y.data_ptr() == out.data_ptr()
    assert bool(torch.isfinite(y).all()), (
        f"unwritten or non-finite outputs: {int((~torch.isfinite(y)).sum())}"
    )
    err = rel_err(y, reference64(layer, x, with_bias))
    assert err < TOL, f"relative error {err:.2e} ({case})"
    cnt = split_k.counters(torch.cuda.current_device())
    assert cnt is None or not bool(cnt.any()), "split counters left nonzero"


@pytest.mark.parametrize("form", ["mma", "fma"])
@pytest.mark.parametrize("reindex", [True, False], ids=["reindexed", "original-order"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_gemv_every_cache_variant(preset, reindex, form):
    from qtool.layouts.vq import cuda as vq

    for i, (n, k) in enumerate(SHAPES[preset]):
        seed = int.from_bytes(os.urandom(4), "little")
        layer = random_vq(n, k, preset, reindex, seed, bias=True)
        p = vq.prepare(layer)
        assert (p.hot > 0) == reindex
        for m in MS:
            for cache in vq.CACHES:
                _check(layer, p, m, seed, with_bias=(m + i) % 2 == 1, cache=cache, form=form)
            for tiers in FORCED[form, preset]:
                _check(layer, p, m, seed, with_bias=m == 3, cache="tiered", tiers=tiers, form=form)
            if p.col_tiles > 1:  # codebook switches inside a block: 2 and all column tiles per block
                for tps in (2, p.col_tiles):
                    _check(layer, p, m, seed, with_bias=True, cache="tiered", tiles_per_split=tps, form=form)


# The mma form's launch options (qtool/layouts/vq/cuda.py `knobs`), each set explicitly: all on (clusters of up to 16
# blocks adding their splits through distributed shared memory, next-tile prefetch, dependent launch), then each
# switched off; "portable" caps clusters at 8 blocks with an ordinary launch; "off" is what the module's defaults
# give today.
ALL_ON = {
    "QTOOL_VQ_CLUSTER": "16",
    "QTOOL_VQ_PREFETCH": "1",
    "QTOOL_VQ_DEPENDENT": "1",
}
KNOBS = {
    "all-on": ALL_ON,
    "global-split-k": {**ALL_ON, "QTOOL_VQ_CLUSTER": "1"},
    "no-prefetch": {**ALL_ON, "QTOOL_VQ_PREFETCH": "0"},
    "portable-ordinary-launch": {**ALL_ON, "QTOOL_VQ_CLUSTER": "8", "QTOOL_VQ_DEPENDENT": "0"},
    "off": {
        "QTOOL_VQ_CLUSTER": "1",
        "QTOOL_VQ_PREFETCH": "0",
        "QTOOL_VQ_DEPENDENT": "0",
    },
}
# Beside SHAPES: 17 column tiles (a cluster of 9 splits: non-portable; 8 with the portable cap) with a ragged row
# tile; AQLM rows in 8 row blocks with a ragged last block and 49-word index rows.
KNOB_SHAPES = {"gptvq-2": [(300, 576), (272, 4352)], "aqlm-3": [(130, 1040), (1000, 1032)]}


@pytest.mark.parametrize("knob", list(KNOBS))
@pytest.mark.parametrize("preset", list(PRESETS))
def test_mma_cluster_prefetch_options(preset, knob, monkeypatch):
    """Every launch option of the mma form against the reference: the cluster's reduction and the global split-K
    one, tile prefetch on and off, dependent and ordinary launches; every cache variant, both index orders, M = 1,
    3, 16. The plans use what the option asks for, and no cluster launch fell back to an ordinary one."""
    from qtool.cuda import dependent_launch
    from qtool.layouts.vq import cuda as vq

    for name, value in KNOBS[knob].items():
        monkeypatch.setenv(name, value)
    cmax, prefetch, _, _ = vq.knobs()
    used = {"dsm": 0}
    for i, (n, k) in enumerate(KNOB_SHAPES[preset]):
        seed = int.from_bytes(os.urandom(4), "little")
        layer = random_vq(n, k, preset, i % 2 == 0, seed, bias=True)
        p = vq.prepare(layer)
        for m in MS:
            for cache in vq.CACHES:
                _check(layer, p, m, seed, with_bias=(m + i) % 2 == 0, cache=cache, form="mma")
                plan = vq.plan_for(p, vq.token_slots(m), cache, torch.cuda.current_device(), form="mma")
                cx, cy = plan.cluster
                assert cx == 1 and cy == (plan.splits if 1 < plan.splits <= cmax else 1), plan
                assert cy <= vq.CLUSTER_LIMIT and plan.prefetch == prefetch
                used["dsm"] += cy > 1
    assert dependent_launch.cluster_fallback_reason() == "", "a cluster launch ran as an ordinary one"
    assert (used["dsm"] > 0) == (cmax > 1), used


def test_chained_calls_read_the_previous_output(monkeypatch):
    """Three calls back to back, each reading the previous call's output and the third writing over what the first
    wrote (and the second read): with ordinary launches, with dependent ones eagerly and replayed from a CUDA graph,
    the outputs are the same bits and equal the reference chain (every launch option on)."""
    from qtool.layouts.vq import cuda as vq

    for name, value in ALL_ON.items():
        monkeypatch.setenv(name, value)
    seed = int.from_bytes(os.urandom(4), "little")
    for preset, n in (("gptvq-2", 768), ("aqlm-3", 512)):
        layer = random_vq(n, n, preset, True, seed, bias=True)
        p = vq.prepare(layer)
        for m in (1, 16):
            x = torch.randn(m, n, device="cuda", dtype=torch.float16)
            a = torch.empty(m, n, device="cuda", dtype=torch.float16)
            b = torch.empty_like(a)

            def chain(x=x, a=a, b=b, p=p, bias=layer.bias) -> torch.Tensor:
                a.fill_(float("nan"))
                b.fill_(float("nan"))
                vq.gemv(x, p, bias, out=a)
                vq.gemv(a, p, bias, out=b)
                return vq.gemv(b, p, bias, out=a)

            plain, outs = dependent_chain_runs(chain)
            for o in outs:
                assert torch.equal(o, plain), f"{preset} M={m}: dependent launches changed the output"
            ref = x
            for _ in range(3):  # the reference rounds to fp16 between calls as the kernel's outputs are
                ref = reference64(layer, ref, True).to(device="cuda", dtype=torch.float16)
            assert rel_err(plain, ref.double().cpu()) < 3 * TOL, f"{preset} M={m} seed {seed}"


def test_mma_form_warps_along_k():
    """AQLM-3's per-tensor range has several 64-vector chunks: the mma plan shares rows between warps along K (wk >
    1) when the grid would not fill the device otherwise, and every wk gives the reference's outputs; M = 1..16
    token slots, one of them partly filled."""
    from qtool.layouts.vq import cuda as vq

    seed = int.from_bytes(os.urandom(4), "little")
    layer = random_vq(200, 2048, "aqlm-3", True, seed, bias=True)
    p = vq.prepare(layer)
    dev = torch.cuda.current_device()
    plan = vq.plan_for(p, 1, "tiered", dev, form="mma")
    assert plan.wk > 1 and plan.rows_per_block == 256 // plan.wk
    for m in (1, 2, 5, 8, 11):
        _check(layer, p, m, seed, with_bias=True, cache="sc", form="mma")


def test_plans_follow_the_layout():
    """GPTVQ splits along its column tiles, AQLM along its residuals (and along K only at many tokens); the
    derived tiers stay inside the codebook and the block's shared memory."""
    from qtool.layouts.vq import cuda as vq

    dev = torch.cuda.current_device()
    g = vq.prepare(random_vq(300, 576, "gptvq-2", True, 1))
    plan = vq.plan_for(g, 1, "tiered", dev)
    assert (plan.splits, plan.splits_k, plan.split_vecs, plan.tiles_per_split) == (3, 3, 64, 1)
    assert plan.grid_x == 2 * plan.rbpt and plan.rows_per_block * plan.rbpt >= 256
    # More tokens, more partial-sum traffic: fewer splits (a block walks through more column tiles).
    big = vq.prepare(random_vq(2048, 4096, "gptvq-2", True, 5))
    few, many_tok = vq.plan_for(big, 1, "sc", dev), vq.plan_for(big, 16, "sc", dev)
    assert few.splits == 16 and many_tok.splits < few.splits and many_tok.tiles_per_split > 1
    assert many_tok.splits_k * many_tok.tiles_per_split >= 16
    a = vq.prepare(random_vq(64, 2048, "aqlm-3", True, 2))
    one, many = vq.plan_for(a, 1, "sc", dev), vq.plan_for(a, 16, "sc", dev)
    assert (one.splits, one.splits_k) == (2, 1)
    assert many.splits_k > 1 and many.splits == 2 * many.splits_k
    for plan in (vq.plan_for(a, 1, "tiered", dev), vq.plan_for(a, 16, "tiered", dev)):
        assert 0 <= plan.n_reg <= plan.n_shared <= 4096 and plan.n_shared % 32 == 0
        assert plan.smem <= vq.device_limits(dev).smem_per_block
        assert plan.why["gc_regs"] > 0


def test_bad_calls_name_the_argument():
    from qtool.layouts.vq import cuda as vq

    layer = random_vq(64, 256, "gptvq-2", True, 3)
    p = vq.prepare(layer)
    x = torch.randn(1, 256, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="cache"):
        vq.gemv(x, p, cache="l2")
    with pytest.raises(ValueError, match="tiers"):
        vq.gemv(x, p, tiers=(16, 64))
    with pytest.raises(ValueError, match="tiers"):
        vq.gemv(x, p, tiers=(64, 0), form="mma")  # replicas need shared memory
    with pytest.raises(ValueError, match="tiers"):
        vq.gemv(x, p, tiers=(128, 64), form="fma")  # beyond two register sets
    with pytest.raises(ValueError, match="form"):
        vq.gemv(x, p, form="wmma")
    with pytest.raises(ValueError, match="x: found torch.float32"):
        vq.gemv(x.float(), p)
    with pytest.raises(ValueError, match="M=17"):
        vq.gemv(torch.randn(17, 256, device="cuda", dtype=torch.float16), p)


def test_vqlinear_dispatch(monkeypatch):
    """VQLinear on CUDA: up to 16 float16 rows through the kernel (QTOOL_KERNELS=cuda: no silent fallback), more
    rows and other dtypes through the torch paths, all equal to the reference."""
    from qtool.layouts.vq import cuda as vq

    layer = random_vq(96, 576, "gptvq-2", True, 4, bias=True)
    calls = []
    gemv = vq.gemv
    monkeypatch.setattr(vq, "gemv", lambda *a, **kw: calls.append(1) or gemv(*a, **kw))
    monkeypatch.setenv("QTOOL_KERNELS", "cuda")
    for shape in [(1, 576), (2, 3, 576), (16, 576)]:
        x = torch.randn(*shape, device="cuda", dtype=torch.float16)
        y = synced(layer(x))
        assert y.shape == (*shape[:-1], 96)
        assert rel_err(y.reshape(-1, 96), reference64(layer, x.reshape(-1, 576), True)) < TOL
    assert len(calls) == 3
    with pytest.raises(Exception, match="vq layer: dtype torch.float32"):
        layer(torch.randn(1, 576, device="cuda"))
    monkeypatch.setenv("QTOOL_KERNELS", "auto")
    x = torch.randn(1, 576, device="cuda")
    assert rel_err(layer(x), reference64(layer, x, True)) < 1e-4 and len(calls) == 3
    x = torch.randn(40, 576, device="cuda", dtype=torch.float16)
    assert rel_err(layer(x), reference64(layer, x, True)) < TOL and len(calls) == 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from click.testing import CliRunner

    from qtool.cli import cli

    from conftest import STORIES, TINY_SAMPLE, write_recipe

    if not STORIES.is_dir() or not TINY_SAMPLE.is_file():
        pytest.skip("stories260K assets not found")
    tmp = tmp_path_factory.mktemp("vq-gpu")
    text = (
        f"model: {STORIES}\ncalibration:\n  source: {TINY_SAMPLE}\n  num_samples: 2\n  seq_len: 64\n  seed: 0\n"
        f"stages:\n  - stage: vq\n    preset: gptvq-2\n    kmeans_iters: 2\noutput: {tmp / 'ckpt'}\n"
    )
    res = CliRunner().invoke(
        cli,
        ["quantize", str(write_recipe(tmp / "r.yaml", text)), "--no-eval", "--json"],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["quantized_linears"] > 0
    return tmp / "ckpt"


def test_checkpoint_layers_through_the_kernel(checkpoint, monkeypatch):
    """Every VQLinear of a real gptvq-2 checkpoint (stories260K: K = 64 and 172, one ragged tile each) through the
    kernel equals the float64 reference, and the model's logits on CUDA equal the CPU reference's."""
    import qtool
    from qtool.layouts.vq import cuda as vq

    monkeypatch.setenv("QTOOL_KERNELS", "cuda")
    model = qtool.load(checkpoint, device="cuda", dtype=torch.float16).eval()
    layers = [m for m in model.modules() if isinstance(m, VQLinear)]
    assert layers and all(m.reindexed for m in layers)
    calls = []
    gemv = vq.gemv
    monkeypatch.setattr(vq, "gemv", lambda *a, **kw: calls.append(1) or gemv(*a, **kw))
    for layer in layers:
        for m in (1, 5):
            x = torch.randn(m, layer.in_features, device="cuda", dtype=torch.float16)
            assert rel_err(synced(layer(x)), reference64(layer, x, True)) < TOL
    assert len(calls) == 2 * len(layers)
    cpu = qtool.load(checkpoint, device="cpu", dtype=torch.float32).eval()
    ids = torch.randint(1, 256, (1, 12))
    with torch.no_grad():
        ref = cpu(ids).logits[0, -1].double()
        got = model(ids[:, :1].cuda(), use_cache=True)
        past = got.past_key_values
        for i in range(1, 12):  # one token at a time: every linear sees M = 1 (the kernel)
            got = model(ids[:, i : i + 1].cuda(), past_key_values=past, use_cache=True)
            past = got.past_key_values
    assert rel_err(got.logits[0, -1], ref) < 2e-2
