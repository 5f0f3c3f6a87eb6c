"""The secret detector of DualTune-GhostDP's phase 1, as rules, and its measured recall (ERRATA E16).

The paper (Sec. 4.2, "Secret Detector"; Sec. 5.2) sanitises the private records before the first,
non-private fine-tuning with a *high-contextual* detector built on spaCy's off-the-shelf NER, POS tagger
and dependency parser: it removes all 18 NER entity types, pronouns (PRON), proper nouns (PROPN), all
verbs (VERB) and subjects/objects (nsubj, dobj, pobj). :class:`SecretDetector` rebuilds it for the
narratives of :mod:`raydp.data.verbalise` without a trained model (none can be downloaded here):

* ``level="base"``: ``spacy.blank("en")`` and an ``entity_ruler`` of token patterns (token regexes via
  ``{"TEXT": {"REGEX": ...}}``) and phrase patterns (closed vocabularies), one label per kind: ``SECRET``
  (canary-like strings: upper-case letters *and* digits, 6+ characters; and the value after
  ``secret_id=``, ``password:``, ...), ``IDENTIFIER`` (integers of 6+ digits; any integer after
  "encounter id", "patient_nbr", "mrn", ...), ``NUMBER`` (integers up to 5 digits, decimals, ordinals),
  ``RANGE`` ("40-50", "[150-175)", ">200", "between 3 and 5"), ``DATE`` (ISO, d/m/y, month names; "May"
  only next to a number), ``TIME``, ``ICD9`` (V/E codes anywhere; 1-3 digit codes after "ICD9 ... is",
  "diagnosis code"), ``WEIGHT`` ("weight is [150-175)", "80 kg"), ``AGE`` ("ages between 40 and 50 years
  old", "age is [40-50)", "72-year-old", "aged 72"), ``RACE`` and ``GENDER`` (the schema's vocabulary;
  "Other", "White", "Black", "M"/"F", "Unknown/Invalid" only after "race"/"gender") and ``PAYER`` (the
  dataset's payer codes; any two capitals after "payer code"). A pattern's context words ("weight is",
  "years old", "secret_id=") are matched but not masked. The tokenizer gets three rules so that a
  canary is one token: ``=`` always splits, a period after a capital or digit is a suffix, and URL
  matching needs a scheme (spaCy's English tokenizer otherwise glues ``secret_id=AB12CD34EF.`` in ~40% of
  random canaries); and "id" loses its special case ("I'd"-style split into a pronoun "i", and any special
  case turns off the tokenizer's cache for the rest of a text: 20x slower on these narratives).
* ``level="high_context"`` adds what rules can do of the paper's "contextual" part: the value of every
  known attribute clause of a :data:`SENSITIVE_FIELDS` field ("payer code is DM." -> "DM", "medical
  specialty is Surgery-Neuro." -> "Surgery-Neuro", "discharge disposition id is Expired." -> "Expired",
  "had 3 / no inpatient visits" -> "3" / "no", "for 4 days" -> "4"; label ``ATTRIBUTE``), pronouns
  (closed class :data:`PRONOUNS`, label ``PRONOUN``) and capitalised tokens that do not start a sentence
  (a proper-noun heuristic: first letter upper case and some lower-case letter, so acronyms such as
  "ICD9" are left to the other rules; label ``PROPER``).

What rules cannot do: find a verb, a subject or an object, or a name that is lower case or starts a
sentence; catch a secret of capitals only without its ``secret_id=`` key; tell a sensitive number from a
harmless one (every number is masked, including "30" in the label clause "readmitted in less than 30
days": pass ``keep=`` the task's label sentences, or redact after :func:`raydp.data.tasks.
to_classification`); know a free-text value's extent without a template. The clause rules are written
for the verbaliser's template, so their recall on it says nothing about free text. Recall is measured,
not assumed: :func:`field_recall` (ground truth from the verbaliser, not from the detector) and
:func:`canary_recall` (injected secrets), with the fraction of non-sensitive tokens masked so that
over-redaction shows too.

Speed. spaCy's Matcher calls a token pattern's Python predicates (REGEX, IN, comparisons) on every token
when they sit on a pattern's first token; those are compiled into lexeme flags (computed once per
distinct string, checked in C), and ``Doc.text``/``Doc.ents``/Token objects are avoided when reading the
result. What remains is the Matcher (~0.15 us per token per token pattern, 24 token patterns).
``redact_all(texts, n_process=2)`` splits the texts over forked workers that return spans.

ERRATA E16. Redaction is not differential privacy. The detector is a deterministic function of the
private records: whatever it misses, and everything it keeps (the rest of each record, which records
exist), reaches the phase-1 model with no guarantee; at best it is selective DP (Shi et al. 2021) for the
spans it finds. A run whose phase 1 trains on redacted private records must be labelled "phase 1 trained
non-privately on redacted private records: epsilon covers phase 2 only; redaction gives no DP guarantee"
(:data:`E16_LABEL`) and report this detector's measured recall; the sound variant trains phase 1 on the
public corpus and needs no label.

Trained pipeline. ``SecretDetector("high_context", pipeline="en_core_web_sm")`` (an installed package
name) or ``pipeline="/path/to/pipeline"`` (a directory written by ``nlp.to_disk``) is loaded with
``spacy.load`` (which never downloads; a pipeline that cannot be loaded is a one-line
:class:`~raydp.errors.ConfigError`), the ruler is added before its ``ner`` (so the NER keeps the rule
entities and adds its own; last in the pipeline when there is no ``ner``), and the high-context level
ALSO masks what the trained components tag: every entity they add (any label), every token whose
``pos_`` is PRON, PROPN or VERB, and every token whose ``dep_`` is ``nsubj``, ``dobj`` or ``pobj`` (the
paper's three relations, exactly these labels; the token bearing the relation, i.e. the head of the
argument's subtree, not the whole subtree: a pobj's subtree can be the rest of the sentence). The base
level runs only the ruler (the trained components are disabled). Labels of these spans: the entity's own
label, ``POS_PRON``/``POS_PROPN``/``POS_VERB``, ``DEP_NSUBJ``/``DEP_DOBJ``/``DEP_POBJ``.

Spans are character offsets, merged when they overlap or touch (the merged span takes the label of its
longest part); :data:`MASK` replaces each. ``keep`` protects literal strings (e.g. a task's label
clauses, :mod:`raydp.data.tasks`) from masking.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from raydp.data import schema
from raydp.data.schema import IdMaps
from raydp.data.verbalise import verbalise
from raydp.errors import ConfigError

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


def _merge(spans: Iterable[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Union of overlapping or touching spans; a merged span takes the label of its longest part."""
    out: list[list] = []
    for s, e, label in sorted(spans):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            cur = out[-1]
            if e - s > cur[3]:
                cur[2], cur[3] = label, e - s
            cur[1] = max(cur[1], e)
        else:
            out.append([s, e, label, e - s])
    return [(s, e, label) for s, e, label, _ in out]


def _subtract(spans: list[tuple[int, int, str]], keep: list[tuple[int, int]]) -> list[tuple[int, int, str]]:
    if not keep:
        return spans
    out = []
    for s, e, label in spans:
        pieces = [(s, e)]
        for ks, ke in keep:
            nxt = []
            for a, b in pieces:
                if ke <= a or ks >= b:
                    nxt.append((a, b))
                else:
                    if a < ks:
                        nxt.append((a, ks))
                    if ke < b:
                        nxt.append((ke, b))
            pieces = nxt
        out.extend((a, b, label) for a, b in pieces if b > a)
    return out


def apply_mask(text: str, spans: Sequence[tuple[int, int, str]], mask: str = MASK) -> str:
    """``text`` with each (merged, sorted) span replaced by ``mask``."""
    parts, pos = [], 0
    for s, e, _ in spans:
        parts.append(text[pos:s])
        parts.append(mask)
        pos = e
    parts.append(text[pos:])
    return "".join(parts)


_LEXICAL = {"ORTH": lambda s: s, "TEXT": lambda s: s, "LOWER": str.lower, "LENGTH": len}
_COMPARE_OPS = {"==": lambda a, b: a == b, "!=": lambda a, b: a != b, ">=": lambda a, b: a >= b,
                "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, "<": lambda a, b: a < b}


class _LexFlag:
    """A Python predicate on a lexical attribute, as a lexeme flag getter (picklable for n_process)."""

    def __init__(self, attr: str, op: str, arg: Any):
        self.attr, self.op, self.arg = attr, op, arg
        self._rx = re.compile(arg) if op == "REGEX" else None
        self._set = frozenset(arg) if op in ("IN", "NOT_IN") else None

    def __call__(self, string: str) -> bool:
        value = _LEXICAL[self.attr](string)
        if self.op == "REGEX":
            return self._rx.search(value) is not None
        if self.op == "IN":
            return value in self._set
        if self.op == "NOT_IN":
            return value not in self._set
        return _COMPARE_OPS[self.op](value, self.arg)

    def __getstate__(self):
        return (self.attr, self.op, self.arg)

    def __setstate__(self, state):
        self.__init__(*state)


def _compile_to_flags(patterns: list[dict], vocab) -> tuple[list[dict], int]:
    """Patterns with the Python predicates (REGEX, IN, NOT_IN, comparisons) on lexical attributes of the
    tokens that can start a match turned into lexeme flags, which the Matcher checks in C.

    spaCy's Matcher calls a pattern's Python predicates on *every* token for a pattern's first token
    (~1.5 us each), which made the ruler ~50x slower than the tokenizer; a lexeme flag is computed once
    per distinct string and cached in the vocabulary. Later tokens keep their predicates (they are only
    tried inside a partial match). Returns the patterns and the number of flags used."""
    free = [b for b in range(19, 64) if b not in vocab.lex_attr_getters]
    flags: dict[tuple, int] = {}

    def flag_for(attr: str, op: str, arg: Any) -> int | None:
        key = (attr, op, tuple(sorted(arg)) if isinstance(arg, (list, tuple)) else arg)
        if key not in flags:
            if not free:
                return None
            flags[key] = vocab.add_flag(_LexFlag(attr, op, arg), flag_id=free.pop(0))
        return flags[key]

    out = []
    for entry in patterns:
        if isinstance(entry["pattern"], str):  # a phrase pattern (PhraseMatcher): already fast
            out.append(entry)
            continue
        tokens = []
        leading = True
        for spec in entry["pattern"]:
            spec = dict(spec)
            if leading:
                for attr in [a for a in spec if a.upper() in _LEXICAL and isinstance(spec[a], dict)]:
                    preds = spec[attr]
                    if len(preds) != 1:
                        continue
                    (op, arg), = preds.items()
                    fid = flag_for(attr.upper(), op, arg)
                    if fid is not None:
                        del spec[attr]
                        spec[fid] = True
            tokens.append(spec)
            op = str(spec.get("OP", ""))
            leading = leading and (op in ("?", "*") or op.startswith("{0"))
        out.append({**entry, "pattern": tokens})
    return out, len(flags)


def _validate(patterns: list[dict]) -> None:
    from spacy.schemas import validate_token_pattern

    for entry in patterns:
        if isinstance(entry["pattern"], str):
            continue
        errors = validate_token_pattern(entry["pattern"])
        if errors:  # pragma: no cover - a bug in the rules above
            raise ValueError(f"bad ruler pattern {entry}: {errors}")


def _import_spacy():
    try:
        import spacy
    except ImportError:
        raise ConfigError("the secret detector (DualTune-GhostDP's redacted phase 1) needs spaCy, an optional "
                          "extra: pip install 'rldp-finetune[redaction]'") from None
    return spacy


def _loosen_tokenizer(nlp) -> None:
    """Make a canary one token: '=' always splits, a period after a capital or digit is a suffix, and
    URL matching needs a scheme or 'www.' (it otherwise glues 'secret_id=AB12CD34EF'); and "id" is no
    special case (English splits it like "I'd" into "i" "d", a pronoun; and a special case hit stops
    spaCy's tokenizer caching for the rest of the text: with "id" in every narrative, 20x slower)."""
    from spacy.tokenizer import Tokenizer

    tok = nlp.tokenizer
    if not isinstance(tok, Tokenizer):  # a custom tokenizer: left as it is
        return
    rules = {k: v for k, v in (tok.rules or {}).items() if k.lower() != "id"}
    infix, suffix, url = (getattr(tok.infix_finditer, "__self__", None),
                          getattr(tok.suffix_search, "__self__", None), tok.url_match)
    scheme = re.compile(r"^(?:[a-zA-Z][\w+.-]*://|www\.)")
    # one new Tokenizer: each attribute set on the old one reloads its ~1,300 special cases (0.1 s)
    nlp.tokenizer = Tokenizer(
        nlp.vocab, rules=rules, prefix_search=tok.prefix_search,
        suffix_search=(re.compile(rf"{suffix.pattern}|(?<=[A-Z0-9])\.$").search
                       if isinstance(suffix, re.Pattern) else tok.suffix_search),
        infix_finditer=(re.compile(f"{infix.pattern}|=").finditer
                        if isinstance(infix, re.Pattern) else tok.infix_finditer),
        token_match=tok.token_match,
        url_match=None if url is None else _SchemeURL(url, scheme),
        faster_heuristics=tok.faster_heuristics)


class _SchemeURL:
    """spaCy's URL match, only for strings with a scheme or 'www.' (picklable)."""

    def __init__(self, url, scheme: re.Pattern[str]):
        self.url, self.scheme = url, scheme

    def __call__(self, string: str):
        return self.url(string) if self.scheme.match(string) else None


class SecretDetector:
    """A rule-based (optionally trained-pipeline) secret detector; see the module docstring.

    ``level``: ``"base"`` or ``"high_context"``. ``pipeline``: an installed spaCy pipeline's package name
    or a path on disk (never downloaded); ``None`` uses ``spacy.blank("en")``. ``mask``: the replacement
    text. ``keep``: literal strings never masked. ``id_maps``: the id tables whose descriptions the
    high-context clause rules know (default: the embedded ``IDs_mapping.csv``).
    """

    def __init__(self, level: str = "base", pipeline: str | None = None, *, mask: str = MASK,
                 keep: Iterable[str] = (), id_maps: IdMaps | None = None):
        if level not in LEVELS:
            raise ConfigError(f"secret detector level must be one of {', '.join(LEVELS)}, got {level!r}")
        spacy = _import_spacy()
        self.level = level
        self.pipeline = None if pipeline is None else str(pipeline)
        self.mask = mask
        self.keep = tuple(k for k in keep if k)
        self._spacy_version = spacy.__version__
        if pipeline is None:
            nlp = spacy.blank("en")
        else:
            try:
                nlp = spacy.load(self.pipeline)
            except Exception as e:  # noqa: BLE001 - OSError E050/E053, bad config, missing factory ...
                reason = " ".join(str(e).split())[:300]
                raise ConfigError(f"spaCy pipeline {self.pipeline!r} cannot be loaded (it is never "
                                  f"downloaded; install the package or pass a directory): {reason}") from None
        _loosen_tokenizer(nlp)
        self._trained = [name for name in nlp.pipe_names]
        ruler_name = "raydp_secret_ruler"
        where = {"before": "ner"} if "ner" in nlp.pipe_names else {}
        ruler = nlp.add_pipe("entity_ruler", name=ruler_name, config={"validate": False}, **where)
        self._patterns = _ruler_patterns()
        _validate(self._patterns)
        compiled, self._n_flags = _compile_to_flags(self._patterns, nlp.vocab)
        ruler.add_patterns(compiled)
        self.nlp = nlp
        self._config = {"level": level, "pipeline": self.pipeline, "mask": mask, "keep": self.keep,
                        "id_maps": id_maps}
        strings = nlp.vocab.strings
        self._kinds = {strings.add(f"raydp:{k}"): (label, {strings.add(w) for w in left},
                                                   {strings.add(w) for w in right})
                       for k, (label, left, right) in _KINDS.items()}
        used = set(nlp.vocab.lex_attr_getters)
        free = [b for b in range(19, 64) if b not in used]
        if len(free) < 2:  # pragma: no cover - 45 flags, ~30 used by the ruler
            raise ConfigError("no free lexeme flags left in the spaCy vocabulary for the detector")
        pron = nlp.vocab.add_flag(_LexFlag("LOWER", "IN", sorted(PRONOUNS)), flag_id=free[0])
        cap = nlp.vocab.add_flag(_LexFlag("TEXT", "REGEX", r"^[A-Z](?=.*[a-z])"), flag_id=free[1])
        self._cols = ["ENT_IOB", "ENT_TYPE", "ENT_ID", "IDX", "LENGTH", "LOWER", pron, cap, "ORTH",
                      "IS_SPACE"]
        self._sentence_enders = {strings.add(w) for w in (".", "!", "?", "\n", "\n\n")}
        from spacy.symbols import PRON, PROPN, VERB

        self._pos_tags = {PRON: "POS_PRON", PROPN: "POS_PROPN", VERB: "POS_VERB"}
        self._dep_tags = {strings.add(d): f"DEP_{d.upper()}" for d in ("nsubj", "dobj", "pobj")}
        # base: the ruler only; high_context with a trained pipeline: everything
        self._disable = self._trained if level == "base" else []
        self._clauses = (_clause_regex(id_maps or schema.default_id_maps()) if level == "high_context"
                         else None)

    # -- spans ---------------------------------------------------------------------------------------
    def _docs(self, texts: Iterable[str], batch_size: int = 64) -> Iterator:
        return self.nlp.pipe(texts, batch_size=batch_size, disable=self._disable)

    def _doc_spans(self, doc, text: str | None = None) -> list[tuple[int, int, str]]:
        """Spans of ``doc``; ``text`` is ``doc.text`` when the caller has it (``Doc.text`` rebuilds the
        string from Token objects: as slow as the ruler)."""
        # Token attributes as one array (Token objects cost ~1 us each: as much as the ruler itself).
        cols = self._cols
        arr = doc.to_array(cols).tolist() if len(doc) else []
        iob_i, type_i, id_i, idx_i, len_i, lower_i = range(6)
        strings = self.nlp.vocab.strings
        raw: list[tuple[int, int, str]] = []
        n = len(arr)
        i = 0
        while i < n:
            if arr[i][iob_i] != 3:  # B of an entity
                i += 1
                continue
            s, e = i, i + 1
            while e < n and arr[e][iob_i] == 1:
                e += 1
            i = e
            kind = self._kinds.get(arr[s][id_i])
            if kind is None:  # a trained NER's entity (only at high_context)
                label = strings[arr[s][type_i]]
            else:
                label, left, right = kind
                while s < e - 1 and arr[s][lower_i] in left:
                    s += 1
                while e > s + 1 and arr[e - 1][lower_i] in right:
                    e -= 1
            raw.append((arr[s][idx_i], arr[e - 1][idx_i] + arr[e - 1][len_i], label))
        if text is None and (self.level == "high_context" or self.keep):
            text = doc.text
        if self.level == "high_context":
            for m in self._clauses.finditer(text):
                g = m.lastindex
                raw.append((m.start(g), m.end(g), "ATTRIBUTE"))
            raw.extend(self._token_spans(doc, arr))
        spans = _merge(raw)
        if self.keep:
            kept = [(m.start(), m.end()) for k in self.keep for m in re.finditer(re.escape(k), text)]
            spans = _subtract(spans, kept)
        return spans

    def _token_spans(self, doc, arr: list[list[int]]) -> Iterator[tuple[int, int, str]]:
        idx_i, len_i, pron_i, cap_i, orth_i, space_i = 3, 4, 6, 7, 8, 9
        trained = bool(self._trained)
        has_pos = trained and doc.has_annotation("POS")
        has_dep = trained and doc.has_annotation("DEP")
        has_sent = trained and doc.has_annotation("SENT_START")
        extra = doc.to_array(["POS", "DEP", "SENT_START"]).tolist() if trained else None
        enders = self._sentence_enders
        prev_orth = None
        for k, row in enumerate(arr):
            a, b = row[idx_i], row[idx_i] + row[len_i]
            if row[pron_i]:
                yield a, b, "PRONOUN"
            elif row[cap_i]:
                if has_sent:
                    initial = extra[k][2] == 1
                else:
                    initial = prev_orth is None or prev_orth in enders
                if not initial:
                    yield a, b, "PROPER"
            if extra is not None:
                pos, dep = extra[k][0], extra[k][1]
                if has_pos and pos in self._pos_tags:
                    yield a, b, self._pos_tags[pos]
                if has_dep and dep in self._dep_tags:
                    yield a, b, self._dep_tags[dep]
            if not row[space_i]:
                prev_orth = row[orth_i]

    def spans(self, text: str) -> list[tuple[int, int, str]]:
        """Sorted, non-overlapping ``(start, end, label)`` character spans to mask in ``text``."""
        return self._doc_spans(next(iter(self._docs([text]))), text)

    def spans_all(self, texts: Iterable[str], *, batch_size: int = 64,
                  n_process: int = 1) -> list[list[tuple[int, int, str]]]:
        """:meth:`spans` of every text, through ``nlp.pipe``; ``n_process > 1`` splits the texts over
        that many worker processes (forked where the platform can, each returning spans, not Docs)."""
        texts = list(texts)
        if n_process > 1 and len(texts) >= 2 * n_process * batch_size:
            return _parallel_spans(self, texts, batch_size, n_process)
        return [self._doc_spans(d, t) for d, t in zip(self._docs(texts, batch_size), texts)]

    def redact(self, text: str) -> str:
        """``text`` with every span replaced by the mask."""
        return apply_mask(text, self.spans(text), self.mask)

    def redact_all(self, texts: Iterable[str], *, batch_size: int = 64, n_process: int = 1) -> list[str]:
        """:meth:`redact` of every text, through ``nlp.pipe`` (see :meth:`spans_all`)."""
        texts = list(texts)
        return [apply_mask(t, s, self.mask)
                for t, s in zip(texts, self.spans_all(texts, batch_size=batch_size, n_process=n_process))]

    def describe(self) -> dict:
        """Level, pipeline, versions and rule counts, for a run summary."""
        counts = Counter(p["label"] for p in self._patterns)
        out = {
            "level": self.level,
            "pipeline": self.pipeline or "spacy.blank('en')",
            "spacy_version": self._spacy_version,
            "components": list(self.nlp.pipe_names),
            "trained_components": list(self._trained) if self.level == "high_context" else [],
            "mask": self.mask,
            "ruler_patterns": len(self._patterns),
            "token_patterns": sum(not isinstance(p["pattern"], str) for p in self._patterns),
            "phrase_patterns": sum(isinstance(p["pattern"], str) for p in self._patterns),
            "lexeme_flags": self._n_flags,
            "patterns_per_label": dict(sorted(counts.items())),
            "guarantee": "none: redaction is not DP (ERRATA E16)",
            "label": E16_LABEL,
        }
        if self.level == "high_context":
            out["clause_rules"] = len(_CLAUSE_KEYS) + len(_ID_CLAUSE_KEYS) + 3
            out["pronouns"] = len(PRONOUNS)
            out["token_rules"] = ["pronoun", "capitalised non-sentence-initial token"] + (
                ["trained entities", "POS in PRON/PROPN/VERB", "dep in nsubj/dobj/pobj"]
                if self._trained else [])
        if self.keep:
            out["keep"] = list(self.keep)
        return out

    def __repr__(self) -> str:
        return f"SecretDetector(level={self.level!r}, pipeline={self.pipeline!r})"


_WORKER: SecretDetector | None = None


def _init_worker(config: dict) -> None:
    global _WORKER
    _WORKER = SecretDetector(**config)


def _worker_spans(args: tuple[list[str], int]) -> list[list[tuple[int, int, str]]]:
    texts, batch_size = args
    return _WORKER.spans_all(texts, batch_size=batch_size)


def _parallel_spans(detector: SecretDetector, texts: list[str], batch_size: int,
                    n_process: int) -> list[list[tuple[int, int, str]]]:
    import multiprocessing as mp

    global _WORKER
    step = math.ceil(len(texts) / (4 * n_process))
    chunks = [(texts[i:i + step], batch_size) for i in range(0, len(texts), step)]
    if "fork" in mp.get_all_start_methods():  # the workers inherit this detector: no start-up cost
        _WORKER = detector
        ctx, init = mp.get_context("fork"), {}
    else:  # pragma: no cover - macOS/Windows: each worker builds its own detector
        ctx, init = mp.get_context("spawn"), {"initializer": _init_worker, "initargs": (detector._config,)}
    try:
        with ctx.Pool(n_process, **init) as pool:
            parts = pool.map(_worker_spans, chunks)
    finally:
        _WORKER = None
    return [s for part in parts for s in part]


# -- recall ------------------------------------------------------------------------------------------
_S = "\u2063S\u2063"  # sentinels: verbalised verbatim, never in a value (U+2063 is not whitespace)
_LO, _HI = "\u2063L\u2063", "\u2063H\u2063"
_COUNT_FIELDS = frozenset(c for c in schema.INT_COLUMNS if c not in schema.ID_COLUMNS)


def _rows(records: Any) -> list[Mapping[str, Any]]:
    if hasattr(records, "to_dict") and hasattr(records, "columns"):
        keys = [str(c) for c in records.columns]
        return [dict(zip(keys, v)) for v in zip(*(records[c].tolist() for c in records.columns))]
    return [dict(r) for r in records]


def _word_at(text: str, p: int) -> str:
    m = re.compile(r"[^\s]+").match(text, p)
    return m.group(0).rstrip(".") if m else ""


def value_regions(record: Mapping[str, Any], field: str, text: str | None = None,
                  id_maps: IdMaps | None = None) -> list[tuple[int, int]] | None:
    """Where ``verbalise(record)`` writes ``field``'s value: character ranges, or None when it writes
    "unknown". Found by verbalising the record again with the field set to a sentinel: the texts agree up
    to the value, and (for text fields) after it; counts are the one word there ("3", or "no" for 0)."""
    text = verbalise(record, id_maps) if text is None else text
    if field == "age":
        age = record.get("age")
        if isinstance(age, str) and age.startswith("[") and age.endswith(")") and "-" in age:
            t = verbalise({**record, "age": f"[{_LO}-{_HI})"}, id_maps)
            p1, p2s = t.find(_LO), t.find(_HI)
            if p1 < 0 or p2s < 0 or t[:p1] != text[:p1]:
                return None
            lo = _word_at(text, p1)
            gap = t[p1 + len(_LO):p2s]
            p2 = p1 + len(lo) + len(gap)
            if text[p1 + len(lo):p2] != gap:
                raise RuntimeError(f"verbaliser template changed around the age clause: {text!r}")
            hi = _word_at(text, p2)
            return [(p1, p1 + len(lo)), (p2, p2 + len(hi))]
    t = verbalise({**record, field: _S}, id_maps)
    p = t.find(_S)
    if p < 0:
        raise RuntimeError(f"the verbaliser does not write field {field!r}")
    if t[:p] != text[:p]:  # the known value's clause has another template: the field reads "unknown"
        cp = next((i for i, (a, b) in enumerate(zip(text, t)) if a != b), min(len(text), len(t)))
        if "unknown" in text[cp:cp + 80]:
            return None
        raise RuntimeError(f"cannot locate field {field!r} in {text!r}")
    if field in _COUNT_FIELDS:
        word = _word_at(text, p)
        return None if word == "unknown" else [(p, p + len(word))]
    tail = t[p + len(_S):]  # the template after a text value is the same whatever the value
    if not text.endswith(tail) or len(text) - len(tail) < p:
        raise RuntimeError(f"cannot locate field {field!r} in {text!r}")
    end = len(text) - len(tail)
    return None if text[p:end] == "unknown" else [(p, end)]


def _covered(regions: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int, str]]) -> bool:
    """Every character of every region lies in some span (spans sorted, non-overlapping)."""
    for a, b in regions:
        pos = a
        for s, e, _ in spans:
            if e <= pos:
                continue
            if s > pos:
                break
            pos = e
            if pos >= b:
                break
        if pos < b:
            return False
    return True


def _hits(tokens: list[tuple[int, int]], ranges: Sequence[tuple[int, ...]]) -> list[bool]:
    """For each token (sorted (start, end)), whether it overlaps one of ``ranges`` (sorted by start)."""
    out, j, n = [], 0, len(ranges)
    ranges = sorted((r[0], r[1]) for r in ranges)
    for a, b in tokens:
        while j < n and ranges[j][1] <= a:
            j += 1
        k, hit = j, False
        while k < n and ranges[k][0] < b:
            if ranges[k][1] > a:
                hit = True
                break
            k += 1
        out.append(hit)
    return out


class _TokenTally:
    """Tokens masked (any character under a span), split by whether they touch a sensitive region."""

    def __init__(self) -> None:
        self.n = self.masked = self.sensitive = self.sensitive_masked = 0

    def add(self, doc, spans: Sequence[tuple[int, int, str]], regions: Sequence[tuple[int, int]]) -> None:
        tokens = [(i, i + n) for i, n, space in doc.to_array(["IDX", "LENGTH", "IS_SPACE"]).tolist()
                  if not space] if len(doc) else []
        for m, sens in zip(_hits(tokens, spans), _hits(tokens, regions)):
            self.n += 1
            self.masked += m
            self.sensitive += sens
            self.sensitive_masked += m and sens

    def summary(self) -> dict:
        non = self.n - self.sensitive
        non_masked = self.masked - self.sensitive_masked
        return {
            "tokens": self.n,
            "masked": self.masked,
            "masked_fraction": self.masked / self.n if self.n else math.nan,
            "sensitive_tokens": self.sensitive,
            "sensitive_masked_fraction": (self.sensitive_masked / self.sensitive if self.sensitive
                                          else math.nan),
            "non_sensitive_tokens": non,
            "non_sensitive_masked": non_masked,
            "non_sensitive_masked_fraction": non_masked / non if non else math.nan,
        }


def _ratio(found: int, total: int) -> dict:
    return {"found": found, "total": total, "recall": found / total if total else math.nan}


def field_recall(records: Any, detector: SecretDetector, id_maps: IdMaps | None = None, *,
                 fields: Iterable[str] = tuple(SENSITIVE_FIELDS), batch_size: int = 64) -> dict:
    """Recall of ``detector`` on the sensitive field values of ``records`` (a DataFrame or mappings).

    Ground truth comes from the verbaliser alone (:func:`value_regions`): for each record and each field
    whose value is not written "unknown", the characters of the value in ``verbalise(record)``. The field
    is found when every one of those characters is masked (a partly masked "250.83" is a miss, and a
    clause altered elsewhere does not count). Returns per-field, per-kind (:data:`SENSITIVE_FIELDS`) and
    overall (micro) recall, the macro mean over fields, and token counts: the fraction of all tokens
    masked, and of non-sensitive tokens (touching no sensitive value) masked, i.e. over-redaction (the
    "and" of "between 40 and 50" counts there: the age's values are the two numbers).
    """
    rows = _rows(records)
    fields = tuple(fields)
    unknown = [f for f in fields if f not in schema.COLUMNS]
    if unknown:
        raise ConfigError(f"unknown field(s) {unknown}; choose among the schema's columns")
    texts = [verbalise(r, id_maps) for r in rows]
    found, total = Counter(), Counter()
    tally = _TokenTally()
    for row, text, doc in zip(rows, texts, detector._docs(texts, batch_size)):
        spans = detector._doc_spans(doc, text)
        all_regions: list[tuple[int, int]] = []
        for f in fields:
            regions = value_regions(row, f, text, id_maps)
            if regions is None:
                continue
            all_regions.extend(regions)
            total[f] += 1
            found[f] += _covered(regions, spans)
        tally.add(doc, spans, all_regions)
    per_field = {f: _ratio(found[f], total[f]) for f in fields}
    recalls = [v["recall"] for v in per_field.values() if v["total"]]
    kinds: dict[str, list[int]] = {}
    for f in fields:
        k = kinds.setdefault(SENSITIVE_FIELDS.get(f, "other"), [0, 0])
        k[0] += found[f]
        k[1] += total[f]
    return {
        "level": detector.level,
        "records": len(rows),
        "fields": per_field,
        "by_kind": {k: _ratio(*v) for k, v in kinds.items()},
        "overall": _ratio(sum(found.values()), sum(total.values())),
        "macro_recall": sum(recalls) / len(recalls) if recalls else math.nan,
        "tokens": tally.summary(),
    }


def canary_recall(texts_with_canaries: Sequence[str], secrets: Sequence[str], detector: SecretDetector,
                  *, batch_size: int = 64) -> dict:
    """Recall of ``detector`` on injected secrets: a secret is found when it appears in no redacted text
    that carried it. Secrets in no text are counted as ``absent`` and left out of the total. Token counts
    are over the texts that carry a secret (the secret's characters are the sensitive region)."""
    secrets = list(dict.fromkeys(s for s in secrets if s))
    if not secrets:
        return {"level": detector.level, **_ratio(0, 0), "absent": 0, "missed": [],
                "tokens": _TokenTally().summary()}
    rx = re.compile("|".join(re.escape(s) for s in sorted(secrets, key=len, reverse=True)))
    carriers = [t for t in texts_with_canaries if rx.search(t)]
    seen: set[str] = set()
    leaked: set[str] = set()
    tally = _TokenTally()
    for text, doc in zip(carriers, detector._docs(carriers, batch_size)):
        spans = detector._doc_spans(doc, text)
        here = {m.group(0) for m in rx.finditer(text)}
        seen |= here
        redacted = apply_mask(text, spans, detector.mask)
        leaked |= {s for s in here if s in redacted}
        tally.add(doc, spans, [(m.start(), m.end()) for m in rx.finditer(text)])
    present = [s for s in secrets if s in seen]
    missed = [s for s in present if s in leaked]
    return {
        "level": detector.level,
        **_ratio(len(present) - len(missed), len(present)),
        "absent": len(secrets) - len(present),
        "missed": missed[:20],
        "tokens": tally.summary(),
    }
