"""The structured synthetic population (raydp.data.structured) against independent computations: empirical
frequencies of large samples against the model's conditionals and marginals, its exact log-probabilities against a
naive per-record loop over the latents, and the derived-field and patient-level rules."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from raydp.data import schema
from raydp.data.structured import (
    CONDITIONS,
    P_CHANGE_WITHOUT_DOSE_MOVE,
    SEVERITIES,
    generate,
    population,
    population_report,
)
from raydp.data.synthetic import generate_records
from raydp.data.verbalise import verbalise_spans


@pytest.fixture(scope="module")
def sample() -> pd.DataFrame:
    return generate(60_000, np.random.default_rng(7), "private", 12_522, 135)


def _z_scores(observed: np.ndarray, expected_p: np.ndarray) -> np.ndarray:
    n = observed.sum()
    sd = np.sqrt(n * expected_p * (1 - expected_p))
    return np.where(sd > 0, (observed - n * expected_p) / np.maximum(sd, 1e-12), 0.0)


@pytest.mark.parametrize("child, parent", [("admission_source_id", "admission_type_id"), ("payer_code", "age")])
def test_observed_conditionals_match_the_models_table(sample, child, parent):
    """P(child | parent) for a field whose only parent is another field: the sample's frequencies against the
    table, cell by cell (binomial z-scores, with enough rows per parent value)."""
    model = population("private")
    f = model.by_name[child]
    parents = model.by_name[parent].values
    for i, value in enumerate(parents):
        rows = sample[sample[parent] == value]
        if len(rows) < 500:
            continue
        counts = rows[child].value_counts().reindex(list(f.values), fill_value=0).to_numpy()
        z = _z_scores(counts, f.table[i])
        assert np.abs(z).max() < 5, (child, value, z)


def _marginal(field) -> np.ndarray:
    """The exact marginal of a field whose parents are latents only: sum over (c, s) of P(c, s) P(field | c, s),
    written out as loops (not the module's einsum)."""
    model = population("private")
    out = np.zeros(len(field.values))
    for ci in range(len(CONDITIONS)):
        for si in range(len(SEVERITIES)):
            pz = model.prior_c[ci] * model.prior_s[ci, si]
            idx = {"c": ci, "s": si}
            row = field.table[tuple(idx[p] for p in field.parents)] if field.parents else field.table
            out += pz * row
    return out


@pytest.mark.parametrize("name", ["diag_1", "time_in_hospital", "A1Cresult", "medical_specialty", "num_procedures"])
def test_marginals_of_latent_driven_fields_match_a_large_sample(sample, name):
    f = population("private").by_name[name]
    expected = _marginal(f)
    patients = sample.drop_duplicates("patient_nbr") if name in ("race", "gender", "age") else sample
    counts = patients[name].value_counts().reindex(list(f.values), fill_value=0).to_numpy()
    keep = expected * len(patients) >= 5  # chi-square needs enough expected mass per cell
    chi2 = (((counts[keep] - len(patients) * expected[keep]) ** 2) / (len(patients) * expected[keep])).sum()
    # encounters of one patient share their latents: an overdispersion of ~1.4 (encounters per patient) allowed
    assert stats.chi2.sf(chi2 / 1.5, keep.sum() - 1) > 1e-3, (name, chi2, keep.sum())


def _naive_log_prob(record: dict, model) -> float:
    """log p(record), one record at a time: for each (c, s), the product of every field's conditional looked up
    by hand, then log-sum-exp; the derived fields by their rules."""
    terms = []
    for ci in range(len(CONDITIONS)):
        for si in range(len(SEVERITIES)):
            total = math.log(model.prior_c[ci]) + math.log(model.prior_s[ci, si])
            for f in model.fields:
                index = []
                for p in f.parents:
                    if p == "c":
                        index.append(ci)
                    elif p == "s":
                        index.append(si)
                    else:
                        index.append(model.by_name[p].values.index(record[p]))
                total += math.log(f.table[tuple(index)][f.values.index(record[f.name])])
            terms.append(total)
    top = max(terms)
    lp = top + math.log(sum(math.exp(t - top) for t in terms))
    meds = [record[m] for m in schema.MEDICATIONS]
    moved = any(m in ("Up", "Down") for m in meds)
    prescribed = any(m != "No" for m in meds)
    p_change = 1.0 if moved else P_CHANGE_WITHOUT_DOSE_MOVE if prescribed else 0.0
    lp += math.log(p_change if record["change"] == "Ch" else 1 - p_change)
    assert (record["diabetesMed"] == "Yes") == prescribed
    return lp


@pytest.mark.parametrize("name", ["private", "public", "pretraining"])
def test_exact_log_probabilities_match_a_naive_loop(sample, name):
    model = population(name)
    rows = sample.iloc[:40]
    fast = model.log_prob(rows)
    slow = [_naive_log_prob(r, model) for r in rows.to_dict("records")]
    np.testing.assert_allclose(fast, slow, rtol=1e-9, atol=1e-9)


def test_derived_fields_and_patient_level_fields_follow_their_rules(sample):
    meds = sample[list(schema.MEDICATIONS)]
    moved = meds.isin(["Up", "Down"]).any(axis=1)
    prescribed = (meds != "No").any(axis=1)
    assert (sample.loc[moved, "change"] == "Ch").all()
    assert (sample.loc[~prescribed, "change"] == "No").all()
    started = prescribed & ~moved
    rate = (sample.loc[started, "change"] == "Ch").mean()
    n = int(started.sum())
    assert abs(rate - P_CHANGE_WITHOUT_DOSE_MOVE) < 4 * math.sqrt(0.38 * 0.62 / n)
    assert ((sample["diabetesMed"] == "Yes") == prescribed).all()
    for column in ("race", "gender", "age", "weight"):  # the same on every encounter of a patient
        assert (sample.groupby("patient_nbr")[column].nunique() == 1).all(), column
    assert sample["patient_nbr"].nunique() < 0.85 * len(sample)  # patients have several encounters


def test_the_benchmark_holds_structure_and_a_private_shift_to_learn():
    """What the issue asks of the data: fields that depend on each other (the independent generator's do not),
    and at least 20 nats per record that only the private records teach beyond the pre-training population."""
    report = population_report(n=6000, seed=1)
    kl, half = report["kl_private_pretraining_nats"]
    assert kl - half >= 20.0
    assert 0 < report["kl_private_public_nats"][0] < kl  # the public population is related, nearer than pre-training
    assert report["total_correlation_nats"] > 5.0
    top = {(a, b) for a, b, _ in report["top_mutual_information_nats"]}
    assert ("medical_specialty", "diag_1") in top or ("diag_1", "medical_specialty") in top
    independent = generate_records(6000, 1, generator="independent", progress=False)
    structured = generate_records(6000, 1, progress=False)

    def cramers_v(frame):
        table = pd.crosstab(frame["medical_specialty"], frame["diag_1"].str[:1])
        chi2 = stats.chi2_contingency(table)[0]
        return math.sqrt(chi2 / (table.to_numpy().sum() * (min(table.shape) - 1)))

    assert cramers_v(structured) > 2 * cramers_v(independent)


def test_the_unseen_population_is_another_hospital_with_other_people():
    """The recipe's proof data (experiments/recipe-proof/): its records are far from the public population the recipe
    was searched on (farther than the private one is, which the public population proxies), its patients share no id
    with the other populations' draws, and a draw is the same for the same seed."""
    n = 3000
    unseen = generate_records(n, 0, population="unseen", progress=False)
    assert unseen.equals(generate_records(n, 0, population="unseen", progress=False))
    private = generate_records(n, 0, population="private", progress=False)

    def kl(frame, p, q):  # KL(p || q) per record, Monte Carlo over frame (drawn from p)
        return float(np.mean(population(p).log_prob(frame) - population(q).log_prob(frame)))

    assert kl(unseen, "unseen", "public") > 2 * kl(private, "private", "public") > 0
    assert kl(unseen, "unseen", "private") > 5.0  # not the benchmark's hospital either
    others = pd.concat([generate_records(n, 0, population=name, progress=False)
                        for name in ("private", "public", "pretraining", "audit", "canary")])
    for column in ("patient_nbr", "encounter_id"):
        assert not set(unseen[column]) & set(others[column])
    from raydp.data.streams import _ID_BASES

    # the id ranges: ids grow by < 200 (encounters) and < 50 (patients) per draw, and unseen's range is the highest,
    # so 10 million encounters of the population below it (pre-training) stay below unseen's first ids
    _, encounter, patient = _ID_BASES["unseen"]
    assert all((e, p) < (encounter, patient) for name, (_, e, p) in _ID_BASES.items() if name != "unseen")
    _, below_e, below_p = _ID_BASES["pretraining"]
    assert below_e + 200 * 10_000_000 <= encounter and below_p + 50 * 10_000_000 <= patient
    with pytest.raises(Exception, match="structured generator"):
        generate_records(10, 0, population="unseen", generator="independent", progress=False)


def test_the_verbalisers_spans_hold_the_field_values(sample):
    for record in sample.iloc[:200].to_dict("records"):
        text, spans = verbalise_spans(record)
        values = [text[a:b] for a, b in spans]
        assert len(values) == 49  # every field but the ids, age as its two bounds, change/diabetesMed/readmitted
        assert values[0] == (record["race"] if record["race"] != "?" else "unknown") and values[1] == record["gender"]
        assert str(record["num_lab_procedures"]) in values
        assert all(text[a - 1] == " " for a, _ in spans)  # a value starts a word
