"""The token-path radix trie under the prefix cache: nodes carry edges of token ids and,
at the exact paths where a snapshot was taken, the cache's entry."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TrieNode:
    """One edge of token ids below ``parent``; ``depth`` counts the tokens from the root."""

    __slots__ = ("children", "depth", "edge", "entry", "parent")

    def __init__(self, edge: tuple[int, ...], parent: TrieNode | None, depth: int) -> None:
        self.edge = edge
        self.parent = parent
        self.depth = depth
        self.children: dict[int, TrieNode] = {}
        self.entry: Any = None  # the cache's entry held at this exact path

    def path(self) -> tuple[int, ...]:
        parts = []
        node: TrieNode | None = self
        while node is not None:
            parts.append(node.edge)
            node = node.parent
        return tuple(t for edge in reversed(parts) for t in edge)


def common_length(edge: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """Length of the common prefix of ``edge`` and ``tokens[start:]``."""
    n = min(len(edge), len(tokens) - start)
    if tuple(tokens[start : start + n]) == edge[:n]:
        return n
    i = 0
    while i < n and edge[i] == tokens[start + i]:
        i += 1
    return i


def entries_on_path(root: TrieNode, tokens: Sequence[int]) -> list[Any]:
    """Entries whose path is a prefix of ``tokens``, deepest first."""
    found: list[Any] = []
    node = root
    i = 0
    while i < len(tokens):
        child = node.children.get(int(tokens[i]))
        if child is None:
            break
        if common_length(child.edge, tokens, i) < len(child.edge):
            break
        node = child
        i += len(child.edge)
        if node.entry is not None:
            found.append(node.entry)
    found.reverse()
    return found


def insert_node(root: TrieNode, key: tuple[int, ...]) -> TrieNode:
    """The node at exactly ``key``, splitting an edge where the path branches off it."""
    node = root
    i = 0
    while i < len(key):
        child = node.children.get(key[i])
        if child is None:
            new = TrieNode(key[i:], node, len(key))
            node.children[key[i]] = new
            return new
        common = common_length(child.edge, key, i)
        if common == len(child.edge):
            node, i = child, i + common
            continue
        middle = TrieNode(child.edge[:common], node, node.depth + common)
        node.children[key[i]] = middle
        child.edge = child.edge[common:]
        child.parent = middle
        middle.children[child.edge[0]] = child
        node, i = middle, i + common
    return node


def prune(node: TrieNode) -> None:
    """After ``node`` lost its entry: drop it if it is a leaf (and so on upwards), or merge
    it into its only child."""
    while node.parent is not None and node.entry is None:
        parent = node.parent
        if not node.children:
            del parent.children[node.edge[0]]
            node = parent
            continue
        if len(node.children) == 1:  # pass-through node: merge into its child
            (child,) = node.children.values()
            child.edge = node.edge + child.edge
            child.parent = parent
            parent.children[child.edge[0]] = child
        break
