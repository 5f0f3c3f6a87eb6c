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

Speed: the spaCy speed-up (lexeme flags for the Matcher's first-token predicates) is its own module,
:mod:`~raydp.data.redaction.lexeme_flags`, used only on the spaCy versions it was checked on (else the same
patterns and rules run as spaCy's plain predicates: the same spans, slower); ``redact_all(texts,
n_process=2)`` splits the texts over forked workers that return spans.

Modules: :mod:`~raydp.data.redaction.patterns` (what is masked: the fields, the entity-ruler patterns and the
clause rules), :mod:`~raydp.data.redaction.lexeme_flags` (the speed-up), :mod:`~raydp.data.redaction.detector`
(:class:`SecretDetector`, spans and masking) and :mod:`~raydp.data.redaction.recall` (:func:`field_recall`,
:func:`canary_recall`). Importing the package imports no spaCy: the detector imports it when built.
"""

from raydp.data.redaction.detector import SecretDetector, apply_mask
from raydp.data.redaction.patterns import E16_LABEL, LEVELS, MASK, PAYER_CODES, PRONOUNS, SENSITIVE_FIELDS
from raydp.data.redaction.recall import canary_recall, field_recall, value_regions

__all__ = ["E16_LABEL", "LEVELS", "MASK", "PAYER_CODES", "PRONOUNS", "SENSITIVE_FIELDS", "SecretDetector", "apply_mask",
           "canary_recall", "field_recall", "value_regions"]
