"""Population Based Training over (clip, sigma) (issue 10): the member strategy, the population Renyi filter,
the study file, the exploit path of a run, and one real PBT study on Ray Tune."""

import io
import json
import math
import random
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from dp_accounting.rdp import rdp_privacy_accountant as dp_rdp

from raydp.errors import ConfigError
from raydp.privacy.accounting.rdp import DEFAULT_ORDERS, rdp_epsilon
from raydp.privacy.filter import FilterGuard, PopulationFilter, RenyiFilter
from raydp.privacy.guard import BudgetExhausted
from raydp.privacy.ledger import PrivacyLedger
from raydp.study.config import load_study
from raydp.study.grid import trial_grid

REPO = Path(__file__).resolve().parents[1]
ORDERS = np.asarray(DEFAULT_ORDERS)
#: dp_accounting and Opacus (which the filters use) agree exactly at integer orders; at fractional ones
#: dp_accounting's bound is the larger
INTEGER = np.array([float(a).is_integer() for a in DEFAULT_ORDERS])


def rdp_step(q: float, sigma: float) -> np.ndarray:
    """One Poisson-subsampled Gaussian step's RDP at the integer orders, from Google's dp_accounting (not the
    code under test)."""
    return np.asarray(dp_rdp._compute_rdp_poisson_subsampled_gaussian(q, sigma, ORDERS[INTEGER]))


# -- the population filter -------------------------------------------------------------------------
def test_population_filter_admits_exactly_the_population_budget():
    q, sigma, steps, members, delta = 0.02, 1.1, 10, 3, 1e-5
    member = RenyiFilter.for_plan(q, sigma, steps, delta)
    population = PopulationFilter.for_members(member, members)
    budget = members * steps * rdp_step(q, sigma)  # B_pop = M * B, by hand
    np.testing.assert_allclose(population.budget[INTEGER], budget, rtol=2e-9)
    assert np.all(population.budget[INTEGER] >= budget)  # the filter's 1e-9 slack only absorbs float sums
    assert population.budget == pytest.approx(members * member.budget, rel=1e-15)
    assert population.epsilon() == pytest.approx(rdp_epsilon(population.budget, ORDERS, delta), rel=1e-12)
    # members * steps steps at the plan's sigma fit, steps of them per member (its share); one more does not
    for i in range(members * steps - 1):
        assert population.admit(q, sigma, member=f"m{i % members}")
    assert not population.admit(q, sigma / 2, member="m0")  # a cheaper-noise step that would cross: refused
    assert population.admit(q, sigma, member="m2")
    np.testing.assert_allclose(population.spent[INTEGER], members * steps * rdp_step(q, sigma), rtol=1e-9)
    assert not population.admit(q, sigma, member="m2")
    assert population.within_budget() and np.all(population.spent <= population.budget)
    assert sum(population.admitted.values()) == members * steps
    assert population.refused == {"m0": 1, "m2": 1}
    described = population.describe()
    assert described["members"] == members and described["within_budget"]
    assert described["epsilon"] == population.epsilon()


def test_a_member_guard_asks_the_population_after_its_own_filter():
    q, sigma, steps = 0.02, 1.1, 4
    calls = []

    def population(q_, sigma_eff):
        calls.append(sigma_eff)
        return len(calls) <= 2

    guard = FilterGuard.for_plan(epsilon_target=50.0, delta=1e-5, planned_steps=steps, q=q, sigma_0=sigma,
                                 population_admit=population)
    ledger = PrivacyLedger()
    for _ in range(2):
        guard.admit(ledger, q, sigma)
        ledger.record_gaussian(q, sigma)
    with pytest.raises(BudgetExhausted, match="population's Renyi filter refused"):
        guard.admit(ledger, q, sigma)
    with pytest.raises(BudgetExhausted, match="would cross the filter's budget"):
        guard.admit(ledger, q, sigma / 10)  # the member's own filter refuses first: the population is not asked
    assert calls == [sigma] * 3



def _after_an_exploit(arrivals):
    """The review's probe (two members, plan T=10 steps at (q, sigma 1)): A runs 5 steps at sigma 0.98, B 5 at
    1.5; A exploits B (A's 5 steps are discarded but stay charged, A's own filter restarts from B's cheaper
    ledger) and both go on at 0.98, asking six steps each in the order ``arrivals`` (which, in a real study,
    follows the members' step times, hence their private Poisson batch sizes)."""
    q, steps = 0.05, 10
    population = PopulationFilter.for_members(RenyiFilter.for_plan(q, 1.0, steps, 1e-5), 2)
    for member, sigma in [("A", 0.98)] * 5 + [("B", 1.5)] * 5:
        assert population.admit(q, sigma, member=member)
    outcomes = {"A": [], "B": []}  # each member's own sequence of admitted / refused
    for member in arrivals:
        outcomes[member].append(population.admit(q, 0.98, member=member))
    assert population.within_budget() and np.all(population.spent <= population.budget)
    return outcomes, population.describe()


def test_who_the_population_filter_refuses_does_not_depend_on_arrival_order():
    """Admission must not follow wall-clock order (the review's p5 probe): A-first, B-first, interleaved and
    random interleavings of the same requests give every member the same admitted/refused sequence and the
    same released counts."""
    orders = [["A"] * 6 + ["B"] * 6, ["B"] * 6 + ["A"] * 6, ["A", "B"] * 6, ["B", "A"] * 6]
    rng = np.random.default_rng(0)
    orders += [list(rng.permutation(["A"] * 6 + ["B"] * 6)) for _ in range(8)]
    results = [_after_an_exploit(order) for order in orders]
    outcomes, described = results[0]
    for other, other_described in results[1:]:
        assert other == outcomes
        for key in ("steps_admitted", "steps_refused", "spent_rdp"):
            assert other_described[key] == described[key]
    assert not (all(outcomes["A"]) and all(outcomes["B"]))  # the budget binds: somebody is refused
    for member in "AB":  # refusal is a halting rule: once refused, a member is refused from then on
        admitted = outcomes[member]
        assert admitted == sorted(admitted, reverse=True)



def test_each_member_is_admitted_within_its_own_share_of_the_population_budget():
    """B_pop = M * B, one share B per member fixed before training: a member's discarded steps count against its
    own share, an unspent share is not lent to another member, and the shares add up to B_pop."""
    from raydp.study.population import Population

    q, sigma, steps = 0.02, 1.1, 4
    member = RenyiFilter.for_plan(q, sigma, steps, 1e-5)
    population = Population(PopulationFilter.for_members(member, 3), ["a", "b", "c"])
    for _ in range(steps):  # a runs its plan, then is exploited: those steps stay charged to a
        assert population.admit("a", q, sigma)
    assert not population.admit("a", q, sigma)  # b and c have spent nothing, but a's share is used up
    assert population.admit("b", q, sigma)
    filt = population.filter
    np.testing.assert_array_equal(filt.share.budget, member.budget)
    np.testing.assert_allclose(filt.spent[INTEGER], (steps + 1) * rdp_step(q, sigma), rtol=1e-9)
    described = population.state()["filter"]
    assert described["steps_admitted"] == {"a": steps, "b": 1} and described["steps_refused"] == {"a": 1}
    assert list(described["spent_rdp_by_member"]) == ["a", "b"] and described["within_budget"]
    with pytest.raises(ValueError, match="not a member"):
        population.admit("d", q, sigma)
    with pytest.raises(ValueError, match="has no share"):  # the filter alone: at most M members have a share
        for name in ("x", "y"):
            filt.admit(q, sigma, member=name)
    with pytest.raises(ConfigError, match="add up to more than"):
        PopulationFilter(member.orders, 2 * member.budget, 1e-5, members=3, share=member.budget)


# -- the member strategy ---------------------------------------------------------------------------
def test_pbt_strategy_dials_and_settings():
    from raydp.strategies.base import StrategyContext
    from raydp.strategies.registry import make_strategy, strategy_settings

    strategy = make_strategy("pbt", {"clip": 0.3, "sigma_scale": 1.25})
    strategy.setup(StrategyContext(n_pairs=4, pair_depths=(0.0, 0.3, 0.6, 1.0), q=0.01, planned_steps=10,
                                   sigma_0=0.8, epsilon_target=2.0, delta=1e-5))
    dials = strategy.dials(3)
    assert dials.clip == (0.3,) and dials.sigma == pytest.approx(1.0)
    assert (strategy.adaptive_sigma, strategy.clip_mode, strategy.allocation) == (True, "flat", "flat")
    assert strategy.releases() == () and strategy.schedule().is_constant
    assert strategy.state_dict() == {}  # an exploited member keeps its own new settings, not the donor's
    defaults = strategy_settings("pbt", {})
    assert (defaults.clip, defaults.sigma_scale) == (1.0, 1.0)
    with pytest.raises(ConfigError, match="settings.sigma_scale"):
        strategy_settings("pbt", {"sigma_scale": 0})
    assert "population_note" in strategy.describe()


# -- the study file --------------------------------------------------------------------------------
PBT_STUDY = {
    "name": "pbt-tiny",
    "models": ["embedded-tiny"],
    "epsilons": [2.0],
    "seeds": [0],
    "strategies": ["pbt"],
    "search": "pbt",
    "pbt": {"members": 2, "perturbation_interval": 1, "seed": 0},
    "resources": {"cpus_per_trial": 1},
    "wandb": {"mode": "disabled"},
    "base": {"data": {"n_records": 400}, "max_steps": 8, "eval_every": 4, "eval_max_records": 16,
             "warmup_steps": 4, "public_eval_records": 16},
}


def write_study(tmp_path, **changes):
    values = json.loads(json.dumps(PBT_STUDY))
    values.update(changes)
    path = tmp_path / f"{values['name']}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@pytest.mark.parametrize("changes, message", [
    ({"search": "grid"}, "strategy 'pbt' trains a population: set search: pbt"),
    ({"strategies": ["static"]}, "search: pbt trains a population of 'pbt' members: add 'pbt' to strategies"),
    ({"epsilons": [2.0, 8.0]}, "search: pbt trains one population: give one model, one epsilon and one seed"),
    ({"seeds": [0, 1]}, "search: pbt trains one population"),
    ({"selection": "private"}, "selection: private is refused"),
    ({"strategy_settings": {"pbt": {"clip": 0.5}}}, "give their ranges in pbt.hyperparam_mutations"),
    ({"pbt": {"members": 1}}, "pbt.members"),
    ({"pbt": {"hyperparam_mutations": {"clip": {"low": 2.0, "high": 0.1}}}}, "needs low < high"),
    ({"pbt": {"perturbation_interval": 0}}, "pbt.perturbation_interval"),
])
def test_invalid_pbt_studies_fail_with_one_line(tmp_path, changes, message, capsys):
    from raydp.cli import main

    path = write_study(tmp_path, **changes)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_study(path)
    assert main(["study", str(path), "--results-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_pbt_study_is_not_resumed(tmp_path):
    from raydp.study.runner import run_study

    with pytest.raises(ConfigError, match="a PBT study cannot be resumed"):
        run_study(write_study(tmp_path), tmp_path / "out", progress=False, resume=True)
    assert not (tmp_path / "out").exists()


def test_members_expand_with_seeded_settings_in_their_ranges(tmp_path):
    study = load_study(write_study(tmp_path, strategies=["static", "pbt"], pbt={"members": 4, "seed": 3}))
    trials = trial_grid(study)
    members = [t for t in trials if t.stage == "pbt"]
    assert [t.strategy for t in trials if t.stage != "pbt"] == ["static"]  # a baseline, run as a grid
    assert [m.member for m in members] == [0, 1, 2, 3]
    assert len({m.name for m in members}) == 4 and members[0].name.endswith("_member0")
    for m in members:
        assert 0.1 <= m.settings["clip"] <= 2.0 and 0.8 <= m.settings["sigma_scale"] <= 1.5
    assert len({m.settings["clip"] for m in members}) == 4
    assert trial_grid(study) == trials  # seeded: the same population every time
    shipped = load_study(REPO / "trials" / "pbt.yaml")
    assert shipped.search == "pbt" and len(trial_grid(shipped)) == shipped.pbt.members == 4


# -- the exploit path of a run ----------------------------------------------------------------------
def _rows(ledger: PrivacyLedger) -> list[tuple]:
    return [(r.step, r.q, r.sigma_eff, r.clip) for r in ledger]


def test_an_exploit_resumes_the_donors_state_with_the_new_settings(tmp_path, raydp_cache):
    """What Tune's exploit does to a member, without Tune: the member's run restores the donor's checkpoint
    (ledger, weights, optimizer) and goes on with ITS settings; the population is asked for its own steps only."""
    import torch

    from raydp.config import TrainConfig
    from raydp.runner.run import run_training

    base = {"model": "embedded-tiny", "strategy": "pbt", "epsilon": 2.0, "data": {"n_records": 400}, "max_steps": 8,
            "eval_every": 4, "eval_max_records": 8, "public_eval_records": 8, "warmup_steps": 2, "cpus": 1}
    checkpoints = []

    def keep(state):  # as Tune keeps it: serialised at the time (the optimizer state is updated in place)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        checkpoints.append(buffer.getvalue())

    donor = run_training(TrainConfig(**base, settings={"clip": 0.5, "sigma_scale": 1.3}), tmp_path / "donor",
                         progress=False, on_checkpoint=keep)
    state = next(s for s in (torch.load(io.BytesIO(c), weights_only=False) for c in checkpoints)
                 if s["trainer"]["step_count"] == 4)
    asked = []

    class Population:  # what PopulationAdmit is to a member: a callable that states the population's epsilon
        epsilon = 1.23

        def __call__(self, q, sigma_eff):
            asked.append(sigma_eff)
            return len(asked) <= 2  # the population admits two of the member's steps, then refuses

    population = Population()

    member = run_training(TrainConfig(**base, settings={"clip": 0.2, "sigma_scale": 1.1}), tmp_path / "member",
                          progress=False, resume=state, population_admit=population)
    donor_rows = _rows(PrivacyLedger.load(tmp_path / "donor"))
    ledger = PrivacyLedger.load(tmp_path / "member")
    rows = _rows(ledger)
    sigma_0 = member["privacy"]["sigma_0"]
    assert donor["privacy"]["sigma_0"] == sigma_0
    assert rows[:4] == donor_rows[:4]  # the donor's ledger, inherited
    assert [r[3] for r in rows[:4]] == [(0.5,)] * 4 and rows[0][2] == pytest.approx(1.3 * sigma_0, rel=1e-6)
    assert [r[3] for r in rows[4:]] == [(0.2,)] * 2  # the member's new settings from the exploit on
    assert [r[2] for r in rows[4:]] == pytest.approx([1.1 * sigma_0] * 2, rel=1e-6)
    assert asked == pytest.approx([1.1 * sigma_0] * 3, rel=1e-6)  # own steps only; the third was refused
    assert member["resumed_from_step"] == 4 and member["steps"] == 6
    assert "population's Renyi filter refused" in member["stopped_early"]
    privacy = member["privacy"]
    budget = np.asarray(privacy["filter"]["budget_rdp"])
    spent = sum(rdp_step(r[1], r[2]) for r in rows)  # the inherited prefix counts against the member's filter
    assert privacy["within_budget"] and privacy["steps_charged"] == 6 and np.all(spent <= budget[INTEGER])
    assert privacy["strategy"]["clip"] == 0.2 and privacy["strategy"]["sigma_scale"] == 1.1
    # the member reports the population's guarantee (its model depends on the whole population), its own filter's
    # figure beside it; a hook that states none claims no guarantee
    assert privacy["epsilon"] == 1.23 and 0 < privacy["epsilon_member_filter"] < math.inf
    assert any("PBT member" in label and "epsilon=1.2300" in label for label in privacy["labels"])
    silent = run_training(TrainConfig(**base, settings={"clip": 0.2, "sigma_scale": 1.1}), tmp_path / "silent",
                          progress=False, resume=state, population_admit=lambda q, sigma_eff: True)
    assert silent["privacy"]["epsilon"] == math.inf


# -- the synchronous scheduler's decisions ------------------------------------------------------------
class _Controller:
    """What the PBT scheduler sees of Ray 2.60's TuneController, with its semantics for the calls it makes:
    ``get_live_trials`` is every trial not TERMINATED (an ERROR trial stays), a scheduler hears a member's end
    while the member is still RUNNING and live, and a paused trial's report checkpoint is its latest one."""

    search_alg = None

    def __init__(self, trials):
        self.trials, self.live = list(trials), set(trials)

    def get_trials(self):
        return list(self.trials)

    def get_live_trials(self):
        return set(self.live)

    def _schedule_trial_save(self, trial, result=None):  # the save of a running trial's latest report
        return trial.checkpoint

    def pause_trial(self, trial, should_checkpoint=True):
        trial.set_status(trial.PAUSED)


class _Population:
    """Three members A, B, C under the study's scheduler (perturbation every 4 steps, plan of 20 steps) and a
    fake controller; events are played in the order a test gives. Records every perturbation: the sync step,
    and each exploit as (sync step, member, donor)."""

    def __init__(self, tmp_path):
        from ray.train import Checkpoint
        from ray.tune.experiment import Trial as TuneTrial

        from raydp.study.pbt import SyncPBTScheduler as _pbt_scheduler

        random.seed(0)  # PBT's exploit/explore draws
        self.checkpoint = Checkpoint.from_directory(str(tmp_path))
        self.trials = {name: TuneTrial("__fake", config={"lr": 0.1}, stub=True, experiment_tag=name)
                       for name in "ABC"}
        self.name = {t: name for name, t in self.trials.items()}
        self.scheduler = _pbt_scheduler(final_step=20, time_attr="step", metric="score", mode="min",
                                        perturbation_interval=4, hyperparam_mutations={"lr": [0.1, 0.2, 0.3]},
                                        quantile_fraction=0.25, resample_probability=0.0, synch=True,
                                        log_config=False)
        self.controller = _Controller(self.trials.values())
        self.syncs, self.exploits = [], []
        scheduler, exploit, checkpoint_or_exploit = self.scheduler, self.scheduler._exploit, \
            self.scheduler._checkpoint_or_exploit

        def spy_exploit(controller, trial, donor):
            self.exploits.append((scheduler._trial_state[trial].last_perturbation_time, self.name[trial],
                                  self.name[donor]))
            exploit(controller, trial, donor)

        def spy_sync(trial, *args):
            sync = scheduler._trial_state[trial].last_perturbation_time
            if sync not in self.syncs:
                self.syncs.append(sync)
            checkpoint_or_exploit(trial, *args)

        scheduler._exploit, scheduler._checkpoint_or_exploit = spy_exploit, spy_sync
        for trial in self.trials.values():
            scheduler.on_trial_add(self.controller, trial)
        self.settle()

    def settle(self):
        """The controller's loop: start every trial the scheduler chooses to run."""
        while (trial := self.scheduler.choose_trial_to_run(self.controller)) is not None:
            trial.set_status(trial.RUNNING)

    def report(self, name, step, score):
        """A member's report with the checkpoint of ``step``; a PAUSE decision pauses it (its save resolves)."""
        from ray.train._internal.session import _TrainingResult

        trial = self.trials[name]
        assert trial.status == trial.RUNNING, f"{name} reports at step {step} but is {trial.status}"
        metrics = {"step": step, "score": score}
        trial.run_metadata.checkpoint_manager._latest_checkpoint_result = _TrainingResult(self.checkpoint, metrics)
        if self.scheduler.on_trial_result(self.controller, trial, dict(metrics)) == self.scheduler.PAUSE:
            trial.set_status(trial.PAUSED)
        self.settle()

    def end(self, name, how):
        """A member's end: its last report then done (``complete``), or a failure Tune does not retry (``error``:
        the trial stays among the live ones, as in Ray 2.60)."""
        trial = self.trials[name]
        if how == "complete":
            self.scheduler.on_trial_complete(self.controller, trial, {"step": 6, "score": 1.0})
            trial.set_status(trial.TERMINATED)
            self.controller.live.discard(trial)
        else:
            self.scheduler.on_trial_error(self.controller, trial)
            trial.set_status(trial.ERROR)
        self.settle()

    def fail_and_retry(self, name):
        """A failure Tune retries (Ray 2.60's _try_recover): the scheduler hears ``on_trial_error`` with the trial
        in ERROR, then ``on_trial_add``, and the trial is PENDING again (to resume from its checkpoint)."""
        trial = self.trials[name]
        trial.set_status(trial.ERROR)
        self.scheduler.on_trial_error(self.controller, trial)
        trial.set_status(trial.PENDING)
        self.scheduler.on_trial_add(self.controller, trial)
        self.settle()


@pytest.mark.parametrize("how", ["complete", "error"])
@pytest.mark.parametrize("order", ["ends_first", "ends_between", "ends_last"])
def test_a_sync_point_does_not_depend_on_when_an_ended_member_ends(tmp_path, order, how):
    """Member A stops after step 6 (its filter refused step 7), before the sync point at step 8. Whether its end
    reaches the driver before, between or after B's and C's results at step 8 follows their step times (the
    private batch sizes), so it must change nothing: the sync at 8 is performed among B and C in every order,
    and the next one is at 12, on the grid."""
    population = _Population(tmp_path)
    for name, score in (("A", 1.0), ("B", 2.0), ("C", 3.0)):
        population.report(name, 4, score)  # all three at the first sync point
    population.report("A", 6, 1.0)  # A's last evaluation (stopped early), between sync points
    events = {"ends_first": ["end", "B", "C"], "ends_between": ["B", "end", "C"],
              "ends_last": ["B", "C", "end"]}[order]
    for event in events:
        if event == "end":
            population.end("A", how)
        else:
            population.report(event, 8, {"B": 2.0, "C": 3.0}[event])
    assert population.scheduler._next_perturbation_sync == 12
    for name in "BC":
        population.report(name, 12, {"B": 2.0, "C": 3.0}[name])
    assert population.syncs == [4, 8, 12]
    assert population.exploits == [(4, "C", "A"), (8, "C", "B"), (12, "C", "B")]
    assert population.scheduler._next_perturbation_sync == 16


@pytest.mark.parametrize("fails", ["before", "after"])
def test_a_retried_member_is_waited_for(tmp_path, fails):
    """A member whose failure Tune retries has not ended: the sync point waits for it, whether it failed before
    or after the others reached the sync point."""
    population = _Population(tmp_path)
    for name, score in (("A", 1.0), ("B", 2.0), ("C", 3.0)):
        population.report(name, 4, score)
    if fails == "before":
        population.fail_and_retry("A")
    population.report("B", 8, 2.0)
    population.report("C", 8, 3.0)
    if fails == "after":
        population.fail_and_retry("A")
    assert population.syncs == [4]
    population.report("A", 8, 1.0)  # resumed from its checkpoint at 4, it reaches the sync point
    assert population.syncs == [4, 8] and population.exploits == [(4, "C", "A"), (8, "C", "A")]
    assert population.scheduler._next_perturbation_sync == 12


# -- one real PBT study on Ray Tune -------------------------------------------------------------------
# ~60 s on CI's 2 cores (every exploit restarts a member's actor): the slow tier. The fast tier has parts of it: Tune's
# real scheduler's syncs, exploits and a failed member's retry (_Population above), and a member resuming its donor's
# state with new settings and reporting the population's epsilon
# (test_an_exploit_resumes_the_donors_state_with_the_new_settings). Only this study runs the population actor, a
# member finding its own name after an exploit, and the population filter over a whole study.
@pytest.fixture(scope="module")
def pbt_study(local_ray, tmp_path_factory):
    from raydp.study.runner import run_study

    root = tmp_path_factory.mktemp("pbt")
    study_dir = run_study(write_study(root), root / "out", progress=False)
    yield study_dir


def _common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.slow
def test_pbt_study_exploits_and_stays_within_every_budget(pbt_study):
    study_dir = pbt_study
    table = pd.read_parquet(study_dir / "results.parquet")
    names = [f"pbt_embedded-tiny_eps2_seed0_member{i}" for i in range(2)]
    assert sorted(table["trial"]) == names  # each member once, not once per incarnation
    assert (table["status"] == "TERMINATED").all() and table["within_budget"].all()
    assert sorted(p.name for p in (study_dir / "trials").iterdir()) == names  # no half-written output left
    population = json.loads((study_dir / "pbt_population.json").read_text())
    summary = json.loads((study_dir / "study_summary.json").read_text())

    # at least one exploit, seen by Tune, by the population actor and in the ledgers
    assert population["n_exploits"] >= 1 and population["pbt_global_log_lines"] >= 1
    assert summary["pbt_population"]["exploits"] == population["n_exploits"]
    ledgers = {n: PrivacyLedger.load(study_dir / "trials" / n) for n in names}
    rows = {n: _rows(ledger) for n, ledger in ledgers.items()}
    shared = _common_prefix(*rows.values())
    assert shared >= 4  # one member's ledger starts with rows the other member ran (their initial clips differ)
    first_clips = {s["member"]: s["settings"]["clip"] for s in population["starts"] if s["start"] == 0}
    assert len(set(first_clips.values())) == 2 and rows[names[0]][0][3][0] in first_clips.values()
    for name in names:  # each member's last incarnation ran with ITS settings (after an exploit: the new ones)
        last = [s for s in population["starts"] if s["member"] == name][-1]
        sigma_0 = json.loads((study_dir / "trials" / name / "summary.json").read_text())["privacy"]["sigma_0"]
        tail = rows[name][last["step"] or 0:]
        assert tail and all(r[3] == (last["settings"]["clip"],) for r in tail)
        assert all(r[2] >= last["settings"]["sigma_scale"] * sigma_0 * (1 - 1e-6) for r in tail)  # only raised
    assert any(s["from_checkpoint_of"] not in (None, s["member"]) for s in population["starts"])

    # every member within its own filter budget (dp_accounting's RDP of its whole ledger, inherited rows included)
    budgets = []
    for name in names:
        privacy = json.loads((study_dir / "trials" / name / "summary.json").read_text())["privacy"]
        budget = np.asarray(privacy["filter"]["budget_rdp"])
        assert np.all(sum(rdp_step(r[1], r[2]) for r in rows[name]) <= budget[INTEGER])
        budgets.append(budget)

    # the population filter: every step any member ran was charged, and the spent curve stayed under M * B
    filt = population["filter"]
    spent, pop_budget = np.asarray(filt["spent_rdp"]), np.asarray(filt["budget_rdp"])
    np.testing.assert_allclose(pop_budget, sum(budgets), rtol=1e-12)
    assert np.all(spent <= pop_budget) and filt["within_budget"]
    run_steps = sum(len(r) for r in rows.values()) - shared  # steps in the final ledgers, shared ones once
    assert sum(filt["steps_admitted"].values()) >= run_steps  # discarded steps are charged too
    for name in names:
        assert np.all(spent[INTEGER] >= sum(rdp_step(r[1], r[2]) for r in rows[name]) * (1 - 1e-9))

    # the study's reported (tuning-aware) epsilon is the composition of the members' budgets = the population's
    sha = json.loads((study_dir / "dataset" / "manifest.json").read_text())["dataset_id"]
    tuning = summary["tuning_aware_epsilon"][sha]
    assert tuning["trials"] == 2 and tuning["unknown_spend"] == []
    composed = rdp_epsilon(sum(budgets), ORDERS, filt["delta"])
    assert tuning["tuning_aware_epsilon"] == pytest.approx(composed, rel=1e-9)
    assert summary["pbt_population"]["population_epsilon"] == pytest.approx(composed, rel=1e-9)
    # every member reports the population's epsilon (its model depends on the whole population), and
    # beside it its own filter's figure, which is smaller
    assert table["epsilon"].to_numpy() == pytest.approx(composed, rel=1e-9)
    for name in names:
        privacy = json.loads((study_dir / "trials" / name / "summary.json").read_text())["privacy"]
        assert privacy["epsilon_member_filter"] < composed and any("PBT member" in x for x in privacy["labels"])


@pytest.mark.slow
def test_report_prints_the_population_epsilon(pbt_study, capsys):
    from raydp.study.tables import format_report

    report = format_report(pbt_study)
    assert "PBT population: 2 members" in report and "population epsilon" in report
