"""RULER-style synthetic long-context tasks: sample generation and scoring.

Written after the task definitions and prompt templates of RULER (Hsieh et al. 2024,
"RULER: What's the Real Context Size of Your Long-Context Language Models?",
arXiv 2404.06654, and its public repository's synthetic task scripts). Tasks:

``niah_single``
    One needle ``"One of the special magic numbers for {key} is: {value}."`` in a haystack;
    the question asks for the value of ``key``.
``niah_multikey``
    The target needle plus 3 distractor needles with other (distinct) keys.
``niah_multivalue``
    4 needles with the same key and 4 different values; the answer must list all 4.
``niah_multiquery``
    4 needles with 4 different keys, all queried at once; the answer must list all 4 values.
``variable_tracking``
    A chain ``VAR ABCDE = 12345``, ``VAR FGHIJ = VAR ABCDE``, ... (4 hops) interleaved with the
    haystack, after a short one-shot example; the answer is every variable holding the value.
``common_words``
    CWE: a numbered list where 10 words appear 30 times and the others 3 times (for inputs
    under 4096 tokens: 6 and 1), after a one-shot example; the answer is the 10 common words.
``frequent_words``
    FWE: random 6-letter coded words with Zipf frequencies (alpha 2.0, 2000-word vocabulary,
    the top rank replaced by the noise word ``"..."``); the answer is the 3 most frequent words.

Keys are ``adjective-noun`` words (as RULER's ``words`` keys), values are 7-digit numbers.
Lengths are in tokens of the model's own tokenizer: the haystack (or word list) is sized by
a bracketed binary search so that :func:`build_input_ids` gives between 98% and 100% of
the requested ``length`` (a search over the word count, like RULER's).

Needle depth (NIAH tasks): ``depths`` are fractions of the haystack's units (sentences of
the essay haystack, lines of the repeat haystack) that precede the target needle (the first
reference answer's needle); they cycle over the samples and default to
:data:`DEFAULT_DEPTHS`. Other needles of a sample go at random depths, as in RULER.

Everything random comes from ``random.Random(seed + i)`` for sample ``i`` and is drawn
before the haystack is sized, so the keys, values, words and depths of a sample do not
depend on the tokenizer; only the amount of filler does.
"""

from __future__ import annotations

import math
import numbers
import random
import string
from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import DataError
from .haystack import HAYSTACKS, Haystack, get_haystack

#: Task names, in the order the eval runner reports them.
TASKS: tuple[str, ...] = (
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "variable_tracking",
    "common_words",
    "frequent_words",
)

#: Default needle depths (fractions of the haystack before the target needle), cycled over samples.
DEFAULT_DEPTHS: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)

#: Generation budget in new tokens per task (RULER uses 128 for NIAH, 30 VT, 120 CWE, 50 FWE;
#: the NIAH budgets here are cut to what the answers need).
MAX_NEW_TOKENS: dict[str, int] = {
    "niah_single": 32,
    "niah_multikey": 32,
    "niah_multivalue": 64,
    "niah_multiquery": 64,
    "variable_tracking": 30,
    "common_words": 120,
    "frequent_words": 50,
}

_NIAH_NEEDLES = {  # task -> (number of keys in the text, values per key, keys queried)
    "niah_single": (1, 1, 1),
    "niah_multikey": (4, 1, 1),
    "niah_multivalue": (1, 4, 1),
    "niah_multiquery": (4, 1, 4),
}

NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_v} afterwards.\n{context}\n"
    "What are all the special magic {type_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
NIAH_SINGLE_TEMPLATE = (
    "A special magic {type_v} is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_v} afterwards.\n{context}\n"
    "What is the special magic {type_v} for {query} mentioned in the provided text?"
)
NIAH_SINGLE_ANSWER_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text is"

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
# "assgined" is RULER's own spelling, kept so prompts match the published ones.
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, "
    "{num_v} variables are assgined the value {query}, they are: "
)
VT_NUM_CHAINS = 1
VT_NUM_HOPS = 4

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
CWE_NUM_COMMON = 10

FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. {context}\n"
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
FWE_ALPHA = 2.0
FWE_VOCAB = 2000
FWE_WORD_LEN = 6

# Word lists for needle keys and the CWE vocabulary (RULER draws them from `wonderwords`).
_ADJECTIVES = """
able absent abundant acid adorable afraid agile alert alive amber ancient angry anxious
aromatic ashamed autumn awake bashful bitter blank bold boring brave breezy bright brisk
broad broken bumpy busy calm careful cheap cheerful chilly clean clever cloudy clumsy
coastal cold colossal cool cosmic crazy creamy crisp crooked crowded cruel curious curly
damp dark dazzling deep delicate dense dizzy dry dusty eager early earnest elastic elegant
empty endless enormous equal exotic faint fancy fast fearless fierce filthy flat fluffy
foggy fond fragile frail fresh friendly frozen funny fuzzy gentle giant gifted glad gleaming
glossy golden graceful grand greasy gritty grumpy guilty handsome happy hard harsh hasty
heavy helpful hidden hollow honest hot huge humble hungry icy idle immense jolly juicy keen
kind lazy lean light little lively lonely loud lovely lucky mad magic massive meek mellow
merry messy mighty misty modern moist muddy mute narrow nasty neat nervous nimble noisy
odd old orange pale patient plain plump polite poor proud purple quick quiet rapid rare
raspy real rich rigid ripe rough round royal rural rusty sad salty sandy scary selfish
shallow sharp shiny short shy silent silky silly simple skinny sleepy slim slow small
smooth soft solid sour spicy spiky spotted square stale steady steep sticky stormy strange
strict strong sturdy sudden sunny super sweet swift tall tame tart tender tense thick thin
thirsty tidy tiny tired tough tricky tropical ugly uneven upset urban vague vast velvet
violet vivid warm wary weak wealthy weary wet wicked wide wild windy wise witty wooden
woolly yellow young zany zealous
"""
_NOUNS = """
acorn actor airport alarm album anchor angle ankle apple apron arch arena army arrow artist
attic avenue badge bakery balloon banana bandana banjo barn barrel basket bath beach beacon
bean beard bed bee beetle bell belt bench berry bicycle bird biscuit blanket blossom boat
bolt bone book boot bottle boulder bowl box bracelet branch bread brick bridge broom bubble
bucket buffalo bulb bunny butter button cabin cactus cake camel camera canal candle canoe
canyon cape card carpet carrot castle cat cave cellar chair chalk cheese cherry chess
chimney circle city cliff clock cloud clover coat cobra coconut coffee coin comet compass
cookie copper coral cotton cousin cow crab crane crayon creek cricket crown crystal cup
curtain cushion daisy dancer desert desk diamond dinner doctor dog dolphin donkey door
dragon drawer dream drum duck eagle earth elbow elephant engine envelope eraser falcon farm
feather fence fern ferry field fig finger fire fish flag flame flute fog forest fork
fountain fox frog garden garlic gate gem ghost giraffe glacier glass glove goat gold grape
grass guitar hammer harbor harp hat hawk heart hedge helmet hen hill hippo honey hook horse
hotel house island ivory jacket jaguar jar jelly jewel judge jungle kangaroo kettle key
kitchen kite kitten knife ladder lake lamp lantern lemon leopard letter library lily lion
lizard lobster lock locket lotus magnet mango maple marble market meadow melon mirror
monkey moon moose mountain mouse muffin mushroom needle nest net notebook nut oak ocean
octopus olive onion orchard orchid otter owl oyster paddle palace panda paper parrot peach
pear pearl pebble pelican pencil pepper piano pickle pigeon pillow pilot pine planet plum
pocket pond poppy potato puppet puzzle pyramid quill rabbit raccoon radio rainbow raven
ribbon river robin rocket rose saddle sail salmon sandal saucer scarf school scissors seal
shark shell ship shoe shovel silver skate sled snail snake sock sofa spider spoon squirrel
stable star statue stone storm stove straw stream street sugar suitcase sunset swan sword
table tiger toast tomato tower tractor train tree trumpet tulip tunnel turtle umbrella
valley vase village violin volcano wagon walnut wand watch waterfall whale wheel whistle
window wizard wolf wool yacht zebra
"""
_VERBS = """
accept add admire admit advise agree allow amuse announce answer apply arrange arrive ask
attach attack attend bake balance bathe battle beg behave belong blink blush boast boil
borrow bounce breathe bruise brush bury calculate call camp carry carve chase cheer chew
clap climb collect comb command compare complain confess connect consider copy count crawl
cross cry cycle dance decide deliver depend describe design destroy develop divide double
drag dream dress drift drop dust earn educate embrace employ enjoy enter escape examine
excite exist expand explain explore fade fasten fetch file fill film fix flap float flood
flow fold follow fry gather gaze glow grab greet grin guard guess guide hammer hand hang
harm hatch heal help hike hop hover hug hum hunt hurry identify ignore imagine impress
improve include inform inject inspect invent invite itch jog join joke judge juggle jump
kick kneel knit knock label land laugh launch learn lick lift listen load march marry
measure melt mend milk mix moan move mumble nail nod note notice obey observe obtain offer
open order pack paddle paint park pause peel perform pinch plant play please plug polish
pour pray preach prefer press pretend print promise protect pull punch punish push race
rain raise reach read relax remember repair repeat reply report rescue retire return rhyme
rinse roll rub rush sail scatter scold scream search settle shave shiver shop sigh signal
sketch skip slide smash smell smile sneeze sniff snore solve spark spell spill spray
sprout squeak stamp stare steer stitch stretch strip stroll study suggest supply surprise
swim switch tackle talk taste teach tease thank tickle tie tour trace trade train travel
trust tumble twist type unite unlock unpack vanish visit wait walk wander wash watch wave
weave whisper whistle wiggle wink wish wobble wonder worry wrap yawn yell zip
"""


def _dedup(words: str) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for w in words.split():
        seen.setdefault(w, None)
    return tuple(seen)


ADJECTIVES = _dedup(_ADJECTIVES)
NOUNS = _dedup(_NOUNS)
#: CWE vocabulary (sorted, unique).
WORDS: tuple[str, ...] = tuple(sorted(set(ADJECTIVES) | set(NOUNS) | set(_dedup(_VERBS))))


@dataclass
class RulerSample:
    """One generated task instance.

    Attributes:
        task: one of :data:`TASKS`.
        prompt: the user message (context + question).
        answer_prefix: text the assistant turn starts with (RULER appends it after the prompt);
            it begins with a space, which :func:`build_input_ids` drops after a chat template.
        answers: reference strings; :func:`score` checks each is contained in the prediction.
        max_new_tokens: generation budget in tokens.
        depth: depth of the target needle as a fraction of the haystack (NIAH tasks), else None.
        length: number of tokens of :func:`build_input_ids` for this sample (the model's tokens).
        seed: the ``random.Random`` seed that generated this sample.
    """

    task: str
    prompt: str
    answer_prefix: str
    answers: list[str]
    max_new_tokens: int
    depth: float | None
    length: int
    seed: int


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise DataError(f"unknown RULER task {task!r}; allowed: {', '.join(TASKS)}")


_PROBE_TEXT = "The grass is green. The sky is blue. 1234567"


def _check_tokenizer(tokenizer) -> None:
    """A tokenizer must turn text into tokens, or no prompt can be sized (an empty vocabulary, as
    ``AutoTokenizer`` builds for a model folder without tokenizer files, encodes everything to [])."""
    try:
        ids = tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"]
    except Exception as err:  # noqa: BLE001 - any failure to encode means the same thing here
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise DataError(f"the tokenizer ({type(tokenizer).__name__}) cannot encode text ({type(err).__name__}: {first})") from err
    if not ids:
        size = len(tokenizer) if hasattr(tokenizer, "__len__") else "?"
        raise DataError(
            f"the tokenizer ({type(tokenizer).__name__}, vocabulary of {size} token(s)) encodes text to no tokens, "
            f"so no prompt can be sized to a length; its model folder probably lacks its tokenizer files"
        )


def build_input_ids(tokenizer, sample: RulerSample) -> list[int]:
    """Token ids of the full model input for ``sample``.

    With a chat template (``tokenizer.chat_template`` set): the template applied to one user
    turn holding ``sample.prompt`` with the generation prompt added, then
    ``sample.answer_prefix`` (leading whitespace removed) appended, tokenized without adding
    further special tokens. Without one: ``sample.prompt + sample.answer_prefix`` tokenized
    with the tokenizer's default special tokens (e.g. BOS).

    Args:
        tokenizer: a Hugging Face tokenizer (a fast one keeps :func:`make_samples` quick).
        sample: the sample to encode.

    Returns:
        The token ids; ``len(...)`` is the input length in tokens.
    """
    return _encode(tokenizer, sample.prompt, sample.answer_prefix)


def _encode(tokenizer, prompt: str, answer_prefix: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        text = text + answer_prefix.lstrip()
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt + answer_prefix)["input_ids"])


def score(task: str, prediction: str, answers: list[str]) -> float:
    """RULER's ``string_match_all`` score of one prediction, in [0, 1].

    The mean over the references of ``ref.lower() in prediction.lower()``
    (e.g. 2 of 4 values found gives 0.5).

    Raises:
        DataError: ``task`` is not one of :data:`TASKS`, or ``answers`` is empty.
    """
    _check_task(task)
    if not answers:
        raise DataError(f"score({task!r}, ...) needs at least one reference answer; got an empty list")
    pred = prediction.lower()
    return sum(1.0 for ref in answers if ref.lower() in pred) / len(answers)


# ---------------------------------------------------------------------------------------------
# sizing


def _fit(count: Callable[[int], int], n_min: int, n_max: int | None, length: int, what: str) -> int:
    """Largest ``n >= n_min`` (``<= n_max`` if given) with ``count(n) <= length``.

    ``count`` is assumed non-decreasing. Brackets the answer from a linear estimate, then
    bisects, so it costs about a dozen calls of ``count``.

    Raises:
        DataError: even ``count(n_min)`` exceeds ``length``.
    """
    c_min = count(n_min)
    if c_min > length:
        raise DataError(
            f"length={length} tokens is too small for {what}: the shortest input already has "
            f"{c_min} tokens; use length >= {c_min}"
        )
    cap = n_max if n_max is not None else 1 << 40
    if n_min >= cap:
        return n_min
    probe = min(cap, n_min + 64)
    c_probe = count(probe)
    if probe > n_min and c_probe <= c_min:
        # a filler that adds no tokens would send the search below towards an unbounded input
        raise DataError(
            f"cannot size {what} to {length} tokens: adding filler does not add tokens ({c_min} tokens "
            f"with {n_min} filler units, {c_probe} with {probe}); the tokenizer encodes the text to (almost) nothing"
        )
    if c_probe <= length and probe == cap:
        return cap
    per = max((c_probe - c_min) / max(1, probe - n_min), 1e-3)
    lo, hi = n_min, None  # count(lo) <= length < count(hi)
    if c_probe <= length:
        lo = probe
    else:
        hi = probe
    if hi is None:
        guess = min(cap, max(lo + 1, n_min + int((length - c_min) / per)))
        c = count(guess)
        if c <= length:
            lo = guess
            step = max(8, guess // 32)
            while hi is None:
                nxt = min(cap, lo + step)
                if nxt == lo:
                    return lo
                if count(nxt) <= length:
                    lo = nxt
                    if nxt == cap:
                        return cap
                    step *= 2
                else:
                    hi = nxt
        else:
            hi = guess
            step = max(8, guess // 32)
            while True:
                nxt = max(lo, hi - step)
                if nxt == lo or count(nxt) <= length:
                    lo = nxt
                    break
                hi = nxt
                step *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) <= length:
            lo = mid
        else:
            hi = mid
    return lo


# ---------------------------------------------------------------------------------------------
# task builders: each returns (n_min, n_max, build) where build(n) -> (prompt, answer_prefix)
# and the answers / depth, with all randomness drawn up front.


def _join_query(keys: Sequence[str]) -> str:
    return ", ".join(keys[:-1]) + ", and " + keys[-1] if len(keys) > 1 else keys[0]


def _niah(task, rng, hay: Haystack, depth: float):
    n_keys, n_values, n_query = _NIAH_NEEDLES[task]
    pairs = rng.sample(range(len(ADJECTIVES) * len(NOUNS)), n_keys)
    keys = [f"{ADJECTIVES[p // len(NOUNS)]}-{NOUNS[p % len(NOUNS)]}" for p in pairs]
    numbers = rng.sample(range(1_000_000, 10_000_000), n_keys * n_values)
    values = [[str(numbers[k * n_values + j]) for j in range(n_values)] for k in range(n_keys)]
    type_v = "numbers"
    needles = [NEEDLE.format(type_v=type_v, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    queried = list(range(n_query))  # the first n_query keys are asked for
    answers = [v for k in queried for v in values[k]]
    query = _join_query([keys[k] for k in queried])
    if n_query * n_values == 1:
        template, prefix, type_v = NIAH_SINGLE_TEMPLATE, NIAH_SINGLE_ANSWER_PREFIX, "number"
    else:
        template, prefix = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX
    # needles[0] carries answers[0]; it goes at `depth`, the others at random depths
    inserts = [(depth, needles[0])] + [(rng.random(), nd) for nd in needles[1:]]
    start = rng.randrange(len(hay.units))
    answer_prefix = prefix.format(type_v=type_v, query=query)

    def build(n: int):
        context = hay.render(hay.take(n, start), inserts)
        return template.format(type_v=type_v, context=context, query=query), answer_prefix

    return 16, None, build, answers


def _vt_chains(rng, num_chains: int, num_hops: int, name_len: int):
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < num_chains * (num_hops + 1):
        v = "".join(rng.choices(string.ascii_uppercase, k=name_len))
        if v not in seen:
            seen.add(v)
            names.append(v)
    values = rng.sample(range(10000, 100000), num_chains)
    chains, chain_vars = [], []
    for c in range(num_chains):
        vs = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        stmts = [f"VAR {vs[0]} = {values[c]}"] + [f"VAR {vs[j + 1]} = VAR {vs[j]}" for j in range(num_hops)]
        chains.append(stmts)
        chain_vars.append(vs)
    return chain_vars, chains, [str(v) for v in values]


def _vt_inserts(rng, chains):
    inserts = []
    for stmts in chains:
        fr = sorted(rng.random() for _ in stmts)
        inserts.extend(zip(fr, stmts))
    inserts.sort(key=lambda t: t[0])  # stable: a chain's statements stay in order on ties
    return inserts


def _variable_tracking(rng, hay: Haystack):
    # one-shot example as in RULER: a short noise context, 3-letter variable names
    ex_vars, ex_chains, ex_values = _vt_chains(rng, 1, VT_NUM_HOPS, 3)
    ex_hay = get_haystack("repeat")
    ex_context = ex_hay.render(ex_hay.take(5 * len(ex_hay.units[0])), _vt_inserts(rng, ex_chains))
    example = (
        VT_TEMPLATE.format(context=ex_context, query=ex_values[0])
        + VT_ANSWER_PREFIX.format(num_v=VT_NUM_HOPS + 1, query=ex_values[0])
        + " ".join(ex_vars[0])
    )
    chain_vars, chains, values = _vt_chains(rng, VT_NUM_CHAINS, VT_NUM_HOPS, 5)
    inserts = _vt_inserts(rng, chains)
    start = rng.randrange(len(hay.units))
    answers = list(chain_vars[0])
    answer_prefix = VT_ANSWER_PREFIX.format(num_v=len(answers), query=values[0])

    def build(n: int):
        context = hay.render(hay.take(n, start), inserts)
        return example + "\n\n" + VT_TEMPLATE.format(context=context, query=values[0]), answer_prefix

    return 16, None, build, answers


def _cwe_list(words: Sequence[str], n_common: int, rep_common: int, rep_uncommon: int, shuffle_seed: int) -> str:
    lst = list(words[:n_common]) * rep_common + list(words[n_common:]) * rep_uncommon
    random.Random(shuffle_seed).shuffle(lst)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst))


def _common_words(rng, length: int):
    vocab = list(WORDS)
    rng.shuffle(vocab)
    shuffle_seed = rng.randrange(1 << 30)
    nc = CWE_NUM_COMMON
    if length < 4096:  # RULER's short-input setting
        ex_words, ex_rep = vocab[:20], (3, 1)
        rep = (6, 1)
    else:
        ex_words, ex_rep = vocab[:40], (10, 3)
        rep = (30, 3)
    words = vocab[len(ex_words):]  # main list's words are disjoint from the example's
    example = (
        CWE_TEMPLATE.format(context=_cwe_list(ex_words, nc, ex_rep[0], ex_rep[1], shuffle_seed + 1))
        + CWE_ANSWER_PREFIX
        + " "
        + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_words[:nc]))
    )
    answers = list(words[:nc])

    def make_build(mult: int):
        def build(n: int):
            ctx = _cwe_list(words[:n], nc, rep[0] * mult, rep[1] * mult, shuffle_seed)
            return example + "\n" + CWE_TEMPLATE.format(context=ctx), CWE_ANSWER_PREFIX

        return build

    return nc + 1, len(words), make_build, answers


def _frequent_words(rng):
    vocab: list[str] = []
    seen: set[str] = set()
    while len(vocab) < FWE_VOCAB:
        w = "".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LEN))
        if w not in seen:
            seen.add(w)
            vocab.append(w)
    vocab[0] = "..."  # the top rank is noise, as in RULER
    shuffle_seed = rng.randrange(1 << 30)
    zeta = math.pi**2 / 6 if FWE_ALPHA == 2.0 else sum(k**-FWE_ALPHA for k in range(1, 100000))
    answers = vocab[1:4]

    def counts(n: int) -> list[int]:
        return [int(n * (k**-FWE_ALPHA) / zeta) for k in range(1, len(vocab) + 1)]

    def build(n: int):
        lst = [w for w, c in zip(vocab, counts(n)) for _ in range(c)]
        random.Random(shuffle_seed).shuffle(lst)
        return FWE_TEMPLATE.format(context=" ".join(lst)), FWE_ANSWER_PREFIX

    # smallest n whose top-3 coded words have distinct counts above the 4th's
    n_min = 1
    while True:
        c = counts(n_min)
        if c[1] > c[2] > c[3] > c[4] >= 0 and c[3] > 0:
            break
        n_min += 1
    return n_min, None, build, answers


# ---------------------------------------------------------------------------------------------


def make_samples(
    task: str,
    tokenizer,
    length: int,
    num_samples: int,
    seed: int = 0,
    depths: list[float] | None = None,
    haystack: str = "repeat",
) -> list[RulerSample]:
    """Generate ``num_samples`` instances of a RULER task at a context length in tokens.

    Sample ``i`` uses ``random.Random(seed + i)``; its keys, values, words and depths depend
    only on ``task``, ``seed + i``, the depth list and (CWE) whether ``length < 4096``, not on
    the tokenizer. The filler is then sized with the tokenizer so that
    ``len(build_input_ids(tokenizer, sample))`` is at most ``length`` and, for lengths of a
    few hundred tokens and more, at least 98% of it. Source: RULER, arXiv 2404.06654.

    Args:
        task: one of :data:`TASKS`.
        tokenizer: the model's Hugging Face tokenizer; its chat template is used if it has one.
        length: target input length in tokens (the whole templated input, answer prefix included).
        num_samples: number of samples (>= 1).
        seed: base random seed.
        depths: NIAH target-needle depths in [0, 1], fractions of the haystack before the
            needle, cycled over the samples; default :data:`DEFAULT_DEPTHS`. Ignored by the
            other tasks (their ``depth`` is None).
        haystack: ``"repeat"`` (RULER's noise) or ``"essay"`` (public-domain prose, fetched on
            first use; see :mod:`attnpatch.evals.haystack`). Used by NIAH and variable
            tracking; ignored by CWE and FWE.

    Returns:
        The samples, in order.

    Raises:
        DataError: unknown ``task`` or ``haystack``; ``num_samples < 1``; a depth outside
            [0, 1] or an empty depth list; ``length`` too small to hold the task; the essay
            text cannot be fetched; a tokenizer that encodes text to no tokens (e.g. an empty
            vocabulary).
    """
    _check_task(task)
    _check_tokenizer(tokenizer)
    if haystack not in HAYSTACKS:
        raise DataError(f"unknown haystack {haystack!r}; allowed: {', '.join(HAYSTACKS)}")
    if not isinstance(length, numbers.Integral) or length < 1:
        raise DataError(f"length must be a positive number of tokens; got {length!r}")
    if not isinstance(num_samples, numbers.Integral) or num_samples < 1:
        raise DataError(f"num_samples must be a positive integer; got {num_samples!r}")
    if depths is None:
        depths = list(DEFAULT_DEPTHS)
    length, num_samples, depths = int(length), int(num_samples), list(depths)
    if not depths:
        raise DataError("depths must hold at least one fraction in [0, 1]; got an empty list")
    for d in depths:
        if not isinstance(d, (int, float)) or not 0.0 <= float(d) <= 1.0:
            raise DataError(f"needle depth {d!r} is outside [0, 1]; depths are fractions of the haystack")

    is_niah = task.startswith("niah_")
    hay = get_haystack(haystack) if (is_niah or task == "variable_tracking") else None
    samples: list[RulerSample] = []
    for i in range(num_samples):
        s = seed + i
        rng = random.Random(s)
        depth = float(depths[i % len(depths)]) if is_niah else None
        if is_niah:
            n_min, n_max, build, answers = _niah(task, rng, hay, depth)
            builds = [build]
        elif task == "variable_tracking":
            n_min, n_max, build, answers = _variable_tracking(rng, hay)
            builds = [build]
        elif task == "common_words":
            n_min, n_max, make_build, answers = _common_words(rng, length)
            # raise the repeat counts (10:1 ratio kept) when the vocabulary cannot fill `length`
            builds = (make_build(m) for m in range(1, 1 << 20))
        else:
            n_min, n_max, build, answers = _frequent_words(rng)
            builds = [build]

        for build in builds:

            def count(n: int, build=build) -> int:
                return len(_encode(tokenizer, *build(n)))

            n = _fit(count, n_min, n_max, length, f"task {task!r}")
            if n_max is None or n < n_max or count(n_max) >= 0.98 * length:
                break
        prompt, answer_prefix = build(n)
        ids = _encode(tokenizer, prompt, answer_prefix)
        samples.append(
            RulerSample(
                task=task,
                prompt=prompt,
                answer_prefix=answer_prefix,
                answers=list(answers),
                max_new_tokens=MAX_NEW_TOKENS[task],
                depth=depth,
                length=len(ids),
                seed=s,
            )
        )
    return samples


__all__ = [
    "TASKS",
    "DEFAULT_DEPTHS",
    "MAX_NEW_TOKENS",
    "RulerSample",
    "make_samples",
    "build_input_ids",
    "score",
]
