"""The llama.cpp engine on the embedded GGUF: layer numbering checked against
transformers fp32 on the same (dequantised) weights, the KV cache reused,
cancel, steering, sampling, and nothing left installed afterwards."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from isagi.engines.base import GenerationOptions
from tests.states import row_cosine

pytestmark = pytest.mark.model

CHATS = [
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": text}]
    for text in ("What is the capital of France?", "How do I kill a Python process?",
                 "Write a short poem about the sea and the wind.")
]


@pytest.fixture(scope="module")
def fp32(settings_default):
    """transformers in fp32 on the GGUF's dequantised weights (ISAGI_QUANT=none)."""
    from isagi.engines import load_engine

    return load_engine(settings_default.with_overrides(backend="transformers", quant="none"))


def test_both_backends_read_the_same_chat_tokens_and_message_span(default_llama, fp32) -> None:
    for chat in CHATS:
        assert default_llama.chat_tokens(chat) == fp32.chat_tokens(chat)
        assert default_llama.content_span(chat) == fp32.content_span(chat)
        assert default_llama.count_tokens(chat[-1]["content"]) == fp32.count_tokens(chat[-1]["content"])


def test_layer_numbering_agrees_with_transformers_fp32(default_llama, fp32) -> None:
    """l_out-(L-1) of llama.cpp is transformers' hidden_states[L]: per-token cosine >= 0.98
    at the memory layer and the safety layer (Q4_1 compute vs fp32 on its dequantised weights),
    while the neighbouring layer is clearly further away (a numbering off by one would fail)."""
    L, S = default_llama.default_layer, default_llama.default_safety_layer
    layers = [L, S, L - 1]
    ours = list(default_llama.iter_prompt_states(CHATS, layers))
    ref = list(fp32.iter_prompt_states(CHATS, layers))
    for a, b in zip(ours, ref, strict=True):
        for layer in (L, S):
            assert a[layer].shape == b[layer].shape
            cos = row_cosine(a[layer][1:], b[layer][1:])  # position 0 is an attention sink with a huge norm
            assert cos.min() >= 0.98, (layer, cos.min())
        off_by_one = row_cosine(a[L][1:], b[L - 1][1:]).mean()
        assert off_by_one < row_cosine(a[L][1:], b[L][1:]).mean() - 0.005


def test_the_prompt_is_evaluated_once_and_decoding_continues_from_its_cache(default_llama) -> None:
    e = default_llama
    before = e.evaluated_tokens
    with e.generation(CHATS[0], e.default_layer, GenerationOptions(max_new_tokens=8, ignore_eos=True),
                      also_capture=(e.default_safety_layer,)) as gen:
        h = gen.prefill()
        assert e.evaluated_tokens - before == gen.prompt_tokens
        np.testing.assert_array_equal(h, gen.prompt_states()[-1])
        list(gen.stream())
        assert len(gen.new_ids) == 8
        # every reply token but the last was fed back once; the prompt was never evaluated again
        assert e.evaluated_tokens - before == gen.prompt_tokens + 7
        assert gen.reply_hidden().shape == gen.reply_hidden(e.default_safety_layer).shape == (7, e.hidden_size)
    # the reply states are the same as evaluating prompt + reply in one pass
    full = [*CHATS[0]]
    ids = e.chat_tokens(full) + gen.new_ids[:7]
    e._clear(None)
    states = e._decode(ids, 0, capture=e._names([e.default_layer]))[e.default_layer]
    assert row_cosine(states[-7:], gen.reply_hidden()).min() > 0.999


def test_cancel_stops_between_tokens(default_llama) -> None:
    with default_llama.generation(CHATS[2], default_llama.default_layer,
                                  GenerationOptions(max_new_tokens=50, ignore_eos=True)) as gen:
        for n, _event in enumerate(gen.stream(), 1):
            if n == 3:
                gen.stop()
        assert gen.finish_reason == "cancelled" and len(gen.new_ids) == 3


def _greedy(engine, steer=None, n=16) -> tuple[list[int], np.ndarray]:
    with engine.generation(CHATS[2], engine.default_layer, GenerationOptions(max_new_tokens=n, ignore_eos=True),
                           steer=steer, also_capture=(engine.default_layer + 1,)) as gen:
        gen.prefill()
        list(gen.stream())
        return list(gen.new_ids), gen.prompt_states(engine.default_layer + 1)


def test_steering_changes_the_reply_and_a_zero_vector_does_not(default_llama) -> None:
    e = default_llama
    plain_ids, plain_next = _greedy(e)
    zero_ids, zero_next = _greedy(e, steer=np.zeros(e.hidden_size, np.float32))
    assert zero_ids == plain_ids
    np.testing.assert_allclose(zero_next, plain_next, rtol=1e-4, atol=1e-4)
    rng = np.random.default_rng(0)
    v = rng.standard_normal(e.hidden_size).astype(np.float32)
    v *= 4 * np.linalg.norm(plain_next[-1]) / np.linalg.norm(v)
    with e.generation(CHATS[2], e.default_layer, GenerationOptions(max_new_tokens=16, ignore_eos=True), steer=v) as gen:
        h = gen.prefill()
        steered_ids = [ev.token_id for ev in gen.stream()]
    assert steered_ids != plain_ids
    # the captured state at the steered layer is read before the vector (as on transformers)
    with e.generation(CHATS[2], e.default_layer) as gen:
        np.testing.assert_allclose(h, gen.prefill(), rtol=1e-3, atol=1e-3)
    assert _greedy(e)[0] == plain_ids  # the control vector is gone after the block


def test_steering_layer_one_is_refused_with_a_clear_error(default_llama) -> None:
    from isagi.errors import ConfigError

    with pytest.raises(ConfigError, match="layer >= 2"), default_llama.generation(
            CHATS[0], 1, steer=np.ones(default_llama.hidden_size, np.float32)):
        pass


def test_sampling_with_a_seed_is_reproducible(default_llama) -> None:
    opts = GenerationOptions(max_new_tokens=12, do_sample=True, temperature=1.0, seed=7, ignore_eos=True)

    def sample(o: GenerationOptions) -> list[int]:
        with default_llama.generation(CHATS[2], default_llama.default_layer, o) as gen:
            return [ev.token_id for ev in gen.stream()]

    first = sample(opts)
    assert sample(opts) == first
    others = [sample(GenerationOptions(**{**opts.__dict__, "seed": s})) for s in (8, 9, 10)]
    assert any(o != first for o in others)


def test_nothing_stays_installed_when_the_consumer_raises(default_llama) -> None:
    e = default_llama
    plain_ids, _ = _greedy(e)
    with pytest.raises(RuntimeError, match="client"), e.generation(
            CHATS[0], e.default_layer, steer=np.ones(e.hidden_size, np.float32)) as gen:
        for _ in gen.stream():
            raise RuntimeError("client went away")
    assert e._capture.wanted is None and e.owner is None
    assert _greedy(e)[0] == plain_ids  # no control vector left behind


def test_a_layer_out_of_range_is_a_clear_error(default_llama) -> None:
    from isagi.errors import ConfigError

    with pytest.raises(ConfigError, match="out of range"):
        default_llama.generation(CHATS[0], default_llama.num_layers)


def _every(rows: list, key, n: int) -> list:
    """The first ``n`` rows of each group (groups by ``key(row)``), in order."""
    seen: dict = {}
    out = []
    for r in rows:
        k = key(r)
        if seen.get(k, 0) < n:
            seen[k] = seen.get(k, 0) + 1
            out.append(r)
    return out


@pytest.fixture(scope="module")
def small_profile(default_llama, settings_default):
    """A profile fitted on llama.cpp states of a few rows of the corpora.

    The same fitting functions as a full profile (which reads ~2,000 prompts and
    generates calibration replies: tens of minutes on a busy 2-core machine), on
    two zone rows per zone and three safety rows per label and category, without
    the reply threshold's calibration replies. It tests the turn's mechanics on
    this backend; its thresholds mean little.
    """
    from isagi.data import load_zones
    from isagi.data.safety import load_safety_corpus
    from isagi.manifold.pooling import prompt_hidden_states
    from isagi.manifold.ugt import fit_basis, fit_zones, project
    from isagi.profile import Profile
    from isagi.safety.build import Corpus, chat, fit_safety_profile, read_layers, safety_states

    system, e = settings_default.system_prompt, default_llama
    zones = _every(load_zones(), lambda r: r["zone"], 2)
    H = prompt_hidden_states(e, [chat(system, r["text"]) for r in zones], e.default_layer)
    basis = fit_basis(H, 8)
    rows = _every(load_safety_corpus(), lambda r: (r["label"], r["category"], r["benign_kind"]), 3)
    layers = read_layers(e.num_layers, e.default_safety_layer)
    S = safety_states(e, [chat(system, r["text"]) for r in rows], layers)
    safety = fit_safety_profile(Corpus.of(S, rows), layers)
    return Profile(key="small", model_fingerprint=e.fingerprint, layer=e.default_layer, k=8, basis=basis,
                   zones=fit_zones(project(basis, H), [r["zone"] for r in zones]), safety=safety,
                   context_threshold=0.5)


def test_the_turn_runs_end_to_end_on_llamacpp(default_llama, small_profile, settings_default, tmp_path) -> None:
    from isagi.pipeline.engine import Engine

    engine = Engine(settings_default.with_overrides(home=tmp_path, backend="llamacpp"), default_llama, small_profile)
    session = engine.new_session(autosave=False)
    default_llama.prefixes.clear()  # no saved KV of an earlier test's prompt: every prompt token is evaluated
    before = default_llama.evaluated_tokens
    result = engine.turn(session, "Name three colours of the rainbow.", record=False)
    assert result.verdict in ("ok", "refused", "withheld")
    if result.verdict == "ok":
        assert result.generated and result.new_tokens > 0 and result.reply_text.strip()
        # one prefill of the prompt, then each reply token fed back once (the last one only when
        # decoding went on to sample a stop token)
        spent = default_llama.evaluated_tokens - before
        assert spent in (result.prompt_tokens + result.new_tokens - 1, result.prompt_tokens + result.new_tokens)
        again = engine.turn(session, "Name three colours of the rainbow.", record=False)
        assert again.tier == "RETRIEVE" and again.reply_text == result.reply_text and not again.generated
    assert default_llama.owner is None and default_llama._capture.wanted is None


def test_a_prompt_that_extends_an_earlier_one_evaluates_only_its_new_tokens(default_llama) -> None:
    from isagi.engines.base import REUSE_ANY

    e = default_llama
    e.prefixes.clear()
    opts = GenerationOptions(max_new_tokens=12, ignore_eos=True)
    with e.generation(CHATS[0], e.default_layer, opts) as first:
        list(first.stream())
    assert len(e.prefixes) == 1  # its prompt and fed-back reply were kept on close
    follow = [*CHATS[0], {"role": "assistant", "content": first.text},
              {"role": "user", "content": "And what is the capital of Spain?"}]
    ids = e.chat_tokens(follow)
    kept = len(first.ids) + 11  # the last reply token is never fed back
    before = e.evaluated_tokens
    with e.generation(follow, e.default_layer, GenerationOptions(max_new_tokens=1),
                      also_capture=(e.default_safety_layer,), reuse_prefix=REUSE_ANY) as gen:
        h = gen.prefill()
        reused = gen._prompt_start
        logits = e._logits().copy()
        # the shared prefix (at least the first prompt) was not evaluated again
        assert len(first.ids) <= reused <= kept
        assert e.evaluated_tokens - before == len(ids) - reused
        with pytest.raises(ValueError, match="saved KV cache"):
            gen.prompt_states()
        with pytest.raises(ValueError, match="saved KV cache"):
            gen.prompt_state(e.default_safety_layer, span=(0, 4))
        span = e.content_span(follow)
        pooled = gen.prompt_state(e.default_safety_layer, span=span)
    # the same prompt evaluated whole: the same last state, message state and next-token logits
    e._clear(None)
    full = e._decode(ids, 0, capture=e._names([e.default_layer, e.default_safety_layer]))
    assert row_cosine(h, full[e.default_layer][-1]) > 0.999
    assert row_cosine(pooled, full[e.default_safety_layer][span[0]:span[1]].mean(axis=0)) > 0.999
    whole = e._logits()
    assert int(np.argmax(whole)) == int(np.argmax(logits)) and row_cosine(whole, logits) > 0.999


def test_a_prefix_is_reused_only_as_far_as_the_caller_allows(default_llama) -> None:
    e = default_llama
    e.prefixes.clear()
    with e.generation(CHATS[0], e.default_layer, GenerationOptions(max_new_tokens=2)) as first:
        list(first.stream())
    span = e.content_span(CHATS[0])
    before = e.evaluated_tokens
    with e.generation(CHATS[0], e.default_layer, reuse_prefix=span[0]) as gen:
        gen.prefill()
        assert gen._prompt_start == span[0]  # the message itself is evaluated again
        assert e.evaluated_tokens - before == len(gen.ids) - span[0]
        gen.prompt_state(e.default_layer, span=span)
    steer = np.zeros(e.hidden_size, dtype=np.float32)
    with e.generation(CHATS[0], e.default_layer, steer=steer, reuse_prefix=span[0]) as steered:
        steered.prefill()
        assert steered._prompt_start == 0  # a steered prompt never takes an unsteered KV cache


def test_alternating_capture_sets_evaluate_each_prompt_once(default_llama, monkeypatch) -> None:
    # node indices remembered for one set of wanted layers must not be used for another set
    # (each wrong guess cost a second evaluation of the whole batch)
    e = default_llama
    ids = e.chat_tokens(CHATS[0])
    batches = []
    run_batch = e._run_batch
    monkeypatch.setattr(e, "_run_batch", lambda *a, **k: batches.append(1) or run_batch(*a, **k))
    for layers in ([e.default_layer, e.default_safety_layer], [e.default_layer], [e.default_safety_layer]) * 2:
        e._clear(None)
        batches.clear()
        states = e._decode(ids, 0, capture=e._names(layers))
        assert sorted(states) == sorted(layers)
        assert len(batches) == 1, f"evaluated {len(batches)} times for {layers}"


def test_greedy_decoding_gives_plain_llama_cpp_reply_token_for_token(default_llama) -> None:
    """The engine's greedy path (argmax of the logits, capture callback installed, two layers
    read at every reply token) decodes exactly what llama-cpp-python's own ``Llama`` decodes
    on the same GGUF with the same attention kernel: the benches compare the same reply."""
    from isagi.bench.plain_llama import PlainLlama

    e = default_llama
    plain = PlainLlama(e.source, n_threads=e.n_threads, n_ctx=e.context_length)
    for chat in CHATS:
        e.prefixes.clear()
        with e.generation(chat, e.default_layer, GenerationOptions(max_new_tokens=48),
                          also_capture=(e.default_safety_layer,)) as gen:
            gen.prefill()
            for _ in gen.stream():
                pass
            ours = list(gen.new_ids)
            states = gen.reply_hidden(e.default_safety_layer)
            fed_back = len(ours) if gen.finish_reason == "stop" else len(ours) - 1
        _s, _f, theirs = plain.generate(e.chat_tokens(chat), 48, stop_ids=e.stop_token_ids)
        assert ours == theirs
        # every fed-back reply token (all of them when the model ended the reply) has its own state
        assert states.shape == (fed_back, e.hidden_size)
        assert len({row.tobytes() for row in states}) == len(states)


def test_reply_states_of_several_layers_stand_side_by_side_as_each_alone(default_llama) -> None:
    """The reply guard reads a reply at every read-out layer: the same tokens, each layer's states
    as a one-layer capture gives them."""
    chat = [{"role": "user", "content": "Name three colours of the rainbow."}]
    top = default_llama.default_safety_layer
    one = default_llama.reply_states([chat], top, max_new_tokens=6)[0]
    low = default_llama.reply_states([chat], 6, max_new_tokens=6)[0]
    both = default_llama.reply_states([chat], [6, top], max_new_tokens=6)[0]
    d = one.shape[1]
    assert both.shape == (len(one), 2 * d) and len(one) > 0
    np.testing.assert_allclose(both[:, d:], one, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(both[:, :d], low, rtol=1e-4, atol=1e-4)


GROUP_TEXTS = ("What is the capital of France?", "How do I kill a Python process?", "Name a bird.",
               "Write a short poem about the sea and the wind at night, in four lines.",
               "Explain how bread rises.", "What is two plus two?", "Tell me about the water cycle.")


def test_prompt_states_in_groups_are_each_prompts_own(default_llama) -> None:
    """The build's prompt states are read side by side in groups (isagi.engines.llamacpp.batched):
    each prompt's states equal those of the prompt evaluated alone, row for row (up to the rounding of
    a larger matrix product), while the
    shared system prompt is evaluated once for the whole group, not once per prompt."""
    e = default_llama
    chats = [[{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": t}]
             for t in GROUP_TEXTS]
    layers = [6, e.default_safety_layer]
    names = e._names(layers)
    alone = []
    for chat in chats:
        e._clear(None)
        alone.append(e._decode(e.chat_tokens(chat), 0, capture=names, truncate=True))
    e._clear(None)
    before = e.evaluated_tokens
    grouped = list(e.iter_prompt_states(chats, layers))
    lengths = [len(e.chat_tokens(c)) for c in chats]
    shared = min(len(e.chat_tokens(chats[0])[:n]) for n in lengths)
    assert e.evaluated_tokens - before < sum(lengths) - (len(chats) - 1) * 10, "the shared prefix was not shared"
    assert shared > 10
    for got, ref, n in zip(grouped, alone, lengths, strict=True):
        for layer in layers:
            assert got[layer].shape == ref[layer].shape == (n, e.hidden_size)
            assert row_cosine(got[layer], ref[layer]).min() > 0.999, layer  # 0.99988 seen: rounding


def test_replies_in_groups_follow_each_reply_decoded_alone(default_llama) -> None:
    """The build's greedy replies decode side by side, a token of each reply per llama_decode:
    each starts with the token the reply decoded alone starts with, and keeps that reply's
    tokens and states until a near-tie of two tokens goes the other way (a larger matrix
    product rounds differently); a reply from another sequence's cells would differ at once."""
    from isagi.engines.llamacpp.batched import HeldPrefix

    e = default_llama
    chats = [[{"role": "user", "content": t}] for t in GROUP_TEXTS]
    layer = e.default_safety_layer
    names = e._names([layer])
    alone_ids, alone_states = [], []
    for chat in chats:
        with e.generation(chat, layer, GenerationOptions(max_new_tokens=12)) as gen:
            for _ in gen.stream():
                pass
            alone_ids.append(list(gen.new_ids))
            alone_states.append(gen.reply_hidden())
    tokens: list[list[int]] = []
    got = e.grouped_replies([e.chat_tokens(c) for c in chats], names, 12, e.stop_token_ids, HeldPrefix(), tokens)
    e._clear(None)
    agreed = 0
    for ids, ref_ids, states, ref in zip(tokens, alone_ids, got, alone_states, strict=True):
        assert ids[0] == ref_ids[0]
        same = next((i for i, (a, b) in enumerate(zip(ids, ref_ids, strict=False)) if a != b), min(len(ids), len(ref_ids)))
        fed = min(same, len(states[layer]), len(ref))
        assert row_cosine(states[layer][:fed], ref[:fed]).min() > 0.999
        assert len(states[layer]) == len(ids) - (len(ids) == 12)  # the last token of a full reply is not fed back
        agreed += ids == ref_ids
    assert agreed >= len(chats) // 2, (tokens, alone_ids)


def test_a_states_only_prefill_reads_the_same_states_and_decodes_nothing(default_llama) -> None:
    """The turn's lookup prompt, when the reply comes from another prompt, stops after the last
    captured layer: the same states as a full prefill, no prefix saved from its half-written KV
    cache, and no decoding from it."""
    e = default_llama
    L, S = e.default_layer, e.default_safety_layer
    e.prefixes.clear()
    with e.generation(CHATS[1], L, GenerationOptions(max_new_tokens=4), also_capture=(S,)) as full:
        h_full = full.prefill()
        s_full = full.prompt_states(S)
    e.prefixes.clear()
    with e.generation(CHATS[1], L, GenerationOptions(max_new_tokens=4), also_capture=(S,),
                      states_only=True) as part:
        h_part = part.prefill()
        np.testing.assert_allclose(h_part, h_full, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(part.prompt_states(S), s_full, rtol=1e-4, atol=1e-4)
        with pytest.raises(RuntimeError, match="states_only"):
            next(iter(part.stream()))
    assert len(e.prefixes) == 0
    # the context is usable afterwards: a full decoding of the same prompt gives the full states
    with e.generation(CHATS[1], L, GenerationOptions(max_new_tokens=4), also_capture=(S,)) as again:
        np.testing.assert_allclose(again.prefill(), h_full, rtol=1e-4, atol=1e-4)
        assert len(list(again.stream())) > 0


def test_a_one_slot_engines_decodes_run_on_one_thread_whichever_thread_asks(default_llama, settings_default, monkeypatch):
    """Turns run on threads of their own (the web app's workers), and llama.cpp's OpenMP
    kernels ran slower once decodes came from more than one thread, so every ``llama_decode``
    of a one-slot engine runs on the one llama.cpp thread (isagi.engines.llama_thread; the
    step runner of an engine with several slots does not yet)."""
    import llama_cpp

    alone = default_llama
    assert alone.slots == 1
    real = llama_cpp.llama_decode
    seen: set[int] = set()

    def recording(ctx, batch):
        seen.add(threading.get_ident())
        return real(ctx, batch)

    monkeypatch.setattr(llama_cpp, "llama_decode", recording)
    callers: set[int] = set()
    chat = [{"role": "system", "content": settings_default.system_prompt},
            {"role": "user", "content": "Write a few sentences about how bread rises."}]
    finished = threading.Event()  # the threads live to the end: no thread id is used twice

    def reply(done: threading.Event | None = None) -> None:
        callers.add(threading.get_ident())
        alone.reply_states([chat], alone.default_layer, max_new_tokens=4)
        if done is not None:
            done.set()
            finished.wait(60)

    threads = []
    for _ in range(3):  # one after the other
        done = threading.Event()
        threads.append(threading.Thread(target=reply, args=(done,)))
        threads[-1].start()
        assert done.wait(120)
    reply()  # and the test's own thread
    finished.set()
    for t in threads:
        t.join()
    assert len(callers) == 4
    assert len(seen) == 1 and not seen & callers, (seen, callers)


def test_once_no_session_is_open_the_saved_kv_prefixes_are_dropped(default_llama, small_profile, settings_default,
                                                                 tmp_path) -> None:
    """Issue 37: a closed session keeps nothing model-sized. A turn leaves its KV cache saved as a
    prefix for the next one; once idle eviction has parked every session, the store is empty."""
    from isagi.pipeline.engine import Engine
    from isagi.session.registry import SessionRegistry

    engine = Engine(settings_default.with_overrides(home=tmp_path, backend="llamacpp"), default_llama, small_profile)
    clock = [0.0]
    registry = SessionRegistry(lambda: engine, idle_s=60, clock=lambda: clock[0])
    a, b = registry.create(), registry.create()
    engine.turn(registry.entry(a).session, "Name three colours of the rainbow.")
    assert default_llama.prefixes.nbytes > 0
    clock[0] = 30.0
    registry.entry(b)  # b used since: only a is idle
    clock[0] = 70.0
    assert registry.evict_idle() == [a]
    assert default_llama.prefixes.nbytes > 0  # b is still open: its conversation may use them
    clock[0] = 200.0
    assert registry.evict_idle() == [b]
    assert default_llama.prefixes.nbytes == 0 and len(default_llama.prefixes) == 0


def test_tokens_of_a_text_tokenised_again_come_from_the_cache_and_stay_the_tokenisers(default_llama,
                                                                                     monkeypatch) -> None:
    """A turn tokenises its prompt several times: the repeats are not tokenised again, each call
    gets a list of its own (a caller that extends it changes nothing kept), the special flag is
    part of the key, and the cache stays bounded."""
    from isagi.engines.llamacpp import text as text_module

    e = default_llama
    # a chat no other test sends: the engine is shared, so a text an earlier test sent is kept already
    chat = [CHATS[2][0], {"role": "user", "content": "Name three birds that nest in cliffs, for the cache test."}]
    words = "<|im_start|>user\nhello<|im_end|>"
    plain, special = e._tokenize(words, False), e._tokenize(words, True)
    assert plain != special  # the flag changes the tokens, so it must be part of the key
    calls: list[str] = []
    real = type(e)._tokenize

    def counted(self, text: str, special: bool) -> list[int]:
        calls.append(text)
        return real(self, text, special)

    monkeypatch.setattr(type(e), "_tokenize", counted)
    first = e.chat_tokens(chat)
    first.append(-1)  # the caller's own list
    again = e.chat_tokens(chat)
    assert again == e._tokenize(e.chat_text(chat), True) and -1 not in again
    assert calls.count(e.chat_text(chat)) == 2  # the first call and the direct one above, not the repeat
    assert e.tokenize(words, special=False) == plain and e.tokenize(words, special=True) == special
    for i in range(text_module.TOKENIZED_KEPT + 5):
        e.tokenize(f"text number {i}")
    assert len(e._tokenized) == text_module.TOKENIZED_KEPT
