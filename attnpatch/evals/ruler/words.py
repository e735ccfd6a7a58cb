"""Word lists of the RULER-style tasks: needle keys (``adjective-noun``) and the CWE vocabulary.

RULER draws them from the ``wonderwords`` package; these are fixed lists of common English words.
"""

from __future__ import annotations

__all__ = ["ADJECTIVES", "NOUNS", "WORDS"]

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
