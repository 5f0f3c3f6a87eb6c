"""The secret detector of DualTune-GhostDP's phase 1 (raydp.data.redaction, ERRATA E16): rules on hand-written
text, recall against the verbaliser (checked by hand on two records), measured recall on synthetic records, and
the trained-pipeline path with a pipeline built here (no network)."""

import sys

import numpy as np
import pytest

spacy = pytest.importorskip("spacy")

from raydp.data import generate_records, verbalise, verbalise_records  # noqa: E402
from raydp.data.canaries import random_secrets, suffix  # noqa: E402
from raydp.data.redaction import (  # noqa: E402
    E16_LABEL,
    MASK,
    SENSITIVE_FIELDS,
    SecretDetector,
    canary_recall,
    field_recall,
    value_regions,
)
from raydp.errors import ConfigError  # noqa: E402

R = MASK


@pytest.fixture(scope="module")
def base():
    return SecretDetector("base")


@pytest.fixture(scope="module")
def high():
    return SecretDetector("high_context")


# -- rules on hand-written text ---------------------------------------------------------------------


def test_canaries_are_masked(base, high):
    text = "the patient was not readmitted. secret_id=O119XP9N56."
    for d in (base, high):
        assert d.redact(text) == f"the patient was not readmitted. secret_id={R}."
        assert d.spans(text) == [(42, 52, "SECRET")]
    # a bare canary-like string (capitals and digits, 6+) and a keyed secret of any shape
    assert base.redact("token AB12CD34 and password: hunter2.") == f"token {R} and password: {R}."
    # capitals only, no key: not canary-like (documented limitation)
    assert base.redact("code ZXCVBNMASD.") == "code ZXCVBNMASD."


def test_dates_and_times(base):
    text = "Seen 2021-03-04, again 04/03/2021, on 3 March 2021, on March 3rd, 2021, in May 2022 at 10:30."
    assert base.redact(text) == f"Seen {R}, again {R}, on {R}, on {R}, in {R} at {R}."
    assert {label for *_, label in base.spans(text)} == {"DATE", "TIME"}
    assert base.redact("May I help?") == "May I help?"  # "May" needs a number


def test_icd9_codes(base):
    text = ("the primary diagnosis code (first three digits of ICD9) is 250.83. "
            "the secondary diagnosis code (first three digits of ICD9) is V57. Also E909.")
    assert base.redact(text) == (f"the primary diagnosis code (first three digits of ICD9) is {R}. "
                                 f"the secondary diagnosis code (first three digits of ICD9) is {R}. Also {R}.")
    assert [label for *_, label in base.spans(text)] == ["ICD9", "ICD9", "ICD9"]


def test_demographics_payer_and_identifiers(base):
    text = ("race is AfricanAmerican. gender is Female. the patient ages between 40 and 50 years old. "
            "weight is [150-175). payer code is DM. encounter id 12345, patient_nbr=8222157.")
    assert base.redact(text) == (f"race is {R}. gender is {R}. the patient ages between {R} years old. "
                                 f"weight is {R}. payer code is {R}. encounter id {R}, patient_nbr={R}.")
    assert [label for *_, label in base.spans(text)] == [
        "RACE", "GENDER", "AGE", "WEIGHT", "PAYER", "IDENTIFIER", "IDENTIFIER"]
    # schema values that are common words count only after their field name
    assert base.redact("race is Other. gender is Unknown/Invalid.") == f"race is {R}. gender is {R}."
    assert base.redact("Other patients came.") == "Other patients came."
    assert base.redact("a 72-year-old male, 80 kg") == f"a {R}-year-old {R}, {R} kg"


def test_pronouns_and_proper_nouns_only_at_high_context(base, high):
    text = "She told the nurse that her son visited Boston. The visit went well."
    assert base.redact(text) == text
    assert high.redact(text) == f"{R} told the nurse that {R} son visited {R}. The visit went well."
    assert [label for *_, label in high.spans(text)] == ["PRONOUN", "PRONOUN", "PROPER"]


def test_text_with_nothing_sensitive_stays_intact(base, high):
    text = ("The patient has the following profile. metformin is unchanged. insulin is not prescribed. "
            "the patient's diabetic medications were not changed. the patient was not readmitted.")
    for d in (base, high):
        assert d.spans(text) == []
        assert d.redact(text) == text


def test_high_context_masks_attribute_values(base, high):
    text = ("discharge disposition id is Expired at home. Medicaid only, hospice.. medical specialty is "
            "Surgery-Cardiovascular/Thoracic. max glu serum is Norm. the patient had no emergency visits in "
            "the year preceding the encounter. weight is unknown.")
    assert high.redact(text) == (f"discharge disposition id is {R}. medical specialty is {R}. max glu serum is "
                                 f"{R}. the patient had {R} emergency visits in the year preceding the "
                                 "encounter. weight is unknown.")
    assert base.redact(text) == text


def test_spans_are_sorted_merged_and_keep_protects(high):
    text = "race is Hispanic. the patient had 3 inpatient visits. the patient was readmitted in less than 30 days."
    spans = high.spans(text)
    assert spans == sorted(spans)
    assert all(e1 < s2 for (_, e1, _), (s2, _, _) in zip(spans, spans[1:]))  # not even touching
    assert text[spans[-1][0]:spans[-1][1]] == "30"
    label = "the patient was readmitted in less than 30 days."
    keeper = SecretDetector("high_context", keep=[label])
    assert keeper.redact(text) == f"race is {R}. the patient had {R} inpatient visits. {label}"


def test_every_random_canary_is_one_token_and_masked(base):
    # spaCy's English tokenizer glues "secret_id=AB12CD34EF." for ~40% of random secrets; the detector's
    # tokenizer rules must not
    secrets = random_secrets(np.random.default_rng(11), 2000)
    texts = ["the patient was not readmitted." + suffix(s) for s in secrets]
    out = canary_recall(texts, secrets, base)
    assert (out["found"], out["total"], out["missed"]) == (2000, 2000, [])


def test_redact_all_matches_redact_and_parallel(base, high):
    texts = verbalise_records(generate_records(40, seed=5, progress=False), progress=False)
    texts = [t + suffix(s) for t, s in zip(texts, random_secrets(np.random.default_rng(5), 40))]
    for d in (base, high):
        one = [d.redact(t) for t in texts]
        assert d.redact_all(texts) == one
        assert d.redact_all(texts, batch_size=4, n_process=2) == one  # forked workers


def test_the_lexeme_flag_speed_up_runs_only_on_the_spacy_versions_it_was_checked_on():
    from raydp.data.redaction.lexeme_flags import CHECKED_SPACY, lexeme_flags_supported

    major, minor = CHECKED_SPACY[0]
    assert lexeme_flags_supported(f"{major}.{minor}.0") and lexeme_flags_supported(f"{major}.{minor}.18")
    for other in (f"{major}.{minor + 1}.0", f"{major + 1}.0.0", "3.7.5", "not-a-version", ""):
        assert not lexeme_flags_supported(other), other


def test_the_plain_path_finds_the_same_spans_as_the_lexeme_flags(base, high, monkeypatch):
    """On a spaCy version the speed-up was not checked on, the detector runs the patterns and token rules as
    spaCy's plain predicates: the same spans, slower."""
    from raydp.data.redaction.lexeme_flags import lexeme_flags_supported

    texts = verbalise_records(generate_records(60, seed=9, progress=False), progress=False)
    texts = [t + suffix(s) for t, s in zip(texts, random_secrets(np.random.default_rng(9), 60))]
    texts += ["She met Alice in Boston on May 3, 2021 at 10:30; MRN: 1234567, a 72-year-old, 80 kg, race is White."]
    if lexeme_flags_supported(spacy.__version__):
        assert base.describe()["lexeme_flags"] > 0 and base._token_flags.use_flags
    monkeypatch.setattr(spacy, "__version__", "3.999.0")  # a version nobody checked
    for fast in (base, high):
        plain = SecretDetector(fast.level)
        assert plain.describe()["lexeme_flags"] == 0 and not plain._token_flags.use_flags
        assert not any(isinstance(key, int) for p in plain.nlp.get_pipe("raydp_secret_ruler").patterns
                       if not isinstance(p["pattern"], str) for token in p["pattern"] for key in token)
        assert plain.spans_all(texts) == fast.spans_all(texts), fast.level
        assert plain.redact_all(texts, batch_size=4, n_process=2) == fast.redact_all(texts)


def test_describe(high):
    info = high.describe()
    assert info["level"] == "high_context" and info["spacy_version"] == spacy.__version__
    assert info["pipeline"] == "spacy.blank('en')" and info["label"] == E16_LABEL
    assert info["token_patterns"] > 0 and info["phrase_patterns"] > 0 and info["patterns_per_label"]["SECRET"] == 2
    assert "DP" in info["guarantee"]


# -- recall: ground truth from the verbaliser, checked by hand ---------------------------------------

_A = {"race": "Caucasian", "gender": "Female", "age": "[70-80)", "weight": "?", "admission_type_id": 1,
      "discharge_disposition_id": 1, "admission_source_id": 7, "time_in_hospital": 3, "payer_code": "MC",
      "medical_specialty": "Cardiology", "num_lab_procedures": 41, "num_procedures": 0,
      "num_medications": 12, "number_outpatient": 0, "number_emergency": 2, "number_inpatient": 0,
      "diag_1": "428", "diag_2": "250.02", "diag_3": "V45", "number_diagnoses": 9, "max_glu_serum": "None",
      "A1Cresult": ">8"}
_B = {"race": "?", "gender": "Male", "age": "[50-60)", "weight": "[75-100)", "admission_type_id": 6,
      "discharge_disposition_id": 11, "admission_source_id": 17, "time_in_hospital": 1, "payer_code": "?",
      "medical_specialty": "?", "num_lab_procedures": 1, "num_procedures": 6, "num_medications": 5,
      "number_outpatient": 1, "number_emergency": 0, "number_inpatient": 3, "diag_1": "?", "diag_2": "E885",
      "diag_3": "8", "number_diagnoses": 3, "max_glu_serum": ">300", "A1Cresult": "Norm"}


@pytest.fixture(scope="module")
def hand_records():
    rest = generate_records(1, seed=0, progress=False).iloc[0].to_dict()  # medications etc.
    return [{**rest, **_A}, {**rest, **_B}]


def test_value_regions_are_the_values_the_verbaliser_writes(hand_records):
    b = hand_records[1]
    text = verbalise(b)
    got = {f: (None if (r := value_regions(b, f, text)) is None else [text[s:e] for s, e in r])
           for f in SENSITIVE_FIELDS}
    assert got == {
        "race": None, "gender": ["Male"], "age": ["50", "60"], "weight": ["[75-100)"],
        "admission_type_id": None, "discharge_disposition_id": ["Expired"], "admission_source_id": None,
        "time_in_hospital": ["1"], "payer_code": None, "medical_specialty": None,
        "num_lab_procedures": ["1"], "num_procedures": ["6"], "num_medications": ["5"],
        "number_outpatient": ["1"], "number_emergency": ["no"], "number_inpatient": ["3"], "diag_1": None,
        "diag_2": ["E885"], "diag_3": ["8"], "number_diagnoses": ["3"], "max_glu_serum": [">300"],
        "A1Cresult": ["Norm"],
    }
    a = hand_records[0]
    text = verbalise(a)
    assert [text[s:e] for s, e in value_regions(a, "admission_source_id", text)] == ["Emergency Room"]
    assert [text[s:e] for s, e in value_regions(a, "number_outpatient", text)] == ["no"]


def test_field_recall_matches_a_hand_count(hand_records, base, high):
    # By hand: A has 20 known sensitive fields (weight '?', max_glu 'None' read "unknown"), B has 16.
    # The base rules miss A's admission type/discharge/source ("Emergency", "Discharged to home",
    # "Emergency Room"), specialty ("Cardiology"), the zero visit counts ("no") -> 14/20; and B's
    # discharge ("Expired"), zero emergency visits ("no"), A1C "Norm" -> 13/16.
    out = field_recall(hand_records, base)
    assert (out["overall"]["found"], out["overall"]["total"]) == (27, 36)
    fields = out["fields"]
    assert {f for f, v in fields.items() if v["found"] < v["total"]} == {
        "admission_type_id", "discharge_disposition_id", "admission_source_id", "medical_specialty",
        "number_outpatient", "number_emergency", "number_inpatient", "A1Cresult"}
    assert (fields["discharge_disposition_id"]["found"], fields["discharge_disposition_id"]["total"]) == (0, 2)
    assert (fields["number_outpatient"]["found"], fields["number_outpatient"]["total"]) == (1, 2)
    assert (fields["race"]["total"], fields["weight"]["total"], fields["A1Cresult"]["found"]) == (1, 1, 1)
    assert {k: (v["found"], v["total"]) for k, v in out["by_kind"].items()} == {
        "demographic": (6, 6), "encounter": (2, 7), "payer": (1, 1), "count": (8, 8), "visits": (3, 6),
        "diagnosis": (5, 5), "lab": (2, 3)}
    full = field_recall(hand_records, high)
    assert (full["overall"]["found"], full["overall"]["total"]) == (36, 36)
    tokens = out["tokens"]
    assert 0 < tokens["masked"] < tokens["tokens"]
    assert tokens["non_sensitive_masked"] >= 2  # "and" between the age bounds, in each record


def test_canary_recall_matches_a_hand_count(hand_records, base, high):
    texts = [verbalise(hand_records[0]) + suffix("O119XP9N56"), verbalise(hand_records[1]) + suffix("QWERTYUIOP"),
             "Free text note: code ZXCVBNMASD was given."]
    secrets = ["O119XP9N56", "QWERTYUIOP", "ZXCVBNMASD", "ABSENT1234"]
    for d in (base, high):
        out = canary_recall(texts, secrets, d)
        # keyed secrets are found whatever their letters; a bare capitals-only one is not; one is in no text
        assert (out["found"], out["total"], out["absent"], out["missed"]) == (2, 3, 1, ["ZXCVBNMASD"])


# -- measured recall on synthetic records -----------------------------------------------------------


@pytest.fixture(scope="module")
def synthetic():
    records = generate_records(300, seed=7, progress=False)
    secrets = random_secrets(np.random.default_rng(1), 300)
    texts = [t + suffix(s) for t, s in zip(verbalise_records(records, progress=False), secrets)]
    return records, texts, secrets


def test_measured_recall_base(synthetic, base):
    records, texts, secrets = synthetic
    out = field_recall(records, base)
    # measured (300 records, seed 7): overall 3716/5456 = 0.681 (macro 0.674); 1.0 on race, gender, age,
    # weight, time_in_hospital, payer_code, num_*, diag_1-3, number_diagnoses; 0 on admission type /
    # discharge / source and medical_specialty (no rule for free-text values); visits 0.13-0.36 (zero
    # counts read "no"); max_glu_serum 0.5, A1Cresult 0.68 ("Norm"). Tokens masked 4.5%, non-sensitive
    # tokens masked 0.47% ("30" of "readmitted in ... 30 days", "and" between the age bounds).
    assert out["overall"]["recall"] >= 0.66
    assert out["fields"]["diag_1"]["recall"] == 1.0 and out["fields"]["race"]["recall"] == 1.0
    assert out["fields"]["medical_specialty"]["recall"] == 0.0
    assert out["tokens"]["non_sensitive_masked_fraction"] <= 0.01
    assert canary_recall(texts, secrets, base)["recall"] == 1.0  # measured 300/300


def test_measured_recall_high_context(synthetic, high):
    records, texts, secrets = synthetic
    out = field_recall(records, high)
    # measured: 5456/5456 = 1.0 on every field (the clause rules are written for this template: this says
    # nothing of free text). Tokens masked 7.9%, non-sensitive tokens masked 0.47%.
    assert out["overall"]["recall"] >= 0.99
    assert min(v["recall"] for v in out["fields"].values()) >= 0.98
    assert out["tokens"]["non_sensitive_masked_fraction"] <= 0.01
    assert canary_recall(texts, secrets, high)["recall"] == 1.0  # measured 300/300


# -- trained-pipeline path, without network ---------------------------------------------------------


def test_a_pipeline_on_disk_adds_its_tags_at_high_context(tmp_path):
    nlp = spacy.blank("en")
    tagger = nlp.add_pipe("attribute_ruler")
    tagger.add([[{"LOWER": "visited"}]], {"POS": "VERB"})
    tagger.add([[{"LOWER": "someone"}]], {"POS": "PRON"})
    tagger.add([[{"LOWER": "boston"}]], {"POS": "PROPN"})
    tagger.add([[{"LOWER": "nurse"}]], {"DEP": "nsubj"})
    ner = nlp.add_pipe("entity_ruler", name="ner")  # stands in for a trained NER
    ner.add_patterns([{"label": "PERSON", "pattern": [{"LOWER": "alice"}]}])
    nlp.to_disk(tmp_path)

    text = "the nurse visited boston with alice and someone on 2021-03-04. secret_id=AB12CD34EF."
    high = SecretDetector("high_context", pipeline=str(tmp_path))
    assert high.nlp.pipe_names == ["attribute_ruler", "raydp_secret_ruler", "ner"]  # ruler before the NER
    assert high.redact(text) == f"the {R} {R} {R} with {R} and {R} on {R}. secret_id={R}."
    assert [label for *_, label in high.spans(text)] == [
        "DEP_NSUBJ", "POS_VERB", "POS_PROPN", "PERSON", "POS_PRON", "DATE", "SECRET"]
    assert high.describe()["pipeline"] == str(tmp_path)
    base = SecretDetector("base", pipeline=str(tmp_path))  # the rules only
    assert base.redact(text) == f"the nurse visited boston with alice and someone on {R}. secret_id={R}."


def test_a_pipeline_that_cannot_be_loaded_is_one_config_error(tmp_path):
    for name in ("raydp_no_such_spacy_pipeline", str(tmp_path / "missing")):
        with pytest.raises(ConfigError, match="cannot be loaded") as err:
            SecretDetector("high_context", pipeline=name)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="level"):
        SecretDetector("medium")


def test_a_missing_spacy_is_a_one_line_error_naming_the_extra(monkeypatch):
    from raydp.data.redaction import SecretDetector
    from raydp.errors import ConfigError

    monkeypatch.setitem(sys.modules, "spacy", None)  # `import spacy` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'rldp-finetune\[redaction\]'") as info:
        SecretDetector()
    assert "\n" not in str(info.value)
