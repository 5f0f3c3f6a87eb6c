"""The population of a PBT study: one Ray actor holding the population's Renyi filter, reached by name.

Population Based Training (``search: pbt``, :func:`raydp.study.pbt._fit_pbt`) runs M members side by
side; an exploit throws away a member's own steps and copies a better member's checkpoint. Every step any
member ran touched the private data, kept or not. The study driver therefore creates, before
``Tuner.fit``, one actor holding a :class:`~raydp.privacy.filter.PopulationFilter` with budget curve
B_pop = M * B (B: the member plan's Renyi filter budget, the same for every member), split into one
share B per member. Each member's guard asks it before every step (``population_admit``, threaded into
:class:`~raydp.privacy.filter.FilterGuard`); a step is admitted iff every step that member has run
(discarded ones included) plus this one stays under its share, so whether a member is refused depends on
its own requests only, never on the order in which concurrent members' requests reach the actor (see
:class:`~raydp.privacy.filter.PopulationFilter` for the theorem); a refused step stops that member cleanly
(BudgetExhausted).

The actor also knows who is who: a Tune trial keeps its id through exploits, but its config (hence any
name in it) becomes a mutated copy of the donor's, so the member a trial trains is registered by Tune trial
id at the trial's first start. When a trial starts from a checkpoint, the actor reads whose checkpoint it
is from Tune's trial directory in its path and records an exploit when it is another member's (the
lineage written to ``pbt_population.json``).

The actor's state (spent curve, lineage) lives only in the running study: a PBT study cannot be
resumed with ``--resume`` (:func:`raydp.study.runner.run_study` refuses it).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from raydp.data import load_texts
from raydp.errors import ConfigError
from raydp.privacy.filter import PopulationFilter, RenyiFilter
from raydp.runner.privacy_setup import plan_private_run, training_units
from raydp.study.grid import trial_config

POPULATION_FILE = "pbt_population.json"
ACTOR_PREFIX = "raydp-pbt-population"


class Population:
    """The population filter plus the registry of members (plain Python; run as a Ray actor)."""

    def __init__(self, population: PopulationFilter, members: list[str]) -> None:
        if len(members) != population.members:
            raise ValueError(f"{len(members)} member names for a population of {population.members}")
        self.filter = population
        self.members = list(members)
        self.trials: dict[str, str] = {}  # Tune trial id -> member name
        self.starts: list[dict] = []  # every start of a member's trainable
        self.exploits: list[dict] = []

    def join(self, trial_id: str, member: int, checkpoint_path: str | None = None,
             step: int | None = None, settings: dict | None = None) -> str:
        """The member that Tune trial ``trial_id`` trains (``member``: the index in its config, used only at
        the trial's first start, before any exploit could have replaced its config). ``checkpoint_path``:
        where the trial resumes from (``step``: its step); a checkpoint of another member's trial is an
        exploit. ``settings``: the member's (clip, sigma_scale) from this start on."""
        name = self.trials.get(trial_id)
        if name is None:
            if not 0 <= int(member) < len(self.members):
                raise ValueError(f"member index {member} outside the population of {len(self.members)}")
            name = self.members[int(member)]
            if name in self.trials.values():
                raise ValueError(f"member {name} is already trained by another Tune trial")
            self.trials[trial_id] = name
        source = None
        if checkpoint_path:
            owners = [t for t in self.trials if t in str(checkpoint_path)]
            source = self.trials[owners[0]] if len(owners) == 1 else "unknown"
        start = {"member": name, "trial_id": trial_id, "start": len([s for s in self.starts if s["member"] == name]),
                 "from_checkpoint_of": source, "step": step, "settings": dict(settings or {})}
        self.starts.append(start)
        if source is not None and source != name:
            self.exploits.append({"member": name, "donor": source, "step": step, "settings": dict(settings or {})})
        return name

    def member_of(self, trial_id: str) -> str | None:
        return self.trials.get(trial_id)

    def admit(self, member: str, q: float, sigma_eff: float) -> bool:
        """Whether ``member``'s next step is admitted: within its own share of B_pop (order-independent)."""
        if member not in self.members:
            raise ValueError(f"{member!r} is not a member of this population")
        return self.filter.admit(q, sigma_eff, member)

    def epsilon(self) -> float:
        return self.filter.epsilon()

    def state(self) -> dict:
        return {"filter": self.filter.describe(), "members": list(self.members), "trials": dict(self.trials),
                "starts": list(self.starts), "exploits": list(self.exploits), "n_exploits": len(self.exploits)}


def population_filter(study, members: list, dataset: str) -> tuple[PopulationFilter, int]:
    """(population filter, the members' planned steps). B_pop = M * B, B the Renyi filter budget of the
    members' plan (every member has the same plan: PBT's settings change the dials, not the plan; checked
    here), built exactly as each member's guard builds it (:meth:`raydp.privacy.filter.FilterGuard.for_plan`)."""
    n_train = len(load_texts(dataset, "train"))
    budgets = set()
    filt = plan = None
    for member in members:
        config = trial_config(study, member, dataset)
        plan = plan_private_run(config, training_units(config, dataset, n_train).count)
        if not plan.adaptive:
            raise ConfigError("PBT members must be enforced by a Renyi filter (adaptive sigma)")
        filt = RenyiFilter.for_plan(plan.q, plan.sigma_map(plan.sigma_0), plan.planned_steps, config.delta)
        budgets.add(tuple(filt.budget.tolist()))
    if len(budgets) != 1:
        raise ConfigError("the PBT members do not share one privacy plan")
    return PopulationFilter.for_members(filt, len(members)), plan.planned_steps


def start_population(study_name: str, population: PopulationFilter, members: list[str], namespace: str):
    """(actor handle, actor name): the population actor (zero CPUs, owned by the driver)."""
    import ray  # lazy: `raydp study --check` (through raydp.study.runner) loads no Ray

    name = f"{ACTOR_PREFIX}-{study_name}-{uuid.uuid4().hex[:8]}"
    actor = ray.remote(num_cpus=0)(Population).options(name=name, namespace=namespace).remote(population, members)
    ray.get(actor.member_of.remote(""))  # started
    return actor, name


def connect(name: str, namespace: str):
    import ray  # lazy: `raydp study --check` (through raydp.study.runner) loads no Ray

    return ray.get_actor(name, namespace=namespace)


def join_population(name: str, namespace: str, trial_id: str, member: int, checkpoint_path: str | None,
                    step: int | None = None, settings: dict | None = None) -> str:
    """Called by a member's trainable when it starts: the member name it trains (see :meth:`Population.join`)."""
    import ray  # lazy: `raydp study --check` (through raydp.study.runner) loads no Ray

    return ray.get(connect(name, namespace).join.remote(trial_id, int(member), checkpoint_path, step, settings))


class PopulationAdmit:
    """A member guard's ``population_admit(q, sigma_eff) -> bool``: one actor call per step."""

    def __init__(self, name: str, namespace: str, member: str) -> None:
        import ray  # lazy: `raydp study --check` (through raydp.study.runner) loads no Ray

        self.actor = connect(name, namespace)
        self.member = member
        #: the population's guarantee, which is also each member's (POPULATION_NOTE)
        self.epsilon = float(ray.get(self.actor.epsilon.remote()))

    def __call__(self, q: float, sigma_eff: float) -> bool:
        import ray  # lazy: `raydp study --check` (through raydp.study.runner) loads no Ray

        return bool(ray.get(self.actor.admit.remote(self.member, float(q), float(sigma_eff))))


def write_population(study_dir: Path, state: dict, extra: dict | None = None) -> Path:
    path = Path(study_dir) / POPULATION_FILE
    path.write_text(json.dumps({**state, **(extra or {})}, indent=2, default=str))
    return path


def population_summary(study_dir: Path) -> dict:
    """The study summary's PBT block (empty for other studies): the population's epsilon, exploits, budget."""
    path = Path(study_dir) / POPULATION_FILE
    if not path.exists():
        return {}
    state = json.loads(path.read_text())
    filt = state["filter"]
    return {"pbt_population": {
        "members": filt["members"], "population_epsilon": filt["epsilon"], "delta": filt["delta"],
        "within_budget": filt["within_budget"], "exploits": state["n_exploits"],
        "steps_admitted": filt["steps_admitted"], "steps_refused": filt["steps_refused"],
        "pbt_global_log_lines": state.get("pbt_global_log_lines"),
        "note": "population epsilon: a Renyi filter over every step of every member (discarded by an exploit or "
                "not), budget = members x the member plan's budget curve = the composition of the members' "
                "budgets in the tuning-aware figure; any member's model is covered by it, not by its own "
                "filter (exploits copy weights chosen by comparing members)"}}
