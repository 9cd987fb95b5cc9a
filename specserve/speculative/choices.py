"""Static draft-tree shapes in the published Medusa / EAGLE format.

Each entry is a path of top-k ranks per depth: [0] is the best candidate at depth 1, [0, 1] the second-best
candidate at depth 2 under it, and so on. Every prefix of an entry must itself be an entry.
`mc_sim_7b_63` is FasterDecoding/Medusa's default tree (medusa/model/medusa_choices.py): 63 nodes below the
root, depth up to 4, ranks up to 9 (top-10 candidates per head).
"""

from __future__ import annotations

mc_sim_7b_63: list[list[int]] = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5], [0, 0, 1],
    [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0],
    [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6],
    [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
    [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1],
    [1, 6], [0, 7, 0],
]

DEFAULT_CHOICES = mc_sim_7b_63
