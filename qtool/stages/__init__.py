"""Registry of recipe stages, keyed by the name used in recipes: one entry per stage module."""

from __future__ import annotations

from qtool.stages.base import QuantizerStage, TransformStage
from qtool.stages.gptq import GPTQStage
from qtool.stages.kv_cache import KVCacheStage
from qtool.stages.mixed import MixedStage
from qtool.stages.outliers import OutliersStage
from qtool.stages.progressive import ProgressiveStage
from qtool.stages.reorder import ReorderStage
from qtool.stages.rotate import RotateStage
from qtool.stages.rtn import RTNStage
from qtool.stages.smooth import SmoothStage
from qtool.stages.smooth_attention import SmoothAttentionStage
from qtool.stages.vq import VQStage
from qtool.stages.vq_kv import VQKVStage

STAGES: dict[str, type[QuantizerStage] | type[TransformStage]] = {
    cls.name: cls
    for cls in (
        GPTQStage,
        KVCacheStage,
        MixedStage,
        OutliersStage,
        ProgressiveStage,
        ReorderStage,
        RotateStage,
        RTNStage,
        SmoothStage,
        SmoothAttentionStage,
        VQStage,
        VQKVStage,
    )
}
