"""What the secret detector masks: the sensitive fields (for recall), the closed vocabularies, the entity-ruler
patterns (token and phrase patterns, one label per kind) and the high-context clause rules (character-level
regexes); see :mod:`raydp.data.redaction`. Plain data and regexes: no spaCy here."""

from __future__ import annotations

import re
from collections.abc import Iterable

from raydp.data import schema
from raydp.data.schema import IdMaps

MASK = "[REDACTED]"
LEVELS = ("base", "high_context")
E16_LABEL = ("phase 1 trained non-privately on redacted private records: epsilon covers phase 2 only; "
             "redaction gives no DP guarantee (ERRATA E16)")

#: Fields whose values are secrets for :func:`field_recall`, by kind. Demographics and the encounter's
#: quasi-identifiers (admission/discharge/source, payer, specialty, diagnoses, stay length, counts, lab
#: results) are in. Left out: the 23 medication states and ``change``/``diabetesMed``/``readmitted``,
#: the treatment and outcome that the phase-1 model is meant to learn (the latter three are the task
#: labels of :mod:`raydp.data.tasks`); ``encounter_id``/``patient_nbr`` are never verbalised.
SENSITIVE_FIELDS: dict[str, str] = {
    "race": "demographic",
    "gender": "demographic",
    "age": "demographic",
    "weight": "demographic",
    "admission_type_id": "encounter",
    "discharge_disposition_id": "encounter",
    "admission_source_id": "encounter",
    "time_in_hospital": "encounter",
    "payer_code": "payer",
    "medical_specialty": "encounter",
    "num_lab_procedures": "count",
    "num_procedures": "count",
    "num_medications": "count",
    "number_outpatient": "visits",
    "number_emergency": "visits",
    "number_inpatient": "visits",
    "diag_1": "diagnosis",
    "diag_2": "diagnosis",
    "diag_3": "diagnosis",
    "number_diagnoses": "count",
    "max_glu_serum": "lab",
    "A1Cresult": "lab",
}

#: Closed-class pronouns masked at the high-context level (personal, possessive, reflexive; not the
#: demonstratives or relatives, which double as determiners).
PRONOUNS: frozenset[str] = frozenset("""
    i me my mine myself we us our ours ourselves you your yours yourself yourselves he him his himself
    she her hers herself it its itself they them their theirs themselves
""".split())

# The payer codes of the Diabetes 130-US file (two capitals; '?' is missing).
PAYER_CODES = ("MC", "HM", "SP", "BC", "MD", "CP", "UN", "CM", "OG", "PO", "DM", "CH", "WC", "OT",
               "MP", "SI", "FR")
_MONTHS = (r"Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|June?|July?|Aug(?:ust)?"
           r"|Sept?(?:ember)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?")

# -- token predicates -------------------------------------------------------------------------------
def _rx(pattern: str) -> dict:
    return {"TEXT": {"REGEX": pattern}}


_NUMERIC = _rx(r"^\d+(?:\.\d+)?$")
_NUMBER = _rx(r"^(?:\d{1,5}|\d+(?:[.,]\d+)+|\d+(?:st|nd|rd|th))$")  # 6+ digits: IDENTIFIER
_IDENT = _rx(r"^\d{6,}$")
_CANARY = _rx(r"^(?=[A-Z0-9]*\d)(?=[A-Z0-9]*[A-Z])[A-Z0-9]{6,}$")
_TIME = _rx(r"^\d{1,2}:\d{2}(?::\d{2})?$")
_ICD9_VE = _rx(r"^(?:V\d{1,2}|E\d{3})(?:\.\d{1,2})?$")
_ICD9 = _rx(r"^(?:\d{1,3}(?:\.\d{1,2})?|V\d{1,2}(?:\.\d{1,2})?|E\d{3}(?:\.\d{1,2})?)$")
_DATE_TOKEN = _rx(rf"^(?:\d{{1,4}}[-/.]\d{{1,2}}[-/.]\d{{1,4}}|(?:{_MONTHS})\.?)$")  # "May" needs a number
_MONTH_OR_MAY = _rx(rf"^(?:{_MONTHS}|May)\.?$")
_DAY = _rx(r"^(?:0?[1-9]|[12]\d|3[01])(?:st|nd|rd|th)?$")
_YEAR = _rx(r"^(?:1[89]|20)\d\d$")
_DAY_OR_YEAR = _rx(r"^(?:(?:0?[1-9]|[12]\d|3[01])(?:st|nd|rd|th)?|(?:1[89]|20)\d\d)$")
_DM = _rx(r"^\d{1,2}$")
_DSEP = {"ORTH": {"IN": ["-", "/", "."]}}
_TWO_CAPS = _rx(r"^[A-Z]{2}$")


def _opt(words: Iterable[str], op: str = "?") -> dict:
    return {"LOWER": {"IN": list(words)}, "OP": op}


def _in(words: Iterable[str]) -> dict:
    return {"LOWER": {"IN": list(words)}}


def _orth(chars: Iterable[str], op: str | None = None) -> dict:
    return {"ORTH": {"IN": list(chars)}, **({"OP": op} if op else {})}


_CONN = ("is", "was", ":", "=", "of", "-")
_OPEN, _CLOSE, _DASH, _CMP = ("[", "("), (")", "]"), ("-", "–"), (">", "<", "≥", "≤", "~")

# kind -> (label, left context words, right context words). Context words at the ends of a match are
# trimmed from the masked span (they say what the value is, they are not the value).
_KINDS: dict[str, tuple[str, frozenset[str], frozenset[str]]] = {}


def _kind(name: str, label: str, left: Iterable[str] = (), right: Iterable[str] = ()) -> str:
    _KINDS[name] = (label, frozenset(left), frozenset(right))
    return name


_ID_KEYS = ("encounter", "patient", "mrn", "record", "member", "account", "case")
_ID_WORDS = ("id", "nbr", "number", "no", "no.", "#")
_ID_FIELDS = ("encounter_id", "patient_nbr", "patient_id", "mrn")
_SECRET_KEYS = ("secret_id", "secret", "canary", "canary_id", "password", "passcode", "pin")
_AGE_KEYS = ("age", "ages", "aged")
_YEARS = ("years", "year", "yrs", "yr", "y")
_WEIGHT_KEYS = ("weight", "weighs", "weighing", "wt")
_WEIGHT_UNITS = ("kg", "kgs", "kilograms", "lb", "lbs", "pounds")
_ICD_KEYS = ("icd9", "icd-9", "icd", "diagnosis", "dx", "diag")


def _variants(words: Iterable[str]) -> list[str]:
    return sorted({v for w in words for v in (w, w.lower(), w.upper(), w[:1].upper() + w[1:].lower())})


def _ruler_patterns() -> list[dict]:
    """The entity-ruler patterns (token patterns, and phrase patterns for closed vocabularies), each with
    an ``id`` naming its kind (for trimming its context words and for counting). Every token pattern
    costs ~0.15 us per token of text in spaCy's Matcher, so alternatives share a pattern where they can."""
    out: list[dict] = []

    def add(kind: str, *patterns: list[dict] | str) -> None:
        label = _KINDS[kind][0]
        out.extend({"label": label, "pattern": p, "id": f"raydp:{kind}"} for p in patterns)

    num = _NUMERIC
    add(_kind("secret", "SECRET"), [_CANARY])
    add(_kind("secret_keyed", "SECRET", left=_SECRET_KEYS + ("=", ":")),
        [_in(_SECRET_KEYS), _orth(("=", ":")),
         {"ORTH": {"NOT_IN": [".", ",", ";", ")"]}, "IS_SPACE": False, "OP": "{1,3}"}])
    add(_kind("identifier", "IDENTIFIER"), [_IDENT])
    add(_kind("identifier_keyed", "IDENTIFIER", left=_ID_KEYS + _ID_WORDS + _ID_FIELDS + (":", "=", "#")),
        [_in(_ID_KEYS + _ID_FIELDS), _opt(_ID_WORDS), _orth((":", "=", "#"), "?"), {"IS_DIGIT": True}])
    add(_kind("number", "NUMBER"), [_NUMBER])
    add(_kind("range", "RANGE", left=("between",)),
        [_orth(_OPEN, "?"), num, _orth(_DASH), num, _orth(_CLOSE, "?")],
        [_orth(_CMP), {"ORTH": "=", "OP": "?"}, num],
        [{"LOWER": "between"}, num, {"LOWER": "and"}, num])
    add(_kind("date", "DATE", left=("of",)),
        [_rx(r"^\d{1,4}$"), _DSEP, _DM, _DSEP, _rx(r"^\d{1,4}$")],  # 2021-03-04, 4/3/21 (split)
        [_DATE_TOKEN],
        [_DAY, {"LOWER": "of", "OP": "?"}, _MONTH_OR_MAY, {"ORTH": ",", "OP": "?"}, {**_YEAR, "OP": "?"}],
        [_MONTH_OR_MAY, _DAY_OR_YEAR, {"ORTH": ",", "OP": "?"}, {**_YEAR, "OP": "?"}])
    add(_kind("time", "TIME"), [_TIME])
    add(_kind("icd9", "ICD9"), [_ICD9_VE])
    add(_kind("icd9_keyed", "ICD9", left=_ICD_KEYS + _CONN + ("code", ")")),
        [_in(_ICD_KEYS), {"ORTH": ")", "OP": "?"}, _opt(("code",) + _CONN, "{0,2}"), _ICD9])
    add(_kind("weight", "WEIGHT", left=_WEIGHT_KEYS + _CONN, right=_WEIGHT_UNITS),
        [_in(_WEIGHT_KEYS), _opt(_CONN, "{0,2}"), _orth(_OPEN + _CMP, "?"), {"ORTH": "=", "OP": "?"}, num,
         _orth(_DASH, "?"), {**num, "OP": "?"}, _orth(_CLOSE, "?"), _opt(_WEIGHT_UNITS)],
        [num, _in(_WEIGHT_UNITS)])
    add(_kind("age", "AGE", left=_AGE_KEYS + _CONN + ("between",),
              right=_YEARS + ("old", "-", "yo", "y/o", "y.o.", "and", "to")),
        [_in(_AGE_KEYS), _opt(_CONN + ("between",), "{0,2}"), _orth(_OPEN, "?"), num,
         _opt(("and", "to", "-")), {**num, "OP": "?"}, _orth(_CLOSE, "?"), _opt(_YEARS), _opt(("old",))],
        [num, {"ORTH": "-", "OP": "?"}, _in(_YEARS), {"ORTH": "-", "OP": "?"}, {"LOWER": "old"}],
        [num, _in(("yo", "y/o", "y.o."))])
    add(_kind("race_word", "RACE"),
        *_variants([r for r in schema.RACES if r not in ("?", "Other")] + ["Latino", "Latina"]),
        *_variants(["African American", "African-American"]))
    add(_kind("race", "RACE", left=("race", "ethnicity") + _CONN),
        [_in(("race", "ethnicity")), _opt(_CONN, "{0,2}"),
         _in([r.lower() for r in schema.RACES if r != "?"] + ["white", "black", "latino", "latina"])])
    add(_kind("gender_word", "GENDER"), *_variants(["Female", "Male"]))
    add(_kind("gender", "GENDER", left=("gender", "sex") + _CONN),
        [_in(("gender", "sex")), _opt(_CONN, "{0,2}"), _in(("female", "male", "f", "m"))],
        [_in(("gender", "sex")), _opt(_CONN, "{0,2}"), {"LOWER": "unknown"}, {"ORTH": "/"},
         {"LOWER": "invalid"}])
    add(_kind("payer_word", "PAYER"), *PAYER_CODES)
    add(_kind("payer", "PAYER", left=("payer", "payor", "code", "id") + _CONN),
        [_in(("payer", "payor")), _opt(("code", "id")), _opt(_CONN, "{0,2}"), _TWO_CAPS])
    return out


# -- high-context clause rules (character level) ----------------------------------------------------
_END = r"(?=\.(?:\s|$)|$)"  # a clause's value ends at a period followed by a space, or the text's end
_FREE_VALUE = r"(?!unknown\.)[^\s.](?:[^.]|\.(?=\S))*?"
_CLAUSE_KEYS = {
    "race": r"race", "gender": r"gender|sex", "age": r"age", "weight": r"weight",
    "time_in_hospital": r"time in hospital", "payer_code": r"payer code",
    "medical_specialty": r"medical specialty", "num_lab_procedures": r"num lab procedures",
    "num_procedures": r"num procedures", "num_medications": r"num medications",
    "visits": r"the number of \w+ visits in the year preceding the encounter",
    "diag": r"diagnosis code(?: \([^)]*\))?", "number_diagnoses": r"number diagnoses",
    "max_glu_serum": r"max glu serum", "A1Cresult": r"A1C ?result",
}
_ID_CLAUSE_KEYS = {"admission_type_id": r"admission type id",
                   "discharge_disposition_id": r"discharge disposition id",
                   "admission_source_id": r"admission source id"}
_COUNT_WORDS = r"\d+|no|one|two|three|four|five|six|seven|eight|nine|ten"


def _clause_regex(id_maps: IdMaps) -> re.Pattern[str]:
    """One regex for all clause rules (one pass over the text); each rule's value is its only
    capturing group, so ``m.lastindex`` names it."""
    alts = [rf"(?:{'|'.join(_CLAUSE_KEYS.values())}) (?:is|was|:|=) ({_FREE_VALUE}){_END}"]
    for column, key in _ID_CLAUSE_KEYS.items():
        descs = sorted({d.strip() for d in id_maps.table(column).values()} - {"NULL", ""}, key=len,
                       reverse=True)
        known = "|".join(re.escape(d) for d in descs)
        alts.append(rf"{key} (?:is|was|:|=) ((?:{known}){_END}|{_FREE_VALUE}{_END})")
    alts.append(rf"(?i:had) ((?i:{_COUNT_WORDS})) (?:\w+ )?(?i:visits?)\b")
    alts.append(r"(?i:for|stayed) (\d+|(?i:one|two|three)) (?i:days?|nights?)\b")
    alts.append(r"(?i:ages?) between (\d+ and \d+)\b")
    return re.compile(r"(?<![\w-])(?:" + "|".join(alts) + ")")
