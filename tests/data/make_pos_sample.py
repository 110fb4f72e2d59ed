#!/usr/bin/env python3
"""Make tests/data/pos_sample.conllu: a small UPOS-tagged sample for the probing tests.

Provenance: synthetic. Sentences are drawn (seed 0) from hand-written templates of Universal
Dependencies part-of-speech sequences and word lists written for this test. Several words appear with
more than one tag ("run", "book", "light", "watch", "play", "saw", "fast", "that", "back", "round"),
so the tag depends on context, not only on the word. Only the ID, FORM and UPOS columns are filled.

    python tests/data/make_pos_sample.py > tests/data/pos_sample.conllu
"""

import random

WORDS = {
    "DET": ["the", "a", "this", "that", "every", "some", "each", "no"],
    "NOUN": ["dog", "teacher", "city", "book", "run", "light", "watch", "play", "river", "bank", "child",
             "letter", "garden", "window", "engine", "song", "idea", "market", "doctor", "table", "cat",
             "village", "friend", "mountain", "computer", "student", "bridge", "kitchen", "painter",
             "island", "farmer", "train", "bottle", "forest", "school", "horse", "apple", "pencil",
             "soldier", "lawyer", "island", "ocean", "museum", "camera", "ticket", "jacket", "tower",
             "bicycle", "queen", "baker", "castle", "violin", "carpet", "lantern", "harbor", "meadow",
             "nurse", "pilot", "wallet", "ladder", "mirror", "blanket", "pocket", "basket", "candle",
             "desert", "valley", "factory", "library", "prison", "temple", "theater", "airport",
             "station", "hospital", "journal", "magazine", "novel", "poem", "picture", "statue",
             "engineer", "dancer", "singer", "tailor", "merchant", "captain", "neighbor", "stranger"],
    "VERB": ["saw", "likes", "reads", "book", "run", "watch", "play", "opened", "found", "carried",
             "painted", "wrote", "cleaned", "sold", "built", "bought", "visited", "followed", "helped",
             "pushed", "lifted", "dropped", "moved", "called", "kicked", "ignored", "borrowed",
             "repaired", "chased", "admired", "measured", "delivered", "described", "guarded", "hid",
             "washed", "signed", "ordered", "packed", "tested", "noticed", "praised", "rescued", "trusted",
             "watched", "joined", "entered", "answered", "copied", "greeted", "warned", "touched"],
    "ADJ": ["old", "red", "quiet", "fast", "light", "happy", "small", "round", "bright", "heavy", "green",
            "tall", "narrow", "famous", "strange", "gentle", "dusty", "wooden", "silver", "empty",
            "broken", "ancient", "clever", "lazy", "noisy", "tiny", "huge", "cold", "warm", "soft",
            "brave", "polite", "rusty", "shiny", "hungry", "modern", "simple", "crowded", "distant"],
    "ADV": ["quickly", "often", "fast", "back", "very", "never", "slowly", "soon", "rarely", "quietly",
            "carefully", "badly", "gladly", "twice", "early", "later"],
    "ADP": ["in", "near", "under", "with", "behind", "round", "across", "above", "beside", "without"],
    "PRON": ["she", "they", "we", "he", "it", "you", "someone", "everyone"],
    "PROPN": ["Paris", "Maria", "Google", "Tokyo", "John", "Lisbon", "Ahmed", "Oslo", "Priya", "Chen",
              "Nairobi", "Elena", "Boston", "Kenji"],
    "AUX": ["will", "can", "should", "must", "may", "might"],
    "CCONJ": ["and", "but", "or"],
    "NUM": ["two", "three", "seven", "ten", "four", "twelve", "five"],
    "PUNCT": [".", "!"],
}
TEMPLATES = [
    "DET NOUN VERB DET ADJ NOUN PUNCT",
    "PRON AUX VERB DET NOUN ADP DET NOUN PUNCT",
    "PROPN VERB NUM ADJ NOUN ADV PUNCT",
    "DET ADJ NOUN VERB ADV ADP PROPN PUNCT",
    "PRON VERB DET NOUN CCONJ PRON VERB DET NOUN PUNCT",
    "PRON AUX ADV VERB DET NOUN PUNCT",
    "DET NOUN ADP DET NOUN VERB DET ADJ NOUN PUNCT",
]


def main(n=260, seed=0):
    rng = random.Random(seed)
    for s in range(1, n + 1):
        tags = rng.choice(TEMPLATES).split()
        words = [rng.choice(WORDS[t]) for t in tags]
        words[0] = words[0][0].upper() + words[0][1:]
        print(f"# sent_id = {s}")
        print(f"# text = {' '.join(words[:-1])}{words[-1]}")
        for i, (w, t) in enumerate(zip(words, tags), start=1):
            print(f"{i}\t{w}\t_\t{t}\t_\t_\t_\t_\t_\t_")
        print()


if __name__ == "__main__":
    main()
