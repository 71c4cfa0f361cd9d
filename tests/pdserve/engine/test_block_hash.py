"""Chained block hashes: deterministic, content- and key-sensitive, incremental, process-independent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pdserve.engine.block_hash import ROOT_HASH, hash_block_tokens, hash_token_blocks

BLOCK_SIZE = 4
TOKENS = list(range(100, 111))  # 11 tokens: two full blocks of 4 and a partial block of 3


def test_chain_is_deterministic_and_linked():
    hashes = hash_token_blocks(TOKENS, BLOCK_SIZE)

    h0 = hash_block_tokens(None, TOKENS[0:4])
    h1 = hash_block_tokens(h0, TOKENS[4:8])
    assert hashes == [h0, h1]
    assert hash_token_blocks(TOKENS, BLOCK_SIZE) == hashes
    assert len(h0) == 16 and h0 != h1


def test_first_block_parent_is_the_root_hash():
    assert hash_block_tokens(None, [1, 2, 3, 4]) == hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])


def test_extra_key_separates_caches():
    assert hash_block_tokens(None, [1, 2, 3, 4], "model-a") != hash_block_tokens(None, [1, 2, 3, 4], "model-b")
    assert hash_block_tokens(None, [1, 2, 3, 4], "model-a") != hash_block_tokens(None, [1, 2, 3, 4])
    # The key reaches every block of the chain, not only the first.
    a = hash_token_blocks(TOKENS, BLOCK_SIZE, extra_key="a")
    b = hash_token_blocks(TOKENS, BLOCK_SIZE, extra_key="b")
    assert a[1] != b[1]


def test_parent_changes_the_hash():
    parent_a = hash_block_tokens(None, [1, 2, 3, 4])
    parent_b = hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(parent_a, [9, 9, 9, 9]) != hash_block_tokens(parent_b, [9, 9, 9, 9])
    assert hash_block_tokens(parent_a, [9, 9, 9, 9]) != hash_block_tokens(None, [9, 9, 9, 9])


def test_tokens_change_the_hash():
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [1, 2, 4, 3])
    # A change in an early block changes every later hash; the same later block alone does not help.
    changed = [999] + TOKENS[1:]
    a, b = hash_token_blocks(TOKENS, BLOCK_SIZE), hash_token_blocks(changed, BLOCK_SIZE)
    assert a[0] != b[0] and a[1] != b[1]


def test_token_ids_above_16_bits_are_distinguished():
    assert hash_block_tokens(None, [70_000, 1, 2, 3]) != hash_block_tokens(None, [70_000 - 65_536, 1, 2, 3])


def test_incremental_hashing_equals_full_hashing():
    tokens = list(range(1, 23))  # 5 full blocks + 2 tokens
    full = hash_token_blocks(tokens, BLOCK_SIZE)
    assert len(full) == 5

    prefix = hash_token_blocks(tokens[:9], BLOCK_SIZE)  # as if the sequence had 9 tokens so far
    assert prefix == full[:2]
    assert hash_token_blocks(tokens, BLOCK_SIZE, parent_hashes=prefix) == full
    # Known hashes are trusted, not recomputed: only the blocks after them are hashed.
    fake = [b"x" * 16]
    assert hash_token_blocks(tokens[:8], BLOCK_SIZE, parent_hashes=fake) == [
        b"x" * 16,
        hash_block_tokens(b"x" * 16, tokens[4:8]),
    ]
    # The caller's list is not mutated.
    assert len(prefix) == 2


def test_partial_blocks_are_not_hashed():
    assert hash_token_blocks([1, 2, 3], BLOCK_SIZE) == []
    assert len(hash_token_blocks(list(range(7)), BLOCK_SIZE)) == 1
    assert len(hash_token_blocks(list(range(8)), BLOCK_SIZE)) == 2
    assert hash_token_blocks(list(range(7)), BLOCK_SIZE) == hash_token_blocks(list(range(4)), BLOCK_SIZE)


# Loads block_hash.py by path: importing the `pdserve.engine` package would pull in transformers (seconds).
HASH_IN_SUBPROCESS = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("block_hash", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(",".join(h.hex() for h in module.hash_token_blocks(list(range(1000, 1013)), 4, "m")))
"""


def test_same_hashes_in_processes_with_different_hash_seeds():
    module_path = Path(__file__).resolve().parents[3] / "pdserve" / "engine" / "block_hash.py"
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", HASH_IN_SUBPROCESS, str(module_path)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        outputs.append(result.stdout.split()[-1])
    expected = ",".join(h.hex() for h in hash_token_blocks(list(range(1000, 1013)), 4, "m"))
    assert outputs[0] == outputs[1] == expected
    assert len(expected.split(",")) == 3
