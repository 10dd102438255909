import pytest
import torch
from toy import path_to

from specd.workers.core.tree import TokenTree, pad_trees


def example_tree() -> TokenTree:
    # root(9) -> a(1) -> c(3)
    #         -> b(2) -> d(4)
    #                 -> e(5)
    return TokenTree.from_paths(9, [[1, 3], [2, 4], [2, 5]])


def test_from_paths_merges_prefixes_in_breadth_first_order():
    tree = example_tree()
    assert tree.tokens.tolist() == [9, 1, 2, 3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2, 2]
    assert tree.children(0) == [1, 2] and tree.children(2) == [4, 5] and tree.children(3) == []
    assert len(tree) == 6 and tree.num_drafted() == 5


def test_depth_positions_and_paths():
    tree = example_tree()
    assert tree.depth().tolist() == [0, 1, 1, 2, 2, 2]
    assert tree.position_ids(start=10).tolist() == [10, 11, 11, 12, 12, 12]
    assert path_to(tree, 5) == [0, 2, 5] and path_to(tree, 0) == [0]
    assert tree.node_of([2, 5]) == 5 and tree.node_of([]) == 0
    with pytest.raises(KeyError):
        tree.node_of([1, 4])


def test_attention_mask_is_ancestor_or_self():
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 0, 1, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(example_tree().attention_mask(), expected)


def test_chain_is_a_tree_with_causal_mask():
    tree = TokenTree.chain(7, [1, 2, 3])
    assert tree.tokens.tolist() == [7, 1, 2, 3] and tree.parents.tolist() == [-1, 0, 1, 2]
    assert torch.equal(tree.attention_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert TokenTree.chain(7, []).tokens.tolist() == [7]


def test_repeated_sibling_tokens_stay_separate_when_built_directly():
    tree = TokenTree(tokens=[0, 3, 3], parents=[-1, 0, 0])
    assert tree.children(0) == [1, 2]
    assert TokenTree.from_paths(0, [[3], [3]]).tokens.tolist() == [0, 3]


@pytest.mark.parametrize(
    "tokens, parents, message",
    [
        ([0, 1], [0, 0], "parents\\[0\\] must be -1"),
        ([0, 1, 2], [-1, 2, 0], "parents\\[1\\] must be in \\[0, 1\\)"),
        ([0, 1], [-1], "same length"),
    ],
)
def test_invalid_trees_are_rejected(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        TokenTree(tokens=tokens, parents=parents)


def test_pad_trees():
    tokens, parents, num_nodes = pad_trees([TokenTree.chain(7, [1]), example_tree()])
    assert tokens.tolist() == [[7, 1, 0, 0, 0, 0], [9, 1, 2, 3, 4, 5]]
    assert parents.tolist() == [[-1, 0, -1, -1, -1, -1], [-1, 0, 0, 1, 2, 2]]
    assert num_nodes.tolist() == [2, 6]
