"""Block bookkeeping of TensorRT-LLM's V1 block manager: refcounts, free queue, reuse tree.

Mirrors ``WindowBlockManager`` in ``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``:

* A block is referenced by every sequence that holds it; at refcount 0 it returns to the
  free queue. Blocks that sit in the reuse tree are queued at the back (evicted last);
  blocks that are not reusable go to the front (``releaseBlock(block, toFront)``).
* The reuse tree (C++ ``mCachedBlocksRoot`` radix tree) maps a chain of block keys to blocks.
  A key is the block's tokens; the chain makes a node stand for its whole prefix, and the
  root is chosen by ``(cache_salt_id, lora_task_id)``, as ``BlockKeyHasher`` mixes the salt
  into the first block and the LoRA id into every block. Exact tuples stand in for the
  64-bit hashes, so the emulator never has a hash collision.
* Taking a free block that is in the tree evicts it: it and its subtree leave the tree.

Block *contents* are never touched here (no zeroing on reuse, as on a GPU); the only data
movement is the copy for a shared partially matched block, done by the caller's callback.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

BlockTokens = tuple[int, ...]
RootKey = tuple[int | None, int | None]  # (cache_salt_id, lora_task_id)


@dataclasses.dataclass(eq=False)
class _Node:
    block_id: int  # -1 for a root
    tokens: BlockTokens
    parent: _Node | None
    children: dict[BlockTokens, _Node] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Match:
    """One reused block of a prefix match.

    Attributes:
        block_id: The block to use (a fresh copy when ``copied``).
        num_tokens: Tokens of this block that matched.
        partial: Fewer tokens matched than the stored block holds, or a partial block.
        copied: The stored block was shared, so its contents were copied to ``block_id``.
    """

    block_id: int
    num_tokens: int
    partial: bool
    copied: bool


class NoFreeBlocksError(RuntimeError):
    """The free queue is empty (C++: "Can't allocate new blocks. No free blocks left.")."""


class BlockPool:
    """Refcounted blocks, an LRU free queue and the reuse tree."""

    def __init__(self, num_blocks: int, copy_block: Callable[[int, int], None]) -> None:
        """Create ``num_blocks`` free blocks.

        Args:
            num_blocks: Blocks in the pool, > 0.
            copy_block: ``copy_block(src, dst)`` copies a block's contents (every layer, K
                and V); used only for a partial match on a shared block.
        """
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._copy_block = copy_block
        self._refs = [0] * num_blocks
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict(
            (b, None) for b in range(num_blocks)
        )
        self._node_of: dict[int, _Node] = {}
        self._roots: dict[RootKey, _Node] = {}

    # --- free queue and refcounts ---

    @property
    def num_free(self) -> int:
        """Blocks with refcount 0 (reusable ones included)."""
        return len(self._free)

    def refcount(self, block_id: int) -> int:
        """Sequences holding ``block_id``."""
        return self._refs[block_id]

    def in_tree(self, block_id: int) -> bool:
        """Whether ``block_id`` can currently be matched."""
        return block_id in self._node_of

    def take_free(self) -> int:
        """Claim the least recently released block, evicting it from the tree.

        Raises:
            NoFreeBlocksError: No block has refcount 0.
        """
        if not self._free:
            raise NoFreeBlocksError("Can't allocate new blocks. No free blocks left.")
        block_id, _ = self._free.popitem(last=False)
        self._detach(block_id)
        self._refs[block_id] = 1
        return block_id

    def acquire(self, block_id: int) -> None:
        """Add a reference to ``block_id`` (a reused block), taking it off the free queue."""
        if self._refs[block_id] == 0:
            del self._free[block_id]
        self._refs[block_id] += 1

    def release(self, block_id: int) -> None:
        """Drop a reference; at zero the block becomes free (reusable ones at the back)."""
        if self._refs[block_id] <= 0:
            raise RuntimeError(f"block {block_id} released more often than acquired")
        self._refs[block_id] -= 1
        if self._refs[block_id] == 0:
            self._free[block_id] = None
            if block_id not in self._node_of:
                self._free.move_to_end(block_id, last=False)

    # --- reuse tree ---

    def match(
        self,
        root: RootKey,
        keys: Sequence[BlockTokens],
        *,
        partial_reuse: bool,
        copy_on_partial_reuse: bool,
    ) -> list[Match]:
        """Claim the longest reusable prefix of ``keys`` (``loadOrAllocateBlocks``' reuse half).

        Walks the tree block by block: an exact key match is reused and the walk goes on; with
        ``partial_reuse`` the child sharing the longest token prefix is reused for that many
        tokens and the walk stops (an unreferenced leaf is claimed outright, a shared one is
        copied if ``copy_on_partial_reuse``). Every returned block is already acquired.
        """
        matches: list[Match] = []
        node = self._roots.get(root)
        for key in keys:
            if node is None or not key:
                break
            child = node.children.get(key)
            if child is not None:
                self.acquire(child.block_id)
                matches.append(Match(child.block_id, len(key), False, False))
                node = child
                continue
            if partial_reuse:
                found = self._partial(node, key, copy_on_partial_reuse)
                if found is not None:
                    matches.append(found)
            break
        return matches

    def _partial(self, node: _Node, key: BlockTokens, copy: bool) -> Match | None:
        best, best_len = None, 0
        for tokens, child in node.children.items():
            common = _common_prefix(tokens, key)
            if common > best_len:
                best, best_len = child, common
        if best is None:
            return None
        source = best.block_id
        if self._refs[source] == 0 and not best.children:
            # NOTE: claimLeafBlock: an unused leaf becomes this sequence's private block.
            self._detach(source)
            self.acquire(source)
            return Match(source, best_len, True, False)
        if not copy:
            return None
        self.acquire(source)  # NOTE: pinned so that taking a free block cannot evict it
        try:
            target = self.take_free()
        finally:
            self.release(source)
        self._copy_block(source, target)
        return Match(target, best_len, True, True)

    def store(self, root: RootKey, blocks: Sequence[tuple[BlockTokens, int]]) -> None:
        """Insert a sequence's blocks under ``root`` (``storeBlocks``).

        Where the tree already holds a block with the same key at that position, that block
        stays and the sequence's duplicate is not inserted. A block already in the tree at
        that position under another key (a partial block that has since filled) is re-keyed.
        """
        node = self._roots.setdefault(root, _Node(-1, (), None))
        for tokens, block_id in blocks:
            if not tokens:
                break
            existing = node.children.get(tokens)
            if existing is not None:
                node = existing
                continue
            old = self._node_of.get(block_id)
            if old is not None:
                self._detach(block_id)
            child = _Node(block_id, tokens, node)
            node.children[tokens] = child
            self._node_of[block_id] = child
            if self._refs[block_id] == 0:
                self._free.move_to_end(block_id)  # NOTE: now reusable: evict it last
            node = child

    def _detach(self, block_id: int) -> None:
        node = self._node_of.get(block_id)
        if node is None:
            return
        if node.parent is not None:
            node.parent.children.pop(node.tokens, None)
        stack = [node]
        while stack:  # NOTE: the subtree becomes unreachable, as in the C++ radix tree
            current = stack.pop()
            self._node_of.pop(current.block_id, None)
            stack.extend(current.children.values())
            current.children = {}


def _common_prefix(a: BlockTokens, b: BlockTokens) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


__all__ = ["BlockPool", "BlockTokens", "Match", "NoFreeBlocksError", "RootKey"]
