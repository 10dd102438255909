import torch
from toy import path_to, residual_skipped

from specd.workers.core.sampling import make_generator
from specd.workers.core.tree import TokenTree
from specd.workers.core.verify_chain import verify_chain
from specd.workers.core.verify_tree import children_table, verify_tree, verify_tree_batch, verify_trees

VOCAB = 6


def one_hot(tokens, vocab=VOCAB):
    return torch.nn.functional.one_hot(torch.as_tensor(tokens), vocab).float()


def example_tree() -> TokenTree:
    # node: 0 root(9); 1 tok 1; 2 tok 2; 3 tok 3 (child of 1); 4 tok 4, 5 tok 5 (children of 2)
    return TokenTree.from_paths(9, [[1, 3], [2, 4], [2, 5]])


def test_children_table_keeps_sibling_order_and_padding():
    tokens = torch.zeros(2, 6, dtype=torch.long)
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2], [-1, 0, -1, -1, -1, -1]])
    table = children_table(parents, torch.tensor([6, 2]))
    assert table.shape == (2, 6, 2)
    assert (
        table[0, 0].tolist() == [1, 2] and table[0, 2].tolist() == [4, 5] and table[0, 3].tolist() == [-1, -1]
    )
    assert table[1, 0].tolist() == [1, -1] and (table[1, 1:] == -1).all()
    assert tokens.shape == (2, 6)


def test_greedy_follows_the_child_equal_to_argmax_and_adds_bonus():
    # argmax p: root -> 2, node 2 -> 5, node 5 (leaf) -> 0.
    p = one_hot([2, 0, 5, 0, 0, 0])
    out = verify_tree(example_tree(), None, p, make_generator(0))
    assert out.accepted_nodes == [2, 5] and out.output_tokens == [2, 5, 0] and out.is_bonus


def test_greedy_no_child_matches_at_root():
    p = one_hot([4, 0, 0, 0, 0, 0])
    out = verify_tree(example_tree(), None, p, make_generator(0))
    assert out.accepted_nodes == [] and out.output_tokens == [4] and not out.is_bonus


def test_greedy_mismatch_at_second_level():
    p = one_hot([2, 0, 3, 0, 0, 0])
    out = verify_tree(example_tree(), None, p, make_generator(0))
    assert out.accepted_nodes == [2] and out.output_tokens == [2, 3] and not out.is_bonus


def test_root_only_tree_samples_one_bonus_token():
    out = verify_tree(TokenTree.chain(9, []), None, one_hot([3]), None)
    assert out.accepted_nodes == [] and out.output_tokens == [3] and out.is_bonus


def test_greedy_tree_does_not_depend_on_the_generator_even_with_sampled_q():
    q = torch.softmax(torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0)), dim=-1)
    p = one_hot([2, 0, 3, 0, 0, 0])
    outputs = {tuple(verify_tree(example_tree(), q, p, make_generator(s)).output_tokens) for s in range(50)}
    assert outputs == {(2, 3)}


def test_rejections_replace_p_by_the_residual():
    # Root children: token 1 then token 0, both drafted from q = [0.5, 0.5, 0].
    # p(root) = [0.5, 0, 0.5]. Token 1 has p = 0: rejected; p becomes norm(max(0, p - q)) = [0, 0, 1],
    # so token 0 is rejected too and the recovered token is always 2. Without the residual, token 0 is
    # accepted with probability min(1, 0.5 / 0.5) = 1.
    tree = TokenTree(tokens=[9, 1, 0], parents=[-1, 0, 0])
    q = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.5, 0.5, 0.0]])
    p = torch.tensor([[0.5, 0.0, 0.5], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    for seed in range(30):
        right = verify_tree(tree, q, p, make_generator(seed))
        with residual_skipped():
            broken = verify_tree(tree, q, p, make_generator(seed))
        assert right.output_tokens == [2] and not right.is_bonus
        assert broken.accepted_nodes == [2] and broken.output_tokens == [0, 1] and broken.is_bonus


def test_repeated_sibling_tokens_are_tried_as_separate_nodes():
    # i.i.d. children from q = [0.2, 0.3, 0.5]: tokens 2, 2, 1. p(root) = [0.6, 0.4, 0].
    # First 2 (p = 0) is rejected: p -> norm([0.4, 0.1, 0]) = [0.8, 0.2, 0]. The repeated 2 is rejected
    # too and still moves p -> norm([0.6, 0, 0]) = [1, 0, 0], so token 1 is rejected and 0 is recovered,
    # always. Merging the repeats would skip that second update and accept token 1 two times in three.
    q = torch.tensor([0.2, 0.3, 0.5]).expand(4, -1)
    p = torch.tensor([[0.6, 0.4, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    repeated = TokenTree(tokens=[9, 2, 2, 1], parents=[-1, 0, 0, 0])
    merged = TokenTree(tokens=[9, 2, 1], parents=[-1, 0, 0])
    assert {tuple(verify_tree(repeated, q, p, make_generator(s)).output_tokens) for s in range(40)} == {(0,)}
    merged_outputs = [
        verify_tree(merged, q[:3], p[[0, 1, 3]], make_generator(s)).output_tokens for s in range(40)
    ]
    assert [1, 0] in merged_outputs


def test_batch_of_different_shapes_matches_one_by_one():
    g = torch.Generator().manual_seed(4)
    repeated = TokenTree(tokens=[9, 3, 3], parents=[-1, 0, 0])
    trees = [example_tree(), TokenTree.chain(9, [1, 2]), TokenTree.chain(9, []), repeated]
    q = [torch.softmax(torch.randn(len(t), VOCAB, generator=g), dim=-1) for t in trees]
    p = [torch.softmax(torch.randn(len(t), VOCAB, generator=g), dim=-1) for t in trees]
    q[1] = None  # one-hot drafts for the chain
    for seed in range(10):
        gens = [make_generator(seed * 10 + b) for b in range(len(trees))]
        batched = verify_trees(trees, q, p, gens)
        single = [verify_tree(t, q[b], p[b], make_generator(seed * 10 + b)) for b, t in enumerate(trees)]
        assert batched == single
        for out, tree in zip(batched, trees, strict=True):
            assert len(out.output_tokens) == len(out.accepted_nodes) + 1
            if out.accepted_nodes:  # the accepted nodes form a path from the root
                assert out.accepted_nodes == path_to(tree, out.accepted_nodes[-1])[1:]


def test_seeded_tree_verification_is_reproducible():
    g = torch.Generator().manual_seed(5)
    tree = example_tree()
    q = torch.softmax(torch.randn(6, VOCAB, generator=g), dim=-1)
    p = torch.softmax(torch.randn(6, VOCAB, generator=g), dim=-1)
    first = [verify_tree(tree, q, p, make_generator(s)) for s in range(20)]
    again = [verify_tree(tree, q, p, make_generator(s)) for s in range(20)]
    assert first == again
    assert len({tuple(o.output_tokens) for o in first}) > 1


def test_greedy_chain_tree_agrees_with_verify_chain():
    g = torch.Generator().manual_seed(6)
    for _ in range(30):
        drafts = torch.randint(0, 3, (4,), generator=g)
        target_argmax = torch.randint(0, 3, (5,), generator=g)
        chain = verify_chain(drafts[None], torch.tensor([4]), None, one_hot(target_argmax)[None], [None])
        tree = verify_tree(TokenTree.chain(9, drafts.tolist()), None, one_hot(target_argmax), None)
        assert tree.output_tokens == chain.emitted(0)
        assert tree.is_bonus == bool(chain.is_bonus[0])


def test_verify_tree_batch_output_tensors():
    tree = example_tree()
    out = verify_tree_batch(
        tree.tokens[None],
        tree.parents[None],
        torch.tensor([6]),
        None,
        one_hot([2, 0, 5, 0, 0, 0])[None],
        [None],
    )
    assert out.accepted_nodes.tolist() == [[2, 5]] and out.output_tokens.tolist() == [[2, 5, 0]]
    assert out.num_accepted.tolist() == [2] and out.is_bonus.tolist() == [True]


def test_walking_every_level_as_on_a_gpu_gives_what_the_early_exits_give(monkeypatch):
    """On a GPU the walk reads nothing back to stop early; the iterations it then runs change nothing."""
    from specd.workers.core import verify_tree as module

    g = torch.Generator().manual_seed(7)
    trees = [example_tree(), TokenTree.chain(9, [1, 2, 3]), TokenTree.chain(9, []),
             TokenTree(tokens=[9, 3, 3], parents=[-1, 0, 0])]
    q = [torch.softmax(torch.randn(len(t), VOCAB, generator=g), dim=-1) for t in trees]
    p = [torch.softmax(torch.randn(len(t), VOCAB, generator=g), dim=-1) for t in trees]
    runs = {}
    for cheap in (True, False):
        monkeypatch.setattr(module, "host_reads_are_cheap", lambda device, cheap=cheap: cheap)
        runs[cheap] = [verify_trees(trees, q, p, [make_generator(seed * 10 + b) for b in range(len(trees))])
                       for seed in range(20)]
    assert runs[True] == runs[False]
    assert len({tuple(out[0].output_tokens) for out in runs[True]}) > 1   # the seeds walk different paths
