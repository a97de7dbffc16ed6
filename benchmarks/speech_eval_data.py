"""The sentences of the speech evaluation set and of the disjoint training split, and how they are spoken.

``build_speech_eval.py`` turns these into audio with espeak-ng and sox. Nothing here is random at
build time: the training split's extra sentences come from a seeded generator, so two builds give
the same texts (and, with the same espeak-ng, the same audio).
"""

from __future__ import annotations

import random

# (espeak-ng voice, words per minute). "+f3"/"+m3" are espeak-ng voice variants.
VOICES = {
    "en": [("en-us", 150), ("en-gb", 170), ("en-us+f3", 140), ("en-gb-x-rp+m3", 160)],
    "de": [("de", 150), ("de+f2", 165)],
    "fr": [("fr-fr", 150), ("fr-fr+f3", 165)],
}

EVAL_SENTENCES = {
    "en": [
        "The quick brown fox jumps over the lazy dog near the river bank.",
        "Please remember to bring your umbrella, because the forecast says it will rain all afternoon.",
        "The library opens at nine in the morning and closes at six in the evening on weekdays.",
        "She walked to the station, bought a ticket to the coast, and waited for the last train of the day.",
        "Scientists have found that regular exercise improves both memory and sleep in older adults.",
        "Our meeting has been moved to Thursday, so please update your calendar and tell the rest of the team.",
        "The old lighthouse stood on the cliff for more than a hundred years before it was finally restored.",
        "If you want to learn a new language, practise a little every day instead of a lot once a week.",
        "The chef added a pinch of salt, stirred the soup slowly, and let it simmer for twenty minutes.",
        "Most of the passengers fell asleep as the plane flew through the night across the ocean.",
        "A small village in the mountains became famous for its cheese and its wooden toys.",
        "The children built a sandcastle with towers, walls and a deep moat filled with sea water.",
        "Before you leave the house, check that the windows are closed and the lights are switched off.",
        "The committee will publish its final report next month, after reviewing all of the evidence.",
        "He fixed the bicycle with a spanner, a bit of wire and a great deal of patience.",
        "Heavy snow closed the main road, so the delivery trucks had to wait until the next morning.",
        "The museum has a new exhibition about the history of printing and the first newspapers.",
        "When the music started, everyone in the room stood up and began to dance.",
        "Good software is written for people to read, and only incidentally for machines to run.",
        "The farmer planted potatoes in the spring and harvested them at the end of the summer.",
        "Astronomers observed a distant galaxy whose light left it billions of years ago.",
        "Could you tell me the way to the nearest post office, please?",
        "The river flooded the fields after a week of storms, and the village had to be evacuated.",
        "Thank you all for coming tonight; dinner will be served in the garden at eight o'clock.",
    ],
    "de": [
        "Der Zug nach München fährt heute eine halbe Stunde später ab.",
        "Im Sommer wandern wir gerne durch die Wälder und über die Berge.",
        "Bitte schließen Sie die Tür, wenn Sie den Raum verlassen.",
        "Meine Schwester arbeitet seit drei Jahren in einem kleinen Krankenhaus am Stadtrand.",
        "Das Wetter war schlecht, deshalb sind wir den ganzen Tag zu Hause geblieben.",
        "Die Kinder spielen im Garten, während die Eltern das Abendessen vorbereiten.",
        "Wir haben im Urlaub viele alte Kirchen und schöne Museen besucht.",
        "Der Bäcker an der Ecke verkauft jeden Morgen frisches Brot und Brötchen.",
    ],
    "fr": [
        "Le train pour Paris partira avec vingt minutes de retard ce matin.",
        "Nous aimons nous promener au bord de la mer pendant les longues vacances d'été.",
        "Pourriez-vous fermer la fenêtre, s'il vous plaît ? Il fait un peu froid.",
        "Ma grand-mère prépare une excellente soupe de légumes tous les dimanches.",
        "Les enfants jouent dans le parc pendant que leurs parents discutent sur un banc.",
        "Le musée de la ville présente une nouvelle exposition sur la peinture moderne.",
        "Il a plu toute la journée, alors nous sommes restés à la maison.",
        "La boulangerie du quartier ouvre très tôt le matin et ferme à midi.",
    ],
}

# Long-form utterances (over 30 s): these eval sentences joined, in this order.
EVAL_LONG = {
    "en": [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))],
    "de": [list(range(0, 8))],
    "fr": [list(range(0, 8))],
}

TRAIN_SENTENCES = {
    "en": [
        "The bakery on the corner sells fresh bread every morning before sunrise.",
        "We spent the whole weekend painting the kitchen a pale shade of green.",
        "The teacher asked the students to write a short story about their summer holidays.",
        "A strong wind blew the leaves across the garden and into the neighbour's pond.",
        "The doctor recommended drinking more water and taking a walk after every meal.",
        "My brother collects old coins from countries that no longer exist.",
        "The ferry crosses the bay every hour, even when the sea is rough.",
        "After the concert, the musicians signed autographs for their fans.",
        "The engineers tested the bridge with heavy trucks before it was opened to traffic.",
        "Turn left at the traffic lights and the hotel will be on your right.",
        "Our cat sleeps on the windowsill all day and hunts moths at night.",
        "The report shows that sales increased slightly during the second quarter.",
        "It took the climbers three days to reach the summit of the mountain.",
        "Please send me the documents by email before the end of the week.",
        "The garden was full of roses, tulips and tall yellow sunflowers.",
        "A group of volunteers cleaned the beach and collected several bags of plastic.",
    ],
    "de": [
        "Am Wochenende fahren wir mit dem Fahrrad an den See.",
        "Der Arzt hat mir geraten, mehr Wasser zu trinken.",
        "Unsere Nachbarn haben einen großen Hund und zwei kleine Katzen.",
        "Kannst du mir bitte sagen, wie spät es ist und wann der nächste Bus kommt?",
        "Die Bibliothek ist am Montag wegen Renovierung geschlossen.",
        "Nach dem Essen haben wir noch lange auf der Terrasse gesessen.",
    ],
    "fr": [
        "Le week-end prochain, nous irons rendre visite à nos cousins à Lyon.",
        "Le médecin m'a conseillé de marcher une demi-heure par jour.",
        "Nos voisins ont un grand jardin avec des pommiers et des cerisiers.",
        "Peux-tu me dire à quelle heure commence le film ce soir au cinéma du centre ?",
        "La bibliothèque municipale sera fermée lundi prochain pour des travaux importants.",
        "Après le dîner, nous avons joué aux cartes jusqu'à minuit.",
    ],
}

# Seeded templates for more English training text (disjoint from the eval set by construction:
# build_speech_eval.py checks that no training text equals or contains an eval sentence).
_SUBJECTS = ["The old sailor", "My neighbour", "A young student", "The shopkeeper", "Our guide", "The pilot",
             "A tired nurse", "The gardener", "My grandfather", "The new manager", "A curious child", "The driver"]
_VERBS = ["carried", "painted", "repaired", "found", "described", "photographed", "ordered", "cleaned",
          "borrowed", "delivered", "measured", "forgot"]
_OBJECTS = ["a heavy wooden box", "the broken fence", "an old map of the city", "three blue chairs",
            "a basket of apples", "the letters from the office", "a small silver key", "the red umbrella",
            "a long piece of rope", "the kitchen table", "two tickets for the theatre", "a jar of honey"]
_PLACES = ["near the harbour", "behind the station", "in the market square", "at the top of the hill",
           "beside the school", "under the old bridge", "in the back of the van", "outside the town hall"]
_TIMES = ["early in the morning", "late last night", "on a rainy Tuesday", "just before lunch",
          "after the storm", "during the festival", "at the end of the day", "in the middle of winter"]


def generated_train_sentences(count: int, seed: int = 14) -> list[str]:
    """``count`` distinct English training sentences from the templates above, the same every time."""
    rng = random.Random(seed)
    seen, out = set(), []
    while len(out) < count:
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)} {rng.choice(_TIMES)}."
        if sentence not in seen:
            seen.add(sentence)
            out.append(sentence)
    return out


def utterances(split: str, generated: int = 200) -> list[dict]:
    """The utterances of ``split`` ("eval" or "train"): id, language, voice, speed and text.

    Eval: every sentence once, voices and speeds taken in turn, plus the long-form joins. Train:
    every training sentence in two voices, plus ``generated`` template sentences in one voice each.
    """
    rows = []
    if split == "eval":
        for language, sentences in EVAL_SENTENCES.items():
            voices = VOICES[language]
            for index, text in enumerate(sentences):
                voice, speed = voices[index % len(voices)]
                rows.append(dict(id=f"eval-{language}-{index:02d}", language=language, voice=voice, speed=speed, text=text))
            for index, members in enumerate(EVAL_LONG[language]):
                voice, speed = voices[index % len(voices)]
                text = " ".join(sentences[i] for i in members)
                rows.append(dict(id=f"eval-{language}-long{index}", language=language, voice=voice, speed=speed, text=text))
    elif split == "train":
        for language, sentences in TRAIN_SENTENCES.items():
            voices = VOICES[language]
            for index, text in enumerate(sentences):
                for turn in range(2):
                    voice, speed = voices[(index + turn) % len(voices)]
                    rows.append(dict(id=f"train-{language}-{index:02d}-{turn}", language=language, voice=voice, speed=speed, text=text))
        for index, text in enumerate(generated_train_sentences(generated)):
            voice, speed = VOICES["en"][index % len(VOICES["en"])]
            rows.append(dict(id=f"train-en-gen{index:04d}", language="en", voice=voice, speed=speed, text=text))
    else:
        raise ValueError(f"split must be 'eval' or 'train', not {split!r}")
    return rows


def check_disjoint() -> None:
    """No training text equals or contains an eval sentence (and no eval sentence contains a training one)."""
    eval_texts = [s.lower() for sentences in EVAL_SENTENCES.values() for s in sentences]
    train_texts = [row["text"].lower() for row in utterances("train")]
    for train in train_texts:
        for text in eval_texts:
            if text in train or train in text:
                raise AssertionError(f"training text {train!r} overlaps eval sentence {text!r}")
