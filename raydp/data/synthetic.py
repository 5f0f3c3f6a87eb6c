"""Seeded synthetic records in the exact schema of ``diabetic_data.csv`` (RLDP Sec. 2.1).

SYNTHETIC RECORDS DESCRIBE NO REAL PATIENT. Two generators sit behind :func:`generate_records`:
``'structured'`` (the default, :mod:`raydp.data.structured`: latent condition and severity per patient, fields
that depend on each other, exact log-probabilities) and ``'independent'`` (this module's, kept as a named
option: the benchmark before the structured records existed). The rest of this docstring describes the
independent generator.

Independent generator: every value is drawn independently per record from
marginals that roughly follow the published UCI table (Caucasian ~75%, Female ~54%, ages 50-90,
readmitted NO/>30/<30 = 54/35/11%, ...) plus two structural rules of the real data:
``diabetesMed == 'Yes'`` iff some medication is not ``'No'``, and ``change == 'Ch'`` whenever some
medication is ``'Up'``/``'Down'`` (and, as in the real table, sometimes when a drug is only
started).

Two populations use disjoint seed streams and disjoint id ranges: ``'private'`` (the records that
are split into train/eval/attack) and ``'public'`` (the public corpus, Sec. 2.2 pre-training). The
public population also has flatter categorical marginals (:data:`PUBLIC_TILT`): a public proxy that
covers the same vocabulary without the private frequencies. A third stream, ``'audit'``, draws the
records that carry audit canaries (:mod:`raydp.data.splits`) from the private marginals.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from raydp.errors import DataError
from raydp.data import schema
from raydp.data.streams import _ID_BASES  # the populations' seed-stream tags and id ranges
from raydp.data.structured import generate

# The public population is a proxy, not a copy, of the private one: every categorical marginal is
# raised to this power and renormalised (flatter). A model pre-trained on it knows the narratives'
# vocabulary but not the private frequencies, so private fine-tuning has something to learn.
PUBLIC_TILT = 0.5

# Marginal counts of the real table (approximate, rounded), value -> weight.
_RACE = {"Caucasian": 76099, "AfricanAmerican": 19210, "?": 2273, "Hispanic": 2037,
         "Other": 1506, "Asian": 641}
_GENDER = {"Female": 54708, "Male": 47055, "Unknown/Invalid": 3}
_AGE = dict(zip(schema.AGES, (161, 691, 1657, 3775, 9685, 17256, 22483, 26068, 17197, 2793)))
_WEIGHT = {"?": 98569, "[75-100)": 1336, "[50-75)": 897, "[100-125)": 625, "[125-150)": 145,
           "[25-50)": 97, "[0-25)": 48, "[150-175)": 35, "[175-200)": 11, ">200": 3}
_ADMISSION_TYPE = {1: 53990, 3: 18869, 2: 18480, 6: 5291, 5: 4785, 8: 320, 7: 21, 4: 10}
_DISCHARGE = {1: 60234, 3: 13954, 6: 12902, 18: 3691, 2: 2128, 22: 1993, 11: 1642, 5: 1184,
              25: 989, 4: 815, 7: 623, 23: 412, 13: 399, 14: 372, 28: 139, 8: 108, 15: 63,
              24: 48, 9: 21, 17: 14, 16: 11, 19: 8, 10: 6, 27: 5, 12: 3, 20: 2}
_ADMISSION_SOURCE = {7: 57494, 1: 29565, 17: 6781, 4: 3187, 6: 2264, 2: 1104, 5: 855, 3: 187,
                     20: 161, 9: 125, 8: 16, 22: 12, 10: 8, 11: 2, 14: 2, 25: 2, 13: 1}
_TIME_IN_HOSPITAL = dict(zip(range(1, 15), (14208, 17224, 17756, 13924, 9966, 7539, 5859, 4391,
                                            3002, 2342, 1855, 1448, 1210, 1042)))
_PAYER = {"?": 40256, "MC": 32439, "HM": 6274, "SP": 5007, "BC": 4655, "MD": 3532, "CP": 2533,
          "UN": 2448, "CM": 1937, "OG": 1033, "PO": 592, "DM": 549, "CH": 146, "WC": 135,
          "OT": 95, "MP": 79, "SI": 55, "FR": 1}
_SPECIALTY = {"?": 49949, "InternalMedicine": 14635, "Emergency/Trauma": 7565,
              "Family/GeneralPractice": 7440, "Cardiology": 5352, "Surgery-General": 3099,
              "Nephrology": 1613, "Orthopedics": 1400, "Orthopedics-Reconstructive": 1233,
              "Radiologist": 1140, "Pulmonology": 871, "Psychiatry": 854, "Urology": 685,
              "ObstetricsandGynecology": 671, "Surgery-Cardiovascular/Thoracic": 652,
              "Gastroenterology": 564, "Surgery-Vascular": 533, "Surgery-Neuro": 468,
              "PhysicalMedicineandRehabilitation": 391, "Oncology": 348, "Pediatrics": 254,
              "Hematology/Oncology": 207, "Neurology": 203, "Pediatrics-Endocrinology": 159,
              "Otolaryngology": 125, "Endocrinology": 120, "Surgery-Thoracic": 109,
              "Psychology": 101, "Podiatry": 100, "Surgery-Cardiovascular": 98,
              "Pediatrics-CriticalCare": 87, "Hematology": 82, "Gynecology": 58,
              "Hospitalist": 57, "Radiology": 53}
_NUM_PROCEDURES = {0: 46652, 1: 20742, 2: 12717, 3: 9443, 4: 4180, 5: 3078, 6: 4954}
_OUTPATIENT = {0: 85027, 1: 8547, 2: 3594, 3: 2042, 4: 1099, 5: 533, 6: 303, 7: 155, 8: 98,
               9: 83, 10: 57, 11: 42, 12: 30, 13: 31, 14: 28, 15: 20, 20: 7, 42: 1}
_EMERGENCY = {0: 90383, 1: 7677, 2: 2042, 3: 725, 4: 374, 5: 192, 6: 94, 7: 73, 8: 50, 9: 33,
              10: 34, 11: 23, 12: 10, 13: 12, 16: 5, 20: 4, 76: 1}
_INPATIENT = {0: 67630, 1: 19521, 2: 7566, 3: 3411, 4: 1622, 5: 812, 6: 480, 7: 268, 8: 151,
              9: 111, 10: 61, 11: 49, 12: 34, 13: 20, 14: 10, 15: 9, 16: 6, 19: 2, 21: 1}
_NUMBER_DIAGNOSES = {9: 49474, 5: 11393, 8: 10616, 7: 10393, 6: 10161, 4: 5537, 3: 2835,
                     2: 1023, 1: 219, 16: 45, 10: 17, 13: 16, 11: 11, 15: 10, 12: 9, 14: 7}
_MAX_GLU = {"None": 96420, "Norm": 2597, ">200": 1485, ">300": 1264}
_A1C = {"None": 84748, ">8": 8216, "Norm": 4990, ">7": 3812}
_READMITTED = {"NO": 54864, ">30": 35545, "<30": 11357}
# Medication -> counts of (No, Steady, Up, Down).
_MEDS = {
    "metformin": (81778, 18346, 1067, 575),
    "repaglinide": (100227, 1384, 110, 45),
    "nateglinide": (101063, 668, 24, 11),
    "chlorpropamide": (101680, 79, 6, 1),
    "glimepiride": (96575, 4670, 327, 194),
    "acetohexamide": (101765, 1, 0, 0),
    "glipizide": (89080, 11356, 770, 560),
    "glyburide": (91116, 9274, 812, 564),
    "tolbutamide": (101743, 23, 0, 0),
    "pioglitazone": (94438, 6976, 234, 118),
    "rosiglitazone": (95401, 6100, 178, 87),
    "acarbose": (101458, 295, 10, 3),
    "miglitol": (101728, 31, 2, 5),
    "troglitazone": (101763, 3, 0, 0),
    "tolazamide": (101727, 38, 1, 0),
    "examide": (101766, 0, 0, 0),
    "citoglipton": (101766, 0, 0, 0),
    "insulin": (47383, 30849, 11316, 12218),
    "glyburide-metformin": (101060, 692, 8, 6),
    "glipizide-metformin": (101753, 13, 0, 0),
    "glimepiride-pioglitazone": (101765, 1, 0, 0),
    "metformin-rosiglitazone": (101764, 2, 0, 0),
    "metformin-pioglitazone": (101765, 1, 0, 0),
}
assert tuple(_MEDS) == schema.MEDICATIONS
# P(change='Ch' | a drug prescribed but none moved Up/Down), chosen so that P(Ch) ~ 46% overall.
_P_CHANGE_WITHOUT_DOSE_MOVE = 0.38

_DIAG_TOP = {
    "diag_1": {"428": 6862, "414": 6581, "786": 4016, "410": 3614, "486": 3508, "427": 2766,
               "491": 2275, "715": 2151, "682": 2042, "434": 2028, "780": 2019, "996": 1967,
               "276": 1966, "250.8": 1680, "599": 1595, "584": 1520, "V57": 1207,
               "250.6": 1183, "38": 1149, "820": 1082, "435": 1063, "562": 1028,
               "250.83": 400, "250.02": 600, "250.13": 500, "8": 300, "E909": 5, "?": 21},
    "diag_2": {"276": 6752, "428": 6662, "250": 6071, "427": 5036, "401": 3736, "496": 3305,
               "599": 3288, "403": 2823, "414": 2650, "411": 2566, "250.02": 2074, "707": 1999,
               "585": 1871, "584": 1649, "491": 1545, "250.01": 1523, "285": 1520,
               "780": 1491, "425": 1434, "682": 1433, "486": 1379, "518": 1355, "V45": 600,
               "E885": 150, "?": 358},
    "diag_3": {"250": 11555, "401": 8289, "276": 5175, "428": 4577, "427": 3955, "414": 3664,
               "496": 2605, "403": 2357, "585": 1992, "272": 1969, "599": 1941, "V45": 1389,
               "250.02": 1300, "707": 1360, "780": 1334, "285": 1200, "425": 1100,
               "E849": 600, "?": 1423},
}
_DIAG_TAIL_SHARE = 0.35  # share of codes drawn from the long tail of rare codes


def _categorical(rng: np.random.Generator, n: int, counts: dict, tilt: float = 1.0) -> np.ndarray:
    values = np.array(list(counts.keys()), dtype=object)
    p = np.array(list(counts.values()), dtype=float) ** tilt
    return values[rng.choice(len(values), size=n, p=p / p.sum())]


def _int_categorical(rng: np.random.Generator, n: int, counts: dict, tilt: float = 1.0) -> np.ndarray:
    return _categorical(rng, n, counts, tilt).astype(np.int64)


def _diag(rng: np.random.Generator, n: int, column: str, tilt: float = 1.0) -> np.ndarray:
    out = _categorical(rng, n, _DIAG_TOP[column], tilt)
    tail = rng.random(n) < _DIAG_TAIL_SHARE
    k = int(tail.sum())
    if k == 0:
        return out
    kind = rng.random(k)
    number = rng.integers(1, 1000, size=k)
    v_code = rng.integers(1, 87, size=k)
    e_code = rng.integers(800, 1000, size=k)
    codes = np.array(
        [str(a) if u < 0.88 else (f"V{b:02d}" if u < 0.96 else f"E{c}")
         for u, a, b, c in zip(kind.tolist(), number.tolist(), v_code.tolist(), e_code.tolist())],
        dtype=object,
    )
    out[tail] = codes
    return out


GENERATORS = ("structured", "independent")
DEFAULT_GENERATOR = "structured"


def generate_records(
    n: int, seed: int = 0, *, population: str = "private", progress: bool = True,
    generator: str = DEFAULT_GENERATOR,
) -> pd.DataFrame:
    """``n`` synthetic encounters (rows in :data:`schema.COLUMNS` order), deterministic per seed.

    ``population`` is ``'private'``, ``'public'``, ``'audit'``, ``'pretraining'`` or ``'unseen'`` (disjoint seed
    streams and id ranges; audit records follow the private parameters; the independent generator has one public
    population, which ``'pretraining'`` then draws from too, and no ``'unseen'`` one). ``generator``: ``'structured'`` (default) or
    ``'independent'`` (module docstring). Integer columns are ``int64``; all other columns hold the CSV's strings.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise DataError(f"synthetic record count must be an integer >= 1, got {n!r}")
    if population not in _ID_BASES:
        raise DataError(f"population must be one of {', '.join(_ID_BASES)}, got {population!r}")
    if generator not in GENERATORS:
        raise DataError(f"generator must be one of {', '.join(GENERATORS)}, got {generator!r}")
    if population == "unseen" and generator != "structured":
        raise DataError("the unseen population is the structured generator's (generator='structured')")
    n = int(n)
    stream, encounter_base, patient_base = _ID_BASES[population]
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), stream]))
    if generator == "structured":
        return generate(n, rng, "private" if population in ("audit", "canary") else population, encounter_base,
                        patient_base)
    tilt = PUBLIC_TILT if population in ("public", "pretraining") else 1.0  # one public population before
    cols: dict[str, np.ndarray] = {}
    bar = tqdm(total=len(schema.COLUMNS), desc=f"generating {n} {population} records",
               unit="col", disable=None if progress else True, leave=False)

    def put(name: str, values: np.ndarray) -> None:
        cols[name] = values
        bar.update(1)

    # Increasing unique ids, like the real file; ~1.4 encounters per patient.
    put("encounter_id", encounter_base + np.cumsum(rng.integers(1, 200, size=n)))
    n_patients = max(1, int(np.ceil(n / 1.42)))
    patients = patient_base + np.cumsum(rng.integers(1, 50, size=n_patients))
    put("patient_nbr", patients[rng.integers(0, n_patients, size=n)])
    put("race", _categorical(rng, n, _RACE, tilt))
    put("gender", _categorical(rng, n, _GENDER, tilt))
    put("age", _categorical(rng, n, _AGE, tilt))
    put("weight", _categorical(rng, n, _WEIGHT, tilt))
    put("admission_type_id", _int_categorical(rng, n, _ADMISSION_TYPE, tilt))
    put("discharge_disposition_id", _int_categorical(rng, n, _DISCHARGE, tilt))
    put("admission_source_id", _int_categorical(rng, n, _ADMISSION_SOURCE, tilt))
    put("time_in_hospital", _int_categorical(rng, n, _TIME_IN_HOSPITAL, tilt))
    put("payer_code", _categorical(rng, n, _PAYER, tilt))
    put("medical_specialty", _categorical(rng, n, _SPECIALTY, tilt))
    labs = np.rint(rng.normal(43.1, 19.7, size=n))
    labs[rng.random(n) < 0.03] = 1  # the real table has a spike at a single lab procedure
    put("num_lab_procedures", np.clip(labs, 1, 132).astype(np.int64))
    put("num_procedures", _int_categorical(rng, n, _NUM_PROCEDURES, tilt))
    meds_n = np.rint(rng.gamma(shape=3.9, scale=4.1, size=n))
    put("num_medications", np.clip(meds_n, 1, 81).astype(np.int64))
    put("number_outpatient", _int_categorical(rng, n, _OUTPATIENT, tilt))
    put("number_emergency", _int_categorical(rng, n, _EMERGENCY, tilt))
    put("number_inpatient", _int_categorical(rng, n, _INPATIENT, tilt))
    for d in ("diag_1", "diag_2", "diag_3"):
        put(d, _diag(rng, n, d, tilt))
    put("number_diagnoses", _int_categorical(rng, n, _NUMBER_DIAGNOSES, tilt))
    put("max_glu_serum", _categorical(rng, n, _MAX_GLU, tilt))
    put("A1Cresult", _categorical(rng, n, _A1C, tilt))
    any_prescribed = np.zeros(n, dtype=bool)
    any_moved = np.zeros(n, dtype=bool)
    for med, counts in _MEDS.items():
        values = _categorical(rng, n, dict(zip(schema.MEDICATION_STATES, counts)), tilt)
        any_prescribed |= values != "No"
        any_moved |= (values == "Up") | (values == "Down")
        put(med, values)
    started = any_prescribed & (rng.random(n) < _P_CHANGE_WITHOUT_DOSE_MOVE)
    put("change", np.where(any_moved | started, "Ch", "No").astype(object))
    put("diabetesMed", np.where(any_prescribed, "Yes", "No").astype(object))
    put("readmitted", _categorical(rng, n, _READMITTED, tilt))
    bar.close()
    return pd.DataFrame({c: cols[c] for c in schema.COLUMNS})
