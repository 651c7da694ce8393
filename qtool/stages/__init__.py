"""Registry of recipe stages, keyed by the name used in recipes."""

from __future__ import annotations

from qtool.stages.base import QuantizerStage, TransformStage

STAGES: dict[str, type[QuantizerStage] | type[TransformStage]] = {}


def register(cls):
    STAGES[cls.name] = cls
    return cls


def _load_builtin() -> None:
    from qtool.stages import (  # noqa: F401  (importing registers them)
        gptq,
        kv_cache,
        mixed,
        outliers,
        progressive,
        reorder,
        rotate,
        rtn,
        smooth,
        smooth_attention,
        vq,
        vq_kv,
    )


_load_builtin()
