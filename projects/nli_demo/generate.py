"""Generate the nli_demo data set: does a forum post show evidence of a given symptom criterion?

A binary NLI task in the spirit of the seeds' post/criterion pairs (DSM-5-style depression criteria). Each row is
(post, criterion, label): label 1 when the post contains evidence for *that* criterion. Negatives are hard on
purpose: they often show evidence of a *different* criterion, or deny this one ("I sleep fine these days").

Posts mix short and long (0-18 neutral filler sentences around the evidence), because real forum posts do,
and because that length mix is where length bucketing and dynamic padding pay off.

    python projects/nli_demo/generate.py            # rewrites data/train.csv and data/validation.csv
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

CRITERIA: dict[str, dict[str, list[str]]] = {
    "depressed_mood": {
        "criterion": ["Depressed mood: feeling sad, down or hopeless most of the day",
                      "Feeling sad, empty or hopeless nearly every day", "Persistent sad or low mood"],
        "evidence": ["I feel {intense} sad {when}", "everything feels empty and grey {when}",
                     "I cry {freq} and I don't even know why", "I feel hopeless about everything {when}",
                     "there is this heavy sadness that never lifts", "I've been {intense} down {when}",
                     "my mood is in the gutter {when}", "nothing can cheer me up anymore"],
        "denial": ["honestly my mood has been pretty good {when}", "I don't feel sad, just busy",
                   "I've been in a great mood {when}"],
    },
    "anhedonia": {
        "criterion": ["Loss of interest or pleasure in activities", "Markedly diminished interest in hobbies",
                      "No longer enjoying things they used to enjoy"],
        "evidence": ["I used to love {hobby} but now I just can't be bothered", "nothing is fun anymore",
                     "I stopped {hobby} because it feels pointless", "even {hobby} doesn't do anything for me now",
                     "I have zero interest in seeing my friends {when}", "things I enjoyed feel like chores {when}",
                     "I can't enjoy anything, not even {hobby}"],
        "denial": ["I still really enjoy {hobby}", "{hobby} is still the highlight of my week",
                   "I picked up {hobby} again and love it"],
    },
    "sleep": {
        "criterion": ["Insomnia or hypersomnia (sleeping too little or too much)", "Sleep disturbance",
                      "Trouble sleeping or sleeping too much"],
        "evidence": ["I can't fall asleep until {hour} {freq}", "I wake up at {hour} and just lie there",
                     "I've been sleeping {many} hours a day and still want more", "my sleep is a mess {when}",
                     "I lie awake most nights staring at the ceiling", "I sleep through my alarms {freq}",
                     "insomnia has been brutal {when}"],
        "denial": ["I sleep fine, about eight hours a night", "my sleep has actually been great {when}",
                   "no problems sleeping at all"],
    },
    "fatigue": {
        "criterion": ["Fatigue or loss of energy nearly every day", "Loss of energy, exhaustion",
                      "Feeling tired and drained all the time"],
        "evidence": ["I'm exhausted {freq} even after resting", "I have no energy to do anything {when}",
                     "getting out of bed feels like running a marathon", "I'm {intense} drained all the time",
                     "showering takes all the energy I have", "I feel worn out by noon {freq}"],
        "denial": ["I've had plenty of energy {when}", "I feel energetic and went for a run today",
                   "energy-wise I'm doing fine"],
    },
    "appetite": {
        "criterion": ["Significant weight loss or gain, or appetite change", "Change in appetite, eating or weight",
                      "Eating much less or much more than usual"],
        "evidence": ["I barely eat anymore and lost {many} kilos", "I've been stress eating {freq}",
                     "food tastes like nothing so I skip meals", "I gained {many} kilos {when}",
                     "I forget to eat {freq}", "my appetite is completely gone {when}"],
        "denial": ["I'm eating normally", "my appetite is the same as always",
                   "my weight hasn't changed at all"],
    },
    "worthlessness": {
        "criterion": ["Feelings of worthlessness or excessive guilt", "Excessive guilt and self-blame",
                      "Feeling worthless or like a failure"],
        "evidence": ["I feel like a burden to everyone around me", "I'm worthless and everyone would be better off",
                     "I keep blaming myself for everything {when}", "I feel {intense} guilty about things I can't change",
                     "I'm a failure at everything I try", "I hate myself {freq}"],
        "denial": ["I feel good about myself {when}", "I'm proud of what I've achieved this year",
                   "I don't blame myself for how it went"],
    },
    "concentration": {
        "criterion": ["Diminished ability to think, focus or concentrate", "Trouble concentrating or making decisions",
                      "Poor focus and concentration"],
        "evidence": ["I read the same page five times and nothing sticks", "I can't focus at work {when}",
                     "even picking what to eat feels impossible to decide", "my brain feels foggy {freq}",
                     "I lose my train of thought mid-sentence", "I can't concentrate on anything {when}"],
        "denial": ["my focus at work has been sharp {when}", "I finished a whole book in a weekend",
                   "decisions come easily to me"],
    },
    "psychomotor": {
        "criterion": ["Psychomotor agitation (restless, pacing) or slowed movement", "Restlessness or being slowed down",
                      "Moving restlessly or slowly"],
        "evidence": ["I can't sit still and keep pacing around the room", "people say I talk and move in slow motion",
                     "I'm {intense} restless, fidgeting all day", "my body feels heavy and every movement is slow",
                     "my hands won't stop shaking and tapping {when}"],
        "denial": ["I feel calm and relaxed", "I've been moving around normally",
                   "no restlessness, I can sit through a movie fine"],
    },
}

FILLER = [
    "Work has been busy with the end of the quarter.", "My sister visited last weekend with her kids.",
    "We finally fixed the leaking kitchen tap.", "The weather here has been rainy for days.",
    "I started a new job in March.", "My cat knocked a plant off the shelf again.",
    "I have a dentist appointment on Thursday.", "Traffic on the way to the office was terrible.",
    "We are planning a trip to the coast in the summer.", "My roommate is learning to play the guitar.",
    "I watched a documentary about octopuses yesterday.", "The new phone update changed all the icons.",
    "My manager asked me to lead the next project.", "I moved into a smaller apartment last year.",
    "My parents are thinking about retiring soon.", "I've been taking the bus since my car broke down.",
    "There is construction outside my window every morning.", "I signed up for an evening class in Spanish.",
    "Our team won the pub quiz last Friday.", "I need to renew my passport before the trip.",
    "The grocery store near me closed down.", "My friend just had a baby girl.",
    "I've been meaning to clean out the garage for months.", "The neighbours got a new puppy.",
    "I switched to working from home two days a week.", "My landlord finally replied about the heating.",
    "We had a family dinner for my grandmother's birthday.", "I'm thinking about changing my career path.",
    "My laptop has been really slow lately.", "I tried a new recipe with lentils and spinach.",
    "Not sure if this is the right place to post this.", "Sorry for the long post, I'm on mobile.",
    "Anyway, that's a bit of background about me.", "I'm 27 and live with my partner.",
    "I've never posted here before but I've been reading for a while.",
]
SLOTS = {
    "intense": ["really", "so", "incredibly", "pretty", "constantly", "just"],
    "when": ["lately", "for weeks now", "since the breakup", "these past months", "since winter started",
             "most days", "ever since I moved"],
    "freq": ["every night", "most days", "all the time", "almost daily", "again and again"],
    "hobby": ["painting", "gaming", "running", "playing piano", "reading", "cooking", "hiking", "football"],
    "hour": ["3am", "4am", "2am", "5 in the morning"],
    "many": ["five", "six", "eight", "ten", "twelve"],
}
OPENERS = ["", "", "Hi all. ", "Long time lurker. ", "Throwaway account. ", "Hey everyone, ", "Not sure how to say this. "]


def _fill(template: str, rng: random.Random) -> str:
    for slot, values in SLOTS.items():
        while "{" + slot + "}" in template:
            template = template.replace("{" + slot + "}", rng.choice(values), 1)
    sentence = template[0].upper() + template[1:]
    return sentence if sentence.endswith((".", "!", "?")) else sentence + rng.choice([".", ".", ".", "!", "..."])


def make_example(rng: random.Random) -> dict[str, str | int]:
    target = rng.choice(list(CRITERIA))
    label = int(rng.random() < 0.45)
    others = [c for c in CRITERIA if c != target]
    signal: list[str] = []
    if label:
        signal += [_fill(t, rng) for t in rng.sample(CRITERIA[target]["evidence"], k=rng.choice([1, 1, 2]))]
    elif rng.random() < 0.4:
        signal.append(_fill(rng.choice(CRITERIA[target]["denial"]), rng))
    # Evidence of other criteria appears in positives and negatives alike: it must not decide the label.
    for other in rng.sample(others, k=rng.choice([0, 0, 1, 1, 2])):
        signal.append(_fill(rng.choice(CRITERIA[other]["evidence"]), rng))
    if not signal:  # every post says something about the person
        signal.append(_fill(rng.choice(CRITERIA[rng.choice(others)]["denial"]), rng))
    # Long-tailed post length: most posts are short, some ramble (up to ~250 tokens).
    n_filler = min(18, int(rng.expovariate(1 / 3.5)))
    sentences = signal + rng.sample(FILLER, k=min(n_filler, len(FILLER)))
    rng.shuffle(sentences)
    post = rng.choice(OPENERS) + " ".join(sentences)
    return {"post": post, "criterion": rng.choice(CRITERIA[target]["criterion"]), "label": label}


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["post", "criterion", "label"])
        writer.writeheader()
        writer.writerows(rows)


def main(n_train: int = 800, n_validation: int = 200, seed: int = 2025) -> None:
    rng = random.Random(seed)
    data_dir = Path(__file__).parent / "data"
    write(data_dir / "train.csv", [make_example(rng) for _ in range(n_train)])
    write(data_dir / "validation.csv", [make_example(rng) for _ in range(n_validation)])


if __name__ == "__main__":
    main()
