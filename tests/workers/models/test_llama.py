"""The plain-torch Llama against transformers' LlamaForCausalLM, on a tiny random model and the real one.

Cache behaviour is checked through logits: batched prefill with different lengths, incremental decode,
rollback, and tree-masked forwards must all give what a fresh full forward gives.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specd.workers.models.config import ModelConfig, UnsupportedModelError
from specd.workers.models.llama import Llama

ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "packed"])
def tiny(tiny_llama_dir, request):
    """The tiny model with plain F.linear weights and with oneDNN pre-packed ones."""
    return Llama.from_pretrained(tiny_llama_dir, pack=request.param)


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [n, vocab]


def _fresh(model: Llama, num_slots: int = 4, max_len: int = 64):
    return model.make_cache(num_slots, max_len)


def _extend(model, cache, slot, ids: list[int]) -> torch.Tensor:
    """Forward `ids` after the slot's committed length and commit them: logits [n, vocab]."""
    start = int(cache.lengths[slot])
    with torch.inference_mode():
        out = model(torch.tensor([ids]), torch.arange(start, start + len(ids))[None], [slot], cache)
    cache.lengths[slot] = start + len(ids)
    return out[0]


def test_config_reads_both_rope_spellings():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1)
    base["num_attention_heads"] = 2
    assert ModelConfig.from_hf({**base, "rope_theta": 5.0}).rope_theta == 5.0
    cfg = ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 7.0, "rope_type": "default"}})
    assert cfg.rope_theta == 7.0 and cfg.num_kv_heads == 2 and cfg.head_dim == 4
    with pytest.raises(UnsupportedModelError, match="'dynamic'"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})


def test_real_rope_rotates_as_the_complex_one(tiny):
    """The (cos, sin) form of compiled code rotates as the complex multiply; its tables are built once."""
    from specd.workers.models.layers import apply_rope

    positions = torch.tensor([[0, 3, 7], [1, 2, 200]])                      # [b, n]
    x = torch.randn(2, 3, 4, tiny.cfg.head_dim, generator=torch.Generator().manual_seed(0))
    complex_rope, real_rope = tiny.ropes(positions)[0], tiny.ropes(positions, real=True)[0]
    assert complex_rope.is_complex() and real_rope.shape == (2, 3, 1, tiny.cfg.head_dim // 2, 2)
    torch.testing.assert_close(apply_rope(x, real_rope), apply_rope(x, complex_rope), rtol=1e-6, atol=1e-6)
    assert tiny.rope_tables(real=True)[0] is tiny.rope_tables(real=True)[0]


def test_full_forward_matches_transformers(tiny, hf_tiny):
    ids = [5, 17, 99, 3, 42, 64, 7, 120, 1, 33]
    cache = _fresh(tiny)
    slot = cache.allocate()
    torch.testing.assert_close(_extend(tiny, cache, slot, ids), _hf_logits(hf_tiny, ids), atol=ATOL, rtol=0)


def test_batched_prefill_with_different_lengths_then_decode(tiny, hf_tiny):
    prompts = [[3, 9, 27, 81, 115, 2, 6], [100, 50], [7, 7, 7, 1, 2]]
    cache = _fresh(tiny)
    slots = [cache.allocate() for _ in prompts]
    n = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (n - len(p)) for p in prompts])  # right-padded
    with torch.inference_mode():
        logits = tiny(ids, torch.arange(n).expand(len(prompts), n), slots, cache)  # [3, n, vocab]
    for i, (slot, p) in enumerate(zip(slots, prompts, strict=True)):
        torch.testing.assert_close(logits[i, : len(p)], _hf_logits(hf_tiny, p), atol=ATOL, rtol=0)
        cache.lengths[slot] = len(p)
    # One decode step for the whole batch at their different lengths, then a two-token step.
    nxt = [[11], [12], [13]]
    with torch.inference_mode():
        pos = torch.tensor([[len(p)] for p in prompts])
        step = tiny(torch.tensor(nxt), pos, slots, cache)  # [3, 1, vocab]
    for i, p in enumerate(prompts):
        torch.testing.assert_close(step[i, 0], _hf_logits(hf_tiny, p + nxt[i])[-1], atol=ATOL, rtol=0)
        cache.lengths[slots[i]] += 1
    two = _extend(tiny, cache, slots[1], [20, 21])
    torch.testing.assert_close(two, _hf_logits(hf_tiny, prompts[1] + [12, 20, 21])[-2:], atol=ATOL, rtol=0)


def test_non_consecutive_slots_in_a_batch(tiny, hf_tiny):
    cache = _fresh(tiny)
    slots = [cache.allocate() for _ in range(4)]
    history = {slots[0]: [1, 2, 3], slots[1]: [5], slots[3]: [9, 8, 7, 6]}
    for slot, ids in history.items():
        _extend(tiny, cache, slot, ids)
    # Rows [3], [0, 1]: two runs of consecutive slots, the second with unequal lengths.
    order = [slots[3], slots[0], slots[1]]
    new = torch.tensor([[40, 41], [42, 43], [44, 45]])
    pos = torch.tensor([[len(history[s]) + j for j in range(2)] for s in order])
    with torch.inference_mode():
        out = tiny(new, pos, order, cache)  # [3, 2, vocab]
    for row, slot in enumerate(order):
        ref = _hf_logits(hf_tiny, history[slot] + new[row].tolist())[-2:]
        torch.testing.assert_close(out[row], ref, atol=ATOL, rtol=0)


def test_rollback_then_new_tokens_equals_a_fresh_forward(tiny, hf_tiny):
    cache = _fresh(tiny)
    slot = cache.allocate()
    _extend(tiny, cache, slot, [10, 20, 30, 40])
    _extend(tiny, cache, slot, [50, 60, 70])  # drafts, two of them rejected
    cache.rollback(slot, 5)
    out = _extend(tiny, cache, slot, [99, 98])
    expected = _hf_logits(hf_tiny, [10, 20, 30, 40, 50, 99, 98])[-2:]
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_logit_index_selects_positions(tiny):
    cache = _fresh(tiny)
    slots = [cache.allocate(), cache.allocate()]
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0]])
    pos = torch.arange(4).expand(2, 4)
    with torch.inference_mode():
        full = tiny(ids, pos, slots, cache)
        last = tiny(ids, pos, slots, cache, logit_index=torch.tensor([[3], [1]]))
    assert last.shape == (2, 1, tiny.cfg.vocab_size)
    torch.testing.assert_close(last[:, 0], torch.stack([full[0, 3], full[1, 1]]))


def test_ragged_rows_skip_their_padding_and_change_nothing_real(tiny):
    """counts: the matmuls run on the real tokens only; logits, hidden states and the cache's K/V of the
    real tokens equal the padded forward's, and padded outputs are zeros."""
    ids = torch.tensor([[1, 2, 3, 4], [5, 0, 0, 0], [7, 8, 0, 0]])
    pos = torch.arange(4).expand(3, 4)
    out = {}
    for mode, counts in (("padded", None), ("ragged", [4, 1, 2])):
        cache = _fresh(tiny)
        slots = [cache.allocate() for _ in range(3)]
        with torch.inference_mode():
            for logit_index in (None, torch.tensor([[3], [0], [1]])):
                res = tiny(ids, pos, slots, cache, logit_index=logit_index, return_hidden=True, counts=counts)
                out[mode, logit_index is None] = res
        out[mode, "k"] = cache.k[0, slots].clone()
    for full in (True, False):
        (lp, hp), (lr, hr) = out["padded", full], out["ragged", full]
        for row, n in enumerate([4, 1, 2]):
            torch.testing.assert_close(hr[row, :n], hp[row, :n], atol=ATOL, rtol=0)
            assert hr[row, n:].eq(0).all()
            if full:
                torch.testing.assert_close(lr[row, :n], lp[row, :n], atol=ATOL, rtol=0)
                assert lr[row, n:].eq(0).all()
        if not full:
            torch.testing.assert_close(lr, lp, atol=ATOL, rtol=0)
    for row, n in enumerate([4, 1, 2]):
        ragged_k, padded_k = out["ragged", "k"][row, :, :n], out["padded", "k"][row, :, :n]
        torch.testing.assert_close(ragged_k, padded_k, atol=ATOL, rtol=0)


@pytest.mark.parametrize("counts", [[3, 1, 1, 2], [1, 1, 4, 1], [2, 4, 3, 2]])
def test_ragged_rows_after_prefixes_of_different_lengths_match_each_row_alone(tiny, counts):
    """Ragged forwards pack their tokens group by group (one-token rows, then the longer ones), write
    K/V for the packed tokens at once and attend per group: each row's logits and cached keys equal a
    forward of that row alone, whatever the prefixes, the order of counts, and with scattered slots."""
    prefixes = [[3, 4, 5], [6], [7, 8, 9, 10, 11, 12], [13, 14]]
    new = [[20 + 3 * i + j for j in range(c)] for i, c in enumerate(counts)]
    n = max(counts)
    alone, alone_cache = [], _fresh(tiny, num_slots=6)
    for prefix, toks in zip(prefixes, new, strict=True):
        slot = alone_cache.allocate()
        _extend(tiny, alone_cache, slot, prefix)
        alone.append((_extend(tiny, alone_cache, slot, toks), alone_cache.k[1, slot].clone()))
    cache = _fresh(tiny, num_slots=6)
    owned = [cache.allocate() for _ in range(6)]
    slots = [owned[5], owned[0], owned[3], owned[1]]     # out of order and not consecutive
    for slot, prefix in zip(slots, prefixes, strict=True):
        _extend(tiny, cache, slot, prefix)
    starts = [len(p) for p in prefixes]
    ids = torch.tensor([t + [0] * (n - len(t)) for t in new])
    pos = torch.tensor(starts)[:, None] + torch.arange(n)
    with torch.inference_mode():
        logits = tiny(ids, pos, slots, cache, counts=counts)
    for row, (c, start) in enumerate(zip(counts, starts, strict=True)):
        want_logits, want_k = alone[row]
        torch.testing.assert_close(logits[row, :c], want_logits, atol=ATOL, rtol=0)
        assert logits[row, c:].eq(0).all()
        got_k = cache.k[1, slots[row], :, : start + c]
        torch.testing.assert_close(got_k, want_k[:, : start + c], atol=ATOL, rtol=0)


def test_tree_mask_gives_the_logits_of_the_corresponding_chains(tiny):
    # Tree after a 3-token prefix:     root(40) -> a(41) -> c(43)
    #                                           -> b(42) -> d(44)
    tokens = [40, 41, 42, 43, 44]
    parents = [-1, 0, 0, 1, 2]
    depth = [0, 1, 1, 2, 2]
    mask = torch.zeros(5, 5, dtype=torch.bool)
    for i in range(5):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    prefix = [7, 8, 9]
    cache = _fresh(tiny)
    slot = cache.allocate()
    _extend(tiny, cache, slot, prefix)
    with torch.inference_mode():
        tree = tiny(torch.tensor([tokens]), torch.tensor([depth]) + 3, [slot], cache, attn_mask=mask[None])[0]
    for chain in ([0, 1, 3], [0, 2, 4]):
        ref_cache = _fresh(tiny)
        s = ref_cache.allocate()
        ref = _extend(tiny, ref_cache, s, prefix + [tokens[i] for i in chain])[3:]
        torch.testing.assert_close(tree[chain], ref, atol=ATOL, rtol=0)
    # Keeping the path root -> b -> d turns the slot into that chain for the next token.
    cache.lengths[slot] = 3 + 5
    cache.compact(slot, 3, [0, 2, 4])
    nxt = _extend(tiny, cache, slot, [5])
    ref_cache = _fresh(tiny)
    s = ref_cache.allocate()
    ref = _extend(tiny, ref_cache, s, prefix + [40, 42, 44, 5])[-1:]
    torch.testing.assert_close(nxt, ref, atol=ATOL, rtol=0)


def _write_drafter(src_dir, out_dir, ids: torch.Tensor) -> None:
    """One layer of the tiny model + a reduced head over `ids`, in the drafter directory format."""
    state = load_file(str(src_dir / "model.safetensors"))
    state = {k: v for k, v in state.items() if not k.startswith("model.layers.1.")}
    state["lm_head.weight"] = state["model.embed_tokens.weight"][ids].clone()
    state["draft_vocab_ids"] = ids
    out_dir.mkdir()
    save_file(state, str(out_dir / "model.safetensors"))
    cfg = json.loads((src_dir / "config.json").read_text())
    cfg.update(num_hidden_layers=1, tie_word_embeddings=False)
    (out_dir / "config.json").write_text(json.dumps(cfg))


def test_reduced_vocabulary_drafter(tiny_llama_dir, tmp_path):
    from transformers import LlamaForCausalLM

    ids = torch.tensor([3, 5, 8, 13, 21, 34, 55, 89, 100, 127])
    _write_drafter(tiny_llama_dir, tmp_path / "drafter", ids)
    drafter = Llama.from_pretrained(tmp_path / "drafter")
    assert drafter.cfg.num_layers == 1 and drafter.head_size == len(ids)
    one_layer = LlamaForCausalLM.from_pretrained(tiny_llama_dir, num_hidden_layers=1).eval()
    prompt = [1, 2, 3, 4, 5, 6]
    ref = _hf_logits(one_layer, prompt)  # [n, vocab] of the same body with the full tied head
    cache = _fresh(drafter)
    slot = cache.allocate()
    full = _extend(drafter, cache, slot, prompt)
    outside = torch.ones(drafter.cfg.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert full.shape == ref.shape
    torch.testing.assert_close(full[:, ids], ref[:, ids], atol=ATOL, rtol=0)
    assert torch.isneginf(full[:, outside]).all()
    assert (torch.softmax(full, -1)[:, outside] == 0).all()  # q is exactly 0 outside the subset
    cache.rollback(slot, 0)
    with torch.inference_mode():
        reduced = drafter(torch.tensor([prompt]), torch.arange(6)[None], [slot], cache, full_vocab=False)[0]
    torch.testing.assert_close(reduced, ref[:, ids], atol=ATOL, rtol=0)


def test_hot_swap_is_in_place(tiny_llama_dir, make_tiny_llama, tmp_path):
    other = make_tiny_llama(tmp_path / "other", seed=1)
    model = Llama.from_pretrained(tiny_llama_dir)
    ptr = model.layers[0].attn.wqkv.weight.data_ptr()
    fresh_other = Llama.from_pretrained(other)
    model.load_hf_tensors(load_file(str(other / "model.safetensors")).items())
    assert model.layers[0].attn.wqkv.weight.data_ptr() == ptr
    for a, b in zip(model.parameters(), fresh_other.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="shape"):
        model.load_hf_tensors([("model.norm.weight", torch.ones(3))], strict=False)
    with pytest.raises(KeyError, match="missing"):
        model.load_hf_tensors([("model.norm.weight", torch.ones(64))])


def test_real_smollm2_matches_transformers(target_model_dir):
    from transformers import AutoModelForCausalLM

    from specd.workers.models.loader import load_tokenizer

    tok = load_tokenizer(target_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(target_model_dir, dtype=torch.float32).eval()
    ours = Llama.from_pretrained(target_model_dir, max_seq_len=256, pack=True)
    cache = ours.make_cache(1, 256)
    for question in ["What is 12 times 7?", "Name a colour of the sky."]:
        chat = [{"role": "user", "content": question}]
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        slot = cache.allocate()
        logits = _extend(ours, cache, slot, prompt)
        # Greedy decode 8 tokens one at a time with the cache.
        generated = []
        for _ in range(8):
            generated.append(int(logits[-1].argmax()))
            logits = _extend(ours, cache, slot, generated[-1:])
        # One teacher-forced transformers forward over prompt + our tokens: its argmax at every step
        # must be our token (so its greedy decode is the same), and its logits must be close to ours.
        ref = _hf_logits(hf, prompt + generated)
        assert ref[len(prompt) - 1 : -1].argmax(-1).tolist() == generated
        cache.rollback(slot, 0)
        full = _extend(ours, cache, slot, prompt + generated)
        assert (full - ref).abs().max() < 2e-3
        cache.free(slot)


def test_bfloat16_runs_close_to_float32(tiny_llama_dir):
    ids = [4, 8, 15, 16, 23, 42]
    ref_model = Llama.from_pretrained(tiny_llama_dir)
    ref_cache = _fresh(ref_model)
    ref = _extend(ref_model, ref_cache, ref_cache.allocate(), ids)
    for pack in (False, True):
        model = Llama.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16, pack=pack)
        cache = _fresh(model)
        assert cache.k.dtype == torch.bfloat16
        out = _extend(model, cache, cache.allocate(), ids)
        assert out.dtype == torch.bfloat16
        assert (out.float() - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weights_run_close_and_survive_a_hot_swap(tiny_llama_dir, make_tiny_llama, tmp_path, dtype):
    ids = [4, 8, 15, 16, 23, 42]
    ref_model = Llama.from_pretrained(tiny_llama_dir)
    ref_cache = _fresh(ref_model)
    ref = _extend(ref_model, ref_cache, ref_cache.allocate(), ids)
    model = Llama.from_pretrained(tiny_llama_dir, dtype=dtype, pack="int8")
    assert model.packed == "int8" and model.layers[0].mlp.w_gate_up.int8[0].dtype == torch.int8
    cache = _fresh(model)
    out = _extend(model, cache, cache.allocate(), ids)
    assert out.dtype == dtype and out.shape == ref.shape
    assert (out.float() - ref).abs().max() < 0.1 * ref.abs().max()
    # a hot swap re-quantizes the new weights
    other = make_tiny_llama(tmp_path / "other", seed=1)
    model.load_hf_tensors(load_file(str(other / "model.safetensors")).items())
    want = Llama.from_pretrained(other, dtype=dtype, pack="int8")
    assert torch.equal(model.layers[0].mlp.w_gate_up.int8[0], want.layers[0].mlp.w_gate_up.int8[0])
    with pytest.raises(ValueError, match="packing"):
        model.pack_weights("int4")


def test_onednn_bfloat16_packing_only_where_the_cpu_has_it(tiny_llama_dir):
    """oneDNN's bfloat16 reorder raises on an AVX2-only CPU: such a model keeps plain weights there,
    and still runs; float32 and int8 packing do not depend on it."""
    from specd.workers.models.layers import can_pack

    cpu = torch.device("cpu")
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert can_pack(cpu, torch.bfloat16, "onednn") is native
    assert can_pack(cpu, torch.bfloat16, "int8") and can_pack(cpu, torch.float32, "int8")
    assert can_pack(cpu, torch.float32, "onednn") is torch.backends.mkldnn.is_available()
    assert not can_pack(torch.device("cuda"), torch.float32, "onednn")
    assert not can_pack(cpu, torch.float16, "onednn")
    model = Llama.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16, pack=True)
    assert model.packed == ("onednn" if native else "none")
