"""The sampler's features, against hand computations and the transformers reference."""

from __future__ import annotations

import math

import pytest
import torch

from baton import SamplingParams
from baton.engine.request import Request
from baton.engine.sampler import _apply_filters, _apply_penalties, _argmax_rows, sample

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def _req(params: SamplingParams, prompt=(0,), output=()) -> Request:
    r = Request("r", list(prompt), params, eos_token_ids={0}, max_model_len=1000)
    r.token_ids.extend(output)
    return r


def test_filters_match_hand_computation():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    # softmax = [0.644, 0.237, 0.087, 0.032]
    finite = lambda out: torch.isfinite(out[0]).tolist()  # noqa: E731
    assert finite(_apply_filters(logits, [_req(SamplingParams(top_k=2))])) == [True, True, False, False]
    assert finite(_apply_filters(logits, [_req(SamplingParams(top_p=0.6))])) == [True, False, False, False]
    assert finite(_apply_filters(logits, [_req(SamplingParams(top_p=0.9))])) == [True, True, True, False]
    assert finite(_apply_filters(logits, [_req(SamplingParams(min_p=0.2))])) == [True, True, False, False]
    shuffled = torch.tensor([[0.0, 2.0, -1.0, 1.0]])  # filtering follows values, not positions
    assert finite(_apply_filters(shuffled, [_req(SamplingParams(top_k=2))])) == [False, True, False, True]


def test_row_argmax_matches_torch_with_ties_infinities_and_nans():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 300, generator=g)
    x[1] = float("-inf")  # nothing allowed: dead
    x[2, 7] = x[2, 9] = 50.0  # a tie: the first
    x[3, 11] = float("nan")  # a NaN wins, as in torch.argmax
    x[4] = float("nan")
    x[5, 3] = x[5, 8] = float("inf")
    x[6] = float("-inf")
    x[6, 5] = float("nan")  # no finite value: dead
    x[7] = float("-inf")
    x[7, 299] = -1e30  # one finite value, the last
    chosen, dead = _argmax_rows(x)
    assert chosen.tolist() == x.argmax(dim=1).tolist()
    assert dead == (~torch.isfinite(x).any(dim=1)).tolist()


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    _apply_penalties(logits, [_req(SamplingParams(repetition_penalty=2.0), prompt=(0,), output=(1,))])
    assert logits.tolist() == [[1.0, -2.0, 0.5, 3.0]]  # seen tokens 0 and 1: 2/2, -1*2
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    _apply_penalties(logits, [_req(params, prompt=(0,), output=(3, 3, 1))])
    assert logits.tolist() == [[2.0, -1.75, 0.5, 2.0]]  # token 3: 3 - 0.5 - 2*0.25; token 1: -1 - 0.75


def test_seeded_draws_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    req = _req(SamplingParams(temperature=1.0, seed=123))
    counts = [0, 0, 0]
    for _ in range(3000):  # successive output positions of one seeded request: each its own noise
        token = sample(probs.log()[None].clone(), [req]).token_ids[0]
        counts[token] += 1
        req.token_ids.append(token)
    for c, p in zip(counts, probs.tolist()):
        assert abs(c / 3000 - p) < 4 * math.sqrt(p * (1 - p) / 3000)


def test_logit_bias_allowed_tokens_and_bad_words_by_hand():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5, 0.0, 2.5]])
    greedy = dict(temperature=0.0)
    assert sample(logits.clone(), [_req(SamplingParams(**greedy, logit_bias={4: 3.5}))]).token_ids == [4]
    assert sample(logits.clone(), [_req(SamplingParams(**greedy, logit_bias={0: -1.0}))]).token_ids == [5]
    assert sample(logits.clone(), [_req(SamplingParams(**greedy, allowed_token_ids=[2, 3]))]).token_ids == [2]
    req = _req(SamplingParams(**greedy), output=[1])
    req.bad_words_token_ids = [[0], [1, 5], [2, 1]]  # 0 always; 5 right after 1; 1 right after 2
    assert sample(logits.clone(), [req]).token_ids == [1]  # 0 banned, 5 banned after 1: next best is 1
    req.token_ids.append(2)
    assert sample(logits.clone(), [req]).token_ids == [5]  # after 2: 1 banned, 5 allowed again


def test_seeded_noise_is_a_function_of_the_position_alone():
    """Counter-based: drawing position 5 gives the same token whatever was drawn before it."""
    logits = torch.randn(1, 50)
    req = _req(SamplingParams(temperature=1.0, seed=2**64 - 1))
    tokens = []
    for _ in range(8):
        tokens.append(sample(logits.clone(), [req]).token_ids[0])
        req.token_ids.append(tokens[-1])
    fresh = _req(SamplingParams(temperature=1.0, seed=2**64 - 1))
    fresh.token_ids += [0] * 5  # five other tokens before: position 5 is next
    assert sample(logits.clone(), [fresh]).token_ids[0] == tokens[5]
    assert len(set(tokens)) > 1


def test_same_seed_same_text_whatever_the_batch(smollm2):
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    prompt = "Once upon a time, by the sea,"
    alone = smollm2.generate([prompt], seeded)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=30, temperature=1.0)
    batch = smollm2.generate(["Hello", prompt, "List three colors:"], [others, seeded, others])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = smollm2.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=8, ignore_eos=True)
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_top_k_1_is_greedy(smollm2):
    prompt = "The three primary colors are"
    greedy = smollm2.generate([prompt], GREEDY)[0].outputs[0].token_ids
    top1 = smollm2.generate([prompt], SamplingParams(max_tokens=24, temperature=1.3, top_k=1, seed=3))
    assert top1[0].outputs[0].token_ids == greedy


@pytest.mark.slow  # exporting the float32 reference directory and loading it: 45 s on a fresh machine
def test_logprobs_and_prompt_logprobs_match_transformers(smollm2_float, smollm2_ref):
    ids = smollm2_float.get_tokenizer().encode("The quick brown fox jumps over the lazy")
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, prompt_logprobs=2)
    out = smollm2_float.generate([{"prompt_token_ids": ids}], params)[0]
    comp = out.outputs[0]
    with torch.no_grad():
        ref = smollm2_ref(torch.tensor([ids + comp.token_ids])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[ids[pos]].logprob - ref[pos - 1, ids[pos]].item()) < 1e-4
        top = ref[pos - 1].topk(2).indices.tolist()
        assert all(t in entry for t in top)
    total = 0.0
    for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(ids) - 1 + i]
        assert entry[tok].rank == 1 and abs(entry[tok].logprob - row[tok].item()) < 1e-4
        assert sorted(entry, key=lambda t: entry[t].rank)[:3] == row.topk(3).indices.tolist()
        total += entry[tok].logprob
    assert abs(comp.cumulative_logprob - total) < 1e-6


def test_stop_strings_stop_tokens_min_tokens_ignore_eos(smollm2):
    prompt = "Count from one to ten in words: one, two,"
    free = smollm2.generate([prompt], GREEDY)[0].outputs[0]
    assert "four" in free.text
    stopped = smollm2.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=["four", "zzz"]))[0]
    c = stopped.outputs[0]
    assert c.text == free.text[: free.text.index("four")]
    assert (c.finish_reason, c.stop_reason) == ("stop", "four")
    kept = smollm2.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, stop="four", include_stop_str_in_output=True)
    )[0].outputs[0]
    assert kept.text == free.text[: free.text.index("four") + 4]

    stop_tok = free.token_ids[3]
    by_id = smollm2.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_tok]))[0]
    first = free.token_ids.index(stop_tok)
    assert by_id.outputs[0].token_ids == free.token_ids[: first + 1]
    assert (by_id.outputs[0].finish_reason, by_id.outputs[0].stop_reason) == ("stop", stop_tok)

    first_tok = free.token_ids[0]
    late = smollm2.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[first_tok], min_tokens=3)
    )[0].outputs[0]
    assert len(late.token_ids) >= 3 and first_tok not in late.token_ids[:3]

    chat = [{"role": "user", "content": "Say hi."}]
    natural = smollm2.chat(chat, SamplingParams(max_tokens=60, temperature=0.0))[0].outputs[0]
    assert natural.finish_reason == "stop" and len(natural.token_ids) < 60
    forced = smollm2.chat(chat, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert forced.finish_reason == "length" and len(forced.token_ids) == 60
    assert forced.token_ids[: len(natural.token_ids)] == natural.token_ids
    assert smollm2.engine.kv.all_free()


def test_n_samples_share_the_prompt_kv(smollm2):
    engine = smollm2.engine
    ids = smollm2.get_tokenizer().encode("Here is a story about a dragon who learned to cook. " * 6)
    before = engine.scheduler.prefix_hit_tokens
    out = smollm2.generate([{"prompt_token_ids": ids}], SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=5))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    shared = (len(ids) - 1) // engine.kv.block_size * engine.kv.block_size
    assert engine.scheduler.prefix_hit_tokens - before >= 2 * shared  # samples 2 and 3 reuse the prompt
    assert engine.kv.all_free()


def test_blocks_return_on_finish_stop_and_abort(smollm2):
    engine = smollm2.engine
    rid = engine.add_request("Tell me about the moon.", SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    other = engine.add_request("And the sun?", SamplingParams(max_tokens=3, temperature=0.0))
    for _ in range(5):
        engine.step()
    assert other not in engine.requests  # finished by length
    assert engine.kv.num_used_blocks(0) > 0
    engine.abort_request(rid)
    assert engine.kv.all_free() and not engine.has_unfinished_requests()
    # abort before the first step, and while waiting behind others
    rid = engine.add_request("Never run.", SamplingParams(max_tokens=5))
    engine.abort_request(rid)
    assert engine.kv.all_free() and not engine.has_unfinished_requests()
