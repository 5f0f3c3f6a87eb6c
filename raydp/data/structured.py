"""The structured synthetic population: records whose fields depend on each other as clinical records do.

SYNTHETIC RECORDS DESCRIBE NO REAL PATIENT. The generative model (a Bayesian network with two latent variables
per patient) is known exactly, so every record's log-probability is computed exactly (:meth:`Population.log_prob`)
and the entropy per record, the mutual information between fields and the divergence between populations are
measured, not guessed (:func:`population_report`).

The model. Each patient has a latent **condition** c (9 groups of the primary diagnosis, after the ICD-9 grouping
Strack et al. 2014 used on this very table: circulatory, respiratory, digestive, diabetes, injury,
musculoskeletal, genitourinary, neoplasms, other) and a latent **severity** s (mild, moderate, severe). Given
them, and each field given the fields drawn before it::

    c ~ prior;  s | c
    race;  gender | c;  age | c;  weight                         (patient-level: the same on every encounter)
    admission_type | s;  admission_source | admission_type;  discharge_disposition | s, age
    time_in_hospital | c, s;  payer_code | age;  medical_specialty | c
    num_lab_procedures | s (binned normal, a spike at 1);  num_procedures | c;  num_medications | s
    number_outpatient | s;  number_emergency | s;  number_inpatient | s
    diag_1 | c;  diag_2 | c;  diag_3 | c  (the condition's own codes and comorbidities);  number_diagnoses | s
    max_glu_serum | c;  A1Cresult | c, s;  each of the 23 medications | c, A1Cresult
    change, diabetesMed | the medications (the real table's rules);  readmitted | s, number_inpatient

A patient's encounters share the latent condition, severity and demographics, so they resemble each other.
Every table is built from a base (roughly the real table's marginals, with the dependencies above) and then
shifted per population by seeded log-normal tilts of each row (:data:`POPULATION_SHIFTS`). Four populations,
the same structure with other parameters and other people, as four sources of records would be:

* ``private``: the hospital whose records are split into train/eval/attack/validation (and the audit canaries);
* ``public``: a related public release (an earlier period of similar hospitals, as the UCI table itself is for
  a hospital fine-tuning on its current records): the private parameters tilted once more, mildly. Public
  validation, the public probe, public episodes (policy pre-training, baseline tuning) and DualTune's public
  phase 1 use it: it points the same way as the private task;
* ``pretraining``: the generic corpus a base model is pre-trained on (the embedded model's tokenizer and
  pre-training): the base tilted independently and as strongly as the private population, far from it;
* ``unseen``: another hospital, for proofs on data that no search or default was ever chosen on (the recipe's,
  ``experiments/recipe-proof/``): the base tilted independently again, as strongly, by a tilt no other population
  uses. Nothing in raydp reads it by default; ``generate_records(population="unseen")`` draws it.

What only the private records teach a model pre-trained on the ``pretraining`` population is
KL(private || pretraining) per record; :func:`population_report` measures it, the entropy per record and the
mutual information between fields. The ids are drawn as in :mod:`raydp.data.synthetic`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd
from scipy.special import logsumexp
from scipy.stats import norm

from raydp.data import schema
from raydp.data.streams import _ID_BASES

CONDITIONS = ("circulatory", "respiratory", "digestive", "diabetes", "injury", "musculoskeletal",
              "genitourinary", "neoplasms", "other")
SEVERITIES = ("mild", "moderate", "severe")
C, S = len(CONDITIONS), len(SEVERITIES)

#: each population's tilts, applied in turn to the base: (seed of the log-normal factors, their scale, the
#: condition prior's scale)
POPULATION_SHIFTS = {"private": ((101, 1.25, 0.8),),
                     "public": ((101, 1.25, 0.8), (303, 0.75, 0.5)),
                     "pretraining": ((202, 1.25, 0.8),),
                     "unseen": ((404, 1.25, 0.8),)}

_RACE = {"Caucasian": 0.748, "AfricanAmerican": 0.189, "?": 0.022, "Hispanic": 0.020, "Other": 0.015,
         "Asian": 0.006}
_WEIGHT = {"?": 0.968, "[75-100)": 0.013, "[50-75)": 0.009, "[100-125)": 0.006, "[125-150)": 0.002,
           "[25-50)": 0.001, "[0-25)": 0.0005, "[150-175)": 0.0003, "[175-200)": 0.0001, ">200": 0.00005}
_CONDITION_PRIOR = (0.30, 0.14, 0.09, 0.09, 0.07, 0.05, 0.05, 0.03, 0.18)
_SEVERITY = {  # P(s | c)
    "circulatory": (0.35, 0.45, 0.20), "respiratory": (0.40, 0.40, 0.20), "digestive": (0.50, 0.35, 0.15),
    "diabetes": (0.45, 0.40, 0.15), "injury": (0.40, 0.40, 0.20), "musculoskeletal": (0.60, 0.30, 0.10),
    "genitourinary": (0.50, 0.35, 0.15), "neoplasms": (0.25, 0.45, 0.30), "other": (0.55, 0.35, 0.10)}
_MEAN_AGE_BRACKET = (6.8, 6.6, 6.2, 5.4, 6.6, 6.3, 6.6, 6.2, 5.8)  # per condition, in brackets of 10 years
_P_FEMALE = (0.49, 0.55, 0.55, 0.50, 0.60, 0.62, 0.58, 0.50, 0.54)
_ADMISSION_TYPES = (1, 2, 3, 5, 6, 8)
_ADMISSION_TYPE = ((0.40, 0.17, 0.30, 0.05, 0.07, 0.01), (0.55, 0.19, 0.16, 0.05, 0.04, 0.01),
                   (0.70, 0.18, 0.04, 0.04, 0.03, 0.01))
_ADMISSION_SOURCES = (1, 2, 4, 6, 7, 17)
_ADMISSION_SOURCE = {1: (0.06, 0.01, 0.02, 0.02, 0.85, 0.04), 2: (0.35, 0.03, 0.04, 0.03, 0.50, 0.05),
                     3: (0.80, 0.05, 0.08, 0.04, 0.02, 0.01), 5: (0.30, 0.02, 0.05, 0.05, 0.28, 0.30),
                     6: (0.30, 0.02, 0.05, 0.05, 0.30, 0.28), 8: (0.30, 0.05, 0.05, 0.05, 0.35, 0.20)}
_DISCHARGES = (1, 2, 3, 6, 11, 18, 22, 25)
_DISCHARGE = ((0.78, 0.02, 0.05, 0.09, 0.005, 0.04, 0.005, 0.01), (0.60, 0.02, 0.13, 0.15, 0.015, 0.04, 0.03, 0.01),
              (0.38, 0.03, 0.22, 0.17, 0.06, 0.05, 0.07, 0.02))
_PAYERS = ("?", "MC", "HM", "SP", "BC", "MD", "CP", "UN", "CM", "OG")
_PAYER_YOUNG = (0.42, 0.05, 0.09, 0.08, 0.09, 0.10, 0.04, 0.05, 0.04, 0.04)
_PAYER_OLD = (0.37, 0.46, 0.05, 0.03, 0.02, 0.01, 0.02, 0.02, 0.01, 0.01)
_SPECIALTIES = ("?", "InternalMedicine", "Emergency/Trauma", "Family/GeneralPractice", "Cardiology",
                "Surgery-General", "Nephrology", "Orthopedics", "Pulmonology", "Gastroenterology",
                "Urology", "Oncology", "Surgery-Cardiovascular/Thoracic", "Endocrinology", "Psychiatry")
_SPECIALTY_FOCUS = {"circulatory": ("Cardiology", "Surgery-Cardiovascular/Thoracic"),
                    "respiratory": ("Pulmonology",), "digestive": ("Gastroenterology", "Surgery-General"),
                    "diabetes": ("Endocrinology",), "injury": ("Orthopedics", "Surgery-General"),
                    "musculoskeletal": ("Orthopedics",), "genitourinary": ("Nephrology", "Urology"),
                    "neoplasms": ("Oncology",), "other": ("Psychiatry",)}
_MEDS = dict(zip(schema.MEDICATIONS, (  # P(prescribed), base, for the 23 medications
    0.19, 0.015, 0.007, 0.001, 0.05, 0.00002, 0.12, 0.10, 0.0002, 0.07, 0.06, 0.003, 0.0004, 0.00003, 0.0004,
    0.0, 0.0, 0.53, 0.007, 0.0001, 0.00002, 0.00002, 0.00002)))
_DIABETES_MEDS = ("metformin", "glipizide", "glyburide", "glimepiride", "pioglitazone", "rosiglitazone",
                  "repaglinide", "insulin")
P_CHANGE_WITHOUT_DOSE_MOVE = 0.38  # the real table's rule, as in raydp.data.synthetic
_CODES = {
    "circulatory": ("428", "414", "410", "427", "434", "435", "402", "404", "401", "440", "433", "424", "785",
                    "459", "453", "415", "416", "425", "426", "411"),
    "respiratory": ("486", "491", "496", "518", "493", "466", "786", "492", "511", "514", "481", "482", "487"),
    "digestive": ("562", "577", "578", "574", "560", "558", "535", "787", "530", "569", "550", "571"),
    "diabetes": ("250.8", "250.6", "250.13", "250.02", "250.83", "250.11", "250.12", "250.4", "250.7", "250.82",
                 "250.03", "250.01", "250.1", "250.22", "250.81", "250.41"),
    "injury": ("820", "996", "998", "812", "824", "813", "808", "850", "805", "959", "997", "965", "969", "958"),
    "musculoskeletal": ("715", "722", "721", "724", "733", "730", "711", "728", "719", "718", "710"),
    "genitourinary": ("599", "584", "590", "595", "592", "593", "620", "618", "788", "591"),
    "neoplasms": ("153", "162", "174", "185", "197", "198", "188", "154", "157", "189", "202", "204", "205"),
    "other": ("780", "276", "682", "38", "8", "300", "296", "V57", "707", "303", "292", "295"),
}
_COMORBIDITIES = ("250", "250.01", "250.02", "401", "276", "428", "427", "414", "403", "585", "272", "599", "496",
                  "285", "707", "780", "V45", "425", "518", "411", "E885", "E849", "305", "?")
_COMORBID_FOCUS = {"circulatory": ("428", "427", "414", "401", "403", "425", "411"),
                   "respiratory": ("496", "518", "428", "305"), "digestive": ("276", "285", "780"),
                   "diabetes": ("250", "250.01", "250.02", "401", "272", "403", "585", "707"),
                   "injury": ("E885", "E849", "285", "780", "V45"), "musculoskeletal": ("401", "272", "V45"),
                   "genitourinary": ("599", "585", "403", "276"), "neoplasms": ("285", "276", "780"),
                   "other": ("276", "780", "305", "250")}


@dataclass(frozen=True)
class Field:
    """One column: its support, its parents (latents ``'c'``/``'s'`` or earlier columns) and its table of
    shape (*parent cardinalities, len(values)); every row sums to 1."""

    name: str
    values: tuple
    parents: tuple[str, ...]
    table: np.ndarray


def _normal_bins(support: np.ndarray, mean: float, sd: float) -> np.ndarray:
    """A normal binned to integers, the tails folded onto the ends of ``support``."""
    edges = np.concatenate([[-np.inf], support[:-1] + 0.5, [np.inf]])
    p = np.diff(norm.cdf((edges - mean) / sd))
    return p / p.sum()


def _geometric(n: int, mean: float) -> np.ndarray:
    """A geometric pmf over 0..n-1 with the given mean (truncated and renormalised)."""
    r = mean / (1.0 + mean)
    p = r ** np.arange(n)
    return p / p.sum()


def _row(values: tuple, weights: dict | None = None, base: float = 0.0, focus=(), boost: float = 0.0) -> np.ndarray:
    """A distribution over ``values``: ``weights`` (else ``base``), plus ``boost`` spread over ``focus`` with
    Zipf weights (the first of ``focus`` the most common, as the real table's top codes are)."""
    w = np.array([(weights or {}).get(v, base) for v in values], dtype=float)
    rank = {v: i for i, v in enumerate(focus)}
    zipf = np.array([1.0 / (rank[v] + 1) ** 0.8 if v in rank else 0.0 for v in values])
    if zipf.sum() > 0:
        w = w + boost * len(focus) * zipf / zipf.sum()
    return w / w.sum()


def _base_fields() -> list[Field]:
    """The base tables (before a population's shift), in sampling order."""
    ages = schema.AGES
    fields = [Field("race", tuple(_RACE), (), _row(tuple(_RACE), _RACE))]
    fields.append(Field("gender", ("Female", "Male"), ("c",),
                        np.array([[f, 1 - f] for f in _P_FEMALE])))
    age_table = np.array([_normal_bins(np.arange(len(ages), dtype=float), m, 1.3) for m in _MEAN_AGE_BRACKET])
    fields.append(Field("age", ages, ("c",), age_table))
    fields.append(Field("weight", tuple(_WEIGHT), (), _row(tuple(_WEIGHT), _WEIGHT)))
    fields.append(Field("admission_type_id", _ADMISSION_TYPES, ("s",), np.array(_ADMISSION_TYPE)))
    old = np.array([1.0 if i >= 7 else 0.0 for i in range(len(ages))])  # 70+: more transfers, Medicare
    discharge = np.stack([np.stack([np.array(row) * (1 + 0.6 * o * np.array([0, 0, 1, 1, 0, 0, 1, 0])) for o in old])
                          for row in _DISCHARGE])
    fields.append(Field("discharge_disposition_id", _DISCHARGES, ("s", "age"),
                        discharge / discharge.sum(-1, keepdims=True)))
    fields.append(Field("admission_source_id", _ADMISSION_SOURCES, ("admission_type_id",),
                        np.array([_ADMISSION_SOURCE[t] for t in _ADMISSION_TYPES])))
    days = np.arange(1, 15, dtype=float)
    stay = np.array([[_normal_bins(days, 2.3 + 1.6 * s + (0.8 if cond in ("neoplasms", "injury") else 0.0),
                                   1.4 + 0.8 * s) for s in range(S)] for cond in CONDITIONS])
    fields.append(Field("time_in_hospital", tuple(range(1, 15)), ("c", "s"), stay))
    payer = np.array([np.array(_PAYER_OLD) if i >= 6 else np.array(_PAYER_YOUNG) for i in range(len(ages))])
    fields.append(Field("payer_code", _PAYERS, ("age",), payer / payer.sum(-1, keepdims=True)))
    spec = {"?": 0.45, "InternalMedicine": 0.17, "Emergency/Trauma": 0.08, "Family/GeneralPractice": 0.08}
    fields.append(Field("medical_specialty", _SPECIALTIES, ("c",),
                        np.array([_row(_SPECIALTIES, spec, 0.004, _SPECIALTY_FOCUS[c], 0.14) for c in CONDITIONS])))
    labs = np.arange(1, 133, dtype=float)
    lab_table = np.array([0.97 * _normal_bins(labs, 34 + 9 * s, 17) for s in range(S)])
    lab_table[:, 0] += 0.03  # the real table's spike at one lab procedure
    fields.append(Field("num_lab_procedures", tuple(range(1, 133)), ("s",), lab_table))
    surgical = {"circulatory": 2.0, "injury": 2.4, "musculoskeletal": 2.6, "digestive": 1.4, "neoplasms": 1.6}
    fields.append(Field("num_procedures", tuple(range(7)), ("c",),
                        np.array([_geometric(7, surgical.get(c, 0.7)) for c in CONDITIONS])))
    meds_n = np.arange(1, 82, dtype=float)
    fields.append(Field("num_medications", tuple(range(1, 82)), ("s",),
                        np.array([_normal_bins(meds_n, 11 + 6 * s, 6 + 2 * s) for s in range(S)])))
    for name, means in (("number_outpatient", (0.2, 0.4, 0.8)), ("number_emergency", (0.1, 0.2, 0.6)),
                        ("number_inpatient", (0.3, 0.7, 1.6))):
        fields.append(Field(name, tuple(range(16)), ("s",), np.array([_geometric(16, m) for m in means])))
    all_codes = tuple(dict.fromkeys([code for codes in _CODES.values() for code in codes] + list(_COMORBIDITIES)))
    primary = np.array([_row(all_codes, None, 0.0005, _CODES[c], 0.05) for c in CONDITIONS])
    fields.append(Field("diag_1", all_codes, ("c",), primary))
    for name, own in (("diag_2", 0.012), ("diag_3", 0.008)):
        table = np.array([_row(all_codes, None, 0.0008, _CODES[c], own) + _row(all_codes, None, 0.0, _COMORBIDITIES, 0.02)
                          + _row(all_codes, None, 0.0, _COMORBID_FOCUS[c], 0.06) for c in CONDITIONS])
        fields.append(Field(name, all_codes, ("c",), table / table.sum(-1, keepdims=True)))
    ndiag = np.arange(1, 17, dtype=float)
    fields.append(Field("number_diagnoses", tuple(range(1, 17)), ("s",),
                        np.array([_normal_bins(ndiag, 5.5 + 1.6 * s, 1.8) for s in range(S)])))
    glu = ("None", "Norm", ">200", ">300")
    fields.append(Field("max_glu_serum", glu, ("c",),
                        np.array([(0.80, 0.06, 0.08, 0.06) if c == "diabetes" else (0.96, 0.02, 0.01, 0.01)
                                  for c in CONDITIONS])))
    a1c = ("None", "Norm", ">7", ">8")
    a1c_table = np.array([[(0.45, 0.08, 0.15, 0.32) if c == "diabetes" else (0.86 - 0.03 * s, 0.05, 0.04, 0.05 + 0.03 * s)
                           for s in range(S)] for c in CONDITIONS])
    fields.append(Field("A1Cresult", a1c, ("c", "s"), a1c_table / a1c_table.sum(-1, keepdims=True)))
    states = schema.MEDICATION_STATES  # No, Steady, Up, Down
    for med, p in _MEDS.items():
        rows = []
        for c in CONDITIONS:
            per_a1c = []
            for a in a1c:
                q = p * (1.6 if c == "diabetes" and med in _DIABETES_MEDS else 1.0) * (1.3 if a in (">7", ">8") else 1.0)
                q = min(q, 0.95)
                moved = 0.08 + (0.25 if a == ">8" and med in _DIABETES_MEDS else 0.0)
                per_a1c.append((1 - q, q * (1 - moved), q * moved * 0.5, q * moved * 0.5))
            rows.append(per_a1c)
        table = np.array(rows) + 1e-9
        fields.append(Field(med, tuple(states), ("c", "A1Cresult"), table / table.sum(-1, keepdims=True)))
    readmitted = ("NO", ">30", "<30")
    inpatient = np.minimum(np.arange(16), 3)
    table = np.array([[(0.62 - 0.08 * s - 0.06 * i, 0.30 + 0.04 * s + 0.03 * i, 0.08 + 0.04 * s + 0.03 * i)
                       for i in inpatient] for s in range(S)])
    fields.append(Field("readmitted", readmitted, ("s", "number_inpatient"), table / table.sum(-1, keepdims=True)))
    return fields


def _tilt(table: np.ndarray, rng: np.random.Generator, scale: float) -> np.ndarray:
    """Each row times exp(scale * N(0, 1)) per entry, renormalised: another population's parameters. Entries are
    floored at 1e-12 first, so every value keeps a (tiny) probability and every log-probability is finite."""
    out = (table + 1e-12) * np.exp(scale * rng.standard_normal(table.shape))
    return out / out.sum(-1, keepdims=True)


class Population:
    """The generative model with one population's parameters: sampling and exact log-probabilities."""

    def __init__(self, name: str):
        if name not in POPULATION_SHIFTS:
            raise ValueError(f"unknown population {name!r}")
        self.name = name
        prior_c = np.array(_CONDITION_PRIOR)[None]
        prior_s = np.array([_SEVERITY[c] for c in CONDITIONS])
        tables = [f.table for f in _base_fields()]
        for seed, scale, prior_scale in POPULATION_SHIFTS[name]:
            rng = np.random.default_rng(seed)
            prior_c = _tilt(prior_c, rng, prior_scale)
            prior_s = _tilt(prior_s, rng, scale * 0.5)
            tables = [_tilt(t, rng, scale) for t in tables]
        self.prior_c, self.prior_s = prior_c[0], prior_s
        self.fields = [Field(f.name, f.values, f.parents, t) for f, t in zip(_base_fields(), tables)]
        self.index = {f.name: {v: i for i, v in enumerate(f.values)} for f in self.fields}
        self.by_name = {f.name: f for f in self.fields}

    # -- sampling ------------------------------------------------------------------------------
    def sample(self, n_patients: int, visits: np.ndarray, rng: np.random.Generator) -> tuple[dict, np.ndarray]:
        """Column values (support indices) of ``visits.sum()`` encounters of ``n_patients`` patients (patient k has
        ``visits[k]`` encounters); also returns each encounter's patient index."""
        patient = np.repeat(np.arange(n_patients), visits)
        n = len(patient)
        c = rng.choice(C, size=n_patients, p=self.prior_c)
        u = rng.random(n_patients)
        s = (u[:, None] > np.cumsum(self.prior_s[c], axis=1)).sum(1)
        latent = {"c": c[patient], "s": s[patient]}
        out: dict[str, np.ndarray] = {}
        patient_level = {"race", "gender", "age", "weight"}
        for f in self.fields:
            rows = self._rows(f, latent, out)
            cum = np.cumsum(f.table.reshape(-1, len(f.values)), axis=1)
            if f.name in patient_level:  # drawn once per patient, the same on every encounter
                first = np.searchsorted(patient, np.arange(n_patients))
                draw = rng.random(n_patients)[patient]
                rows = rows[first][patient]
            else:
                draw = rng.random(n)
            out[f.name] = np.minimum((draw[:, None] > cum[rows]).sum(1), len(f.values) - 1)
        return out, patient

    def _rows(self, f: Field, latent: dict, values: dict) -> np.ndarray:
        """The flat parent-configuration index of every encounter for field ``f``."""
        shape = f.table.shape[:-1]
        idx = np.zeros(len(next(iter(latent.values()))), dtype=np.int64)
        for parent, size in zip(f.parents, shape):
            idx = idx * size + (latent[parent] if parent in latent else values[parent])
        return idx

    def decode(self, sampled: dict) -> dict[str, np.ndarray]:
        """Support indices -> the CSV's values, with change and diabetesMed derived (needs uniform draws: see
        :meth:`derive`)."""
        return {name: np.asarray(self.by_name[name].values, dtype=object)[idx] for name, idx in sampled.items()}

    # -- exact log-probabilities -----------------------------------------------------------------
    def log_prob(self, frame: pd.DataFrame) -> np.ndarray:
        """log p(record) of every row: the latent condition and severity summed out exactly; the derived fields
        (change, diabetesMed) included; ids excluded (they are not part of a narrative)."""
        n = len(frame)
        idx = {}
        for f in self.fields:
            lookup = self.index[f.name]
            col = frame[f.name].tolist()
            idx[f.name] = np.array([lookup.get(_norm(v), -1) for v in col], dtype=np.int64)
        latent_lp = np.log(self.prior_c)[:, None] + np.log(self.prior_s)  # (C, S)
        total = np.broadcast_to(latent_lp, (n, C, S)).copy()
        grid_c, grid_s = np.meshgrid(np.arange(C), np.arange(S), indexing="ij")
        for f in self.fields:
            x = idx[f.name]
            logt = np.log(f.table)
            if (x < 0).any():
                total[x < 0] = -np.inf
            xs = np.maximum(x, 0)
            if "c" not in f.parents and "s" not in f.parents:
                rows = self._rows(f, {"_": np.zeros(n, dtype=np.int64)}, {p: idx[p] for p in f.parents})
                total += logt.reshape(-1, len(f.values))[rows, xs][:, None, None]
                continue
            for ci in range(C):
                for si in range(S):
                    lat = {"c": np.full(n, ci), "s": np.full(n, si)}
                    rows = self._rows(f, lat, {p: idx[p] for p in f.parents if p not in ("c", "s")})
                    total[:, ci, si] += logt.reshape(-1, len(f.values))[rows, xs]
        lp = logsumexp(total.reshape(n, -1), axis=1)
        return lp + _derived_log_prob(frame)


def _norm(v):
    """A CSV value as the support holds it (ints as ints, everything else as its string)."""
    if isinstance(v, (np.integer, int)) and not isinstance(v, bool):
        return int(v)
    return v


def derive_change(values: dict[str, np.ndarray], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """change and diabetesMed from the medications: 'Ch' when a dose moved, else with probability
    :data:`P_CHANGE_WITHOUT_DOSE_MOVE` when a drug is prescribed; 'Yes' when any drug is prescribed."""
    meds = np.stack([values[m] for m in schema.MEDICATIONS])
    prescribed = (meds != "No").any(0)
    moved = ((meds == "Up") | (meds == "Down")).any(0)
    started = prescribed & ~moved & (rng.random(meds.shape[1]) < P_CHANGE_WITHOUT_DOSE_MOVE)
    change = np.where(moved | started, "Ch", "No").astype(object)
    return change, np.where(prescribed, "Yes", "No").astype(object)


def _derived_log_prob(frame: pd.DataFrame) -> np.ndarray:
    """log P(change, diabetesMed | medications): exact under :func:`derive_change`'s rules."""
    meds = np.stack([frame[m].astype(str).to_numpy() for m in schema.MEDICATIONS])
    prescribed = (meds != "No").any(0)
    moved = ((meds == "Up") | (meds == "Down")).any(0)
    change = frame["change"].astype(str).to_numpy() == "Ch"
    p_ch = np.where(moved, 1.0, np.where(prescribed, P_CHANGE_WITHOUT_DOSE_MOVE, 0.0))
    p = np.where(change, p_ch, 1 - p_ch)
    ok = (frame["diabetesMed"].astype(str).to_numpy() == "Yes") == prescribed
    with np.errstate(divide="ignore"):
        return np.where(ok, np.log(p), -np.inf)


@lru_cache(maxsize=4)
def population(name: str) -> Population:
    """The population's model (built once per process)."""
    return Population(name)


def generate(n: int, rng: np.random.Generator, name: str, encounter_base: int, patient_base: int) -> pd.DataFrame:
    """``n`` encounters of population ``name`` in :data:`schema.COLUMNS` order (ids as in
    :mod:`raydp.data.synthetic`: increasing encounter ids, about 1.42 encounters per patient)."""
    model = population(name)
    visits = 1 + rng.poisson(0.42, size=max(1, int(np.ceil(n / 1.42))))
    while visits.sum() < n:
        visits = np.concatenate([visits, 1 + rng.poisson(0.42, size=max(1, n - int(visits.sum())))])
    cut = np.searchsorted(np.cumsum(visits), n)  # the first patients whose encounters make n
    visits = visits[:cut + 1].copy()
    visits[-1] -= int(visits.sum()) - n
    n_patients = len(visits)
    sampled, patient = model.sample(n_patients, visits, rng)
    values = model.decode(sampled)
    values["change"], values["diabetesMed"] = derive_change(values, rng)
    order = rng.permutation(n)  # a patient's encounters spread through the file, as in the real table
    patient_ids = patient_base + np.cumsum(rng.integers(1, 50, size=n_patients))
    cols = {"encounter_id": encounter_base + np.cumsum(rng.integers(1, 200, size=n)),
            "patient_nbr": patient_ids[patient][order]}
    for name_ in schema.COLUMNS[2:]:
        col = values[name_][order]
        cols[name_] = col.astype(np.int64) if name_ in schema.INT_COLUMNS else col
    return pd.DataFrame({c: cols[c] for c in schema.COLUMNS})


def _clustered_ci(values: np.ndarray, patients: np.ndarray) -> tuple[float, float]:
    """Mean and 95% half-width, the standard error clustered by patient (a patient's encounters are dependent)."""
    frame = pd.DataFrame({"v": values, "p": patients})
    sums = frame.groupby("p")["v"].agg(["sum", "count"])
    mean = float(values.mean())
    resid = sums["sum"] - mean * sums["count"]
    se = float(np.sqrt((resid ** 2).sum()) / len(values))
    return mean, 1.96 * se


def _latent_only(model: Population) -> list[Field]:
    """The fields whose parents are latents only (or none): their marginals and pairwise joints are exact sums."""
    return [f for f in model.fields if set(f.parents) <= {"c", "s"}]


def _given_latents(model: Population, f: Field) -> np.ndarray:
    """P(field | c, s) as an array of shape (C, S, |values|)."""
    table = f.table
    if f.parents == ():
        return np.broadcast_to(table, (C, S, len(f.values)))
    if f.parents == ("c",):
        return np.broadcast_to(table[:, None, :], (C, S, len(f.values)))
    if f.parents == ("s",):
        return np.broadcast_to(table[None, :, :], (C, S, len(f.values)))
    return table  # ("c", "s")


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def population_report(n: int = 20_000, seed: int = 0) -> dict:
    """What the benchmark's records hold, measured on ``n`` private records (seed ``seed``): the entropy per
    record, -E[log p(x)] (exact log-probabilities, Monte Carlo over records, 95% interval clustered by patient);
    KL(private || pretraining), what only the private records teach a model that knows the pre-training population
    perfectly, and KL(private || public), both the same way; the sum of the fields' marginal entropies and the
    total correlation (that sum minus the record's entropy: the information the fields share, which a model can
    use); and the largest pairwise mutual informations. Marginals and pairwise MI are exact sums over the latents
    for the fields whose parents are latent only; the other fields' marginal entropies (medications, discharge,
    admission source, payer, readmitted, change, diabetesMed: small supports) are plug-in estimates from the sample."""
    model = population("private")
    rng = np.random.default_rng(np.random.SeedSequence([seed, _ID_BASES["private"][0]]))
    frame = generate(n, rng, "private", *_ID_BASES["private"][1:])
    lp = {name: population(name).log_prob(frame) for name in ("private", "public", "pretraining")}
    patients = frame["patient_nbr"].to_numpy()
    entropy = _clustered_ci(-lp["private"], patients)
    out = {"records": n, "seed": seed, "entropy_nats": entropy}
    for other in ("public", "pretraining"):
        out[f"kl_private_{other}_nats"] = _clustered_ci(lp["private"] - lp[other], patients)
    pz = model.prior_c[:, None] * model.prior_s  # P(c, s)
    exact = {f.name: _given_latents(model, f) for f in _latent_only(model)}
    marginal = {name: _entropy(np.einsum("cs,csv->v", pz, t)) for name, t in exact.items()}
    for c in schema.COLUMNS[2:]:
        if c not in marginal:
            marginal[c] = _entropy(frame[c].value_counts(normalize=True).to_numpy())
    out["sum_marginal_entropies_nats"] = float(sum(marginal.values()))
    out["total_correlation_nats"] = out["sum_marginal_entropies_nats"] - entropy[0]
    pairs = []
    names = list(exact)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            joint = np.einsum("cs,csa,csb->ab", pz, exact[a], exact[b])
            pa, pb = joint.sum(1), joint.sum(0)
            pairs.append((a, b, _entropy(pa) + _entropy(pb) - _entropy(joint.ravel())))
    out["top_mutual_information_nats"] = [(a, b, round(v, 4)) for a, b, v in sorted(pairs, key=lambda t: -t[2])[:12]]
    return out
