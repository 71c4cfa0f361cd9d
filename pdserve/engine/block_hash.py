"""Chained block hashing: the identity of a full block of tokens and everything before it.

    tokens:  [t0 .. t15][t16 .. t31][t32 .. t40]
    hashes:   h0=H(seed, block0)   h1=H(h0, block1)   (partial block: no hash)

The same prefix gives the same chain in every process (xxh3-128 over a fixed byte encoding,
never Python's salted `hash`), so the gateway and every node agree on block identities.
`extra_key` (model id, cache salt) separates caches that must not share blocks.
"""

from __future__ import annotations

import struct

import xxhash

ROOT_HASH = b"pdserve-block-hash-v1"


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int] | tuple[int, ...], extra_key: str = "") -> bytes:
    """Hash of one full block given its parent's hash (None for the first block)."""
    hasher = xxhash.xxh3_128()
    hasher.update(parent_hash if parent_hash is not None else ROOT_HASH)
    hasher.update(extra_key.encode())
    hasher.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return hasher.digest()


def hash_token_blocks(
    token_ids: list[int], block_size: int, extra_key: str = "", parent_hashes: list[bytes] | None = None
) -> list[bytes]:
    """Chained hashes of every full block of `token_ids`.

    `parent_hashes`, if given, are the already known hashes of the leading blocks; only the
    blocks after them are hashed (so a growing sequence is hashed incrementally).
    """
    hashes = list(parent_hashes or [])
    parent = hashes[-1] if hashes else None
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_key)
        hashes.append(parent)
    return hashes
