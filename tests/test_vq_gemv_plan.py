"""CPU side of the VQ GEMV (qtool/layouts/vq/cuda.py): the codebook cache's tiers from a build's measured registers and
shared memory, the traffic-balanced split factor, which layers the kernel takes, and the bench's VQ rows (fake
cases and timer, no GPU)."""

from __future__ import annotations

import pytest

from qtool.bench import kernels as kb
from qtool.bench import stats
from qtool.bench.command import _vq_presets
from qtool.layouts.vq import cuda as vq
from tests.test_bench_stats import FakeCases, FakeTimer

H100 = vq.DeviceLimits(sms=132)


def test_tiers_keep_the_occupancy_of_the_gc_build():
    # 62 registers (64 allocated): 4 blocks of 256 threads fill the register file, so no register is left; a block
    # may use 233472/4 - 1024 bytes of shared memory, 8 KB of which hold activations: 3072 entries of 16 bytes fit,
    # 2048 (a power of two) are taken.
    n_reg, n_shared, why = vq.cache_tiers(8, 4096, 20, 62, 8192, H100)
    assert (n_reg, n_shared) == (0, 2048)
    assert (
        why["blocks_per_sm"] == 4 and why["reg_slack"] == 0 and why["smem_slack"] == 233472 // 4 - 1024 - 8192
    )
    # 56 registers: still 4 blocks, 64 registers per thread at that occupancy, 8 spare: one set of 32 entries
    # (4 registers each at d = 8) as there are hot entries; none without.
    assert vq.cache_tiers(8, 4096, 20, 56, 8192, H100)[:2] == (32, 32 + 2048)
    assert vq.cache_tiers(8, 4096, 0, 56, 8192, H100)[:2] == (0, 2048)
    # 40 registers: 6 blocks, no register left, 233472/6 - 1024 - 8192 bytes: 1856 entries, 1024 taken
    assert vq.cache_tiers(8, 4096, 40, 40, 8192, H100)[:2] == (0, 1024)
    # A small codebook fits whole; two register sets at most.
    assert vq.cache_tiers(4, 256, 100, 24, 512, H100)[:2] == (64, 256)
    # No shared memory left: all-global beyond the registers.
    assert vq.cache_tiers(4, 256, 0, 32, 233472 // 8 - 1024, H100)[:2] == (0, 0)


def test_mma_tiers_replicate_whole_codebooks_only():
    # 78 registers (80 allocated): 3 blocks; 233472/3 - 1024 reserved - 1024 staged = 75776 bytes: GPTVQ-2's 2 KiB
    # codebook whole, and its 16 copies (32 KiB) fit too: every entry replicated.
    n_rep, n_shared, why = vq.cache_tiers_mma(4, 256, 78, 1024, H100)
    assert (n_rep, n_shared) == (256, 256) and why["blocks_per_sm"] == 3 and why["smem_slack"] == 75776
    # 16 copies do not fit beside the single copy: no replicas (never a part of the codebook).
    assert vq.cache_tiers_mma(4, 256, 78, 233472 // 3 - 1024 - 16000, H100)[:2] == (0, 256)
    # AQLM-3, 128 registers: 2 blocks, 107520 bytes: 4096 single copies (64 KiB), far from 16 copies (1 MiB).
    assert vq.cache_tiers_mma(8, 4096, 128, 8192, H100)[:2] == (0, 4096)
    # 64 registers: 4 blocks, 49152 bytes: 2048 single copies (a power of two).
    assert vq.cache_tiers_mma(8, 4096, 64, 8192, H100)[:2] == (0, 2048)
    # Nothing left: all-global.
    assert vq.cache_tiers_mma(4, 256, 32, 233472 // 8 - 1024, H100)[:2] == (0, 0)


def test_traffic_split_balances_codebook_and_reduction_traffic():
    # sqrt(128 blocks x 128 KB / 16 KB) = 32, capped by the two residuals to split along
    assert vq.traffic_split(128 * 1024, 128, 16 * 1024, 2) == 2
    assert vq.traffic_split(128 * 1024, 128, 16 * 1024, 64) == 32
    assert vq.traffic_split(64, 1, 16 * 1024, 8) == 1
    assert vq.traffic_split(16 * 1024, 4, 16 * 1024, 8, cost_ratio=4.0) == 4


def test_layers_the_kernel_takes():
    assert vq.unsupported_reason(4, 8, 256, 4096) is None
    assert vq.unsupported_reason(8, 12, None, 4096) is None
    assert vq.unsupported_reason(4, 8, 1024, 576) is None  # one column tile: no tile constraint
    assert "tile_cols=32" in vq.unsupported_reason(4, 8, 32, 4096)  # 8 vectors: less than a 16-vector chunk
    assert "vector_size=6" in vq.unsupported_reason(6, 8, None, 576)
    assert "vector_size=2" in vq.unsupported_reason(2, 8, None, 576)
    assert "index_bits=16" in vq.unsupported_reason(4, 16, None, 576)
    assert [vq.token_slots(m) for m in (1, 3, 5, 16)] == [1, 4, 8, 16]


class VQCases(FakeCases):
    def vq_info(self, k, n, m, preset, cache):
        return 1_000_000, {"n_shared": 256}

    def vq(self, k, n, m, preset, cache, form=None):
        self.__dict__.setdefault("forms", []).append((cache, form))
        return [lambda: "gemv" if cache == "tiered" else "dequant+cublas"]

    def vq_gemm_paths(self, k, n, m, preset):
        return (
            ["vq-gemm-direct", "vq-gemm-shfl"],
            "vq-gemm-direct",
            2_000_000,
            {"gptvq-2": 2, "aqlm-3": 3}[preset],
        )

    def vq_gemm(self, k, n, m, preset, path):
        return [lambda: "gemv" if path == "vq-gemm-direct" else "dequant+cublas"]


def test_vq_rows_gemv_per_cache_up_to_16_tokens_gemm_above():
    cfg = kb.KernelBenchConfig(
        shapes=[(4096, 4096)],
        ms=[1, 64],
        bits=[4],
        group_sizes=[128],
        warmup=3,
        iters=50,
        vq_presets=["gptvq-2", "aqlm-3"],
    )
    report = kb.run_kernel_bench(cfg, VQCases(), FakeTimer())
    assert stats.validate_kernels_report(report) == []
    rows = [r for r in report["results"] if r.get("layout") == "vq"]
    assert [(r["m"], r["preset"], r.get("cache"), r["bits"]) for r in rows] == [
        (1, p, c, b) for p, b in (("gptvq-2", 2), ("aqlm-3", 3)) for c in ("gc", "sc", "tiered")
    ] + [(64, "gptvq-2", None, 2), (64, "aqlm-3", None, 3)]
    gemm = rows[-1]
    assert gemm["path"] == "vq-gemm-direct" and kb.row_label(gemm) == "aqlm-3"
    assert gemm["speedup"]["fp16"] == pytest.approx(3.0, rel=0.05)
    tiered = rows[2]
    assert tiered["path"] == "vq-tiered" and tiered["quant"]["median_us"] == pytest.approx(4.0, rel=0.05)
    assert (
        tiered["speedup"]["fp16"] == pytest.approx(3.0, rel=0.05) and tiered["roofline"]["bytes"] == 1_000_000
    )
    assert "gptvq-2 tiered vq-tiered:" in kb.format_row(tiered) and tiered["plan"] == {"n_shared": 256}
    # the tiered row times the other GEMV form beside the dispatched one; GC and SC only the dispatched form
    assert set(tiered["candidates"]) == {"vq-tiered", "vq-tiered-fma"} and set(rows[0]["candidates"]) == {
        "vq-gc"
    }
    assert report["config"]["vq_presets"] == ["gptvq-2", "aqlm-3"]


def test_vq_option():
    assert _vq_presets("gptvq-2, AQLM-3,gptvq-2") == ["gptvq-2", "aqlm-3"]
    assert _vq_presets("none-rows") == []
    with pytest.raises(stats.BenchError, match="--vq: found 'quip-4'"):
        _vq_presets("quip-4")


@pytest.mark.parametrize("preset, k, n", [("gptvq-2", 576, 300), ("aqlm-3", 1024, 64)])
def test_bench_layers_are_reindexed_vq_layers(preset, k, n):
    """The bench's random layers (random_vq_weight, built where the bench runs; here on the CPU) hold valid indices
    whose access counts fall with the entry index in every scope, as the `vq` stage writes them, and the hot
    boundary of the skew, which the kernels' view takes."""
    import torch

    from qtool.bench.cuda_cases import random_vq_weight
    from qtool.layouts.vq.layout import entry_counts, tier_bounds
    from qtool.stages.vq import PRESETS

    p = random_vq_weight(k, n, preset, torch.device("cpu"), torch.Generator().manual_seed(0))
    cfg = PRESETS[preset]
    z, d = cfg["residuals"], cfg["vector_size"]
    assert p.codebooks.shape[2:] == (z, cfg["entries"], d) and p.codebooks.dtype == torch.float16
    codes = p.codes()
    assert codes.shape == (z, n, k // d)
    counts = entry_counts(codes, cfg["entries"], d, cfg["tile_rows"], cfg["tile_cols"])
    assert bool((counts[..., 1:] <= counts[..., :-1]).all())
    hot = int(p.entry_tiers[..., 0].max())
    assert hot == max(tier_bounds(c)[0] for c in counts.reshape(-1, cfg["entries"])) > 0


class _FakeBuild:
    """What plan_for reads of a compiled module: registers and static shared memory of an entry."""

    def __init__(self, regs: int) -> None:
        self.regs = regs

    def fn(self, name: str):
        return type("Fn", (), {"num_regs": self.regs, "shared_size_bytes": 16})()


def _prepared(k: int, n: int, preset: str) -> vq.Prepared:
    import torch

    d, bits, z, tr, tc = {"gptvq-2": (4, 8, 1, 256, 256), "aqlm-3": (8, 12, 2, None, None)}[preset]
    v = k // d
    r, c = (1 if tr is None else -(-n // tr)), (1 if tc is None else -(-k // tc))
    return vq.Prepared(
        indices=torch.empty(z, n, -(-v * bits // 32), dtype=torch.int32),
        codebooks=torch.empty(r, c, z, 1 << bits, d, dtype=torch.float16),
        vector_size=d,
        index_bits=bits,
        residuals=z,
        tile_rows=n if tr is None else min(tr, n),
        tile_vecs=v if tc is None else tc // d,
        in_features=k,
        out_features=n,
        hot=8,
    )


@pytest.mark.parametrize(
    "env, cluster",
    [
        ({"QTOOL_VQ_CLUSTER": "16"}, 16),
        ({"QTOOL_VQ_CLUSTER": "8"}, 8),
        ({}, 1),  # the module's defaults: no clusters until measured
    ],
)
def test_mma_plans_cluster_the_splits(monkeypatch, env, cluster):
    """The mma form's launch geometry on Llama-2-7B shapes (H100 limits, fake builds of 80 / 122 registers): the
    splits of a row block form one cluster along y when they fit the cap (GPTVQ walks more column tiles per block
    so they do), never more than one block along x, and the staging leaves room for the row sums the cluster
    reads."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(vq, "device_limits", lambda dev: H100)
    monkeypatch.setattr(
        vq,
        "module_for",
        lambda p, n_reg, n_shared, dev, form="fma", prefetch=1: _FakeBuild(80 if n_shared < 4096 else 122),
    )
    for k, n in ((4096, 4096), (4096, 11008), (11008, 4096)):
        for m in (1, 4, 16):
            g = vq.plan_for(_prepared(k, n, "gptvq-2"), m, "tiered", 0, form="mma")
            assert g.cluster[0] == 1 and g.splits_k * g.tiles_per_split >= -(-k // 256)
            if cluster > 1:
                assert g.splits <= cluster and g.cluster[1] == (g.splits if g.splits > 1 else 1)
                assert g.smem >= 256 * 16 * 8 + 2 * 256 * m * 4  # replicas + staging with the row sums
            else:
                assert g.cluster == (1, 1)
            for cache in ("gc", "sc"):
                a = vq.plan_for(_prepared(k, n, "aqlm-3"), m, cache, 0, form="mma")
                assert a.cluster == (1, a.splits if 1 < a.splits <= cluster else 1)
                assert a.cluster[1] <= vq.CLUSTER_LIMIT
    # GPTVQ-2 at 4096x4096, M = 1: 16 column tiles, one per block, the 16 splits one (non-portable) cluster.
    g = vq.plan_for(_prepared(4096, 4096, "gptvq-2"), 1, "tiered", 0, form="mma")
    assert (g.tiles_per_split, g.splits, g.cluster) == (
        (1, 16, (1, 16)) if cluster == 16 else (2, 8, (1, 8)) if cluster == 8 else (1, 16, (1, 1))
    )
