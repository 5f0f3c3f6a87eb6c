"""The recipe's proof data (issue 48, item 3): records and texts that no search, default or recipe was chosen on.

Writes two private tables into OUT, each as a user would bring them:
  * ``unseen.csv``: Diabetes 130-US records of another hospital (the structured generator's ``unseen`` population:
    the base model tilted by a tilt no other population uses, and patient ids no other population draws;
    :mod:`raydp.data.structured`). KL(unseen || public) is about 23 nats per record, against 4.4 for the benchmark's
    private records: the public population the recipe was searched on is no proxy for it.
  * ``letters.csv``: free-text physiotherapy progress letters (another kind of text than the clinical notes the tests
    use, and than the verbalised records the embedded model was pre-trained on), one to four per patient, in columns
    ``letter`` (the text) and ``patient`` (a string id, the privacy unit). A patient's letters share their injury,
    side, therapist and goal, and their pain scores fall over the sessions, so a model has structure to learn.
  * ``unseen-holdout.csv``: 1,000 more encounters of the same hospital (the ``unseen`` population drawn at seed + 1:
    the same parameters, other patients), the held-out records arm (d) of the campaign tunes on without noise, given
    to its search as ``public_validation`` (raydp refuses the file if it shares a patient with the private table).
  * ``letters-holdout.csv``: letters of 300 other patients (ids beginning ``H``), the held-out texts for arm (d).
All are deterministic in ``--seed``. They are synthetic and describe no real patient.

Run: python experiments/recipe-proof/make_data.py OUT [--records 5000] [--patients 1500] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

#: injury -> (body region, exercises); a letter names the patient's injury, its region and two of its exercises
INJURIES = {
    "anterior cruciate ligament repair": ("knee", ("quadriceps sets", "straight leg raises", "mini squats",
                                                   "stationary cycling", "step-ups")),
    "rotator cuff tear": ("shoulder", ("pendulum swings", "wall slides", "external rotation with band",
                                       "scapular squeezes", "doorway stretch")),
    "lumbar disc herniation": ("lower back", ("pelvic tilts", "bird dogs", "prone press-ups", "bridges",
                                              "walking programme")),
    "ankle sprain": ("ankle", ("alphabet tracing", "calf raises", "single-leg balance", "band eversion",
                               "heel walks")),
    "total hip replacement": ("hip", ("heel slides", "glute sets", "sit-to-stand", "side-lying abduction",
                                      "gait training")),
    "tennis elbow": ("elbow", ("wrist extensor stretch", "eccentric wrist curls", "grip squeezes",
                               "forearm rotation with hammer", "ice massage")),
}
THERAPISTS = ("Okafor", "Lindqvist", "Marchetti", "Haddad", "Nakamura", "Brennan", "Duarte", "Kowalczyk")
GOALS = ("return to running", "climb stairs without a rail", "lift a child safely", "return to office work",
         "play tennis again", "walk to the shops", "sleep through the night", "garden without pain")
ADHERENCE = ("has done the home programme daily", "has done the home programme most days",
             "has found the home programme hard to keep up", "missed a week of exercises")


def letters(n_patients: int, seed: int) -> pd.DataFrame:
    """One to four progress letters per patient, in a shuffled order."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x4C455454]))  # "LETT"
    injuries = list(INJURIES)
    rows = []
    for k in range(n_patients):
        patient = f"PT-{rng.integers(100_000, 999_999)}-{k:05d}"
        injury = injuries[rng.integers(len(injuries))]
        region, exercises = INJURIES[injury]
        side = ("left", "right")[rng.integers(2)] if region not in ("lower back",) else "central"
        therapist, goal = THERAPISTS[rng.integers(len(THERAPISTS))], GOALS[rng.integers(len(GOALS))]
        pain = int(rng.integers(5, 10))
        for session in range(1, 2 + int(rng.integers(0, 4))):
            pain = max(0, pain - int(rng.integers(0, 3)))
            pair = rng.choice(len(exercises), size=2, replace=False)
            rows.append({"patient": patient, "letter": (
                f"Session {session} with {therapist} for {side} {region} pain after {injury}. "
                f"Pain today {pain} out of 10. The patient {ADHERENCE[rng.integers(len(ADHERENCE))]}. "
                f"We worked on {exercises[pair[0]]} and {exercises[pair[1]]}. Goal: {goal}.")})
    order = rng.permutation(len(rows))
    return pd.DataFrame([rows[i] for i in order], columns=["letter", "patient"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--records", type=int, default=5000, help="encounters in unseen.csv")
    parser.add_argument("--holdout", type=int, default=1000, help="encounters in unseen-holdout.csv")
    parser.add_argument("--patients", type=int, default=1500, help="patients in letters.csv")
    parser.add_argument("--holdout-patients", type=int, default=300, help="patients in letters-holdout.csv")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from raydp.data.synthetic import generate_records

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = generate_records(args.records, args.seed, population="unseen", progress=False)
    records.to_csv(out / "unseen.csv", index=False)
    # the same hospital's other patients: drawn at seed + 1, their ids moved past the private table's (two draws of
    # a population number their patients from the same base)
    holdout = generate_records(args.holdout, args.seed + 1, population="unseen", progress=False)
    holdout["patient_nbr"] += int(records["patient_nbr"].max())
    holdout["encounter_id"] += int(records["encounter_id"].max())
    holdout.to_csv(out / "unseen-holdout.csv", index=False)
    private_letters = letters(args.patients, args.seed)
    private_letters.to_csv(out / "letters.csv", index=False)
    # other patients' letters (drawn at seed + 1, ids marked H); a letter that happens to repeat a private one word
    # for word is dropped, as raydp refuses public records that hold a private text
    held = letters(args.holdout_patients, args.seed + 1)
    held["patient"] = "H" + held["patient"]
    held = held[~held["letter"].isin(set(private_letters["letter"]))]
    held.to_csv(out / "letters-holdout.csv", index=False)
    print(f"wrote {out / 'unseen.csv'} ({args.records} encounters), {out / 'unseen-holdout.csv'} ({args.holdout}), "
          f"{out / 'letters.csv'} ({args.patients} patients) and {out / 'letters-holdout.csv'} "
          f"({args.holdout_patients} patients)")


if __name__ == "__main__":
    main()
