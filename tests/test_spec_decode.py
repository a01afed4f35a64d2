"""Speculative decoding: the output with drafts is the output without them, token for token
(greedy and seeded), whatever the proposer, batch, chunking, prefix hits, preemption, import or
grammar; the sampled distribution is the target's; nothing leaks."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import torch

from baton import LLM, SamplingParams
from baton.config import SpeculativeConfig
from baton.sampling_params import StructuredOutputsParams
from baton.spec_decode.ngram import propose_ngram
from baton.spec_decode.suffix import SEPARATOR, SuffixProposer, longest_match, walk
from tests.conftest import PROMPTS
from tests.test_handoff import prefill_span, run_imported
from tests.test_random_models import make_model
from tests.test_recurrent_hybrid import QWEN3_NEXT

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
# drafting every step: whether drafts pay is measured from step timings, which on a shared machine
# (the suite runs in two processes) can turn speculation off, and these tests are about exactness
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
PASSAGE = (
    "The river ran past the old mill, under the stone bridge and on to the harbor, where the boats "
    "waited for the morning tide. "
)
GROUNDED = [
    "Repeat the following text exactly.\n\n" + PASSAGE * 2 + "\n\nThe text again:\n\n" + PASSAGE[:40],
    PROMPTS[1] + "    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" + PROMPTS[1],
    PROMPTS[6],
]


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _ids(llm: LLM, prompts) -> list[dict]:
    return [{"prompt_token_ids": llm.get_tokenizer().encode(p)} for p in prompts]


def _all_free(llm: LLM) -> bool:
    spec = llm.engine.spec
    draft_kv = getattr(spec.draft, "kv", None) if spec is not None else None  # the suffix drafter has none
    return llm.engine.kv.all_free() and (draft_kv is None or draft_kv.all_free())


@pytest.fixture(scope="module")
def smollm2_ngram() -> LLM:
    return LLM("smollm2-135m", progress=False, speculative_config=NGRAM)


def test_ngram_proposals_follow_the_latest_full_match():
    assert propose_ngram([5, 6, 7, 8, 9, 5, 6], 3, 2, 5) == [7, 8, 9]
    # [2, 3] occurs at 1 and 4: the match at 4 has the 2 tokens asked for after it
    assert propose_ngram([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, 2, 2) == [7, 1]
    # the longest suffix wins: [9, 2, 3] occurred once, followed by 7
    assert propose_ngram([9, 2, 3, 7, 4, 2, 3, 5, 9, 2, 3], 1, 2, 3) == [7]
    assert propose_ngram([1, 2, 3, 4], 3, 2, 5) == []
    assert propose_ngram([1, 2], 0, 1, 2) == []


def test_suffix_walk_follows_the_most_frequent_continuation():
    a = np.array([1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2])
    n, ends = longest_match(a, a, 24)
    assert n == 2 and ends.tolist() == [1, 4, 7]  # "1 2" occurred three times before the end
    # 3 twice, 4 once; after "3": 1 and 9 once each (a tie: the smaller id); then "3 1" went on "2 4"
    assert walk([(a, ends)], 4, 0.1) == [3, 1, 2, 4]
    assert walk([(a, ends)], 4, 0.7) == []  # 3's share is 2/3
    b = np.array([5, 6, SEPARATOR, 5, 6, 7])
    n, ends = longest_match(b, np.array([5, 6]), 24)
    assert walk([(b, ends)], 3, 0.1) == [7]  # never across a separator: one continuation, 7
    assert longest_match(a, np.array([8]), 24)[0] == 0


def test_suffix_drafts_recent_outputs_of_the_same_salt_only():
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=8)
    proposer = SuffixProposer(config)

    class Req:
        def __init__(self, rid, tokens, salt=b""):
            self.request_id, self.token_ids, self.cache_salt = rid, tokens, salt
            self.output_token_ids = tokens[2:]

    done = Req("a", [1, 2, 10, 11, 12, 13, 14, 15])
    proposer.observe([done])
    proposer.release(set())
    assert proposer.propose([(Req("b", [7, 10, 11]), 8)]) == [[12, 13]]  # spec factor 1: two tokens of match
    assert proposer.propose([(Req("c", [7, 10, 11], salt=b"other"), 8)]) == [[]]


def test_greedy_suffix_is_exact_and_reuses_recent_outputs(smollm2):
    prompts = _ids(smollm2, GROUNDED + PROMPTS[:2])
    expected = [_tokens(smollm2, [p])[0] for p in prompts]
    llm = LLM("smollm2-135m", progress=False, speculative_config={**NGRAM, "method": "suffix"})
    spec = llm.engine.spec
    assert _tokens(llm, prompts) == expected  # batched
    first = spec.num_accepted_tokens
    assert first > 20 and first < spec.num_draft_tokens
    assert _tokens(llm, prompts[3:4]) == expected[3:4]  # a prompt that repeats nothing: drafts from the last output
    assert spec.num_accepted_tokens - first >= 20
    assert _all_free(llm) and not spec.draft.requests


def test_speculative_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig.parse({"method": "eagle9"})
    with pytest.raises(ValueError, match="unknown speculative config keys"):
        SpeculativeConfig.parse('{"method": "ngram", "num_tokens": 3}')
    with pytest.raises(ValueError, match="not JSON"):
        SpeculativeConfig.parse("{method: ngram}")
    with pytest.raises(ValueError, match='needs "model"'):
        SpeculativeConfig.parse({"method": "draft_model"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.parse({"num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="float KV cache"):
        LLM("smollm2-135m", progress=False, kv_cache_dtype="fp8", speculative_config=NGRAM)
    with pytest.raises(ValueError, match="no MTP layers"):
        LLM("smollm2-135m", progress=False, speculative_config={"method": "mtp"})


@pytest.mark.slow  # other exactness cases stay in the default suite
def test_greedy_ngram_is_exact_batched_chunked_and_on_prefix_hits(smollm2, smollm2_ngram):
    prompts = _ids(smollm2, GROUNDED + PROMPTS[:3])
    expected = [_tokens(smollm2, [p])[0] for p in prompts]
    spec = smollm2_ngram.engine.spec
    assert _tokens(smollm2_ngram, prompts) == expected  # batched, cold
    assert spec.num_accepted_tokens > 20 and spec.num_accepted_tokens < spec.num_draft_tokens  # both paths ran
    hits = smollm2_ngram.engine.scheduler.prefix_hit_tokens
    assert _tokens(smollm2_ngram, prompts[::-1]) == expected[::-1]  # warm: every prompt hits
    assert smollm2_ngram.engine.scheduler.prefix_hit_tokens > hits
    assert _all_free(smollm2_ngram)
    chunked = LLM("smollm2-135m", progress=False, max_num_batched_tokens=64, speculative_config=NGRAM)
    assert _tokens(chunked, prompts) == expected
    assert chunked.engine.spec.num_accepted_tokens > 0 and _all_free(chunked)


def test_prefix_hits_are_the_same_with_speculation(smollm2_ngram):
    system = "You are a careful assistant. " * 40
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": smollm2_ngram.get_tokenizer().encode(system + q)} for q in ("Hi.", "Why?", "How?")]
    off = LLM("smollm2-135m", progress=False)
    cached_off = [o.num_cached_tokens for o in off.generate(prompts, params) + off.generate(prompts, params)]
    spec = smollm2_ngram
    on = [o.num_cached_tokens for o in spec.generate(prompts, params) + spec.generate(prompts, params)]
    assert on == cached_off and sum(on) > 0


def test_seeded_sampling_keeps_its_tokens(smollm2, smollm2_ngram):
    prompts = _ids(smollm2, GROUNDED[:2])
    params = [SamplingParams(max_tokens=40, temperature=0.5, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 2)]
    expected = [o.outputs[0].token_ids for o in smollm2.generate(prompts, params)]
    before = smollm2_ngram.engine.spec.num_accepted_tokens
    assert [o.outputs[0].token_ids for o in smollm2_ngram.generate(prompts, params)] == expected
    assert smollm2_ngram.engine.spec.num_accepted_tokens > before


def test_logprobs_and_stops_inside_accepted_drafts(smollm2, smollm2_ngram):
    prompts = _ids(smollm2, GROUNDED[:1])
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=2, stop=["boats"])
    a, b = smollm2.generate(prompts, params)[0].outputs[0], smollm2_ngram.generate(prompts, params)[0].outputs[0]
    assert a.token_ids == b.token_ids and a.text == b.text
    assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason)
    assert [{t: e.logprob for t, e in x.items()} for x in a.logprobs] == [
        {t: e.logprob for t, e in x.items()} for x in b.logprobs
    ]
    assert _all_free(smollm2_ngram)


def test_grammar_cuts_drafts_and_keeps_the_constrained_output(smollm2, smollm2_ngram):
    word = {"type": "string", "maxLength": 24}
    schema = {
        "type": "object",
        "properties": {
            "name": word,
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": word, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
    }
    msg = [{"role": "user", "content": "JSON for a person named Alice Alice, age 30, tags alice, alice-alice, alice:"}]
    params = SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
    expected = smollm2.chat(msg, params)[0].outputs[0]
    before = smollm2_ngram.engine.spec.num_drafts
    got = smollm2_ngram.chat(msg, params)[0].outputs[0]
    assert got.token_ids == expected.token_ids
    jsonschema.validate(json.loads(got.text), schema)
    assert smollm2_ngram.engine.spec.num_drafts > before
    assert _all_free(smollm2_ngram)


def test_aborts_and_preemption_leak_nothing(smollm2):
    prompts = _ids(smollm2, GROUNDED[:2] + PROMPTS[:4])
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = _tokens(smollm2, prompts, params)
    small = LLM("smollm2-135m", progress=False, num_kv_blocks=14, max_model_len=160, speculative_config=NGRAM)
    assert _tokens(small, prompts, params) == expected
    assert small.engine.scheduler.num_preemptions > 0 and small.engine.spec.num_accepted_tokens > 0
    assert _all_free(small)
    engine = small.engine
    rid = engine.add_request(prompts[0], params)
    while not engine.requests[rid][0].spec_token_ids:
        engine.step()
    engine.step()  # a verification is in the request's past, drafts in its future
    engine.abort_request(rid)
    assert _all_free(small)


def test_decode_worker_speculates_on_an_imported_request(smollm2, smollm2_ngram):
    ids = smollm2.get_tokenizer().encode(GROUNDED[0])
    expected = _tokens(smollm2, [{"prompt_token_ids": ids}])[0]
    before = smollm2_ngram.engine.spec.num_accepted_tokens
    out = run_imported(smollm2_ngram, ids, prefill_span(smollm2, ids), GREEDY)
    assert out.outputs[0].token_ids == expected
    assert smollm2_ngram.engine.spec.num_accepted_tokens > before
    assert _all_free(smollm2_ngram)


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("qwen3-next-spec"), "Qwen3NextForCausalLM", **QWEN3_NEXT)[1]


def _loops(seed: int) -> list[dict]:
    """Prompts whose greedy continuations on a random model loop, so n-gram drafts get accepted."""
    rng = random.Random(seed)
    base = [rng.randrange(256) for _ in range(40)]
    return [
        {"prompt_token_ids": base * 3},
        {"prompt_token_ids": [rng.randrange(256) for _ in range(70)]},
        {"prompt_token_ids": base[:20] * 4 + [5]},
    ]


def test_recurrent_state_rolls_back_to_the_accepted_draft(qwen3_next_dir):
    """Gated DeltaNet layers keep a state per verified draft and commit the accepted one; the
    checkpoints that accepted drafts cross are taken from those states, so hits stay equal."""
    off = LLM(str(qwen3_next_dir), progress=False)
    on = LLM(
        str(qwen3_next_dir),
        progress=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    )
    prompts = _loops(0)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = _tokens(off, prompts, params)
    assert _tokens(on, prompts, params) == expected
    spec = on.engine.spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert _all_free(on)
    # a second turn resumes from the checkpoints of the first, drafts or not
    turns = [{"prompt_token_ids": p["prompt_token_ids"] + e + [7]} for p, e in zip(prompts, expected)]
    hits_off = [o.num_cached_tokens for o in off.generate(turns, params)]
    hits_on = [o.num_cached_tokens for o in on.generate(turns, params)]
    assert hits_on == hits_off and min(hits_on) > 0
    assert _all_free(on)


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    """A target and a different draft over a 16-token vocabulary."""
    root = tmp_path_factory.mktemp("tiny-vocab")
    shape = dict(vocab_size=16, num_hidden_layers=2, max_position_embeddings=64)
    target = make_model(root / "target", "LlamaForCausalLM", **shape)[1]
    torch.manual_seed(1)
    draft = make_model(root / "draft", "LlamaForCausalLM", **shape, hidden_size=32, intermediate_size=64)[1]
    return target, draft


@pytest.mark.slow
def test_draft_model_sampling_has_the_target_distribution(tiny_vocab):
    """Chi-square of the second and third sampled tokens against the exact marginals from
    transformers' forward on the same weights, over 10,000 seeded draws with a draft model whose
    proposals differ from the target's (a 2-point shift of one token's probability adds ~60 to the
    statistic; the bound is p < 0.001); the draws also equal the undrafted ones."""
    from transformers import AutoModelForCausalLM

    target, draft = tiny_vocab
    prompt = [3, 1, 4, 1, 5]
    ref = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    with torch.no_grad():
        p0 = ref(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        seqs = torch.tensor([prompt + [t] for t in range(16)])
        p1 = ref(seqs).logits[:, -1].softmax(-1)  # [t0, t1]
        pairs = torch.tensor([prompt + [a, b] for a in range(16) for b in range(16)])
        p2 = ref(pairs).logits[:, -1].softmax(-1).view(16, 16, 16)  # [t0, t1, t2]
    marginal1 = p0 @ p1
    marginal2 = torch.einsum("a,ab,abc->c", p0, p1, p2)
    on = LLM(
        str(target),
        progress=False,
        max_num_seqs=256,
        speculative_config={
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": 2,
            "disable_by_batch_size": None,
            "adaptive": False,  # draft at every batch size, paying or not
        },
    )
    n = 10000
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    outs = [o.outputs[0].token_ids for o in on.generate([{"prompt_token_ids": prompt}] * n, params)]
    spec = on.engine.spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    for position, marginal in ((1, marginal1), (2, marginal2)):
        counts = torch.bincount(torch.tensor([o[position] for o in outs]), minlength=16).double()
        expected = marginal.double() * n
        chi2 = ((counts - expected) ** 2 / expected).sum().item()
        assert chi2 < 37.7, f"position {position}: chi-square {chi2:.1f} over 15 degrees of freedom (p < 0.001)"
    off = LLM(str(target), progress=False, max_num_seqs=256)
    assert [o.outputs[0].token_ids for o in off.generate([{"prompt_token_ids": prompt}] * 200, params[:200])] == outs[
        :200
    ]
    assert _all_free(on)


@pytest.mark.slow  # a server of its own: 7 s
def test_server_speculates_and_reports_vllm_metrics(smollm2):
    import subprocess
    import sys

    import requests

    from tests.server_util import ServerProcess

    bad = subprocess.run(
        [sys.executable, "-m", "baton.cli", "serve", "--speculative-config", '{"method": "eagle"}'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "speculative method must be one of" in bad.stderr
    expected = smollm2.generate(GROUNDED[0], SamplingParams(max_tokens=40, temperature=0.0))[0].outputs[0].text
    server = ServerProcess("--speculative-config", json.dumps(NGRAM))
    try:
        body = {"model": "smollm2-135m", "prompt": GROUNDED[0], "max_tokens": 40, "temperature": 0.0}
        r = requests.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
        streamed = requests.post(f"{server.base_url}/v1/completions", json={**body, "stream": True}, timeout=120)
        chunks = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ") and "[DONE]" not in line]
        assert "".join(json.loads(c)["choices"][0]["text"] for c in chunks if json.loads(c)["choices"]) == expected
        drafts = server.metric("baton_spec_decode_num_drafts_total")
        accepted = server.metric("baton_spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= server.metric("baton_spec_decode_num_draft_tokens_total")
        first = server.metric('baton_spec_decode_num_accepted_tokens_per_pos_total{position="0"}')
        assert 0 < first <= drafts
    finally:
        assert server.terminate() == 0


def test_ngram_proposals_equal_a_plain_search():
    """Against the definition, searched naively, on many small random sequences."""

    def plain(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
        for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
            if n <= 0:
                break
            ends = [i + n for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[-n:]]
            if ends:
                full = [e for e in ends if e + k <= len(tokens)]
                start = full[-1] if full else ends[0]
                return tokens[start : start + k]
        return []

    rng = random.Random(7)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(2, 40))]
        k, n_min = rng.randrange(1, 6), rng.randrange(1, 4)
        n_max = rng.randrange(n_min, 7)
        assert propose_ngram(tokens, k, n_min, n_max) == plain(tokens, k, n_min, n_max), (tokens, k, n_min, n_max)
