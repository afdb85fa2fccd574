"""Digests in messages: a 32-bit value sent so that the reduced message shows whether every rank
sent the same one (the hyperparameters of a step, the steps a state has taken). Local; no
communication. Shared by the control messages (``_messages``) and the replica groups' check
(``_replicas``).
"""
from __future__ import annotations

import zlib
from typing import Sequence

HYPER_LEN = 16  # a message's hyper field: a 32-bit digest in 4-bit chunks, twice (see digest_code)
HYPER_CHUNKS = HYPER_LEN // 2  # 4-bit chunks of the 32-bit digest


def digest_code(digest: int, maxed: bool) -> list[float]:
    """A 32-bit ``digest`` as a message's ``hyper`` field: its 4-bit chunks d, then d squared (or
    -d where the message is maxed), so that the reduced field shows whether every rank sent the
    same digest (``digests_agree``). Local."""
    chunks = [float((digest >> (4 * j)) & 15) for j in range(HYPER_CHUNKS)]
    return chunks + [-d if maxed else d * d for d in chunks]


def digests_agree(reduced: Sequence[float], ranks: int, maxed: bool) -> bool:
    """Whether ``reduced`` (``ranks`` ranks' ``digest_code``, summed or maxed) shows the same digest
    from every one of them: summed, n times the sum of squares equals the square of the sum only
    when the n values are equal; maxed, the largest d is minus the largest -d only then. A
    question, from the reduced field alone."""
    chunks, second = reduced[:HYPER_CHUNKS], reduced[HYPER_CHUNKS:]
    if maxed:
        return all(d == -e for d, e in zip(chunks, second))
    return all(ranks * e == d * d for d, e in zip(chunks, second))


def steps_code(steps: int) -> list[float]:
    """A round tag's ``hyper`` field: the digest of the steps this rank's state has taken (skipped
    ones included), so that ranks whose states come from different steps raise before their
    gradients are reduced (see _replicas [Note: replicas through torchft]). Local."""
    return digest_code(zlib.crc32(f"steps {int(steps)}".encode()), False)
