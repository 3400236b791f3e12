"""A deterministic English-like corpus, generated in code, to train the default checkpoint's tokenizer.

No download: sentences are drawn from a seeded RNG over an embedded word list, plus made-up words
built from syllables (so byte-level BPE has enough distinct words to learn thousands of merges),
numbers, punctuation, and a little accented and non-Latin text. The same seed gives the same text.
"""

from __future__ import annotations

import random

WORDS = """
the of and to a in is it you that he was for on are with as his they be at one have this from or had by
word but what some we can out other were all there when up use your how said an each she which do their
time if will way about many then them write would like so these her long make thing see him two has look
more day could go come did number sound no most people my over know water than call first who may down
side been now find any new work part take get place made live where after back little only round man year
came show every good me give our under name very through just form sentence great think say help low line
differ turn cause much mean before move right boy old too same tell does set three want air well also play
small end put home read hand port large spell add even land here must big high such follow act why ask men
change went light kind off need house picture try us again animal point mother world near build self earth
father head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw far sea
draw left late run while press close night real life few north open seem together next white children begin
got walk example ease paper group always music those both mark often letter until mile river car feet care
second book carry took science eat room friend began idea fish mountain stop once base hear horse cut sure
watch color face wood main enough plain girl usual young ready above ever red list though feel talk bird
soon body dog family direct pose leave song measure door product black short numeral class wind question
happen complete ship area half rock order fire south problem piece told knew pass since top whole king space
heard best hour better true during hundred five remember step early hold west ground interest reach fast
verb sing listen six table travel less morning ten simple several vowel toward war lay against pattern slow
center love person money serve appear road map rain rule govern pull cold notice voice unit power town fine
certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct able pound done
beauty drive stood contain front teach week final gave green oh quick develop ocean warm free minute strong
special mind behind clear tail produce fact street inch multiply nothing course stay wheel full force blue
object decide surface deep moon island foot system busy test record boat common gold possible plane stead
dry wonder laugh thousand ago ran check game shape equate hot miss brought heat snow tire bring yes distant
fill east paint language among grand ball yet wave drop heart am present heavy dance engine position arm
wide sail material size vary settle speak weight general ice matter circle pair include divide syllable felt
perhaps pick sudden count square reason length represent art subject region energy hunt probable bed brother
egg ride cell believe fraction forest sit race window store summer train sleep prove lone leg exercise wall
catch mount wish sky board joy winter sat written wild instrument kept glass grass cow job edge sign visit
past soft fun bright gas weather month million bear finish happy hope flower clothe strange gone jump baby
eight village meet root buy raise solve metal whether push seven paragraph third shall held hair describe cook
floor either result burn hill safe cat century consider type law bit coast copy phrase silent tall sand soil
roll temperature finger industry value fight lie beat excite natural view sense ear else quite broke case
middle kill son lake moment scale loud spring observe child straight consonant nation dictionary milk speed
method organ pay age section dress cloud surprise quiet stone tiny climb cool design poor lot experiment
""".split()
EXTRA = "café naïve résumé über straße señor façade déjà vu 日本語 東京 こんにちは 你好 世界 привет мир 🙂 🚀 €".split()
NAMES = "Alice Bob Carol Dave Eve Frank Grace Heidi Ivan Judy Mallory Oscar Peggy Trent Victor Walter".split()
_ONSETS = "b c d f g h j k l m n p r s t v w z br cl dr fl gr pl st tr sh ch th".split()
_VOWELS = "a e i o u ai ea ie oo ou".split()
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck"]


def made_up_words(rng: random.Random, count: int) -> list[str]:
    """`count` distinct pronounceable non-words of 1 to 4 syllables."""
    words: set[str] = set()
    out: list[str] = []
    while len(out) < count:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                       for _ in range(rng.randint(1, 4)))
        if word not in words:
            words.add(word)
            out.append(word)
    return out


def sentence(rng: random.Random, vocab: list[str]) -> str:
    """One sentence: capitalized, 4 to 16 words, sometimes a comma, a number, a name or a quote."""
    words = []
    for _ in range(rng.randint(4, 16)):
        roll = rng.random()
        if roll < 0.03:
            words.append(str(rng.randint(0, 10_000)))
        elif roll < 0.06:
            words.append(rng.choice(NAMES))
        elif roll < 0.075:
            words.append(rng.choice(EXTRA))
        else:
            words.append(rng.choice(vocab))
        if rng.random() < 0.06:
            words[-1] += ","
    words[0] = words[0][:1].upper() + words[0][1:]
    text = " ".join(words) + rng.choice([".", ".", ".", "?", "!", ";", ":"])
    if rng.random() < 0.05:
        text = '"' + text + '"'
    return text


def generate(seed: int, num_lines: int = 20_000, made_up: int = 6_000) -> list[str]:
    """`num_lines` lines of 1 to 4 sentences each; the common words dominate, as in real English."""
    rng = random.Random(seed)
    invented = made_up_words(rng, made_up)
    # NOTE: real words are listed several times so they are frequent and get whole-word tokens first.
    vocab = WORDS * 8 + invented
    return [" ".join(sentence(rng, vocab) for _ in range(rng.randint(1, 4))) for _ in range(num_lines)]
