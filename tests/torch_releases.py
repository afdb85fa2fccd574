"""What shardopt's kernel self-check finds on each torch release of the supported range (measured
on CPU; see docs/design.md, "The floor"): the pin compiles every codec bit for bit, older
releases' CPU code folds the fp16 residual."""
from __future__ import annotations

import torch

FOLDED_ON = {(2, 9): ("fp16 residual", "fp16 residual written in place"),
             (2, 10): ("fp16 residual written in place",), (2, 11): ("fp16 residual written in place",),
             (2, 12): ("fp16 residual written in place",), (2, 13): ()}


def folded() -> tuple[str, ...]:
    """The codecs this torch's compiler gets wrong; fails outside the supported range."""
    release = tuple(int(x) for x in torch.__version__.split(".")[:2])
    assert release in FOLDED_ON, f"torch {torch.__version__} is outside the supported range (setup.cfg)"
    return FOLDED_ON[release]
